"""Page keys as docs/hash-spec.md specifies them (version 1).

A page key names one full page of tokens together with everything before it: SHA-256 of the
previous page's key (or of nothing, in the default namespace, or of the namespace seed) and
the page's token ids as little-endian u32. In the default namespace these are exactly
SGLang's HiCache keys. ``tests/test_keys.py`` checks this module against the vectors in the
spec, the same vectors the Rust implementation is held to.
"""

from __future__ import annotations

import hashlib
import struct
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
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    parent = namespace.seed()
    keys: list[bytes] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.sha256()
        if parent is not None:
            h.update(parent)
        h.update(struct.pack(f"<{page_size}I", *tokens[start : start + page_size]))
        parent = h.digest()
        keys.append(parent)
    return keys


def to_hex(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]
