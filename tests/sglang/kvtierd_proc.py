"""A real kvtierd process for the Python tests, on its own data directory.

kvtierd is the binary `cargo test` built ($CARGO_TARGET_DIR/debug/kvtierd); KVTIERD_BIN
overrides it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def debug_binary(name: str, env_var: str) -> str:
    """A binary of this checkout's debug build (the one `cargo test` built); ``env_var``
    overrides it."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    return str(Path(target) / "debug" / name)


def run_as(user: tuple[int, int, list[int]] | None) -> list[str]:
    """The command prefix that runs a process as ``(uid, gid, supplementary gids)`` (as
    root, with util-linux's setpriv); none for the caller's own identity."""
    if user is None:
        return []
    uid, gid, groups = user
    extra = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *extra, "--"]


def kvtierd_bin() -> str:
    return debug_binary("kvtierd", "KVTIERD_BIN")


class Kvtierd:
    """kvtierd with `--set` overrides; its file L3 is <data_dir>/l3. `start()` again after
    `kill()` or `stop()` restarts it on the same directory."""

    def __init__(
        self,
        data_dir: Path,
        *sets: str,
        config: Path | None = None,
        user: tuple[int, int, list[int]] | None = None,
    ):
        self.data_dir, self.sets, self.config, self.user = data_dir, sets, config, user
        self.socket = str(data_dir / "kvtierd.sock")
        self.start()

    def start(self) -> None:
        args = [
            kvtierd_bin(),
            "--set",
            f"data_dir={self.data_dir}",
            "--set",
            "metrics.listen=127.0.0.1:0",
            "--set",
            "log.level=warn",
            # A closed grpcio channel sometimes keeps its socket open a while; kvtierd's
            # graceful stop then waits the whole drain for it. Keep that short here.
            "--set",
            "server.drain_timeout=2s",
        ]
        for s in self.sets:
            args += ["--set", s]
        if self.config is not None:
            args += ["--config", str(self.config)]
        # kvtierd reads KVTIER_* variables as configuration: none of the caller's leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        args = run_as(self.user) + args
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        self.metrics_url = self._wait_ready()

    def _wait_ready(self) -> str:
        found: list[str] = []

        def read():
            for line in self.proc.stdout:
                if "kvtierd ready" in line:
                    found.append(line)
                    break

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(30)
        if not found:
            code = self.proc.poll()
            self.proc.kill()
            if code is not None:
                raise RuntimeError(f"kvtierd exited with status {code} before it was ready")
            raise RuntimeError("kvtierd did not become ready in 30 s")
        # Keep draining stdout so the daemon never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        return re.search(r"metrics=(\S+)", found[0]).group(1)

    def metric(self, series: str, absent: float | None = None) -> float:
        """A series' value; `absent` when it is not exported yet (else KeyError)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        if absent is None:
            raise KeyError(series)
        return absent

    def kill(self) -> None:
        """SIGKILL: no flush, no cleanup."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def l3_files(self) -> list[Path]:
        """The object files of the file L3 (its directory marker and temp files left out)."""
        objects = self.data_dir / "l3" / "objects"
        return [p for p in objects.rglob("*") if p.is_file() and not p.name.startswith(".")]
