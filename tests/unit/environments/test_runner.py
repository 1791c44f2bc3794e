"""The agent runner's pure parts: which tasks it plays and in what order, the session ids, what
/reset gets, the prompt, how observations are cut and versions read, and its command line."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from clawrl.environments.episode import (
    EpisodeResult,
    clip,
    reply_version,
    task_meta,
)
from clawrl.environments.prompting import DEMOS, SYSTEM, opening_messages
from clawrl.environments.runner import numbered, schedule, select_tasks
from clawrl.environments.tasks import Task, TaskSet, TaskSetError, load_taskset
from clawrl.simulate.main import parse_args


def task(family: str, name: str, split: str = "train", **extra) -> Task:
    return Task(
        id=f"{family}.{name}",
        family=family,
        split=split,
        instruction=f"do {name}",
        files=extra.pop("files", {"in.txt": "1\n"}),
        tools=("sh", "cat"),
        max_steps=extra.pop("max_steps", 3),
        command_timeout_s=5.0,
        checker="test -f out.txt",
        solution="cat in.txt > out.txt",
        **extra,
    )


SET = TaskSet.of(
    [task("alpha", "a"), task("alpha", "b"), task("alpha", "c", "heldout"),
     task("beta", "a"), task("beta", "b", "heldout"), task("gamma", "a")]
)  # fmt: skip


def ids(tasks) -> list[str]:
    return [t.id for t in tasks]


def test_select_tasks_by_split_family_and_id():
    assert ids(select_tasks(SET, ["train"])) == ["alpha.a", "alpha.b", "beta.a", "gamma.a"]
    assert ids(select_tasks(SET, ["heldout"])) == ["alpha.c", "beta.b"]
    both = select_tasks(SET, ["train", "heldout"], ["beta"])
    assert [(t.split, t.id) for t in both] == [("heldout", "beta.b"), ("train", "beta.a")]
    assert ids(select_tasks(SET, ["train"], None, ["gamma.a", "alpha.b"])) == [
        "alpha.b",
        "gamma.a",
    ]


@pytest.mark.parametrize(
    ("splits", "families", "task_ids", "message"),
    [
        (["train"], ["delta"], None, "unknown family 'delta'"),
        (["train"], ["alpha"], ["alpha.c"], "no task 'alpha.c'"),  # held out, not in train
        (["heldout"], ["gamma"], None, "no task matches"),
    ],
)
def test_select_tasks_refuses_what_matches_nothing(splits, families, task_ids, message):
    with pytest.raises(TaskSetError, match=message):
        select_tasks(SET, splits, families, task_ids)


def test_schedule_plays_each_task_once_per_pass_in_a_seeded_order():
    tasks = select_tasks(SET, ["train"])
    one_pass = ids(schedule(tasks, seed=3, limit=None))
    assert sorted(one_pass) == ids(tasks)  # each once
    assert one_pass == ids(schedule(tasks, seed=3, limit=None))  # the seed decides
    orders = {tuple(ids(schedule(tasks, seed=s, limit=None))) for s in range(10)}
    assert len(orders) > 1
    ten = ids(schedule(tasks, seed=3, limit=10))
    assert len(ten) == 10
    assert sorted(ten[:4]) == sorted(ten[4:8]) == ids(tasks)  # whole passes, reshuffled
    endless = schedule(tasks, seed=3, limit=0)
    counts = Counter(ids(itertools.islice(endless, 400)))
    assert set(counts.values()) == {100}


def test_session_ids_are_numbered_and_name_the_task():
    tasks = select_tasks(SET, ["train"])
    jobs = list(numbered(tasks, "agent-abc"))
    assert [session for _, session in jobs] == [
        "agent-abc-000000-alpha.a",
        "agent-abc-000001-alpha.b",
        "agent-abc-000002-beta.a",
        "agent-abc-000003-gamma.a",
    ]


def test_task_meta_carries_files_tools_checker_and_the_command_limit():
    meta = task_meta(task("alpha", "a", files={"d/in.txt": "x\n"}))
    assert meta == {
        "task_name": "alpha.a",
        "instruction": "do a",
        "files": {"d/in.txt": "x\n"},
        "tools": ["sh", "cat"],
        "checker": "test -f out.txt",
        "limits": {"timeout_s": 5.0},
    }
    assert "solution" not in json.dumps(meta)


def test_every_shipped_task_makes_a_valid_reset():
    from clawrl.environments.protocol import TaskMeta

    for shipped in load_taskset().tasks:
        parsed = TaskMeta.model_validate(task_meta(shipped))
        assert parsed.checker == shipped.checker
        assert parsed.limits.timeout_s == shipped.command_timeout_s


def test_clip_keeps_head_and_tail():
    assert clip("short", 10) == "short"
    text = "H" * 500 + "T" * 500
    cut = clip(text, 200)
    assert len(cut) == 200
    assert cut.startswith("HHHH") and cut.endswith("TTTT")
    assert "[... 800 characters cut ...]" in cut


@pytest.mark.parametrize(
    ("fingerprint", "version"),
    [("clawrl-policy-v0", 0), ("clawrl-policy-v17", 17), (None, None), ("fp_abc", None)],
)
def test_reply_version(fingerprint, version):
    assert reply_version(fingerprint) == version


def test_an_episode_split_by_a_sync_has_no_version():
    result = EpisodeResult("s", "alpha.a", "alpha", "train")
    assert result.policy_version is None  # no reply yet
    for version in (3, 3, None):
        result.saw(version)
    assert (result.policy_version, result.versions) == (3, [3])
    result.saw(4)
    assert (result.policy_version, result.versions) == (None, [3, 4])
    assert result.record()["policy_versions"] == [3, 4]


def test_opening_messages():
    messages = opening_messages("Delete x.txt.")
    assert messages[0] == {"role": "system", "content": SYSTEM}
    assert messages[-1] == {"role": "user", "content": "Delete x.txt."}
    calls = [m for m in messages if m.get("tool_calls")]
    assert len(calls) == len(DEMOS)
    for message in calls:
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "shell_exec"
        assert set(json.loads(call["function"]["arguments"])) == {"command"}
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert results == [m["tool_calls"][0]["id"] for m in calls]
    assert opening_messages("x", "plain") == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "x"},
    ]
    with pytest.raises(ValueError, match="unknown prompt style"):
        opening_messages("x", "zero-shot")


def test_demos_show_no_shipped_task_file_or_solution():
    demo_text = json.dumps(opening_messages("x"))
    for shipped in load_taskset().tasks:
        assert shipped.solution.strip() not in demo_text, shipped.id


def test_agent_run_command_line():
    args = parse_args(
        ["agent", "run", "--gateway-url", "http://g/v1", "--split", "train,heldout",
         "--families", "alpha,beta", "--episodes", "0", "--concurrency", "3"]
    )  # fmt: skip
    assert (args.command, args.agent_command, args.base_url) == ("agent", "run", "http://g/v1")
    assert args.split == ["train", "heldout"] and args.families == ["alpha", "beta"]
    assert (args.episodes, args.concurrency, args.max_tokens) == (0, 3, 128)
    assert args.post_outcome is True and args.prompt == "few-shot"
    assert parse_args(["agent", "run", "--no-outcome"]).post_outcome is False
    assert parse_args(["agent", "run"]).episodes is None  # one pass


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["agent", "run", "--split", "test"], "'test' is not one of train, heldout"),
        (["agent", "run", "--concurrency", "0"], "--concurrency must be at least 1"),
        (["agent", "run", "--episodes", "-1"], "--episodes must be 0"),
        (["eval", "--track", "terminal", "--eval-concurrency", "0"], "--eval-concurrency"),
    ],
)
def test_bad_command_lines_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_eval_defaults_per_track_and_mode():
    from clawrl.environments.agent_eval import resolve

    chat = parse_args(["eval"])
    assert (chat.track, chat.max_tokens) == ("chat", 96)
    held_out = parse_args(["eval", "--track", "terminal"])
    resolve(held_out)
    assert (held_out.split, held_out.temperature, held_out.max_tokens) == (["heldout"], 0.0, 128)
    base = parse_args(["eval", "--track", "terminal", "--base-rate"])
    resolve(base)
    assert (base.split, base.temperature, base.attempts) == (["train", "heldout"], 0.7, 3)
    assert base.concurrency == base.eval_concurrency


def test_result_log_writes_lines_and_counts_without_keeping_results(tmp_path):
    from clawrl.environments.runner import ResultLog
    from clawrl.environments.runner_metrics import RunnerMetrics

    metrics = RunnerMetrics()
    with (tmp_path / "e.jsonl").open("w") as out:
        log = ResultLog(out, metrics)
        for n, (passed, versions) in enumerate([(True, [0]), (False, [0, 2]), (None, [])]):
            result = EpisodeResult(f"s{n}", "alpha.a", "alpha", "train", passed=passed)
            for version in versions:
                result.saw(version)
            log.add(result)
            assert log.changed.is_set()
        assert not log.broke_off_only
    lines = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [(x["session_id"], x["passed"], x["policy_version"]) for x in lines] == [
        ("s0", True, 0), ("s1", False, None), ("s2", None, None)
    ]  # fmt: skip
    assert log.summary() == "3 episodes: 1 passed of 2 checked (0.500), 1 broke off"
    assert log.newest_version == 2
    assert metrics.registry.get_sample_value("clawrl_agent_policy_version") == 2.0
    broken = ResultLog(out, metrics)
    broken.counts[None] = 2
    assert broken.broke_off_only


async def test_a_gateway_that_never_answers_fails_the_request_at_the_runner_timeout():
    """A hung engine used to hold an episode (and its lease) for the openai client's 600 s,
    times 3 tries; --request-timeout-s bounds it."""
    import asyncio
    import time

    import openai

    from clawrl.environments.runner import connect
    from clawrl.environments.runner_metrics import RunnerMetrics

    held = []  # the connections stay open, unanswered

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    args = parse_args(["agent", "run", "--gateway-url", f"http://127.0.0.1:{port}/v1",
                       "--model", "m", "--request-timeout-s", "0.3"])  # fmt: skip
    async with server, connect(args, RunnerMetrics()) as clients:
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await clients.gateway.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        assert time.monotonic() - started < 15  # 3 tries of 0.3 s and the client's backoff
        assert len(held) == 3
