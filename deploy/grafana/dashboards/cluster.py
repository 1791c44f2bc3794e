"""The cluster dashboard: pods (restarts, OOM kills, memory, CPU), GPUs, Redis and Ray."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import RATE, SCOPE, Panel, sel


def dcgm(metric: str) -> str:
    """A DCGM exporter gauge of the scoped pods, labelled with the GPU's pod as `pod`.
    dcgm-exporter names the pod using a GPU in `namespace` and `pod`; Prometheus renames them
    `exported_namespace` and `exported_pod` when it keeps the exporter's own target labels
    (honorLabels false, the default of NVIDIA's charts): both spellings are read."""
    exported = SCOPE.replace("namespace=", "exported_namespace=").replace("pod=", "exported_pod=")
    renamed = f'label_replace({metric}{{{exported}}}, "pod", "$1", "exported_pod", "(.+)")'
    return f"({renamed} or {sel(metric)})"


OOM_KILLED = '{reason="OOMKilled"}'
CONTAINERS = '{container!=""}'  # not the pod-level cgroup's series (they would count twice)
MEMORY_LIMIT = '{resource="memory"}'

# Kubernetes (kube-state-metrics, the kubelet's cAdvisor), GPUs (NVIDIA's dcgm-exporter), Redis
# (the chart's redis_exporter sidecar, and the judge's own reading), Ray (the trainer's nodes).
CLUSTER = [
    Panel(
        "Container restarts",
        "short",
        (
            (
                f"sum by (pod) (increase({sel('kube_pod_container_status_restarts_total')}{RATE}))",
                "{{pod}}",
            ),
        ),
        "Container restarts per pod over the window (kube-state-metrics). An engine or trainer "
        "that restarts reloads its weights; see OOM kills beside it.",
        threshold=1,
    ),
    Panel(
        "OOM kills",
        "short",
        (
            (
                "sum by (pod) ("
                f"{sel('kube_pod_container_status_last_terminated_reason', OOM_KILLED)})",
                "{{pod}}",
            ),
        ),
        "1 for a pod whose container last ended killed for passing its memory limit "
        "(kube-state-metrics): raise the component's resources.limits.memory.",
        threshold=1,
    ),
    Panel(
        "Memory (working set) and limit",
        "bytes",
        (
            (
                f"sum by (pod) ({sel('container_memory_working_set_bytes', CONTAINERS)})",
                "{{pod}}",
            ),
            (
                f"sum by (pod) ({sel('kube_pod_container_resource_limits', MEMORY_LIMIT)})",
                "{{pod}} limit",
            ),
        ),
        "Memory the kubelet counts against each pod's limit (cAdvisor), and the limit.",
    ),
    Panel(
        "CPU",
        "short",
        (
            (
                f"sum by (pod) (rate({sel('container_cpu_usage_seconds_total', CONTAINERS)}"
                f"{RATE}))",
                "{{pod}}",
            ),
        ),
        "Cores each pod uses (cAdvisor).",
    ),
    Panel(
        "GPU utilisation",
        "percent",
        ((f"avg by (pod) ({dcgm('DCGM_FI_DEV_GPU_UTIL')})", "{{pod}}"),),
        "Mean utilisation of each pod's GPUs (dcgm-exporter): engines, and the trainer's Ray "
        "workers.",
    ),
    Panel(
        "GPU memory used",
        "decmbytes",
        ((f"sum by (pod) ({dcgm('DCGM_FI_DEV_FB_USED')})", "{{pod}}"),),
        "Frame-buffer memory used on each pod's GPUs (dcgm-exporter). SGLang reserves "
        "mem_fraction_static of it at start.",
    ),
    Panel(
        "GPU power and temperature",
        "short",
        (
            (f"sum by (pod) ({dcgm('DCGM_FI_DEV_POWER_USAGE')})", "{{pod}} W"),
            (f"max by (pod) ({dcgm('DCGM_FI_DEV_GPU_TEMP')})", "{{pod}} °C (hottest)"),
        ),
        "Power draw (watts) of each pod's GPUs and the hottest one's temperature.",
    ),
    Panel(
        "GPU XID errors",
        "short",
        ((f"max by (pod) ({dcgm('DCGM_FI_DEV_XID_ERRORS')})", "{{pod}}"),),
        "The last XID error each pod's GPUs reported (0: none): a driver-level GPU fault.",
    ),
    Panel(
        "Redis memory",
        "bytes",
        (
            (f"max({sel('clawrl_judge_redis_used_memory_bytes')})", "used (judge's reading)"),
            (f"max({sel('clawrl_judge_redis_maxmemory_bytes')} > 0)", "maxmemory"),
            (f"max({sel('redis_memory_used_bytes')})", "used (redis_exporter)"),
        ),
        "Redis refuses writes at maxmemory (noeviction): turns are then spooled or lost and "
        "the judge stops (ClawrlRedisMemoryHigh).",
    ),
    Panel(
        "Redis streams",
        "short",
        (
            (f"max by (stream) ({sel('redis_stream_length')})", "{{stream}} length"),
            (
                f"max by (stream, group) ({sel('redis_stream_group_lag')})",
                "{{stream}} {{group}} not delivered",
            ),
            (
                f"max by (stream, group) ({sel('redis_stream_group_messages_pending')})",
                "{{stream}} {{group}} pending",
            ),
        ),
        "Entries on each clawrl stream, and per consumer group those not yet delivered and "
        "those delivered but not acknowledged (redis_exporter sidecar, redis.exporter).",
    ),
    Panel(
        "Ray nodes",
        "percent",
        (
            (f"avg by (pod) ({sel('ray_node_cpu_utilization')})", "{{pod}} CPU"),
            (f"avg by (pod) ({sel('ray_node_gpus_utilization')})", "{{pod}} GPU"),
        ),
        "CPU and GPU utilisation of the trainer's Ray nodes as Ray reports them.",
    ),
    Panel(
        "Ray memory",
        "bytes",
        (
            (f"sum by (pod) ({sel('ray_node_mem_used')})", "{{pod}} memory"),
            (f"sum by (pod) ({sel('ray_object_store_memory')})", "{{pod}} object store"),
        ),
        "Memory used on each Ray node, and by Ray's object store (the trainer's batches).",
    ),
]
