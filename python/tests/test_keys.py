"""kvtier.keys against the normative vectors in docs/hash-spec.md (the Rust code is held to
the same vectors by tests/hash_spec.rs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.keys import Namespace, extend_keys, page_keys

SPEC = Path(__file__).resolve().parents[2] / "docs/hash-spec.md"


def vectors() -> list[dict[str, str]]:
    block = re.search(r"```vectors\n(.*?)```", SPEC.read_text(), re.S)
    assert block, "docs/hash-spec.md has no vectors block"
    out = []
    for line in block.group(1).strip().splitlines():
        out.append(dict(field.split("=", 1) for field in line.split()))
    assert len(out) >= 5
    return out


def tokens_of(spec: str) -> list[int]:
    a, b = spec.split("..=")
    return list(range(int(a), int(b) + 1))


@pytest.mark.parametrize(
    "v", vectors(), ids=lambda v: " ".join(f"{k}={x[:12]}" for k, x in v.items())
)
def test_vector(v: dict[str, str]) -> None:
    ns = Namespace(
        tenant=v.get("tenant", ""),
        cache_salt=v.get("cache_salt", ""),
        lora_id=v.get("lora_id", ""),
        extra_key=v.get("extra_key", ""),
    )
    keys = page_keys(tokens_of(v["tokens"]), int(v["page_size"]), ns)
    if "seed" in v:
        assert ns.seed().hex() == v["seed"]
    if "keys" in v:
        assert [k.hex() for k in keys] == v["keys"].split(",")
    if "last_key" in v:
        assert keys[-1].hex() == v["last_key"]


def test_default_namespace_has_no_seed_and_partial_pages_no_key() -> None:
    assert Namespace().seed() is None
    assert page_keys([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1], 0)


def test_seed_preimage_quoted_in_the_spec() -> None:
    # The spec quotes tenant=acme's preimage; its digest is the vector's seed.
    import hashlib

    pre = re.search(r"`([0-9a-f]{60,})`", SPEC.read_text()).group(1)
    assert hashlib.sha256(bytes.fromhex(pre)).digest() == Namespace(tenant="acme").seed()


@pytest.mark.parametrize("ns", [Namespace(), Namespace(tenant="t", lora_id="a")])
def test_a_chain_continued_after_a_parent_is_the_whole_chain(ns: Namespace) -> None:
    tokens = [(i * 7919) % 152_000 for i in range(16 * 9 + 5)]
    whole = page_keys(tokens, 16, ns)
    assert len(whole) == 9
    for cut in range(1, 9):
        rest = extend_keys(whole[cut - 1], tokens[cut * 16 :], 16, ns)
        assert rest == whole[cut:], cut
    assert extend_keys(None, tokens, 16, ns) == whole
    with pytest.raises(ValueError, match="parent"):
        extend_keys(b"short", tokens, 16, ns)
