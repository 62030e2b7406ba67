"""What separates one engine's KV pages from another's: the cache identity, one definition for
every integration (docs/identity.md has the table: each field, where vLLM and SGLang give it,
and why).

A page is served only to a reader whose identity equals the writer's. Two parts carry it:

- the **layout fingerprint** (``LayoutDescriptor``: model id and version, dtype, geometry,
  TP rank and size), which kvtierd keys its pools and every stored object by. The fields
  fixed for the life of a worker go here: :meth:`CacheIdentity.descriptor_fields` turns them
  into ``model_id`` (the checkpoint, never a served alias) and ``model_version`` (a readable
  summary and a digest of all of them);
- the page key's **namespace** (docs/hash-spec.md): tenant, ``cache_salt``, LoRA adapter, and
  the **weight epoch**. The epoch changes while the engine runs: vLLM's ``reset_cache`` and
  SGLang's ``clear`` move the instance to a new one (:class:`WeightEpoch`), so nothing stored
  before is served to it again, while pages other instances stored are left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.keys import Namespace

__all__ = [
    "CacheIdentity",
    "WeightEpoch",
    "adapter_digest",
    "checkpoint_digest",
    "config_digest",
    "file_digest",
]

# Bump when the meaning of a field changes: pages of the old meaning are then never served.
# 2: the checkpoint by content, the resolved RoPE, LoRA adapters by content.
IDENTITY_VERSION = 2
# kvtier-core refuses a longer model_id or model_version.
_MAX_FIELD = 512


def config_digest(*parts: Any) -> str:
    """A stable digest of model configuration objects (dicts, HF configs, dataclasses,
    strings): JSON with sorted keys, anything else by ``str``. 16 hex digits."""

    def plain(x: Any) -> Any:
        to_dict = getattr(x, "to_dict", None)
        if callable(to_dict):
            return to_dict()
        if hasattr(x, "__dataclass_fields__"):
            return asdict(x)
        return x

    blob = json.dumps([plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Weight files (checkpoints and adapters), by the suffixes engines load.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The indexes that name which weight file holds which tensor.
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Digests of files, by (kind, real path, size, mtime): a file rewritten in place is read
# again.
_digests: dict[tuple[str, str, int, int], str] = {}
_digest_lock = threading.Lock()
_CHUNK = 1 << 20


def _once(kind: str, path: str | os.PathLike[str], read: Callable[[Any, int], bytes]) -> str:
    """``read(file, size)``'s SHA-256 (16 hex digits), computed once per version of the
    file and ``kind``."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (kind, real, st.st_size, st.st_mtime_ns)
    with _digest_lock:
        hit = _digests.get(key)
    if hit is not None:
        return hit
    with open(real, "rb") as f:
        out = hashlib.sha256(read(f, st.st_size)).hexdigest()[:16]
    with _digest_lock:
        _digests[key] = out
    return out


def _whole(f: Any, size: int) -> bytes:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.digest()


