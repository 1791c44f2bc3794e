"""The Kubernetes launcher's API calls, made by the real `kubernetes` client against a local HTTP
server that plays the few batch/v1 endpoints it uses (create a Job, read its status, delete it)
and records every request: the Job body and namespace, the polling, the cleanup, and what the
launcher does when the API refuses or fails."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.kube import KubernetesLauncher

pytestmark = pytest.mark.integration

NAMESPACE = "ml"
JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
TEMPLATE = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"generateName": "clawrl-weight-sync-"},
    "spec": {
        "template": {
            "spec": {
                "containers": [
                    {"name": "weight-sync", "image": "clawrl-trainer:0.1.0",
                     "command": ["clawrl-weight-sync"]}
                ]
            }
        }
    },
}  # fmt: skip
READY = VersionReady(version=7, path="/ckpt/policy/v7", step=70, created_at=0.0)


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: dict | None


@dataclass
class FakeApi:
    """What the API server answers: `create_status` for POST, then the Job's status from
    `statuses` in turn (the last one repeats), `errors_first` 500s before the first status."""

    create_status: int = 201
    statuses: list[dict] = field(default_factory=lambda: [{"active": 1}])
    errors_first: int = 0
    calls: list[Call] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)
    polled: threading.Event = field(default_factory=threading.Event)  # the status was read

    def answer(self, call: Call) -> tuple[int, dict]:
        self.calls.append(call)
        if call.method == "POST" and call.path == JOBS:
            if self.create_status != 201:
                return self.create_status, status_body(self.create_status, "Forbidden")
            name = call.body["metadata"]["name"]
            self.jobs[name] = call.body
            return 201, {**call.body, "status": {}}
        name = call.path.removeprefix(JOBS + "/").removesuffix("/status")
        if name not in self.jobs:
            return 404, status_body(404, "NotFound")
        if call.method == "GET" and call.path.endswith("/status"):
            if self.errors_first:
                self.errors_first -= 1
                return 500, status_body(500, "InternalError")
            status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
            self.polled.set()
            return 200, {**self.jobs[name], "status": status}
        if call.method == "DELETE":
            del self.jobs[name]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 405, status_body(405, "MethodNotAllowed")

    def of(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]


def status_body(code: int, reason: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
            "code": code, "message": f"{reason.lower()} (fake API server)"}  # fmt: skip


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, client.BatchV1Api]]:
    fake = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            call = Call(self.command, url.path, parse_qs(url.query),
                        json.loads(raw) if raw else None)  # fmt: skip
            code, body = fake.answer(call)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    config.retries = False  # a refused call fails at once
    api_client = client.ApiClient(config)
    try:
        yield fake, client.BatchV1Api(api_client)
    finally:
        api_client.close()
        server.shutdown()


def launcher(batch: client.BatchV1Api, timeout_s: float = 900) -> KubernetesLauncher:
    return KubernetesLauncher(TEMPLATE, NAMESPACE, timeout_s, api=batch, poll_s=0.02, grace_s=0)


def test_a_sync_job_is_created_in_the_namespace_and_polled_until_it_succeeds(api):
    fake, batch = api
    fake.statuses = [{"active": 1}, {"active": 1}, {"succeeded": 1}]
    assert asyncio.run(launcher(batch)(READY)) == 0
    [create] = fake.of("POST")
    assert create.path == JOBS
    job = create.body
    name = job["metadata"]["name"]
    assert name.startswith("clawrl-weight-sync-v7-")
    assert job["metadata"]["labels"]["clawrl.io/policy-version"] == "7"
    assert job["spec"]["activeDeadlineSeconds"] == 900 and job["spec"]["backoffLimit"] == 0
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "run", "--version", "7", "--path", "/ckpt/policy/v7", "--job-id", name,
    ]  # fmt: skip
    polls = fake.of("GET")
    assert [c.path for c in polls] == [f"{JOBS}/{name}/status"] * 3
    assert fake.of("DELETE") == []  # a finished Job is left to its ttlSecondsAfterFinished


def test_a_failed_job_fails_the_attempt_and_is_left_for_its_log(api):
    fake, batch = api
    fake.statuses = [{"active": 1}, {"failed": 1}]
    assert asyncio.run(launcher(batch)(READY)) == 1
    assert len(fake.of("GET")) == 2 and fake.of("DELETE") == []


def test_a_job_past_its_deadline_is_deleted_with_its_pods(api):
    fake, batch = api
    # 1 s of 20 ms polls: many more than 3 reads even when a loaded host is slow to answer.
    assert asyncio.run(launcher(batch, timeout_s=1.0)(READY)) == 1
    [delete] = fake.of("DELETE")
    name = fake.of("POST")[0].body["metadata"]["name"]
    assert delete.path == f"{JOBS}/{name}"
    assert delete.query["propagationPolicy"] == ["Background"]  # the Job's pods go too
    assert len(fake.of("GET")) >= 3 and fake.jobs == {}


def test_a_launcher_that_stops_deletes_its_running_job(api):
    fake, batch = api

    async def stop_while_polling():
        task = asyncio.create_task(launcher(batch)(READY))
        assert await asyncio.to_thread(fake.polled.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stop_while_polling())
    assert len(fake.of("DELETE")) == 1 and fake.jobs == {}


def test_a_refused_create_fails_the_attempt_without_polling(api, caplog):
    fake, batch = api
    fake.create_status = 403
    assert asyncio.run(launcher(batch)(READY)) == 1
    assert fake.of("GET") == [] and fake.of("DELETE") == []
    assert "cannot create Job ml/clawrl-weight-sync-v7-" in caplog.text and "403" in caplog.text


def test_an_api_error_while_polling_is_retried(api, caplog):
    fake, batch = api
    fake.errors_first = 2
    fake.statuses = [{"succeeded": 1}]
    assert asyncio.run(launcher(batch)(READY)) == 0
    assert len(fake.of("GET")) == 3
    assert caplog.text.count("cannot read Job") == 2


def test_an_unreachable_api_server_fails_the_attempt():
    config = client.Configuration()
    config.host = "http://127.0.0.1:9"  # discard port: nothing listens
    config.retries = False
    unreachable = client.BatchV1Api(client.ApiClient(config))
    assert asyncio.run(launcher(unreachable)(READY)) == 1
