"""What a vLLM worker's pages are: its cache identity (docs/identity.md), from vLLM's config
and the layers and KV cache the worker holds."""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.identity import (
    WEIGHT_SUFFIXES,
    CacheIdentity,
    adapter_digest,
    checkpoint_digest,
    config_digest,
)
from kvtier.integrations.vllm.blocks import BlockBytes
from kvtier.integrations.vllm.common import Settings, parallel_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig


logger = logging.getLogger("kvtier.vllm")


def cache_identity(
    vllm_config: VllmConfig,
    settings: Settings,
    instance: str,
    layer_names: Sequence[str],
    sample: torch.Tensor,
    geometry: BlockBytes,
) -> CacheIdentity:
    """A vLLM worker's cache identity (docs/identity.md): what keeps its pages apart from
    every other worker's whose bytes differ. ``instance`` names this process (KV scales it
    computes are its own); ``layer_names`` are the attention layers it holds."""
    import vllm

    # vLLM's bytes of a block are opaque to kvtier: its version and the block's axes in
    # the order a page stores them (blocks.py) keep apart workers whose bytes differ.
    layout = f"vllm-{vllm.__version__}|{sample.dtype}|{geometry.form}"
    return engine_identity(
        vllm_config, settings.model_id, settings.weight_version, instance, layer_names, layout
    )


def engine_identity(
    vllm_config: VllmConfig,
    model_id: str,
    weight_version: str,
    instance: str,
    layer_names: Sequence[str],
    layout: str,
) -> CacheIdentity:
    """The cache identity of pages a vLLM engine stores as ``layout`` describes their bytes:
    :func:`cache_identity`'s for the connector's blocks, the secondary tier's (tier.py) for
    rows of vLLM's own CPU offload region. ``model_id`` and ``weight_version`` are the
    settings of the same names (empty: vLLM's model, no version)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    pc = vllm_config.parallel_config

    model = model_id or mc.model
    kv_dtype = str(cc.cache_dtype)
    if kv_dtype == "auto":
        kv_dtype = str(mc.dtype).removeprefix("torch.")
    scales = ""
    if kv_dtype.startswith(("fp8", "nvfp4")):
        # Scales read from the checkpoint are part of the model; scales computed from the
        # first batch are this instance's own, so its pages are its own too.
        scales = (
            f"calculated/{instance}" if getattr(cc, "calculate_kv_scales", False) else "checkpoint"
        )
    shards = []
    for name, size_attr, rank_fn in (
        ("dcp", "decode_context_parallel_size", "get_decode_context_model_parallel_rank"),
        ("pcp", "prefill_context_parallel_size", "get_prefill_context_model_parallel_rank"),
    ):
        size = int(getattr(pc, size_attr, 1) or 1)
        if size > 1:
            rank = parallel_rank(lambda ps, fn=rank_fn: getattr(ps, fn)())
            shards.append(f"{name}{rank}of{size}")
    return CacheIdentity(
        engine="vllm",
        model=str(model),
        revision=str(mc.revision or ""),
        checkpoint=checkpoint_digest(
            str(mc.model),
            str(getattr(mc, "revision", "") or ""),
            str(getattr(getattr(vllm_config, "load_config", None), "download_dir", "") or ""),
        ),
        config=config_digest(getattr(mc, "hf_config", None), getattr(mc, "quantization", None)),
        rope=resolved_rope(getattr(mc, "hf_config", None), int(mc.max_model_len)),
        weight_version=weight_version,
        kv_dtype=kv_dtype,
        kv_scales=scales,
        layers=layer_range(layer_names),
        shards="/".join(shards),
        layout=layout,
    )


def layer_range(names: Sequence[str]) -> str:
    """The model layers a worker holds, from vLLM's layer names ("model.layers.7.attn"):
    "first-last" when contiguous, else a digest of the indices."""
    idx = []
    for n in names:
        m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", n)
        if m is None:
            return "names:" + config_digest(sorted(names))
        idx.append(int(m.group(1)))
    idx.sort()
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return f"{idx[0]}-{idx[-1]}"
    return "set:" + config_digest(idx)


def resolved_rope(hf_config: object, max_model_len: int) -> str:
    """What vLLM decides about RoPE beyond the config: LongRoPE (Phi-3 128k, Phi-3.5,
    Phi-4-mini) uses its long factors when ``max_model_len`` exceeds the original context,
    else its short ones, so the same checkpoint's K differs with ``--max-model-len``."""
    params: list[dict] = []
    for attr in ("rope_parameters", "rope_scaling"):
        v = getattr(hf_config, attr, None)
        if isinstance(v, dict):
            # transformers 5 may key them by layer type.
            nested = [x for x in v.values() if isinstance(x, dict)]
            params += nested or [v]
    for p in params:
        kind = p.get("rope_type") or p.get("type")
        if kind in ("longrope", "su"):
            orig = p.get("original_max_position_embeddings") or getattr(
                hf_config, "original_max_position_embeddings", None
            )
            if orig is None:
                return f"longrope=len{max_model_len}"
            return "longrope=long" if max_model_len > int(orig) else "longrope=short"
    return ""


def lora_id(lora_request: object) -> str:
    """A LoRA adapter in the page keys' namespace: its name, path and content
    (``adapter_digest``), so a name pointed at another adapter shares nothing with it.

    The digest is taken once per adapter id; each call checks the adapter's files by their
    stat (size, mtime, inode: tens of microseconds), and a changed stat by their digest.
    Files whose bytes changed under a loaded adapter leave no
    way to tell which weights vLLM computes with (the ones it holds, or the new ones it
    reads when it loads the adapter again after evicting it), so from then on the adapter's
    pages are this process's alone: shared with no other instance, and none of theirs
    used."""
    name = str(getattr(lora_request, "lora_name", "") or "")
    path = str(getattr(lora_request, "lora_path", "") or "")
    key = (name, path, int(getattr(lora_request, "lora_int_id", 0) or 0))
    stamp = _adapter_stamp(path)
    found = _lora_ids.get(key)
    if found is None:
        found = _lora_ids[key] = (stamp, f"{name}@{adapter_digest(path)}")
    elif found[0] != stamp and not found[1].endswith(_CHANGED):
        if found[1] == f"{name}@{adapter_digest(path)}":
            # Touched, or copied over with the same bytes: the same adapter.
            _lora_ids[key] = (stamp, found[1])
            return found[1]
        logger.warning(
            "kvtier: the files of LoRA adapter %r (%s) changed while it is loaded; its pages "
            "are this instance's alone from now on (load changed weights under a new name "
            "or path to share them)",
            name,
            path,
        )
        found = _lora_ids[key] = (found[0], found[1] + _CHANGED)
    return found[1]


def _adapter_stamp(path: str) -> tuple:
    """The adapter's files as ``stat`` sees them (through symlinks): what changes when
    they are rewritten, replaced or re-pointed."""
    try:
        real = os.path.realpath(path)
        if os.path.isfile(real):
            st = os.stat(real)
            return ((real, st.st_size, st.st_mtime_ns, st.st_ino),)
        out: list[tuple] = []
        for entry in sorted(os.scandir(real), key=lambda e: e.name):
            if entry.name == "adapter_config.json" or entry.name.endswith(WEIGHT_SUFFIXES):
                st = entry.stat()
                out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
        return (real, *out)
    except OSError:
        return ()


_lora_ids: dict[tuple[str, str, int], tuple[tuple, str]] = {}
# What an adapter's id becomes once its files changed while it was loaded: this process's.
_CHANGED = "+changed/" + secrets.token_hex(8)
