"""Real kvtierd and kvtier-agent processes for the package's tests: the binaries `cargo test`
built ($CARGO_TARGET_DIR/debug), or KVTIERD_BIN / KVTIER_AGENT_BIN."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def binary(name: str, env_var: str) -> str:
    if os.environ.get(env_var):
        return os.environ[env_var]
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    return str(Path(target) / "debug" / name)


class Server:
    """One server process on `data_dir`, started and waited for ready."""

    def __init__(self, name: str, env_var: str, data_dir: Path, *sets: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        args = [
            binary(name, env_var),
            "--set",
            f"data_dir={data_dir}",
            "--set",
            "metrics.listen=127.0.0.1:0",
            "--set",
            "log.level=warn",
        ]
        for s in sets:
            args += ["--set", s]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        assert f"{name} ready" in line, f"{name} did not start: {line!r}"
        self.socket = line.split("socket=")[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def kvtierd(tmp_path: Path):
    s = Server("kvtierd", "KVTIERD_BIN", tmp_path)
    yield s
    s.stop()


@pytest.fixture
def agent(tmp_path: Path, kvtierd: Server):
    """A kvtier-agent beside `kvtierd` (same data directory, so it finds its socket)."""
    s = Server("kvtier-agent", "KVTIER_AGENT_BIN", tmp_path)
    yield s
    s.stop()
