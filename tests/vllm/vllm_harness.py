"""The harness of the vLLM connector tests: real kvtierd and kvtier-agent processes, and one
vLLM worker process (vllm_engine.py) per run, driven by the flag ``vllm serve`` takes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from kvtier.testing import Agent, Kvtierd, debug_binary, run_as  # noqa: F401 - for the tests

ENGINE = Path(__file__).with_name("vllm_engine.py")


def flag(agent: Agent | str | None, role: str = "kv_both", **extra) -> str:
    """The --kv-transfer-config flag, as docs/vllm.md gives it, for one agent's socket or a
    socket template; without either, the connector's default template. ``extra``: keys of
    kv_connector_extra_config."""
    where = {"agent": agent.socket if isinstance(agent, Agent) else agent} if agent else {}
    return json.dumps(
        {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**where, **extra},
        }
    )


def prompts(seed: int, prefixes: int = 4, each: int = 3) -> list[dict]:
    """Conversations: each of `prefixes` system prompts (5 to 9 pages) followed by `each`
    user turns of 20 to 60 tokens; some carry a cache_salt of their own."""
    rng = random.Random(seed)
    out = []
    for p in range(prefixes):
        rng_p = random.Random(1000 + p)  # the same prefixes in every run
        system = [rng_p.randrange(1000) for _ in range(16 * rng_p.randrange(5, 10))]
        for i in range(each):
            turn = [rng.randrange(1000) for _ in range(rng.randrange(20, 60))]
            out.append(
                {
                    "id": f"s{seed}-p{p}-{i}",
                    "tokens": system + turn,
                    "max_tokens": rng.randrange(4, 24),
                    "salt": "team-b" if p == 3 else None,
                }
            )
    return out


def start_worker(
    tmp: Path,
    name: str,
    kv_flag: str,
    ps: list[dict],
    *opts: str,
    kill: str | None = None,
    stop: str | None = None,
    cwd: Path | None = None,
    user: tuple[int, int, list[int]] | None = None,
) -> tuple[subprocess.Popen, Path]:
    """Starts one vLLM worker process (vllm_engine.py; ``opts`` are its options), as
    ``user`` (uid, gid, groups) if given."""
    (tmp / f"{name}.prompts.json").write_text(json.dumps(ps))
    out = tmp / f"{name}.out.json"
    cmd = [
        sys.executable,
        str(ENGINE),
        "--kv-transfer-config",
        kv_flag,
        "--prompts",
        str(tmp / f"{name}.prompts.json"),
        "--out",
        str(out),
    ]
    if kill:
        cmd += ["--kill", kill]
    if stop:
        cmd += ["--stop", stop]
    cmd += list(opts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if user is not None:
        # Another user: its own home and temporary files (the model directory among them:
        # one per user, so its workers run the same checkpoint), in the test directory.
        home = tmp / f"uid{user[0]}.home"
        home.mkdir(exist_ok=True)
        os.chown(home, user[0], user[1])
        env.update(HOME=str(home), TMPDIR=str(home), USER=f"uid{user[0]}")
        # Nothing of the caller's home (caches torch and vLLM would write to).
        mine = os.path.expanduser("~")
        env = {k: v for k, v in env.items() if k == "PATH" or not v.startswith(mine)}
        env.update({f"XDG_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")})
    proc = subprocess.Popen(
        run_as(user) + cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )
    return proc, out


def finish_worker(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def run_worker(*args, **kwargs) -> dict:
    """Runs one vLLM worker process to the end (``start_worker``'s arguments)."""
    return finish_worker(*start_worker(*args, **kwargs))


def same_prompts_again(ps: list[dict], suffix_seed: int) -> list[dict]:
    """The same conversations continued: each prompt plus another turn."""
    rng = random.Random(suffix_seed)
    return [
        dict(
            p, id=p["id"] + "-again", tokens=p["tokens"] + [rng.randrange(1000) for _ in range(30)]
        )
        for p in ps
    ]