def _samples(f: Any, size: int) -> bytes:
    parts = [str(size).encode()]
    for at in sorted({0, max(0, size // 2 - _CHUNK // 2), max(0, size - _CHUNK)}):
        f.seek(at)
        parts.append(f.read(_CHUNK))
    return b"".join(parts)


def file_digest(path: str | os.PathLike[str]) -> str:
    """A digest of a file's content (16 hex digits), read once per version of the file."""
    return _once("whole", path, _whole)


def _sampled_digest(path: str) -> str:
    """A digest of a weight file's size and three 1 MiB samples (start, middle, end), read
    once per version of the file: weights fine-tuned in place differ in every sample, and
    reading three MiB of each file costs milliseconds where hashing a model costs minutes."""
    return _once("samples", path, _samples)


def hf_hub_cache() -> str:
    """The Hugging Face hub cache the engines download into, as ``huggingface_hub`` resolves
    it (``HF_HUB_CACHE``, the older ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``,
    ``XDG_CACHE_HOME``), or the same rules here where it is not installed."""
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        pass
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.expanduser(env)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return os.path.join(os.path.expanduser(home), "hub")


def hub_snapshot(model: str, revision: str = "", cache_dir: str = "") -> str:
    """Where the Hugging Face cache (``cache_dir``, an engine's download directory, else
    :func:`hf_hub_cache`) holds hub id ``model`` at ``revision`` (a commit, a branch or a
    tag; empty: ``main``), as the engines download it: the snapshot directory of the commit
    the ref names now. Empty when it is not there."""
    if not model or "/" not in model or os.path.isabs(model) or model.startswith("."):
        return ""
    hub = os.path.expanduser(cache_dir) if cache_dir else hf_hub_cache()
    repo = os.path.join(hub, "models--" + model.replace("/", "--"))
    ref = revision or "main"
    commit = ref if re.fullmatch(r"[0-9a-f]{40}", ref) else ""
    if not commit:
        try:
            with open(os.path.join(repo, "refs", ref)) as f:
                commit = f.read().strip()
        except OSError:
            return ""
    snapshot = os.path.join(repo, "snapshots", commit)
    return snapshot if commit and os.path.isdir(snapshot) else ""


def longrope_limit(config: dict) -> int | None:
    """For a LongRoPE model config (Phi-3 128k, Phi-3.5, Phi-4-mini: a ``config.json`` as
    a dict) whose long and short factors differ: its ``original_max_position_embeddings``,
    past which the long factors apply (0 when the config does not say). ``None`` for any
    other model."""
    found: list[dict] = []
    for key in ("rope_scaling", "rope_parameters"):
        v = config.get(key)
        if isinstance(v, dict):
            nested = [x for x in v.values() if isinstance(x, dict)]
            found += nested or [v]
    for p in found:
        if (p.get("rope_type") or p.get("type")) not in ("longrope", "su"):
            continue
        if p.get("short_factor") == p.get("long_factor"):
            return None
        orig = p.get("original_max_position_embeddings") or config.get(
            "original_max_position_embeddings"
        )
        return int(orig) if orig else 0
    return None


def checkpoint_digest(model: str, revision: str = "", cache_dir: str = "") -> str:
    """The checkpoint by content, where it is a local directory or file, or a hub id in
    the Hugging Face cache (the snapshot its ``revision``, else ``main``, names now): the
    bytes of its ``config.json`` and weight index, and for every weight file its name, size
    and three 1 MiB samples (hashing whole weights would read the model at every start).
    Empty for a hub id not on this machine. A volume downloaded again with other weights, a
    hub ref that moved to another commit, or a ``current`` symlink moved to another
    checkpoint gets another digest; weights rewritten in place with the same sizes and
    changed only away from the samples do not (give them another path, a revision or a
    weight version)."""
    if model and not os.path.exists(model):
        model = hub_snapshot(model, revision, cache_dir)
    if not model or not os.path.exists(model):
        return ""
    real = os.path.realpath(model)
    h = hashlib.sha256()
    if os.path.isfile(real):
        h.update(_sampled_digest(real).encode())
        return h.hexdigest()[:16]
    for name in ("config.json", *_INDEXES):
        f = os.path.join(real, name)
        if os.path.isfile(f):
            h.update(f"{name}={file_digest(f)}".encode())
    for name in sorted(os.listdir(real)):
        if name.endswith(WEIGHT_SUFFIXES):
            h.update(f"{name}:{_sampled_digest(os.path.join(real, name))}".encode())
    return h.hexdigest()[:16]


def adapter_digest(path: str) -> str:
    """A LoRA adapter by content: its ``adapter_config.json`` and every weight file's bytes
    (adapters are small; each version of a file is read once). A path that is not on this
    machine is named by itself."""
    if not path or not os.path.exists(path):
        return hashlib.sha256(f"path:{path}".encode()).hexdigest()[:16]
    real = os.path.realpath(path)
    if os.path.isfile(real):
        return file_digest(real)
    h = hashlib.sha256()
    for name in sorted(os.listdir(real)):
        if name == "adapter_config.json" or name.endswith(WEIGHT_SUFFIXES):
            h.update(f"{name}={file_digest(os.path.join(real, name))}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CacheIdentity:
    """The fields fixed for a worker's life that decide whether its pages may be shared.

    TP rank and size, page size, heads and head dim, and the storage dtype travel in the
    layout descriptor's own fields; the rest is here."""

    # Which engine wrote the bytes ("vllm", "sglang"): their page byte layouts differ.
    engine: str
    # The checkpoint: a local path or a hub id, never the served alias.
    model: str
    # The checkpoint's revision (a hub commit or tag), if any.
    revision: str = ""
    # The checkpoint by content (checkpoint_digest): a path names no particular weights.
    checkpoint: str = ""
    # Digest of the model's config and quantization config (config_digest).
    config: str = ""
    # The weight version the engine was started with (SGLang --weight-version, the vLLM
    # connector's weight_version); empty when none was declared.
    weight_version: str = ""
    # The logical KV dtype, with the fp8/nvfp4 format (fp8_e4m3, fp8_e5m2, nvfp4, or the
    # model dtype's name), and how its scales are made.
    kv_dtype: str = ""
    kv_scales: str = ""
    # The RoPE the engine resolved where the config alone does not say it: LongRoPE's long
    # or short factors, which vLLM picks from --max-model-len ("longrope=long").
    rope: str = ""
    # The attention layers this worker holds (a pipeline stage's range), "first-last".
    layers: str = ""
    # Context-parallel shards, e.g. "dcp1of2"; empty without context parallelism.
    shards: str = ""
    # The engine's physical page layout where it is not canonical (vLLM's block shape and
    # strides, and its version): kept apart rather than converted.
    layout: str = ""
    # Anything else the integration keeps apart (SGLang's pool name for hybrid pools).
    extra: str = ""

    def digest(self) -> str:
        blob = json.dumps([IDENTITY_VERSION, asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def descriptor_fields(self) -> tuple[str, str]:
        """``(model_id, model_version)`` for the layout descriptor. The version reads as the
        fields that most often differ, then ``id=`` and the digest of every field, which is
        what separates pages (the readable part may be cut to fit)."""
        if not self.model:
            raise ValueError("kvtier: the cache identity has no model (checkpoint path or id)")
        model = self.model
        if len(model.encode()) > _MAX_FIELD:
            model = model[:200] + "#" + hashlib.sha256(model.encode()).hexdigest()[:32]
        readable = [
            f"{self.engine}",
            f"rev={self.revision}" if self.revision else "",
            f"w={self.weight_version}" if self.weight_version else "",
            f"kv={self.kv_dtype}" if self.kv_dtype else "",
            f"layers={self.layers}" if self.layers else "",
            self.shards,
            self.extra,
        ]
        tail = f"|id={IDENTITY_VERSION}:{self.digest()[:32]}"
        head = "|".join(p for p in readable if p)
        room = _MAX_FIELD - len(tail.encode())
        head = head.encode()[:room].decode(errors="ignore")
        return model, head + tail


@dataclass
class WeightEpoch:
    """The instance's weight epoch: empty until the first reset, then a new random one per
    reset. It seeds the page keys' namespace (``extra_key``), so pages stored under an earlier
    epoch are never found again by this instance. Random rather than counted: two instances
    reset the same number of times may hold different weights."""

    value: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self) -> str:
        with self._lock:
            self.value = secrets.token_hex(16)
            return self.value

    def namespace(self, ns: Namespace) -> Namespace:
        """``ns`` within this epoch."""
        if not self.value:
            return ns
        epoch = f"kvtier-epoch/{self.value}"
        extra = f"{ns.extra_key}|{epoch}" if ns.extra_key else epoch
        return Namespace(ns.tenant, ns.cache_salt, ns.lora_id, extra)
