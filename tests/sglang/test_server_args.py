"""The launcher's argv, for the settings the chart can render, parsed by SGLang's own ServerArgs
parser (sglang.srt.server_args.prepare_server_args) in the SGLang venv."""

from __future__ import annotations

import json

import pytest

from clawrl.engine.launcher import build_argv
from tests.sglang.conftest import engine_settings, run_in_sglang, sglang_env

pytestmark = pytest.mark.sglang

# Prints the parsed fields the launcher sets, as JSON, or fails with SGLang's own message.
PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(args, k) for k in json.loads(sys.argv[2])}, default=str))
"""

CASES = {
    "defaults": {},
    "scheduler": {
        "max_running_requests": 8,
        "max_queued_requests": 64,
        "max_prefill_tokens": 2048,
        "chunked_prefill_size": 1024,
        "incremental_streaming_output": True,
    },
    "no_radix_cache_seeded": {
        "disable_radix_cache": True,
        "random_seed": 7,
        "log_level": "warning",
    },
    "context_override": {"context_length": 16384},
    "parsers": {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"},
    "no_metrics": {"enable_metrics": False, "mem_fraction_static": 0.5},
}

EXPECTED_FIELDS = {
    "max_running_requests": 8,
    "max_queued_requests": 64,
    "max_prefill_tokens": 2048,
    "chunked_prefill_size": 1024,
    "incremental_streaming_output": True,
    "disable_radix_cache": True,
    "random_seed": 7,
    "context_length": 16384,
    "tool_call_parser": "qwen25",
    "reasoning_parser": "qwen3",
    "enable_metrics": False,
    "mem_fraction_static": 0.5,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sglang_parses_the_launchers_argv(case):
    settings = engine_settings(30000, **CASES[case])
    argv = build_argv(settings)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    fields = ["model_path", "port", "dtype", "weight_version", "served_model_name", "device"]
    fields += [name for name in CASES[case] if name != "log_level"]
    done = run_in_sglang(PARSE, json.dumps(argv[3:]), json.dumps(fields), env=sglang_env(settings))
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["port"] == 30000
    assert parsed["dtype"] == "bfloat16"
    assert parsed["weight_version"] == "default"
    assert parsed["served_model_name"] == "SmolLM2-135M-Instruct"
    assert parsed["device"] == "cpu"
    for name in CASES[case]:
        if name != "log_level":
            assert parsed[name] == EXPECTED_FIELDS[name], name


def test_sglang_refuses_a_flag_it_does_not_know():
    """The check above can fail: SGLang's parser exits non-zero on an unknown flag."""
    settings = engine_settings(30000, extra_args=["--no-such-flag", "1"])
    done = run_in_sglang(PARSE, json.dumps(build_argv(settings)[3:]), json.dumps(["port"]))
    assert done.returncode != 0
    assert "unrecognized arguments: --no-such-flag" in done.stderr
