"""Engine integrations' settings: a dataclass of typed fields filled from the JSON object an
engine passes through (SGLang's ``extra_config``, vLLM's ``kv_connector_extra_config``)."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

logger = logging.getLogger(__name__)


def fill(
    target: Any,
    extra: dict[str, Any],
    where: str,
    *,
    ignore: frozenset[str] = frozenset(),
    strict: bool = True,
) -> None:
    """Sets each of ``target``'s fields that ``extra`` names, checked against the field's
    type (an int is taken for a float). A key that is no field (nor in ``ignore``) is an
    error with ``strict``, else a warning; either way it names the keys there are."""
    known = {f.name for f in fields(target)}
    unknown = sorted(k for k in extra if k not in known and k not in ignore)
    if unknown:
        msg = f"kvtier: unknown {where} keys {unknown}; kvtier's keys are {sorted(known)}"
        if strict:
            raise ValueError(msg)
        logger.warning("%s (ignored)", msg)
    for name in sorted(known & extra.keys()):
        v = extra[name]
        want = type(getattr(target, name))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        # A bool is an int to Python: it fills a bool field only, never a number.
        if not isinstance(v, want) or (isinstance(v, bool) and want is not bool):
            raise ValueError(f"kvtier: {where}.{name}: expected a {want.__name__}, got {v!r}")
        setattr(target, name, v)
