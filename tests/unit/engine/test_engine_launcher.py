"""The SGLang command built from clawrl settings (flag names are SGLang's ServerArgs)."""

import json

import pytest

from clawrl.common.settings import ModelSettings
from clawrl.engine.launcher import build_argv, build_env
from clawrl.engine.main import load_settings, parse_args
from clawrl.engine.settings import EngineServerSettings, EngineSettings, SGLangSettings


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_minimal_command():
    settings = EngineSettings(
        model=ModelSettings(path="Qwen/Qwen3-4B"),
        engine=EngineServerSettings(host="0.0.0.0", port=30000),
    )
    argv = build_argv(settings)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "Qwen/Qwen3-4B"
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--port") == "30000"
    assert flag(argv, "--tp-size") == "1"
    assert flag(argv, "--served-model-name") == "Qwen3-4B"
    assert flag(argv, "--weight-version") == "default"
    assert "--enable-metrics" in argv
    assert "--context-length" not in argv
    assert "--mem-fraction-static" not in argv
    assert "--tool-call-parser" not in argv


def test_every_setting_reaches_its_flag():
    settings = EngineSettings(
        model=ModelSettings(path="/models/policy", served_name="policy", context_length=4096),
        engine=EngineServerSettings(port=30001, weight_version="3"),
        sglang=SGLangSettings(
            tp_size=2,
            dp_size=2,
            mem_fraction_static=0.8,
            max_running_requests=64,
            enable_metrics=False,
            tool_call_parser="qwen25",
            reasoning_parser="qwen3",
            random_seed=1,
            trust_remote_code=True,
            extra_args=["--attention-backend", "fa3"],
        ),
    )
    argv = build_argv(settings)
    assert flag(argv, "--model-path") == "/models/policy"
    assert flag(argv, "--served-model-name") == "policy"
    assert flag(argv, "--weight-version") == "3"
    assert flag(argv, "--tp-size") == "2"
    assert flag(argv, "--dp-size") == "2"
    assert flag(argv, "--context-length") == "4096"
    assert flag(argv, "--mem-fraction-static") == "0.8"
    assert flag(argv, "--max-running-requests") == "64"
    assert flag(argv, "--tool-call-parser") == "qwen25"
    assert flag(argv, "--reasoning-parser") == "qwen3"
    assert flag(argv, "--random-seed") == "1"
    assert "--trust-remote-code" in argv
    assert "--enable-metrics" not in argv
    assert argv[-2:] == ["--attention-backend", "fa3"]


def test_a_prepared_model_name_becomes_its_directory(tmp_path):
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "config.json").write_text("{}")
    settings = EngineSettings(model=ModelSettings(path="mymodel", cache_dir=tmp_path))
    assert flag(build_argv(settings), "--model-path") == str(tmp_path / "mymodel")


def test_cli_flags_override_settings(monkeypatch):
    monkeypatch.setenv("CLAWRL_ENGINE__PORT", "1234")
    monkeypatch.setenv("CLAWRL_ENGINE__MAX_QUEUED_REQUESTS", "7")
    settings = load_settings(
        parse_args(["--port", "5678", "--model", "smollm2-tiny", "--backend", "sglang"])
    )
    assert settings.engine.port == 5678
    assert settings.engine.max_queued_requests == 7
    assert settings.engine.backend == "sglang"
    assert settings.model.path == "smollm2-tiny"


def test_sglang_reports_raw_logprobs_like_the_cpu_engine():
    env = build_env(EngineSettings(), {"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    off = EngineSettings(sglang=SGLangSettings(return_original_logprob=False))
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in build_env(off, {})


def test_scheduler_flags_reach_sglang_under_backend_sglang(monkeypatch):
    """Flags are routed to the section the chosen backend reads, never dropped."""
    monkeypatch.delenv("CLAWRL_ENGINE__BACKEND", raising=False)
    args = [
        "--backend", "sglang", "--max-running-requests", "48", "--max-queued-requests", "9",
        "--max-total-tokens", "100000", "--chunked-prefill-size", "4096",
        "--max-prefill-tokens", "16384", "--context-length", "32768",
        "--incremental-streaming-output", "--random-seed", "5", "--tp-size", "2",
        "--disable-radix-cache", "--dtype", "float16",
    ]  # fmt: skip
    settings = load_settings(parse_args(args))
    argv = build_argv(settings, model="/m")
    assert flag(argv, "--dtype") == "float16"
    assert flag(argv, "--max-running-requests") == "48"
    assert flag(argv, "--max-queued-requests") == "9"
    assert flag(argv, "--max-total-tokens") == "100000"
    assert flag(argv, "--chunked-prefill-size") == "4096"
    assert flag(argv, "--max-prefill-tokens") == "16384"
    assert flag(argv, "--context-length") == "32768"
    assert flag(argv, "--random-seed") == "5"
    assert flag(argv, "--tp-size") == "2"
    assert "--incremental-streaming-output" in argv
    assert "--disable-radix-cache" in argv
    # The CPU scheduler's section is left as it was.
    assert settings.engine.max_running_requests == EngineServerSettings().max_running_requests


def test_the_same_flags_set_the_cpu_scheduler_under_backend_cpu():
    settings = load_settings(
        parse_args(
            ["--backend", "cpu", "--max-running-requests", "3", "--chunked-prefill-size", "64",
             "--incremental-streaming-output", "--torch-threads", "1", "--dtype", "bfloat16"]
        )
    )  # fmt: skip
    assert settings.engine.dtype == "bfloat16"
    assert settings.engine.max_running_requests == 3
    assert settings.engine.chunked_prefill_size == 64
    assert settings.engine.incremental_streaming_output is True
    assert settings.engine.torch_threads == 1
    assert settings.sglang.max_running_requests is None


def test_a_flag_the_backend_cannot_use_is_an_error():
    with pytest.raises(SystemExit, match="--torch-threads has no effect with --backend sglang"):
        load_settings(parse_args(["--backend", "sglang", "--torch-threads", "2"]))
    with pytest.raises(SystemExit, match="--tp-size has no effect with --backend cpu"):
        load_settings(parse_args(["--backend", "cpu", "--tp-size", "2"]))


def test_a_context_beyond_the_model_stretches_rope_on_sglang_too(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    settings = EngineSettings(model=ModelSettings(path=str(tmp_path), context_length=32768))
    argv = build_argv(settings, model=str(tmp_path))
    assert flag(argv, "--context-length") == "32768"
    override = json.loads(flag(argv, "--json-model-override-args"))
    assert override == {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    }
    assert build_env(settings, {})["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    within = EngineSettings(model=ModelSettings(path=str(tmp_path), context_length=4096))
    assert "--json-model-override-args" not in build_argv(within, model=str(tmp_path))


def test_an_exported_checkpoint_is_stretched_from_what_the_model_was_trained_on(tmp_path):
    """A checkpoint the trainer exported at 16384 keeps its trained 8192 in the RoPE config:
    serving it at 32768 stretches 4x from 8192, not 2x from 16384."""
    (tmp_path / "config.json").write_text(
        json.dumps({
            "max_position_embeddings": 16384,
            "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e5,
                                "original_max_position_embeddings": 8192},
        })
    )  # fmt: skip
    settings = EngineSettings(
        model=ModelSettings(path=str(tmp_path), context_length=32768, rope_scaling="linear")
    )
    override = json.loads(
        flag(build_argv(settings, model=str(tmp_path)), "--json-model-override-args")
    )
    assert override["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
