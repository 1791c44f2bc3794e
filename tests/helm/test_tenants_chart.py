"""The chart's `tenants` values (per-tenant LoRA adapters, issue 20) and `redis.cluster` /
`redis.streamShards` (Redis Cluster and stream shards) become the services' settings: each
service builds its real settings class from the rendered environment, and what would fail at
start (or never work) fails at render with what to set."""

from __future__ import annotations

import fnmatch

import pytest

from clawrl.common.settings import RedisSettings
from clawrl.common.shards import Shards
from clawrl.engine.launcher import build_argv
from clawrl.engine.settings import EngineSettings
from clawrl.gateway.settings import GatewaySettings
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.helm.conftest import CHART, CLUSTER_VALUES, helm, pod_specs, render
from tests.helm.test_chart import SERVICE_SETTINGS, container_env
from tests.helm.test_cluster_readiness import notes

PER_TENANT = ("tenants.mode=per_tenant", "policyEngine.lora.enabled=true", "trainer.backend=torch",
              "trainer.settings.lora.enabled=true")  # fmt: skip
GATEWAY = ("Deployment", "clawrl-gateway", "gateway")
TRAINER = [("RayJob", "clawrl-trainer/head", "ray-head"),
           ("RayJob", "clawrl-trainer/gpu", "ray-worker")]  # fmt: skip
ENGINE = ("Deployment", "clawrl-policy-engine", "engine")
JUDGE_ENGINE = ("Deployment", "clawrl-judge-engine", "engine")
LAUNCHER = ("RayJob", "clawrl-trainer/head", "weight-sync-launcher")


def failure(*sets: str) -> str:
    """helm template's error for these values (the render must fail)."""
    args = ["template", "clawrl", str(CHART), "-f", str(CLUSTER_VALUES)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode != 0, f"rendered with {sets}"
    return result.stderr


def test_per_tenant_values_reach_the_gateway_and_the_trainer(settings_of) -> None:
    objects = render(sets=(*PER_TENANT, "tenants.allow={alice,team-a}", "tenants.pattern=team-.*",
                           "tenants.header=x-clawrl-tenant", "tenants.maxAdapters=3",
                           "tenants.minSamplesPerStep=2"))  # fmt: skip
    # Rendered first: settings_of sets the containers' environment (HOME too) in this process.
    shared_objects = render()
    gateway = settings_of(GatewaySettings, container_env(objects, *GATEWAY)).tenants
    for where in TRAINER:  # the driver and the training actors read the same section
        trainer = settings_of(TrainerSettings, container_env(objects, *where))
        assert trainer.tenants == gateway
        assert trainer.lora.enabled and trainer.train.backend == "torch"
    assert gateway.per_tenant and gateway.allow == ["alice", "team-a"]
    assert (gateway.max_adapters, gateway.min_samples_per_step) == (3, 2)
    assert gateway.header == "x-clawrl-tenant"
    assert gateway.owns_adapter("team-b") and not gateway.owns_adapter("bob")
    # The weight-sync launcher follows the tenants' versions only in per-tenant mode.
    launcher = settings_of(WeightSyncSettings, container_env(objects, *LAUNCHER))
    assert launcher.tenants.mode == "per_tenant"
    shared = settings_of(WeightSyncSettings, container_env(shared_objects, *LAUNCHER))
    assert shared.tenants.mode == "shared"


def test_notes_say_who_gets_an_adapter_and_how_to_list_them() -> None:
    text = notes(*PER_TENANT, "tenants.allow={alice,bob}", "tenants.maxAdapters=4")
    assert "up to 4 tenants (alice, bob) each train" in text
    assert "clawrl-trainer tenants" in text
    assert "Per-tenant" not in notes()


def test_shared_mode_is_the_default_and_gives_the_engine_no_loaded_limit(settings_of) -> None:
    objects = render()
    gateway = settings_of(GatewaySettings, container_env(objects, *GATEWAY)).tenants
    assert gateway.mode == "shared" and gateway.allow == [] and gateway.header is None
    assert gateway.pattern is None  # empty values are left to the settings' defaults
    engine = container_env(render(sets=("policyEngine.lora.enabled=true",)), *ENGINE)
    assert "CLAWRL_ENGINE__MAX_LOADED_LORAS" not in engine


@pytest.mark.parametrize(
    ("sets", "loaded"),
    [
        ((), 18),  # 8 tenants and the shared adapter, each with a second version mid-sync
        (("tenants.allow={alice,bob,carol}",), 8),  # 2 x 4, raised to maxLorasPerBatch
        (("tenants.allow={alice,bob,carol}", "policyEngine.lora.maxLorasPerBatch=4"), 8),
        (("tenants.allow={alice}", "tenants.pattern=team-.*"), 18),  # a pattern names any
        (("policyEngine.lora.maxLoadedLoras=12",), 12),
    ],
)
def test_per_tenant_mode_gives_the_engine_room_for_every_tenants_adapter(
    sets: tuple[str, ...], loaded: int, settings_of
) -> None:
    objects = render(sets=(*PER_TENANT, *sets))
    engine = settings_of(EngineSettings, container_env(objects, *ENGINE))
    argv = build_argv(engine, model="/models/policy")  # SGLang's command line
    assert argv[argv.index("--max-loaded-loras") + 1] == str(loaded)
    batch = int(argv[argv.index("--max-loras-per-batch") + 1])
    assert loaded >= batch  # SGLang refuses less
    judge = build_argv(settings_of(EngineSettings, container_env(objects, *JUDGE_ENGINE)), "/m")
    assert not [flag for flag in judge if "lora" in flag]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("tenants.mode=per_tenant",), "set policyEngine.lora.enabled"),
        (("tenants.mode=per_tenant", "policyEngine.lora.enabled=true"),
         "set trainer.backend torch and trainer.settings.lora.enabled true"),
        ((*PER_TENANT[:3],), "trainer.settings.lora.enabled true"),
        ((*PER_TENANT, "policyEngine.lora.maxLoadedLoras=4"),
         "maxLoadedLoras (4) must be at least maxLorasPerBatch (8)"),
        ((*PER_TENANT, "policyEngine.lora.maxLoadedLoras=9"),
         "maxLoadedLoras (9) must be at least 10 in per_tenant mode: 8 tenants' adapters"),
        (("tenants.allow={../x}",), "/tenants/allow/0"),
        (("tenants.mode=everyone",), "/tenants/mode"),
        (("redis.cluster=true",), "the internal Redis is a single node"),
        (("redis.streamShards=0",), "/redis/streamShards"),
    ],
)  # fmt: skip
def test_what_cannot_work_fails_at_render(sets: tuple[str, ...], message: str) -> None:
    assert message in failure(*sets)


