"""Structured logs carry the session id and policy version of the work in hand."""

import io
import json
import logging

from clawrl.common.logs import configure_logging, log_context
from clawrl.common.settings import LoggingSettings


def capture(fmt: str) -> io.StringIO:
    configure_logging(LoggingSettings(format=fmt, level="INFO"), service="gateway")
    stream = io.StringIO()
    logging.getLogger().handlers[0].setStream(stream)
    return stream


def test_json_lines_include_context_and_extras() -> None:
    stream = capture("json")
    with log_context(session_id="s-1", policy_version=4):
        logging.getLogger("clawrl.test").info("turn %d finalised", 2, extra={"reason": "idle"})
    logging.getLogger("clawrl.test").info("outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "turn 2 finalised"
    assert first["service"] == "gateway"
    assert (first["session_id"], first["policy_version"], first["reason"]) == ("s-1", 4, "idle")
    assert "session_id" not in second  # the context ended with the block


def test_text_format_is_one_readable_line() -> None:
    stream = capture("text")
    with log_context(session_id="abc"):
        logging.getLogger("x").warning("engine slow")
    line = stream.getvalue().strip()
    assert "WARNING gateway engine slow" in line
    assert "session_id=abc" in line


def test_private_record_attributes_are_left_out() -> None:
    # Ray's driver adds _ray_timestamp_ns to every record: private attributes are noise in both
    # formats. (Not that name here: once Ray is imported, its record factory sets it already.)
    for fmt in ("text", "json"):
        stream = capture(fmt)
        logging.getLogger("x").info("step", extra={"_clawrl_private": 1, "step": 3})
        assert "_clawrl_private" not in stream.getvalue()
        assert "step" in stream.getvalue()
