"""A Llama-shaped decoder in plain torch, with random weights, over a vLLM-shaped paged KV
cache: what ``benches/e2e_ttft.py`` (time to first token with kvtier) and its CPU twin
(``python/tests/test_e2e_ttft.py``) compute.

Nothing is downloaded: every weight is drawn from a generator seeded by the preset's seed,
on the device the model runs on, so two processes with the same preset hold the same model.
The layer is Llama's: RMSNorm, fused QKV projection, rotary embeddings (Llama 3's base of
500,000, without its long-context frequency scaling), grouped-query causal attention
(``scaled_dot_product_attention``), a SwiGLU MLP, and the final norm and LM head applied to
the last position only (the first token's logits).

The KV cache is laid out as vLLM 0.33 lays it out for ``KVCacheLayout.LBNHC`` (the layout
``python/tests/test_dma_gpu.py`` times): one allocation for all layers, each layer a
``[num_blocks, kv_heads, block_size, 2 * head_dim]`` view whose last axis holds a token's K
then V, stored layer, block, token, head, K|V outermost first. The agent opens that
allocation (CUDA IPC handle, or on CPU the shared-memory file's descriptor) with the pieces
of a page, exactly as the vLLM connector's DMA transfer registers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.agent import AgentClient, PoolInfo
from kvtier.integrations.vllm.blocks import BlockBytes, block_bytes, cpu_export, cuda_export, pieces
from kvtier.layout import LayoutSpec, State

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Preset:
    """A model shape, where it runs, and the prompts a run measures."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    dtype: str
    device: str
    prompts: tuple[int, ...]
    block_size: int = 16
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    seed: int = 0
    # The goal row: (prompt tokens, most L2-hit TTFT / recompute TTFT). None: this preset
    # has no goal (its numbers are the CPU twin's, not a claim about GPUs).
    goal: tuple[int, float] | None = None
    # Timed runs per figure (the median is reported); kvtierd restarts before each L3 hit.
    repeat: int = 3
    # torch's CPU threads in the reader and the writer (0: torch's default). The CPU twin
    # runs one each: beside kvtierd and two agents on a small machine, a second thread
    # mostly waits at the barriers of its parallel regions while the others run.
    threads: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    @property
    def layer_block_bytes(self) -> int:
        """One layer's share of a page: K and V of ``block_size`` tokens."""
        return self.block_size * self.kv_heads * 2 * self.head_dim * self.element_bytes

    @property
    def page_bytes(self) -> int:
        return self.layers * self.layer_block_bytes

    def layout(self) -> LayoutSpec:
        """The pages' layout as kvtier sees it: opaque bytes per token per layer (the
        vLLM connector describes a DMA-registered cache the same way)."""
        return LayoutSpec(
            model_id=f"kvtier-e2e-ttft/{self.name}/seed-{self.seed}",
            model_version="",
            dtype="uint8",
            num_layers=self.layers,
            page_size=self.block_size,
            shape=State(self.layer_block_bytes // self.block_size),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Preset:
        """The preset :meth:`to_json` gave (JSON makes its tuples lists)."""
        goal = d.get("goal")
        return Preset(
            **{**d, "prompts": tuple(d["prompts"]), "goal": None if goal is None else tuple(goal)}
        )


PRESETS = {
    # Llama-3.1-8B's shapes (the vocabulary cut to 32,000: only the LM head's last row
    # costs anything, and the first token's logits are all this measures of it).
    "gpu-8b": Preset(
        name="gpu-8b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14336,
        vocab=32000,
        dtype="bfloat16",
        device="cuda",
        prompts=(4096, 16384, 32768),
        goal=(32768, 0.07),
    ),
    # The CPU twin: the same code on tiny shapes.
    "cpu-small": Preset(
        name="cpu-small",
        layers=2,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        mlp=768,
        vocab=4096,
        dtype="float32",
        device="cpu",
        prompts=(256, 1024),
        threads=1,
    ),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, H, D]`` (the halves convention Llama's checkpoints
    use), ``cos`` and ``sin`` ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    out: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * mlp, hidden]
    down: torch.Tensor  # [hidden, mlp]


class KvCache:
    """A vLLM-shaped paged KV cache (LBNHC): ``views[l]`` is layer ``l``'s
    ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` view of one allocation. On CPU the
    allocation is shared memory, so the agent can map it by descriptor."""

    def __init__(self, p: Preset, num_blocks: int) -> None:
        self.preset, self.num_blocks = p, num_blocks
        e = p.element_bytes
        c_bytes = 2 * p.head_dim * e
        # Logical [L, B, H, N, C] (bytes), physically L, B, N, H, C.
        shape = (p.layers, num_blocks, p.kv_heads, p.block_size, c_bytes)
        strides = [0] * 5
        step = 1
        for dim in reversed((0, 1, 3, 2, 4)):
            strides[dim] = step
            step *= shape[dim]
        self.buffer = torch.zeros(step, dtype=torch.uint8, device=p.device)
        if self.buffer.device.type == "cpu":
            self.buffer.share_memory_()
        self.views = [
            torch.as_strided(self.buffer, shape[1:], strides[1:], layer * strides[0]).view(
                p.torch_dtype
            )
            for layer in range(p.layers)
        ]
        # Per layer [num_blocks, block_size, kv_heads, 2 * head_dim]: a token's K|V by
        # (block, slot) pairs.
        self._by_token = [v.permute(0, 2, 1, 3) for v in self.views]
        self.geometry: list[BlockBytes] = [
            block_bytes(f"model.layers.{i}.self_attn.attn", v, num_blocks)
            for i, v in enumerate(self.views)
        ]

    def register(self, client: AgentClient) -> PoolInfo:
        """Registers the cache with the agent in engine-cache mode: by CUDA IPC handle on a
        GPU, by shared-memory descriptor on CPU, with the pieces of a page either way."""
        p = self.preset
        if self.buffer.device.type == "cuda":
            ex = cuda_export(self.views)
            return client.register_pool(
                p.layout().descriptor(),
                self.num_blocks * p.block_size,
                cuda_ordinal=ex.ordinal,
                cuda_ipc_handles=ex.handles,
                allocation_bytes=ex.allocation_bytes,
                pieces=pieces(self.geometry, ex.bases),
                engine_cache=True,
            )
        cx = cpu_export(self.views)
        return client.register_pool(
            p.layout().descriptor(),
            self.num_blocks * p.block_size,
            cpu_allocation_fds=cx.fds,
            allocation_bytes=cx.allocation_bytes,
            pieces=pieces(self.geometry, cx.bases),
            engine_cache=True,
        )

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Stores the K and V (``[T, kv_heads, head_dim]``) of T tokens at (block, slot)."""
        self._by_token[layer][blocks, slots] = torch.cat((k, v), dim=-1)

    def read(
        self, layer: int, table: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[tokens, kv_heads, head_dim]``) of a request's first ``tokens``
        tokens, whose blocks are ``table`` in order."""
        bs = self.preset.block_size
        nb = -(-tokens // bs)
        kv = self._by_token[layer][table[:nb]].flatten(0, 1)[:tokens]
        d = self.preset.head_dim
        return kv[..., :d], kv[..., d:]

    def zero(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.buffer.device)
        for v in self.views:
            v[idx] = 0

    def corrupt(self, block: int, layer: int = 0) -> None:
        """Flips the bits of one element of ``block`` in ``layer`` (what a test poisons)."""
        first = self.views[layer][block][0, 0, :1].view(torch.int16)
        first.bitwise_not_()

    def differences(self, got: list[int], want: list[int]) -> list[tuple[int, int]]:
        """The (layer, index into ``got``) of every block whose bytes differ from the
        corresponding block of ``want``: compared whole, as int16 (bit for bit: NaN or
        -0.0 compare as their bits)."""
        if len(got) != len(want):
            raise ValueError(f"comparing {len(got)} blocks against {len(want)}")
        if not got:
            return []
        dev = self.buffer.device
        g = torch.tensor(got, dtype=torch.long, device=dev)
        w = torch.tensor(want, dtype=torch.long, device=dev)
        out: list[tuple[int, int]] = []
        for layer, v in enumerate(self.views):
            a, b = v[g].view(torch.int16), v[w].view(torch.int16)
            if torch.equal(a, b):
                continue
            bad = (a != b).flatten(1).any(dim=1).nonzero().flatten().tolist()
            out += [(layer, int(i)) for i in bad]
        return out

    def digest(self, blocks: list[int]) -> str:
        """A position-weighted sum of ``blocks``' bytes (as int32 words, mod 2^64), the same
        for the same bytes in any process and in any order of summation: it tells a page
        the transfer changed from one the writer computed differently."""
        if not blocks:
            return "0"
        idx = torch.tensor(blocks, dtype=torch.long, device=self.buffer.device)
        total = 0
        for v in self.views:
            words = v[idx].contiguous().view(torch.int32).flatten().to(torch.int64)
            weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
            total = (total * 1_000_003 + int((words * weights).sum()) + int(words.sum())) % (
                1 << 64
            )
        return f"{total:016x}"


@dataclass
class Model:
    """Random Llama-shaped weights for ``preset``, drawn from its seed."""

    preset: Preset
    embed: torch.Tensor = field(init=False)
    layers: list[LayerWeights] = field(init=False)
    final_norm: torch.Tensor = field(init=False)
    lm_head: torch.Tensor = field(init=False)
    inv_freq: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        p = self.preset
        dev, dt = torch.device(p.device), p.torch_dtype
        g = torch.Generator(device=dev)
        g.manual_seed(p.seed)

        def draw(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(shape, generator=g, device=dev) * std).to(dt)

        def ones() -> torch.Tensor:
            return torch.ones(p.hidden, dtype=dt, device=dev)

        h, d = p.hidden, p.head_dim
        # Unit-variance projections, but the MLP's output scaled down by the depth: the
        # attention's share of the residual stream stays large enough that a token's
        # logits depend on the context (a prompt's KV replaced by another's moves them
        # by most of their range; last-bit rounding in the tail's kernels, by about 1%).
        self.embed = draw(p.vocab, h, std=1.0)
        self.layers = [
            LayerWeights(
                attn_norm=ones(),
                qkv=draw((p.heads + 2 * p.kv_heads) * d, h, std=1 / math.sqrt(h)),
                out=draw(h, p.heads * d, std=1 / math.sqrt(p.heads * d)),
                mlp_norm=ones(),
                gate_up=draw(2 * p.mlp, h, std=1 / math.sqrt(h)),
                down=draw(h, p.mlp, std=1 / math.sqrt(p.mlp * p.layers)),
            )
            for _ in range(p.layers)
        ]
        self.final_norm = ones()
        self.lm_head = draw(p.vocab, h, std=1 / math.sqrt(h))
        self.inv_freq = 1.0 / (
            p.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        )

    def forward(
        self, tokens: torch.Tensor, start: int, table: torch.Tensor, cache: KvCache
    ) -> torch.Tensor:
        """Computes ``tokens`` (a request's tokens from position ``start`` on), storing their
        K and V in the request's blocks (``table``, a long tensor of block ids in order);
        the tokens before ``start`` are read from those blocks (loaded, or computed
        before). Returns the last position's logits (float32, ``[vocab]``)."""
        p = self.preset
        n = tokens.shape[0]
        d, hq, hk = p.head_dim, p.heads, p.kv_heads
        pos = torch.arange(start, start + n, device=tokens.device)
        blocks, slots = table[pos // p.block_size], pos % p.block_size
        angles = pos.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(p.torch_dtype), angles.sin().to(p.torch_dtype)
        # Token i (at start + i) sees every position up to its own: causal, aligned to the
        # keys' end (flash or memory-efficient kernels where the device has them).
        mask = causal_lower_right(n, start + n) if start else None
        x = self.embed[tokens]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, p.norm_eps)
            q, k, v = F.linear(h, w.qkv).split((hq * d, hk * d, hk * d), dim=-1)
            q = rotate(q.view(n, hq, d), cos, sin)
            k = rotate(k.view(n, hk, d), cos, sin)
            v = v.view(n, hk, d)
            cache.write(i, blocks, slots, k, v)
            if start:
                # The whole context as the blocks hold it: the loaded (or earlier) tokens
                # and these.
                k, v = cache.read(i, table, start + n)
            a = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            x = x + F.linear(a[0].transpose(0, 1).reshape(n, hq * d), w.out)
            gate, up = F.linear(rms_norm(x, w.mlp_norm, p.norm_eps), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        last = rms_norm(x[-1:], self.final_norm, p.norm_eps)
        return F.linear(last, self.lm_head)[0].float()


def prompt_tokens(p: Preset, n: int) -> list[int]:
    """The benchmark's prompt of ``n`` tokens: drawn from the preset's seed and ``n``, so
    the writer and the reader make the same one, and prompts of different lengths share no
    page."""
    g = torch.Generator()
    g.manual_seed(p.seed * 1_000_003 + n)
    return torch.randint(1, p.vocab, (n,), generator=g).tolist()


def sync(device: str) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
