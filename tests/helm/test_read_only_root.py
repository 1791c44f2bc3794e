"""The chart's read-only root filesystems, tried on the real programs: the CPU engine and the
gateway of the CPU example run in a mount namespace where every filesystem is read-only except
the emptyDir volumes their rendered containers mount, and must serve and record a turn. Needs root
(a mount namespace); CI runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from tests.conftest import REPO, VENV_BIN, ChildProcess, free_port, wait_until
from tests.helm.conftest import EXAMPLE_VALUES, pod_specs, render

pytestmark = pytest.mark.integration

# Run inside `unshare --mount`: every mount but /proc, /sys and /dev read-only, then a fresh
# tmpfs (an emptyDir) on each writable directory, then exec the program. What the programs run
# from (the checkout, the venv) stays visible, read-only, where a tmpfs would hide it (a clone
# under /tmp): held open before the tmpfs is mounted, then bound back on top of it.
SANDBOX = r"""
import ctypes, os, subprocess, sys
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
libc = ctypes.CDLL(None, use_errno=True)
sep, keep_sep = sys.argv.index("--"), sys.argv.index("--keep")
writable, keep, argv = sys.argv[1:keep_sep], sys.argv[keep_sep + 1:sep], sys.argv[sep + 1:]
hidden = [k for k in keep if any(k.startswith(w.rstrip("/") + "/") for w in writable)]
held = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in hidden}
mountinfo = open("/proc/self/mountinfo").read().splitlines()
points = {line.split()[4].encode().decode("unicode_escape") for line in mountinfo}
for point in sorted(points):
    if point.split("/")[1] not in ("proc", "sys", "dev"):
        subprocess.run(["mount", "-o", "remount,bind,ro", point], check=True)
for path in writable:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", path], check=True)
for path, fd in held.items():
    os.makedirs(path, exist_ok=True)
    for source, flags in ((f"/proc/self/fd/{fd}", MS_BIND | MS_REC),
                          (None, MS_REMOUNT | MS_BIND | MS_RDONLY)):
        if libc.mount(source and source.encode(), path.encode(), None, flags, None) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {path}")
