"""The cache identity's content digests (docs/identity.md): a checkpoint, a LoRA adapter and a
scale file are named by what they hold, so a name moved to other bytes shares nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from kvtier.identity import CacheIdentity, adapter_digest, checkpoint_digest, file_digest


def _checkpoint(d: Path, layers: int, weights: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    (d / "model.safetensors").write_bytes(b"w" * weights)
    return d


def test_a_checkpoint_is_named_by_its_content_not_its_path(tmp_path: Path):
    a = _checkpoint(tmp_path / "a", 2, 100)
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(a))
    # Another config, or weights of another size: another checkpoint.
    b = _checkpoint(tmp_path / "b", 3, 100)
    c = _checkpoint(tmp_path / "c", 2, 101)
    digests = {checkpoint_digest(str(p)) for p in (a, b, c)}
    assert len(digests) == 3
    # A `current` symlink moved from one checkpoint to another moves its identity with it.
    cur = tmp_path / "current"
    os.symlink(a, cur)
    first = checkpoint_digest(str(cur))
    assert first == checkpoint_digest(str(a))
    cur.unlink()
    os.symlink(b, cur)
    assert checkpoint_digest(str(cur)) != first
    # The same path downloaded again with another config.
    (a / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    assert checkpoint_digest(str(a)) != first
    # Fine-tuned in place: the same names and sizes, other bytes.
    d = _checkpoint(tmp_path / "tuned", 2, 3 << 20)
    before = checkpoint_digest(str(d))
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(3 << 19)
        f.write(b"x" * 16)
    assert checkpoint_digest(str(d)) != before
    # The same bytes at another path are the same checkpoint.
    e = _checkpoint(tmp_path / "copy", 2, 100)
    (e / "config.json").write_text((a / "config.json").read_text())
    assert checkpoint_digest(str(e)) == checkpoint_digest(str(a))
    # A hub id not on this machine: empty.
    assert checkpoint_digest("org/model-that-is-not-here") == ""


def test_a_hub_id_is_named_by_the_snapshot_its_ref_names_now(tmp_path: Path):
    """A hub id in the Hugging Face cache, as the engines download it (here the engine's
    download directory; else huggingface_hub's own cache, ``hf_hub_cache``): `main` moved
    to another commit upstream and downloaded again on one node is another checkpoint
    there, though both nodes name the model alike (review of issue 61)."""
    hub = str(tmp_path / "hub")
    repo = tmp_path / "hub" / "models--org--model"
    old, new = "a" * 40, "b" * 40
    _checkpoint(repo / "snapshots" / old, 2, 100)
    _checkpoint(repo / "snapshots" / new, 3, 100)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(old)
    before = checkpoint_digest("org/model", "", hub)
    assert before and before == checkpoint_digest(str(repo / "snapshots" / old))
    (repo / "refs" / "main").write_text(new)
    after = checkpoint_digest("org/model", "", hub)
    assert after and after != before
    # A revision given by commit, or by a ref of its own.
    assert checkpoint_digest("org/model", old, hub) == before
    (repo / "refs" / "v1").write_text(old)
    assert checkpoint_digest("org/model", "v1", hub) == before
    assert checkpoint_digest("org/model", "no-such-ref", hub) == ""
    # Not in the cache the engine uses: no content to name.
    assert checkpoint_digest("org/model", "", str(tmp_path / "elsewhere")) == ""


def test_a_lora_adapter_is_named_by_its_content(tmp_path: Path):
    from kvtier.integrations.vllm.identity import lora_id

    one, two = tmp_path / "one", tmp_path / "two"
    for d, w in ((one, b"1"), (two, b"2")):
        d.mkdir()
        (d / "adapter_config.json").write_text('{"r": 8}')
        (d / "adapter_model.safetensors").write_bytes(w * 64)
    assert adapter_digest(str(one)) != adapter_digest(str(two))
    # One name re-pointed at another adapter is another namespace.
    lr = SimpleNamespace(lora_name="support", lora_path=str(one), lora_int_id=1)
    moved = SimpleNamespace(lora_name="support", lora_path=str(two), lora_int_id=2)
    assert lora_id(lr) != lora_id(moved)
    assert lora_id(lr).startswith("support@")


def test_a_lora_adapter_whose_files_change_while_loaded_shares_nothing_after(tmp_path: Path):
    """vLLM reloads an evicted adapter from its path, so files rewritten under a loaded one
    leave no way to tell which weights it computes with: from then on its pages are this
    process's alone (review of issue 61: the digest was taken once for the process's life)."""
    from kvtier.integrations.vllm.identity import lora_id

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(b"1" * 64)
    lr = SimpleNamespace(lora_name="support", lora_path=str(d), lora_int_id=7)
    first = lora_id(lr)
    assert lora_id(lr) == first
    # Touched, or copied over with the same bytes: still the same adapter, shared.
    os.utime(d / "adapter_model.safetensors")
    same = d / "same.tmp"
    same.write_bytes(b"1" * 64)
    os.replace(same, d / "adapter_model.safetensors")
    assert lora_id(lr) == first
    # Rewritten in place (same size, new bytes).
    tmp = d / "new.tmp"
    tmp.write_bytes(b"2" * 64)
    os.replace(tmp, d / "adapter_model.safetensors")
    changed = lora_id(lr)
    assert changed != first and changed.startswith(first + "+changed/")
    assert lora_id(lr) == changed


def test_longrope_is_keyed_by_the_factors_vllm_picks():
    from kvtier.integrations.vllm.identity import resolved_rope

    cfg = SimpleNamespace(
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0],
            "long_factor": [2.0],
            "original_max_position_embeddings": 4096,
        }
    )
    assert resolved_rope(cfg, 4096) == "longrope=short"
    assert resolved_rope(cfg, 131072) == "longrope=long"
    # transformers 5 keys the parameters by layer type.
    nested = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "longrope"}})
    nested.original_max_position_embeddings = 8192
    assert resolved_rope(nested, 16384) == "longrope=long"
    assert resolved_rope(SimpleNamespace(rope_scaling={"type": "linear"}), 4096) == ""
    assert resolved_rope(SimpleNamespace(), 4096) == ""
    # The choice is in the identity: the two launches never share pages.
    ids = [CacheIdentity("vllm", "m", rope=resolved_rope(cfg, n)).digest() for n in (4096, 8192)]
    assert ids[0] != ids[1]


def test_sglang_kv_scales_are_named_by_their_file_content(tmp_path: Path):
    from kvtier.integrations.sglang.backend import kv_scale_file

    f = tmp_path / "scales.json"
    f.write_text('{"k": 0.5}')
    one = kv_scale_file(SimpleNamespace(quantization_param_path=str(f)))
    assert one == f"file:{file_digest(f)}"
    f.write_text('{"k": 0.25}')
    assert kv_scale_file(SimpleNamespace(quantization_param_path=str(f))) != one
    assert kv_scale_file(SimpleNamespace(quantization_param_path=None)) == ""
