"""The committed gRPC stubs are what proto/ generates now (scripts/gen-python-stubs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_the_protos(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts/gen-python-stubs"), str(tmp_path)], check=True)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "kvtier/v1").iterdir()}
    committed_dir = ROOT / "python/kvtier/v1"
    committed = {
        p.relative_to(ROOT / "python"): p.read_bytes()
        for p in committed_dir.iterdir()
        if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(committed), "stub files differ: run scripts/gen-python-stubs"
    stale = [str(name) for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run scripts/gen-python-stubs"
    # Every service of proto/kvtier/v1 has its stub module.
    protos = {p.stem for p in (ROOT / "proto/kvtier/v1").glob("*.proto")}
    assert {f"{s}_pb2_grpc.py" for s in protos} <= {n.name for n in fresh}
