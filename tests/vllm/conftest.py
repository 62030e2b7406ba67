"""The vLLM tests' fixtures (kvtier.testing; the helpers are in vllm_harness.py).

vLLM's CPU build from PyPI cannot tell its platform on its own: the tests that run vLLM's
classes in the test process (the secondary tier's) need it named before vLLM first looks,
as the engine subprocesses get it in their environment."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvtier.testing.fixtures import node  # noqa: E402, F401 - a fixture
