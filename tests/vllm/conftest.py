"""The vLLM tests' fixtures (kvtier.testing; the helpers are in vllm_harness.py)."""

from kvtier.testing.fixtures import node  # noqa: F401 - a fixture
