"""The kubernetes backend's claims, without a cluster: the SandboxClaim it creates validates
strictly against agent-sandbox's v1beta1 CRD (tests/helm/crds), claim statuses (themselves valid
against the CRD's status schema) are read right, and the API's failures become SandboxErrors.

The failures come from a real HTTP server on loopback that answers the kubernetes client's
requests with the API server's error statuses: only error paths are run that way. What needs a
real cluster (a claim becoming Ready, pod exec over the API server's websocket) is not run here;
the commands themselves run in test_kube_exec.py."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest
from k8s_agent_sandbox.constants import TERMINAL_CLAIM_READY_REASONS
from kubernetes import client

from clawrl.environments.backend import (
    IsolationUnavailable,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SpecError,
)
from clawrl.environments.kube import (
    CLAIM_GROUP,
    ID_LABEL,
    OWNER_LABEL,
    ClaimState,
    KubeApiError,
    KubeBackend,
    KubeSandboxSettings,
    claim_manifest,
    claim_name,
    claim_state,
    create_backend,
    pod_of,
)
from tests.helm.conftest import crd_errors, crd_schemas

TERMINAL = frozenset(TERMINAL_CLAIM_READY_REASONS)
AT = datetime(2026, 12, 5, 12, 0, 0, 250000, tzinfo=UTC)


@pytest.fixture(scope="module")
def claim_schema() -> dict:
    return crd_schemas("extensions.agents.x-k8s.io_sandboxclaims.yaml.gz")[
        ("SandboxClaim", "v1beta1")
    ]


def manifest(sandbox_id: str = "lease-0123456789abcdef0123") -> dict:
    name = claim_name("clawrl-environments", sandbox_id)
    return claim_manifest(
        name, warm_pool="clawrl-sandbox", owner="clawrl-environments",
        sandbox_id=sandbox_id, shutdown_at=AT,
    )  # fmt: skip


def test_the_claim_matches_agent_sandboxs_crd(claim_schema: dict) -> None:
    claim = manifest()
    assert crd_errors(claim, claim_schema) == []
    assert claim["apiVersion"] == f"{CLAIM_GROUP}/v1beta1" and claim["kind"] == "SandboxClaim"
    assert claim["spec"] == {
        "warmPoolRef": {"name": "clawrl-sandbox"},
        # The controller deletes the claim, its Sandbox and pod at this time at the latest.
        "lifecycle": {"shutdownTime": "2026-12-05T12:00:00Z", "shutdownPolicy": "Delete"},
    }
    labels = claim["metadata"]["labels"]
    assert labels[OWNER_LABEL] == "clawrl-environments"
    assert labels[ID_LABEL] == "lease-0123456789abcdef0123"


def test_the_crd_check_catches_a_wrong_claim(claim_schema: dict) -> None:
    for path, value in (
        (("spec", "warmPoolRef"), {"pool": "x"}),  # name is required
        (("spec", "lifecycle", "shutdownPolicy"), "Forget"),  # not in the enum
        (("spec", "sandboxTemplateRef"), {"name": "x"}),  # v1alpha1's field, gone in v1beta1
    ):
        claim = manifest()
        node = claim
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert crd_errors(claim, claim_schema), path


@pytest.mark.parametrize(
    "sandbox_id", ["lease-0123456789abcdef0123", "Lease_With.Odd+Chars", "x" * 80]
)
def test_claim_names_are_dns_labels_and_distinct(sandbox_id: str) -> None:
    name = claim_name("clawrl-environments", sandbox_id)
    assert len(name) <= 63 and name == name.lower()
    assert all(c.isalnum() or c == "-" for c in name) and name[0].isalnum() and name[-1].isalnum()
    assert name != claim_name("clawrl-environments", sandbox_id + "y")
    assert name != claim_name("other-service", sandbox_id)


def status(ready: str, reason: str, sandbox: str | None = None, message: str = "") -> dict:
    condition = {
        "type": "Ready", "status": ready, "reason": reason, "message": message,
        "lastTransitionTime": "2026-12-05T12:00:00Z",
    }  # fmt: skip
    result: dict = {"conditions": [condition]}
    if sandbox:
        result["sandbox"] = {"name": sandbox, "podIPs": ["10.0.0.7"]}
    return result


@pytest.mark.parametrize(
    ("claim_status", "expected"),
    [
        (None, ClaimState(False, None)),
        (status("False", "SandboxNotReady", "sb-1"),
         ClaimState(False, "sb-1", None, "SandboxNotReady")),
        (status("True", "DependenciesReady", "sb-1"),
         ClaimState(True, "sb-1", None, "DependenciesReady")),
        (status("False", "ClaimExpired", "sb-1", "expired"),
         ClaimState(False, "sb-1", "ClaimExpired: expired", "ClaimExpired")),
        (status("False", "WarmPoolNotFound", None, "no pool"),
         ClaimState(False, None, "WarmPoolNotFound: no pool", "WarmPoolNotFound")),
    ],
)  # fmt: skip
def test_claim_states(claim_status: dict | None, expected: ClaimState, claim_schema: dict) -> None:
    claim = manifest()
    if claim_status is not None:
        claim["status"] = claim_status
    assert crd_errors(claim, claim_schema) == []  # a status the controller could write
    assert claim_state(claim, TERMINAL) == expected


def test_the_pod_is_the_sandboxs_unless_it_names_an_adopted_one() -> None:
    assert pod_of({"metadata": {"name": "sb-1"}}) == "sb-1"
    adopted = {"metadata": {"name": "sb-1", "annotations": {"agents.x-k8s.io/pod-name": "p-9"}}}
    assert pod_of(adopted) == "p-9"


class FakeApi:
    """A loopback HTTP server answering the kubernetes client: each (method, path suffix) gets
    a scripted (status, body); every request is recorded with its JSON body."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], tuple[int, dict]] = {}
        self.requests: list[tuple[str, str, dict | None]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                api.requests.append((self.command, self.path, body))
                path = self.path.split("?")[0]
                code, payload = 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
                for (method, suffix), answer in api.answers.items():
                    if method == self.command and path.endswith(suffix):
                        code, payload = answer
                        break
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def backend(self, **settings: object) -> KubeBackend:
        configuration = client.Configuration(host=self.url)
        configuration.retries = 0
        values = {"namespace": "ml", "warm_pool": "clawrl-sandbox", "ready_timeout_s": 5.0,
                  "api_timeout_s": 5.0, **settings}  # fmt: skip
        return KubeBackend(KubeSandboxSettings(**values), client.ApiClient(configuration))


def failure(code: int, reason: str) -> tuple[int, dict]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                  "reason": reason, "message": f"{reason} (scripted)"}  # fmt: skip


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


