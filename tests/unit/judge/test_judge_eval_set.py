"""The labelled set `clawrl judge-eval` ships, and its pure figures worked by hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from clawrl.judge.evaluation import (
    Case,
    CaseResult,
    auc,
    balanced_order,
    load_cases,
    percentile,
    summarize,
)


def next_user_text(case: Case) -> str:
    return next((m["content"] for m in case.next_state if m["role"] == "user"), "")


def test_the_shipped_set_has_every_verdict_in_varied_wording_and_every_kind() -> None:
    cases = load_cases()
    assert 40 <= len(cases) <= 60
    by_verdict = Counter(c.verdict for c in cases)
    assert min(by_verdict[v] for v in (1, 0, -1)) >= 12
    for verdict in (1, 0, -1):
        wordings = {json.dumps(c.next_state) for c in cases if c.verdict == verdict}
        assert len(wordings) >= 8
    kinds = Counter(c.kind for c in cases)
    assert kinds["tool_ok"] >= 3 and kinds["tool_error"] >= 3 and kinds["new_topic"] >= 8
    assert all(c.verdict == 1 for c in cases if c.kind == "tool_ok")
    assert all(c.verdict == -1 for c in cases if c.kind == "tool_error")
    assert all(c.verdict == 0 for c in cases if c.kind == "new_topic")
    assert all(c.next_state[0]["role"] == "tool" for c in cases if c.kind.startswith("tool"))
    texts = [next_user_text(c) for c in cases if next_user_text(c)]
    openers = [t for t in texts if t.lower().startswith(("thank", "please"))]
    assert len(openers) <= len(texts) // 10  # not the fixed-remark user's two openings
    assert sum(t.rstrip().endswith("?") for t in texts) >= 5  # some are questions
    assert sum(len(t.split()) <= 2 for t in texts) >= 5  # some are terse
    # hints: the corrections say how, approvals and new topics do not
    assert sum(c.hint for c in cases) >= 10
    assert not any(c.hint for c in cases if c.verdict != -1)
    assert any(not c.hint for c in cases if c.verdict == -1)  # "Wrong." says not how
    assert all(len(c.hint_gist) > 10 for c in cases if c.hint)


def test_bad_cases_are_refused_with_their_line() -> None:
    good = {"id": "a", "kind": "feedback", "messages": [], "verdict": 1, "hint": False,
            "reply": {"role": "assistant", "content": "x"},
            "next_state": [{"role": "user", "content": "ok"}]}  # fmt: skip
    assert load_cases(json.dumps(good))[0].verdict == 1
    for change, message in (
        ({"verdict": 2}, "verdict must be"),
        ({"kind": "other"}, "kind 'other'"),
        ({"hint": True}, "needs its hint_gist"),
        ({"next_state": []}, "next_state non-empty"),
    ):
        with pytest.raises(ValueError, match=f"line 2: .*{message}"):
            load_cases(json.dumps({**good, "id": "b"}) + "\n" + json.dumps({**good, **change}))
    with pytest.raises(ValueError, match="duplicate id a"):
        load_cases(json.dumps(good) + "\n" + json.dumps(good))


def case(verdict: int, kind: str = "feedback", hint: bool = False, name: str = "") -> Case:
    return Case(name or f"{kind}{verdict}", kind, [], {"role": "assistant"}, [{}], verdict, hint,
                "a hint gist here" if hint else "")  # fmt: skip


def test_balanced_order_interleaves_the_verdicts() -> None:
    cases = [case(1, name="p1"), case(1, name="p2"), case(-1, name="n1"), case(0, name="z1")]
    assert [c.id for c in balanced_order(cases)] == ["p1", "z1", "n1", "p2"]


def test_summary_figures_by_hand() -> None:
    results = [
        # gold +1, votes 1,1,None -> +1 (agreement 1.0); no hint asked for, none given
        CaseResult(case(1), 1, [1, 1, None], "", [-1, -1, -1], 1.0, 2.0),
        # gold -1 with a hint, votes 1,-1,-1 -> -1 (agreement 2/3); hint given
        CaseResult(case(-1, hint=True), -1, [1, -1, -1], "do X instead", [1, None, -1], 2.0, 2.0),
        # gold 0, votes -1,1,None -> tie 0 (agreement 0); a false hint
        CaseResult(case(0, "new_topic"), 0, [-1, 1, None], "bogus", [1, 1, 1], 0.5, 0.5),
        # gold +1 tool_ok, no valid vote -> 0 (left out of agreement)
        CaseResult(case(1, "tool_ok"), 0, [None, None, None], "", [-1, -1, -1], 4.0, 6.0),
    ]
    s = summarize(results)
    assert s["accuracy_all"] == 0.75 and s["accuracy"] == pytest.approx(2 / 3)
    assert s["confusion"] == {"+1": {"+1": 1, "0": 1, "-1": 0}, "0": {"+1": 0, "0": 1, "-1": 0},
                              "-1": {"+1": 0, "0": 0, "-1": 1}}  # fmt: skip
    assert s["parse_rate"] == pytest.approx(7 / 12) and s["votes"] == 12
    assert s["vote_agreement"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert s["hint_yield"] == 1.0 and s["false_hint_rate"] == pytest.approx(1 / 3)
    assert s["hint_parse_rate"] == pytest.approx(11 / 12)
    assert s["by_kind"]["tool_ok"] == {"cases": 1, "accuracy": 0.0}
    assert s["latency_s"] == {"mean": 4.5, "p50": 3.0, "p95": 10.0}
    assert s["prm_latency_s"]["p50"] == 1.0


def test_one_vote_verdicts_report_no_agreement() -> None:
    s = summarize([CaseResult(case(1), 1, [1], "", [], 0.1, 0.0)])
    assert s["vote_agreement"] is None and s["hint_parse_rate"] is None
    assert s["hint_yield"] is None  # no case asks for a hint


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 21))  # 1..20
    assert percentile(values, 0.5) == 10 and percentile(values, 0.95) == 19
    assert percentile([7.0], 0.95) == 7.0


def test_auc_by_hand() -> None:
    # pairs (p, n): (0.9, 0.2) win, (0.9, 0.5) win, (0.5, 0.2) win, (0.5, 0.5) tie -> 3.5 / 4
    assert auc([0.9, 0.5], [0.2, 0.5]) == 0.875
    assert auc([0.1], [0.9]) == 0.0 and auc([], [0.3]) is None


def test_the_yes_share_auc_comes_from_the_logprob_cases() -> None:
    results = [
        CaseResult(case(1, name="a"), 1, [1], "", [], 0.1, 0.0, yes_share=0.8),
        CaseResult(case(1, name="b"), 0, [0], "", [], 0.1, 0.0, yes_share=0.4),
        CaseResult(case(-1, name="c"), 0, [0], "", [], 0.1, 0.0, yes_share=0.6),
        CaseResult(case(0, name="d"), 0, [None], "", [], 0.1, 0.0, yes_share=None),
    ]
    s = summarize(results)
    assert s["yes_share_auc"] == 0.5  # 0.8 > 0.6 wins, 0.4 < 0.6 loses
    assert [r["yes_share"] for r in s["results"]] == [0.8, 0.4, 0.6, None]
    assert summarize(results[:1])["yes_share_auc"] is None  # no -1 case
