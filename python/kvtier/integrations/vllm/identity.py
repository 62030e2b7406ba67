"""What a vLLM worker's pages are: its cache identity (docs/identity.md), from vLLM's config
and the layers and KV cache the worker holds."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.identity import CacheIdentity, config_digest
from kvtier.integrations.vllm.blocks import BlockBytes
from kvtier.integrations.vllm.common import Settings, parallel_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    pc = vllm_config.parallel_config

    model = settings.model_id or mc.model
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
    # vLLM's bytes of a block are opaque to kvtier: its version and the block's axes in
    # the order a page stores them (blocks.py) keep apart workers whose bytes differ.
    return CacheIdentity(
        engine="vllm",
        model=str(model),
        revision=str(mc.revision or ""),
        config=config_digest(getattr(mc, "hf_config", None), getattr(mc, "quantization", None)),
        weight_version=settings.weight_version,
        kv_dtype=kv_dtype,
        kv_scales=scales,
        layers=layer_range(layer_names),
        shards="/".join(shards),
        layout=f"vllm-{vllm.__version__}|{sample.dtype}|{geometry.form}",
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