CLAIMS = "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/ml/sandboxclaims"


async def test_a_missing_pool_or_a_forbidden_account_stops_the_start(api: FakeApi) -> None:
    backend = api.backend()
    with pytest.raises(IsolationUnavailable, match=r"clawrl-sandbox in namespace ml.*404"):
        await backend.probe()
    api.answers[("GET", "/sandboxwarmpools/clawrl-sandbox")] = failure(403, "Forbidden")
    with pytest.raises(IsolationUnavailable, match="403 Forbidden"):
        await backend.probe()
    api.answers[("GET", "/sandboxwarmpools/clawrl-sandbox")] = (200, {"kind": "SandboxWarmPool"})
    await backend.probe()  # the same backend starts once the pool is there
    await backend.aclose()


async def test_a_claim_that_fails_is_deleted_and_reported(api: FakeApi, claim_schema: dict) -> None:
    backend = api.backend()
    name = claim_name("clawrl-environments", "lease-1")
    failed = {**manifest(), "status": status("False", "WarmPoolNotFound", None, "no such pool")}
    api.answers[("POST", "/sandboxclaims")] = (201, manifest())
    api.answers[("GET", f"/sandboxclaims/{name}")] = (200, failed)
    api.answers[("DELETE", f"/sandboxclaims/{name}")] = (200, {"kind": "Status"})
    with pytest.raises(SandboxError, match="WarmPoolNotFound: no such pool"):
        await backend.create("lease-1", SandboxSpec())
    (post,) = [body for method, _, body in api.requests if method == "POST"]
    assert crd_errors(post, claim_schema) == []  # what was sent is a valid claim
    assert post["metadata"]["name"] == name
    assert ("DELETE", f"{CLAIMS}/{name}") in [(m, p) for m, p, _ in api.requests]
    with pytest.raises(SandboxError, match="does not exist"):  # nothing kept of it
        await backend.exec(SandboxHandle("lease-1", "kubernetes"), "true")
    await backend.aclose()


