"""The vLLM connector's jobs in pieces: every piece of a split job names its pages
by the key of the page before it, so each piece's keys are the whole prompt's keys at its
pages (what the agent computes from a piece is what it would compute from the prompt)."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.common import Job
from kvtier.keys import Namespace, extend_keys, page_keys

BS = 4


def prompt(pages: int) -> list[int]:
    return [(i * 7919 + 13) % 32000 for i in range(pages * BS)]


def keys_of(piece: Job, ns: Namespace) -> list[bytes]:
    return extend_keys(piece.parent, piece.tokens, BS, ns)


@pytest.mark.parametrize("start", [0, 3])
def test_split_keeps_every_pieces_parent(start: int) -> None:
    ns = Namespace(tenant="jobs")
    tokens = prompt(start + 7)
    whole = page_keys(tokens, BS, ns)
    job = Job(
        "r",
        tokens[start * BS :],
        ns,
        start,
        list(range(100, 107)),
        parent=whole[start - 1] if start else None,
    )
    assert keys_of(job, ns) == whole[start:]
    for n in (1, 3, 6):
        first, rest = job.split(n, BS)
        assert (first.start, first.blocks) == (start, job.blocks[:n])
        assert keys_of(first, ns) == whole[start : start + n]
        assert rest is not None and rest.start == start + n
        assert rest.blocks == job.blocks[n:]
        assert keys_of(rest, ns) == whole[start + n :]
    assert job.split(7, BS) == (job, None)
    # Split again and again, as a job goes through a staging pool 3 pages at a time.
    pieces, rest = [], job
    while rest is not None:
        piece, rest = rest.split(3, BS)
        pieces.append(piece)
    assert [p.start for p in pieces] == [start, start + 3, start + 6]
    for p in pieces:
        assert keys_of(p, ns)[: len(p.blocks)] == whole[p.start : p.start + len(p.blocks)]


def test_the_rest_of_a_load_follows_the_key_the_agent_named() -> None:
    """A load in pieces takes the next piece's parent from the agent's answer (the key of
    the last page asked for), not from hashing its pages; an answer with no key (an older
    agent) falls back to hashing, so the piece is keyed right either way."""
    ns = Namespace(tenant="jobs")
    tokens = prompt(6)
    whole = page_keys(tokens, BS, ns)
    job = Job("r", tokens, ns, 0, list(range(6)))
    named = job.after(2, BS, whole[1])
    assert named is not None and named.parent == whole[1]
    assert keys_of(named, ns) == whole[2:]
    # The key given is used as it is: a wrong one would show here.
    other = job.after(2, BS, b"\x01" * 32)
    assert other is not None and other.parent == b"\x01" * 32
    hashed = job.after(2, BS, b"")
    assert hashed is not None and hashed.parent == whole[1]
    assert job.after(6, BS, whole[5]) is None
    assert job.head(6, BS) is job
