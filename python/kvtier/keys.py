"""Page keys as docs/hash-spec.md specifies them (version 1).

A page key names one full page of tokens together with everything before it: SHA-256 of the
previous page's key (or of nothing, in the default namespace, or of the namespace seed) and
the page's token ids as little-endian u32. In the default namespace these are exactly
SGLang's HiCache keys. ``tests/test_keys.py`` checks this module against the vectors in the
spec, the same vectors the Rust implementation is held to.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEY_BYTES = 32
_SEED_TAG = b"kvtier/namespace/v1"


@dataclass(frozen=True)
class Namespace:
    """Whose prefix this is. All fields empty is the default namespace."""

    tenant: str = ""
    cache_salt: str = ""
    lora_id: str = ""
    extra_key: str = ""

    def is_default(self) -> bool:
        return not (self.tenant or self.cache_salt or self.lora_id or self.extra_key)

    def seed(self) -> bytes | None:
        """The chain's seed: None in the default namespace."""
        if self.is_default():
            return None
        pre = bytearray(_SEED_TAG)
        for field in (self.tenant, self.cache_salt, self.lora_id, self.extra_key):
            b = field.encode("utf-8")
            pre += struct.pack("<I", len(b)) + b
        pre += b"\x00" * ((2 - len(pre)) % 4)
        return hashlib.sha256(bytes(pre)).digest()


def page_keys(
    tokens: Sequence[int], page_size: int, namespace: Namespace = Namespace()
) -> list[bytes]:
    """The keys of every full page of ``tokens``; a trailing partial page has none."""
    return extend_keys(None, tokens, page_size, namespace)


def extend_keys(
    parent: bytes | None,
    tokens: Sequence[int],
    page_size: int,
    namespace: Namespace = Namespace(),
) -> list[bytes]:
    """The keys of the full pages of ``tokens``, which follow the page keyed ``parent``
    (None: ``tokens`` start the prompt, and the chain starts at the namespace's seed).
    O(pages of ``tokens``), whatever came before them."""
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if parent is not None and len(parent) != KEY_BYTES:
        raise ValueError(f"parent: a page key is {KEY_BYTES} bytes, got {len(parent)}")
    prev = parent if parent is not None else namespace.seed()
    n = len(tokens) // page_size
    body = array.array("I", tokens[: n * page_size])
    if body.itemsize != 4 or sys.byteorder == "big":  # pragma: no cover
        raw = struct.pack(f"<{n * page_size}I", *tokens[: n * page_size])
    else:
        raw = body.tobytes()
    step = page_size * 4
    keys: list[bytes] = []
    for i in range(0, len(raw), step):
        h = hashlib.sha256(prev) if prev is not None else hashlib.sha256()
        h.update(raw[i : i + step])
        prev = h.digest()
        keys.append(prev)
    return keys


def to_hex(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]