def redis_containers(objects: list[dict]) -> dict[str, dict[str, str]]:
    """`<pod>/<container>` -> env of every container that reads Redis."""
    return {
        f"{where}/{c['name']}": {e["name"]: e.get("value") for e in c.get("env", [])}
        for obj in objects
        for where, spec in pod_specs(obj)
        for c in spec["containers"]
        if any(e["name"] == "CLAWRL_REDIS__URL" for e in c.get("env", []))
    }


def test_a_redis_cluster_and_its_shards_reach_every_service(settings_of) -> None:
    url = "redis://redis-cluster-0.redis-cluster:6379/0"
    objects = render(sets=("redis.mode=external", f"redis.externalUrl={url}", "redis.cluster=true",
                           "redis.streamShards=6"))  # fmt: skip
    containers = redis_containers(objects)
    # Gateway, judge, trainer (driver and actors), launcher, sync Jobs, the helm test hook.
    assert len(containers) >= 8, sorted(containers)
    for where, env in containers.items():
        shards = RedisSettings(
            url=env["CLAWRL_REDIS__URL"],
            cluster=env["CLAWRL_REDIS__CLUSTER"],
            stream_shards=env["CLAWRL_REDIS__STREAM_SHARDS"],
        ).shards()
        assert (shards.count, shards.cluster) == (6, True), where
    # Each service's own settings class takes them (a section it lacked would be ignored).
    for key, cls in SERVICE_SETTINGS.items():
        if "engine" in key[1]:
            continue  # engines do not read Redis
        settings = settings_of(cls, container_env(objects, *key))
        assert settings.redis.shards() == Shards(6, True), key
    # No StatefulSet: the cluster is the operator's.
    assert not [o for o in objects if o["kind"] == "StatefulSet"]


def test_one_redis_one_shard_leaves_the_services_defaults() -> None:
    for where, env in redis_containers(render()).items():
        assert "CLAWRL_REDIS__CLUSTER" not in env and "CLAWRL_REDIS__STREAM_SHARDS" not in env, (
            where
        )


def test_the_exporter_finds_every_shard_of_the_internal_redis(settings_of) -> None:
    objects = render(sets=("redis.streamShards=3",))
    (redis,) = [o for o in objects if o["kind"] == "StatefulSet"]
    (exporter,) = [c for c in redis["spec"]["template"]["spec"]["containers"]
                   if c["name"] == "redis-exporter"]  # fmt: skip
    env = {e["name"]: e.get("value") for e in exporter["env"]}
    patterns = env["REDIS_EXPORTER_CHECK_STREAMS"].split(",")
    # The names the services write (common/shards.py) for every stream the exporter reports:
    # each matched by its stream's pattern (Redis's glob: `{` is literal, as in fnmatch), and
    # by no other stream's.
    gateway = settings_of(GatewaySettings, container_env(objects, *GATEWAY))
    shards = gateway.redis.shards()
    assert shards == Shards(3, False)
    for stream in env["REDIS_EXPORTER_CHECK_SINGLE_STREAMS"].split(","):
        for name in shards.names(stream):
            matching = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
            assert matching == [f"{stream}:{{s*}}"], name
        assert not [p for p in patterns if fnmatch.fnmatchcase(stream, p)]
    unsharded = render()
    (redis,) = [o for o in unsharded if o["kind"] == "StatefulSet"]
    names = {e["name"] for c in redis["spec"]["template"]["spec"]["containers"]
             for e in c.get("env", [])}  # fmt: skip
    assert "REDIS_EXPORTER_CHECK_STREAMS" not in names  # no SCAN on one shard


@pytest.mark.parametrize(
    "sets",
    [
        PER_TENANT,
        ("redis.mode=external", "redis.externalUrl=redis://r:6379/0", "redis.cluster=true",
         "redis.streamShards=3"),
        ("redis.streamShards=3",),
    ],
    ids=["per_tenant", "cluster", "shards"],
)  # fmt: skip
def test_helm_lint_strict(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART), "-f", str(CLUSTER_VALUES)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
