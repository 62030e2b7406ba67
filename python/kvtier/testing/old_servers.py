"""Answers as servers older than the running package give them, for the tests that keep the
package working beside them (a sidecar or daemon image not yet upgraded)."""

from __future__ import annotations

import grpc


class BareNotFound(grpc.RpcError):
    """A NOT_FOUND without the kvtier-lost trailer, as an agent or kvtierd older than the
    trailer answers a call about what the caller lost."""

    def __init__(self, details: str = "not found"):
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()

    def answer(self, request, timeout=None, metadata=None):
        """A stub method that always answers this."""
        raise self