async def test_a_claim_that_never_gets_ready_times_out_and_is_deleted(api: FakeApi) -> None:
    backend = api.backend(ready_timeout_s=1.2)
    name = claim_name("clawrl-environments", "lease-2")
    pending = {**manifest(), "status": status("False", "SandboxNotReady", "sb-2")}
    api.answers[("POST", "/sandboxclaims")] = (201, manifest())
    api.answers[("GET", f"/sandboxclaims/{name}")] = (200, pending)
    api.answers[("DELETE", f"/sandboxclaims/{name}")] = (200, {"kind": "Status"})
    with pytest.raises(SandboxError, match=r"not Ready within 1s .*SandboxNotReady"):
        await backend.create("lease-2", SandboxSpec())
    assert [m for m, _, _ in api.requests].count("DELETE") == 1
    await backend.aclose()


async def test_api_failures_become_sandbox_errors(api: FakeApi) -> None:
    backend = api.backend()
    api.answers[("POST", "/sandboxclaims")] = failure(409, "AlreadyExists")
    with pytest.raises(KubeApiError, match=r"creating claim .*409") as caught:
        await backend.create("lease-3", SandboxSpec())
    assert caught.value.status == 409 and isinstance(caught.value, SandboxError)
    # Destroying a claim that is gone is fine; any other failure is raised.
    await backend.destroy(SandboxHandle("lease-3", "kubernetes", {"claim": "gone"}))
    api.answers[("DELETE", "/sandboxclaims/stuck")] = failure(500, "InternalError")
    with pytest.raises(KubeApiError, match="500"):
        await backend.destroy(SandboxHandle("lease-4", "kubernetes", {"claim": "stuck"}))
    await backend.aclose()


async def test_a_bad_spec_fails_before_any_claim(api: FakeApi) -> None:
    backend = api.backend()
    for spec in (SandboxSpec(files={"../x": "y"}), SandboxSpec(env={"BAD NAME": "1"})):
        with pytest.raises(SpecError):
            await backend.create("lease-5", spec)
    assert api.requests == []
    await backend.aclose()


async def test_an_unreachable_api_server_is_a_sandbox_error() -> None:
    configuration = client.Configuration(host="http://127.0.0.1:9")  # discard: nothing listens
    configuration.retries = 0
    settings = KubeSandboxSettings(namespace="ml", warm_pool="p", api_timeout_s=2.0)
    backend = KubeBackend(settings, client.ApiClient(configuration))
    with pytest.raises(KubeApiError, match="no answer") as caught:
        await backend.list_live()
    assert caught.value.status is None
    await backend.aclose()


async def test_leftovers_are_this_owners_claims(api: FakeApi) -> None:
    backend = api.backend(owner="svc-a")
    mine = copy.deepcopy(manifest("lease-9"))
    mine["metadata"]["labels"][OWNER_LABEL] = "svc-a"
    api.answers[("GET", "/sandboxclaims")] = (200, {"kind": "SandboxClaimList", "items": [mine]})
    (handle,) = await backend.list_live()
    assert handle.id == "lease-9" and handle.data["claim"] == mine["metadata"]["name"]
    (get,) = [path for method, path, _ in api.requests if method == "GET"]
    assert "labelSelector=clawrl.io/sandbox-owner=svc-a" in unquote(get)
    await backend.aclose()


def test_the_backend_refuses_settings_that_cannot_work() -> None:
    with pytest.raises(IsolationUnavailable, match="warm_pool"):
        KubeBackend(KubeSandboxSettings(), client.ApiClient(client.Configuration()))

    class Settings:  # the service's settings without the section
        pass

    with pytest.raises(IsolationUnavailable, match="kube_sandbox"):
        create_backend(Settings())
