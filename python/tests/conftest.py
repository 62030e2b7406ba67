"""The package tests' fixtures: real kvtierd and kvtier-agent processes (kvtier.testing)."""

from kvtier.testing.fixtures import agent, kvtierd  # noqa: F401 - fixtures