os.execvp(argv[0], argv)
"""
# The directories the sandboxed programs run from.
KEPT = tuple(sorted({str(REPO), sys.prefix, sys.base_prefix}))


def chart_container(objects: list[dict], where: str, name: str) -> tuple[dict, dict]:
    (spec,) = [s for o in objects for w, s in pod_specs(o) if w == where]
    (container,) = [c for c in spec["containers"] if c["name"] == name]
    return spec, container


def sandbox_of(spec: dict, container: dict) -> tuple[tuple[str, ...], dict[str, str]]:
    """The writable directories (the container's emptyDir mounts) and HOME for the sandbox. The
    sandbox cannot create a mount point on this host's read-only root: a volume whose directory
    is missing here (the engine's /home/clawrl) moves under another writable one, /tmp."""
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    empty = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    paths = [
        m["mountPath"]
        for m in container.get("volumeMounts", [])
        if m["name"] in empty and not m.get("readOnly") and not m["mountPath"].startswith("/dev/")
    ]
    env = {}
    home = next((e["value"] for e in container.get("env", []) if e["name"] == "HOME"), None)
    if home is not None:
        assert home in paths, f"HOME {home} is not an emptyDir"
        if not Path(home).is_dir():
            paths.remove(home)
            assert "/tmp" in paths
            home = "/tmp" + home
        env["HOME"] = home
    return tuple(paths), env


def read_only(argv: list[str], writable: tuple[str, ...]) -> list[str]:
    unshare = ["unshare", "--mount", "--propagation", "private"]
    return [*unshare, sys.executable, "-c", SANDBOX, *writable, "--keep", *KEPT, "--", *argv]


@pytest.fixture(scope="module", autouse=True)
def mount_namespaces() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a mount namespace")
    # A container without CAP_SYS_ADMIN is root but cannot make one.
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("this host refuses mount namespaces")


def test_the_sandbox_is_read_only_but_for_its_volumes() -> None:
    probe = "import sys, os\nfor d in sys.argv[1:]:\n    try:\n        open(os.path.join(d, '.ro-probe'), 'w').close(); print(d, 'rw')\n    except OSError as e:\n        print(d, e.errno)"  # noqa: E501
    dirs = [
        "/tmp",
        str(Path(sys.executable).parent),
        str(REPO),
        str(Path.home()),
        "/var/tmp",
        "/etc",
    ]
    result = subprocess.run(
        read_only([sys.executable, "-c", probe, *dirs], ("/tmp",)), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    # 30: EROFS. /tmp is the fresh tmpfs; the venv, the checkout (there, wherever it is), $HOME,
    # /var/tmp and /etc are not writable.
    assert result.stdout.split("\n")[:-1] == ["/tmp rw"] + [f"{d} 30" for d in dirs[1:]]


def cpu_example() -> list[dict]:
    (path,) = [path for path in EXAMPLE_VALUES if path.name == "values-cpu.yaml"]
    return render(path)


def listen(port: int) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url: str) -> Iterator[tuple[str, str]]:
    """(engine URL, gateway URL): the CPU engine (smollm2-tiny) and a gateway, both read-only."""
    logs = tmp_path_factory.mktemp("read-only")
    objects = cpu_example()
    engine = chart_container(objects, "Deployment/clawrl-policy-engine", "engine")
    engine_dirs, engine_env = sandbox_of(*engine)
    gateway = chart_container(objects, "Deployment/clawrl-gateway", "gateway")
    gateway_dirs, gateway_env = sandbox_of(*gateway)
    model = str(resolve_model_dir(ModelSettings(path="smollm2-tiny")))  # as /models/<name>
    engine_port, gateway_port, grpc_port = free_port(), free_port(), free_port()
    engine_argv = [str(VENV_BIN / "clawrl-engine"), "--backend", "cpu", "--model", model]
    engine = ChildProcess(
        "engine",
        read_only([*engine_argv, *listen(engine_port)], engine_dirs),
        logs,
        env={**engine_env, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml"},
    )
    engine_url = f"http://127.0.0.1:{engine_port}"
    upstream = ["--engine-url", engine_url, "--redis-url", redis_url, "--grpc-port", str(grpc_port)]
    gateway = ChildProcess(
        "gateway",
        read_only(
            [str(VENV_BIN / "clawrl-gateway"), *listen(gateway_port), *upstream], gateway_dirs
        ),
        logs,
        env={
            **gateway_env,
            "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
            "CLAWRL_MODEL__PATH": model,
            "CLAWRL_SESSIONS__KEY_PREFIX": "test:read-only",
            "CLAWRL_REDIS__TURNS_STREAM": "test:read-only:turns",
            "CLAWRL_GATEWAY_ID": "read-only",
        },
    )
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    try:
        for child, url in ((engine, f"{engine_url}/health"), (gateway, f"{gateway_url}/healthz")):
            try:
                wait_until(lambda u=url: httpx.get(u, timeout=1).status_code == 200, 300,
                           child.name, child.proc)  # fmt: skip
            except Exception:
                print(child.log_tail(), file=sys.stderr)
                raise
        yield engine_url, gateway_url
    finally:
        gateway.stop()
        engine.stop()


def test_engine_and_gateway_serve_and_record_with_a_read_only_root(
    stack: tuple[str, str], redis_url: str
) -> None:
    from openai import OpenAI

    _, gateway_url = stack
    client = OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        # The session ends with this request: its turn is recorded at once.
        extra_headers={"X-Session-Id": "read-only-1", "X-Session-Done": "1"},
    )
    assert reply.choices[0].message.content is not None
    turns = redis.Redis.from_url(redis_url)
    wait_until(lambda: turns.xlen("test:read-only:turns") == 1, 30, "the recorded turn")


def test_a_ray_head_runs_a_task_with_a_read_only_root() -> None:
    """`ray start --head` (with its dashboard, as under KubeRay) and a driver in the head
    container's sandbox: Ray's session directory (logs, sockets, GCS state) goes to /tmp."""
    head = chart_container(cpu_example(), "RayJob/clawrl-trainer/head", "ray-head")
    dirs, env = sandbox_of(*head)
    ray = str(VENV_BIN / "ray")
    driver = (
        "import ray; ray.init(address='auto'); print(ray.get(ray.remote(lambda: 6 * 7).remote()))"
    )
    script = (
        f"{ray} start --head --num-cpus=1 --disable-usage-stats >/dev/null || exit 90; "
        f'{sys.executable} -c "{driver}"; rc=$?; {ray} stop --force >/dev/null 2>&1; exit $rc'
    )
    # Not this process's RAY_* settings: a ray.init() earlier in the test session sets
    # RAY_AUTH_MODE=token in os.environ, and the head would then look for a token that the
    # sandbox does not hold (the container gets only what the chart gives it).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    result = subprocess.run(
        read_only(["sh", "-c", script], dirs),
        capture_output=True,
        text=True,
        timeout=300,
        env={**inherited, **env},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "42"
