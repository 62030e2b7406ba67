"""The deployment artefacts: the Kubernetes manifests (kustomize) validated against the
Kubernetes schemas, their and the image's config files checked by the real binaries, the
Dockerfile linted, and the image built with podman and run: kvtierd and kvtier-agent answer
grpc.health.v1 as an unprivileged user, serve metrics, refuse a peer outside their allow-list
and stop cleanly.

Needs: podman, runc, debootstrap and kubectl (scripts/setup installs them), and the Python
packages of tests/deploy/requirements.txt.
"""

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", "/var/tmp/kvtier-target"))
K8S_VERSION = "1.33"
IMAGE = "localhost/kvtier:test"
# This sandbox needs runc (its hybrid cgroups are refused by crun) and ulimits it may set.
PODMAN = ["podman", *os.environ.get("KVTIER_PODMAN", "--runtime runc").split()]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4000:4000"]


def binary(name):
    p = TARGET / "debug" / name
    assert p.exists(), f"{p} missing: build the workspace first (cargo build)"
    return str(p)


def kustomize(overlay):
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy/k8s" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_spec(doc):
    return doc["spec"]["template"]["spec"]


def check_config(tmp_path, name, text):
    """The config kvtierd or the agent would read, checked by the binary itself."""
    f = tmp_path / name
    f.write_text(text)
    exe = "kvtierd" if name == "kvtierd.toml" else "kvtier-agent"
    # The file alone: kvtier-agent reads KVTIER_AGENT_* variables as config keys, and the
    # shell running the tests may set some for other runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_AGENT_")}
    r = subprocess.run(
        [binary(exe), "--config", str(f), "--check-config"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, f"{name}: {r.stderr}"


@pytest.mark.parametrize("overlay", ["base", "example"])
def test_manifests_validate_against_the_kubernetes_schemas(overlay, tmp_path):
    docs = kustomize(overlay)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    # The validator is live: a wrongly typed field is refused.
    bad = copy.deepcopy(by_kind(docs, "DaemonSet")[0])
    pod_spec(bad)["containers"][0]["ports"][0]["containerPort"] = "metrics"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    # Every config file the manifests ship is one the binaries accept.
    cm = by_kind(docs, "ConfigMap")[0]
    assert sorted(cm["data"]) == ["kvtier-agent.toml", "kvtierd.toml"]
    for name, text in cm["data"].items():
        check_config(tmp_path, name, text)


def test_the_daemonset_runs_kvtierd_unprivileged_with_probes_and_host_volumes():
    docs = kustomize("base")
    (ds,) = by_kind(docs, "DaemonSet")
    spec = pod_spec(ds)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001
    (c,) = spec["containers"]
    health = ["kvtierctl", "health", "--socket", "/run/kvtier/kvtierd.sock"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == health, probe
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["kvtierctl", "drain"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host == {"run": "/run/kvtier", "pools": "/dev/shm/kvtier", "data": "/var/lib/kvtier"}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["pools"] == "/dev/shm/kvtier" and mounts["secrets"] == "/etc/kvtier/secrets"
    # The config the DaemonSet points at puts the pools and the socket on those volumes.
    cm = by_kind(docs, "ConfigMap")[0]
    assert c["args"] == ["--config", "/etc/kvtier/k8s/kvtierd.toml"]
    conf = cm["data"]["kvtierd.toml"]
    assert 'shm_dir = "/dev/shm/kvtier"' in conf and 'socket = "/run/kvtier/kvtierd.sock"' in conf
    (svc,) = by_kind(docs, "Service")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert svc["spec"]["ports"][0]["port"] == 9464
    assert by_kind(docs, "Secret")[0]["metadata"]["name"] == "kvtier-secrets"


def test_the_example_worker_runs_the_agent_as_a_native_sidecar_on_the_nodes_tiers():
    (worker,) = by_kind(kustomize("example"), "Deployment")
    spec = pod_spec(worker)
    (agent,) = spec["initContainers"]
    assert agent["restartPolicy"] == "Always", "the agent must be a native sidecar"
    assert agent["command"] == ["kvtier-agent"]
    assert agent["securityContext"]["runAsUser"] == 10001
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/run/kvtier", "/run/kvtier-agent"} <= mounts
    # kvtierd's pools arrive as descriptors on its socket directory: no pod but kvtierd's
    # mounts the directory they live in.
    assert "/dev/shm/kvtier" not in mounts
    assert "/dev/shm/kvtier" not in {v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    engine = spec["containers"][0]
    assert "/run/kvtier-agent" in {m["mountPath"] for m in engine["volumeMounts"]}
    assert 10001 in spec["securityContext"]["supplementalGroups"]
    # vLLM's staging pool is a memfd the worker hands the agent over its memory door: no
    # volume shares files between the two containers (the agent opens no path), and none
    # needs kvtier's group to own it. tests/vllm/test_vllm_deployments.py runs the two
    # under different uids with real processes.
    assert not [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert "fsGroup" not in spec["securityContext"]


def test_the_image_config_files_are_accepted(tmp_path):
    for name in ("kvtierd.toml", "kvtier-agent.toml"):
        check_config(tmp_path, name, (ROOT / "deploy/container" / name).read_text())


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run(
        [
            hadolint,
            "--no-color",
            "--config",
            str(ROOT / ".hadolint.yaml"),
            "--failure-threshold",
            "info",
            str(ROOT / "Dockerfile"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def podman(*args, check=True):
    return subprocess.run([*PODMAN, *args], check=check, capture_output=True, text=True)


def wait_healthy(name, sock, timeout=60):
    deadline = time.time() + timeout
    while True:
        r = podman("exec", name, "kvtierctl", "health", "--socket", sock, check=False)
        if r.returncode == 0:
            return r.stdout
        assert time.time() < deadline, (
            f"{name} never healthy: {r.stderr}\n" + podman("logs", name, check=False).stderr
        )
        time.sleep(0.5)


@pytest.fixture(scope="module")
def image():
    subprocess.run([str(ROOT / "tests/deploy/build-image"), IMAGE], check=True)
    return IMAGE


def test_the_image_builds_runs_unprivileged_and_answers_health(image):
    meta = json.loads(podman("image", "inspect", image).stdout)[0]
    assert meta["Config"]["User"] == "10001:10001"
    assert meta["Healthcheck"]["Test"][1:] == [
        "kvtierctl",
        "health",
        "--socket",
        "/run/kvtier/kvtierd.sock",
    ]
    run_dir = Path(tempfile.mkdtemp(prefix="kvtier-run-"))
    agent_dir = Path(tempfile.mkdtemp(prefix="kvtier-agent-"))
    for d in (run_dir, agent_dir):
        os.chown(d, 10001, 10001)
    port, agent_port = free_port(), free_port()
    names = [f"kvtierd-test-{os.getpid()}", f"kvtier-agent-test-{os.getpid()}"]
    common = [*LIMITS, "--network", "host", "--shm-size", "256m"]
    try:
        podman(
            "run", "-d", "--name", names[0], *common,
            "-v", f"{run_dir}:/run/kvtier",
            "-e", f"KVTIER_METRICS_LISTEN=127.0.0.1:{port}",
            image,
        )  # fmt: skip
        assert wait_healthy(names[0], "/run/kvtier/kvtierd.sock") == "SERVING\n"
        # podman's own health check runs the image's HEALTHCHECK.
        assert podman("healthcheck", "run", names[0], check=False).returncode == 0
        assert podman("exec", names[0], "id", "-u").stdout.strip() == "10001"
        # The agent from the same image, beside it, reaching kvtierd through the socket.
        podman(
            "run", "-d", "--name", names[1], *common,
            "-v", f"{run_dir}:/run/kvtier",
            "-v", f"{agent_dir}:/run/kvtier-agent",
            "-e", f"KVTIER_AGENT_METRICS_LISTEN=127.0.0.1:{agent_port}",
            "--entrypoint", "kvtier-agent",
            image, "--config", "/etc/kvtier/kvtier-agent.toml",
        )  # fmt: skip
        assert wait_healthy(names[1], "/run/kvtier-agent/kvtier-agent.sock") == "SERVING\n"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"kvtier_l2_sessions" in metrics
        agent_metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{agent_port}/metrics", timeout=5
        ).read()
        assert b"kvtier_agent_" in agent_metrics
        # This test runs as root: not kvtierd's uid, not listed, so its socket refuses us.
        r = subprocess.run(
            [binary("kvtierctl"), "health", "--socket", str(run_dir / "kvtierd.sock")],
            capture_output=True,
            text=True,
        )
        assert r.returncode != 0
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        series = 'kvtier_server_denied_connections_total{socket="control"} '
        (denied,) = [ln for ln in page.decode().splitlines() if ln.startswith(series)]
        assert float(denied.split()[-1]) >= 1
        # SIGTERM: both drain and exit 0, and kvtierd removes its socket.
        for n in reversed(names):
            podman("stop", "-t", "20", n)
            state = json.loads(podman("inspect", n).stdout)[0]["State"]
            assert state["ExitCode"] == 0, podman("logs", n, check=False).stderr
        assert not (run_dir / "kvtierd.sock").exists()
    finally:
        for n in names:
            podman("rm", "-f", n, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(agent_dir, ignore_errors=True)
