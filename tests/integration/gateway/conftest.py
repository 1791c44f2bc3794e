"""Gateway fixtures: real `clawrl-gateway` processes in front of the CPU engine (smollm2-tiny)
and the session's real Redis. Each gateway has its own Redis key prefix and turns stream, so
tests (and idle sweepers) never see each other's sessions."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until

from .helpers import GatewayHandle

MODEL = "smollm2-tiny"


class GatewayFactory:
    """Starts gateways at once (they load their tokenizers in parallel) and waits for each
    only when a test first needs it."""

    def __init__(self, log_dir: Path, redis_url: str, engine_url: str):
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.engine_url = engine_url
        self.handles: dict[str, GatewayHandle] = {}
        self.launches: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(
        self,
        name: str,
        *,
        engine_url: str | None = None,
        redis_url: str | None = None,
        **env: str,
    ) -> GatewayHandle:
        if name in self.handles:
            return self.handles[name]
        port, grpc_port = free_port(), free_port()
        stream = env.get("CLAWRL_REDIS__TURNS_STREAM", f"test:{name}:turns")
        environment = {
            "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
            "CLAWRL_MODEL__PATH": MODEL,
            "CLAWRL_SESSIONS__KEY_PREFIX": f"test:{name}",
            "CLAWRL_REDIS__TURNS_STREAM": stream,
            "CLAWRL_GATEWAY_ID": name,
            "CLAWRL_SERVING__RETRY_AFTER_S": "3",
            # Its own spool: one left by an earlier run must not replay into this one's Redis.
            "CLAWRL_SESSIONS__SPOOL_DIR": str(self.log_dir / f"spool-{name}"),
            # Its own served-version key: a sync run by another module on the session's Redis
            # must not decide what this gateway serves at start.
            "CLAWRL_CONTROL__SERVED_KEY": f"test:{name}:serving",
            **env,
        }
        argv = [
            str(VENV_BIN / "clawrl-gateway"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--engine-url",
            engine_url or self.engine_url,
            "--redis-url",
            redis_url or self.redis_url,
        ]
        self.launches[name] = (argv, environment)
        child = ChildProcess(f"gateway-{name}", argv, self.log_dir, env=environment)
        handle = GatewayHandle(
            name=name,
            url=f"http://127.0.0.1:{port}",
            grpc_port=grpc_port,
            stream=stream,
            redis_url=self.redis_url,
            child=child,
        )
        self.handles[name] = handle
        return handle

    def ready(self, handle: GatewayHandle) -> GatewayHandle:
        if not handle.ready:
            try:
                # Generous: on a loaded 2-core host several gateways load tokenizers at once.
                wait_until(
                    lambda: httpx.get(f"{handle.url}/healthz", timeout=1).status_code == 200,
                    300,
                    handle.child.name,
                    handle.child.proc,
                )
            except Exception:
                print(handle.child.log_tail(), file=sys.stderr)
                raise
            handle.ready = True
        return handle

    def restart(self, handle: GatewayHandle) -> GatewayHandle:
        """Stop the gateway and start it again with the same ports and environment."""
        argv, environment = self.launches[handle.name]
        handle.child.stop()
        handle.child = ChildProcess(f"gateway-{handle.name}-restarted", argv, self.log_dir,
                                    env=environment)  # fmt: skip
        handle.ready = False
        return self.ready(handle)

    def stop_all(self) -> None:
        for handle in self.handles.values():
            handle.child.stop()


# Configurations the tests use, started together on first use.
CONFIGS: dict[str, dict[str, str]] = {
    "main": {},
    "secured": {
        "CLAWRL_SERVING__API_KEYS": '["sk-test-1", "sk-test-2"]',
        "CLAWRL_CONTROL__TOKEN": "control-secret",
        "CLAWRL_CONTROL__HOLD_TIMEOUT_S": "1.0",
    },
    # Two replicas sharing one prefix and stream, sweeping often for idle sessions.
    "idle-a": {
        "CLAWRL_SESSIONS__IDLE_TIMEOUT_S": "2.0",
        "CLAWRL_SESSIONS__SWEEP_INTERVAL_S": "0.2",
        "CLAWRL_SESSIONS__KEY_PREFIX": "test:idle",
        "CLAWRL_REDIS__TURNS_STREAM": "test:idle:turns",
    },
    "idle-b": {
        "CLAWRL_SESSIONS__IDLE_TIMEOUT_S": "2.0",
        "CLAWRL_SESSIONS__SWEEP_INTERVAL_S": "0.2",
        "CLAWRL_SESSIONS__KEY_PREFIX": "test:idle",
        "CLAWRL_REDIS__TURNS_STREAM": "test:idle:turns",
    },
}


@pytest.fixture(scope="session")
def engine_url(engine_factory) -> str:
    return engine_factory(MODEL)


@pytest.fixture(scope="session")
def gateways(log_dir, redis_url, engine_url) -> Iterator[GatewayFactory]:
    factory = GatewayFactory(log_dir, redis_url, engine_url)
    for name, env in CONFIGS.items():
        factory.start(name, **env)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def gateway(gateways) -> GatewayHandle:
    """The default configuration: open API, recording on, default timeouts."""
    return gateways.ready(gateways.handles["main"])


@pytest.fixture(scope="session")
def secured(gateways) -> GatewayHandle:
    """API keys, a control token and a 1 s hold timeout."""
    return gateways.ready(gateways.handles["secured"])


@pytest.fixture(scope="session")
def idle_pair(gateways) -> tuple[GatewayHandle, GatewayHandle]:
    """Two replicas over one session namespace, with a 2 s idle timeout."""
    return gateways.ready(gateways.handles["idle-a"]), gateways.ready(gateways.handles["idle-b"])


@pytest.fixture(scope="session")
def scripted(gateways) -> Iterator[tuple]:
    """A scripted SGLang stand-in (test_gateway_apis.ScriptedEngine) and a default gateway in
    front of it, shared by the modules that script replies (each test scripts and reads its
    own; one gateway start instead of one a module)."""
    from .test_gateway_apis import ScriptedEngine

    engine = ScriptedEngine().start()
    yield engine, gateways.ready(gateways.start("scripted", engine_url=engine.url))
    engine.stop()


@pytest.fixture(scope="session")
def renderer():
    from clawrl.common.chat import ChatRenderer
    from clawrl.common.settings import ModelSettings

    return ChatRenderer.from_settings(ModelSettings(path=MODEL))


@pytest.fixture
def session_id(request) -> str:
    import uuid

    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
