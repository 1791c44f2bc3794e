"""Redis stays inside its container: a maxmemory below the memory limit with writes refused
(never stream data evicted) past it, and an alert, checked and unit-tested by Prometheus's own
`promtool`, that fires before Redis gets there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from clawrl.judge.metrics import JudgeMetrics
from tests.helm.conftest import render

UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
QUANTITY = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
# A judge pod of the release render() makes (alerts are scoped to the release's pods).
JUDGE_POD = '{namespace="ml", pod="clawrl-judge-5d8f7c9b4-x2x7q"}'


def redis_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", text).groups()
    return int(number) * UNITS[unit or "b"]


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", text).groups()
    return int(number) * QUANTITY[unit]


def redis_container(objects: list[dict]) -> dict:
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    return statefulset["spec"]["template"]["spec"]["containers"][0]


def test_redis_refuses_writes_below_its_container_limit() -> None:
    container = redis_container(render())
    args = container["args"]
    maxmemory = redis_bytes(args[args.index("--maxmemory") + 1])
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    assert maxmemory <= 0.8 * limit
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_the_schema_rejects_a_maxmemory_redis_cannot_read() -> None:
    from tests.helm.conftest import helm

    result = helm("template", "x", str(Path(__file__).parents[2] / "helm" / "clawrl"),
                  "--set", "redis.maxmemory=6Gi")  # fmt: skip
    assert result.returncode != 0
    assert "maxmemory" in result.stderr


def test_the_redis_memory_alert_is_valid_and_fires_past_the_ratio(promtool, tmp_path) -> None:
    objects = render(sets=("prometheusRule.enabled=true",))  # the default ratio, 0.85
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)],
                             capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The expression reads metrics the judge exports.
    names = {m.name for m in JudgeMetrics().registry.collect()}
    expr = rule["spec"]["groups"][0]["rules"][0]["expr"]
    for metric in re.findall(r"clawrl_\w+", expr):
        assert metric in names

    # 9 GiB of 10 fires after 5 minutes; 7 of 10 never does.
    gib = 1024**3
    fired = {"exp_labels": {"severity": "warning"}, "exp_annotations": rule["spec"]["groups"][0]
             ["rules"][0]["annotations"]}  # fmt: skip
    tests = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f"clawrl_judge_redis_used_memory_bytes{JUDGE_POD}",
                        "values": f"{9 * gib}x10",
                    },
                    {
                        "series": f"clawrl_judge_redis_maxmemory_bytes{JUDGE_POD}",
                        "values": f"{10 * gib}x10",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "3m", "alertname": "ClawrlRedisMemoryHigh", "exp_alerts": []},
                    {
                        "eval_time": "7m",
                        "alertname": "ClawrlRedisMemoryHigh",
                        "exp_alerts": [fired],
                    },
                ],
            },
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f"clawrl_judge_redis_used_memory_bytes{JUDGE_POD}",
                        "values": f"{7 * gib}x10",
                    },
                    {
                        "series": f"clawrl_judge_redis_maxmemory_bytes{JUDGE_POD}",
                        "values": f"{10 * gib}x10",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "9m", "alertname": "ClawrlRedisMemoryHigh", "exp_alerts": []},
                ],
            },
        ],
    }
    tests_file = tmp_path / "tests.yaml"
    tests_file.write_text(yaml.safe_dump(tests))
    tested = subprocess.run([promtool, "test", "rules", str(tests_file)],
                            capture_output=True, text=True)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
