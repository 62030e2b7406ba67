"""The vLLM scheduler side's ``Keys``: a request's page keys kept as the runs they came in
(a lookup's answer, or hashed here), never copied into one buffer. Seeded random sequences of
merges and extensions against a model that keeps one flat list: every key at every page
must agree, across run boundaries and overlapping runs."""

from __future__ import annotations

import random

import pytest

from kvtier.integrations.vllm.scheduler import Keys
from kvtier.keys import KEY_BYTES, Namespace, page_keys

BS = 4
NS = Namespace(tenant="keys")


def prompt(pages: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(pages * BS)]


@pytest.mark.parametrize("seed", range(20))
def test_keys_agree_with_one_flat_list_whatever_runs_they_came_in(seed: int) -> None:
    rng = random.Random(seed)
    tokens = prompt(60, seed)
    truth = page_keys(tokens, BS, NS)
    keys = Keys()
    model: list[bytes] = []
    for _ in range(rng.randrange(1, 12)):
        if rng.random() < 0.6:
            # A lookup's answer: keys of pages first..first+n, from the agent.
            first = rng.randrange(0, len(model) + 3)
            n = rng.randrange(0, 15)
            run = truth[first : first + n]
            keys.merge(first, b"".join(run))
            if first <= len(model):
                model.extend(run[len(model) - first :])
        else:
            upto = rng.randrange(0, 61)
            keys.extend_to(upto, tokens, NS, BS)
            model.extend(truth[len(model) : upto])
        assert len(keys) == len(model)
        for page in range(len(model)):
            assert keys[page] == model[page], page
            assert keys.parent_of(page + 1) == model[page]
        assert keys.parent_of(0) is None
        with pytest.raises(IndexError):
            keys[len(model)]
        with pytest.raises(IndexError):
            keys[-1]
    assert all(len(k) == KEY_BYTES for k in model)
