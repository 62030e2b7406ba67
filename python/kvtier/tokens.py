"""Token runs as kvtier's calls carry them, without copying an engine's token list.

A 128k-token prompt is a Python list of 128k ints; slicing it costs 0.5 ms and packing it
for the wire 1.5 ms, on whichever thread does it. :class:`TokenWindow` names
``tokens[start:end]`` of a list that only grows (an engine's prompt and output tokens)
without copying it, so vLLM's scheduler thread hands a step's pages to the workers in O(1);
the thread that sends them packs them (:func:`packed`, in chunks that let go of the GIL).
A window that leaves the process (vLLM pickles its workers' metadata) goes as
:class:`PackedTokens`, the run's little-endian u32s: 4 bytes a token, copied as one block.
"""

from __future__ import annotations

import array
import struct
import sys
import time
from collections.abc import Sequence
from typing import overload

# Tokens converted per C call: each call holds the GIL (about 0.1 ms for 8k tokens here).
# Between calls the packing thread lets go of the GIL (``time.sleep(0)``), so another thread
# (vLLM's scheduler, while a lookup thread packs a 128k-token prompt) waits for at most one
# call. Without it, a waiting thread asks for the GIL only after the interpreter's switch
# interval (5 ms): measured here, a thread beside one packing 128k-token prompts woke 5-11 ms
# late. Each yield costs about 60 us on this 2-core machine: at 1k-token chunks a 128k
# lookup took 12 ms (9 of them packing), at 8k 5.6 ms, and the scheduler thread's time per
# waiting 128k request fell with the shorter lookups (fewer passes ask about it).
_PACK_CHUNK = 8192


def packed(tokens: Sequence[int]) -> bytes:
    """Tokens as the wire's `packed_tokens`: little-endian u32s, which the agent decodes with
    a copy where the varint `tokens` field costs a loop over every token. C-level
    conversions (a third of ``struct.pack``'s time at 128k tokens), in chunks of
    ``_PACK_CHUNK`` tokens so that no one holds the GIL for long."""
    if isinstance(tokens, PackedTokens):
        return tokens.data
    try:
        a = array.array("I")
        for i in range(0, len(tokens), _PACK_CHUNK):
            part = tokens[i : i + _PACK_CHUNK]
            a.fromlist(part if isinstance(part, list) else list(part))
            if len(tokens) > _PACK_CHUNK:
                time.sleep(0)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"tokens: every token id must be an int in 0..2**32-1 ({e})") from None
    if a.itemsize != 4:  # pragma: no cover - every platform kvtier runs on has 4-byte "I"
        return struct.pack(f"<{len(tokens)}I", *tokens)
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


class _TokenRun(Sequence[int]):
    """A run of token ids, equal to any sequence of the same ids (a list, or the other
    kind of run); mutable behind it, so not hashable."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class TokenWindow(_TokenRun):
    """``tokens[start:end]`` without copying it. ``tokens`` may grow meanwhile (a request's
    output tokens are appended to the same list); the window's own tokens never change.
    Pickled, it is :class:`PackedTokens` of its run."""

    __slots__ = ("_tokens", "_start", "_len")

    def __init__(self, tokens: Sequence[int], start: int, end: int):
        if start < 0 or end > len(tokens):
            raise ValueError(f"a token window {start}..{end} outside {len(tokens)} tokens")
        self._tokens, self._start, self._len = tokens, start, max(0, end - start)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            a, b, step = i.indices(self._len)
            if step != 1:
                raise ValueError("a token window slices with step 1 only")
            return self._tokens[self._start + a : self._start + max(a, b)]
        if not -self._len <= i < self._len:
            raise IndexError(i)
        return self._tokens[self._start + (i % self._len)]

    def __repr__(self) -> str:
        return f"TokenWindow({self._start}..{self._start + self._len})"

    def __reduce__(self) -> tuple[type[PackedTokens], tuple[bytes]]:
        return PackedTokens, (packed(self),)


class PackedTokens(_TokenRun):
    """A run of tokens as little-endian u32s (what :func:`packed` returns), read as a
    sequence of ints: what a :class:`TokenWindow` becomes in another process."""

    __slots__ = ("data", "_view")

    def __init__(self, data: bytes):
        if len(data) % 4:
            raise ValueError(f"packed tokens: {len(data)} bytes is not a whole number of u32s")
        self.data = bytes(data)
        a = array.array("I")
        a.frombytes(self.data)
        if sys.byteorder == "big":  # pragma: no cover
            a.byteswap()
        self._view = a

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return self._view[i].tolist()
        return self._view[i]

    def __repr__(self) -> str:
        return f"PackedTokens({len(self)} tokens)"

    def __reduce__(self) -> tuple[type[PackedTokens], tuple[bytes]]:
        return PackedTokens, (self.data,)
