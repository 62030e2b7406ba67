"""Real kvtierd and kvtier-agent processes for tests and benches, each on its own data
directory, started and waited for ready.

The binaries are the ones `cargo test` built in this checkout ($CARGO_TARGET_DIR/debug, else
target/debug); KVTIERD_BIN and KVTIERAGENT_BIN override them.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# The checkout this package is installed from (editable), for its binaries and protos.
ROOT = Path(__file__).resolve().parents[3]


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


def metric(url: str, series: str, absent: float | None = None) -> float:
    """A series' value on the Prometheus page at ``url``; ``absent`` when it is not exported
    (labels are made on first use), else KeyError."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    if absent is None:
        raise KeyError(series)
    return absent


def stop(proc: subprocess.Popen[str], grace_s: float) -> None:
    """SIGTERM, and SIGKILL after ``grace_s`` when the process has not exited by then."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_dead: list[tuple[Path, int]] = []


def _left_pools(shm_dir: Path, pid: int) -> None:
    """Remembers the pools a killed kvtierd left in its own directory in ``shm_dir``
    (``kvtierd-<uid>``); at exit, removes those still there
    (``kvtier-<instance>-<pid>-<layout>`` and their slot tables)."""
    if not _dead:
        atexit.register(_remove_left_pools)
    _dead.append((shm_dir, pid))


def _remove_left_pools() -> None:
    for shm_dir, pid in _dead:
        for p in (shm_dir / f"kvtierd-{os.geteuid()}").glob(f"kvtier-*-{pid}-*"):
            p.unlink(missing_ok=True)


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
        out = self.proc.stdout
        assert out is not None, "started with stdout=PIPE"

        def read():
            for line in out:
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
        threading.Thread(target=lambda: [None for _ in out], daemon=True).start()
        m = re.search(r"metrics=(\S+)", found[0])
        if m is None:
            raise RuntimeError(f"kvtierd's ready line names no metrics address: {found[0]!r}")
        return m.group(1)

    def metric(self, series: str, absent: float | None = None) -> float:
        """A series' value; `absent` when it is not exported yet (else KeyError)."""
        return metric(self.metrics_url, series, absent)

    def kill(self) -> None:
        """SIGKILL: no flush, no cleanup. Its L2 pool stays in shared memory, as a crashed
        kvtierd's does, for a restart on this directory to take over; what no restart took
        over is removed when this process exits."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        shm = next((s.split("=", 1)[1] for s in self.sets if s.startswith("l2.shm_dir=")), None)
        _left_pools(Path(shm or "/dev/shm"), self.proc.pid)

    def stop(self) -> None:
        stop(self.proc, 30)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def l3_files(self) -> list[Path]:
        """The object files of its file L3 (<data_dir>/l3)."""
        return l3_objects(self.data_dir / "l3")


def l3_objects(l3: Path) -> list[Path]:
    """The object files of the file L3 at ``l3`` (its directory marker and temp files left
    out), sorted."""
    return sorted(
        p for p in (l3 / "objects").rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def agent_bin() -> str:
    if "KVTIER_AGENT_BIN" in os.environ:
        # The old name: kvtier-agent reads every KVTIER_AGENT_* variable as a config key, so
        # the agent it named refused to start ("no such configuration key").
        raise RuntimeError("KVTIER_AGENT_BIN is now KVTIERAGENT_BIN (KVTIER_AGENT_* are config)")
    return debug_binary("kvtier-agent", "KVTIERAGENT_BIN")


class Agent:
    """A kvtier-agent named ``name`` on ``data_dir``, linked to the kvtierd at
    ``daemon_socket``, with `--set` overrides; its socket is <data_dir>/<name>.sock unless
    ``socket`` says otherwise."""

    def __init__(
        self,
        data_dir: Path,
        name: str,
        daemon_socket: str,
        *sets: str,
        socket: Path | None = None,
        user: tuple[int, int, list[int]] | None = None,
    ):
        self.socket = str(socket or data_dir / f"{name}.sock")
        args = [agent_bin()]
        settings: Sequence[str] = (
            f"data_dir={data_dir}",
            f"server.socket={self.socket}",
            f"daemon.address={daemon_socket}",
            f"daemon.name={name}",
            "daemon.reconnect_min=20ms",
            "metrics.listen=127.0.0.1:0",
            "log.level=warn",
            "cache.evict_wait=500ms",
            *sets,
        )
        for s in settings:
            args += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        args = run_as(user) + args
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "kvtier-agent ready" in line, line
        self.metrics = line.split("metrics=")[1].split()[0]

    def metric(self, series: str, absent: float | None = None) -> float:
        """A series' value; ``absent`` for one not exported yet (labels made on first use)."""
        return metric(self.metrics, series, absent)

    def wait_daemon(self, connected: bool, timeout: float = 15.0) -> None:
        """Waits until the agent's link to kvtierd is up (``connected``) or down."""
        want = 1.0 if connected else 0.0
        deadline = time.monotonic() + timeout
        while self.metric("kvtier_agent_daemon_connected", absent=0.0) != want:
            if time.monotonic() > deadline:
                state = "up" if connected else "down"
                raise TimeoutError(f"the agent's link to kvtierd was not {state} in {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        stop(self.proc, 15)
