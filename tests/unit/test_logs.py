"""Log lines: ``event key=value ...`` as text, or the same as one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest

from agent.logs import JsonFormatter, TextFormatter, configure

# 2024-05-06T07:08:09.123Z
CREATED = 1714979289.123


class Capture(logging.Handler):
    def __init__(self, formatter: logging.Formatter):
        super().__init__()
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.created, record.msecs = CREATED, 123.0
        self.lines.append(self.format(record))


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger("tessera.test.logs")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    yield log
    log.handlers.clear()


def json_lines(log: logging.Logger) -> Capture:
    capture = Capture(JsonFormatter())
    log.addHandler(capture)
    return capture


def text_lines(log: logging.Logger) -> Capture:
    capture = Capture(TextFormatter())
    log.addHandler(capture)
    return capture


def record(message: str, *args: object, level: int = logging.INFO) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"name": "agent", "levelno": level, "levelname": logging.getLevelName(level), "msg": message, "args": args}
        | {"created": CREATED, "msecs": 123.0}
    )


def as_json(message: str, *args: object) -> dict[str, object]:
    return json.loads(JsonFormatter().format(record(message, *args)))


# ----- JSON ----------------------------------------------------------------------------------------


def test_json_line_splits_the_event_from_its_fields(logger: logging.Logger):
    capture = json_lines(logger)
    logger.info("allocated resource=%s devices=%s", "nvidia.com/gpu", "GPU-a,GPU-b")
    (line,) = capture.lines
    assert json.loads(line) == {
        "time": "2024-05-06T07:08:09.123Z",
        "level": "info",
        "logger": "tessera.test.logs",
        "msg": "allocated",
        "resource": "nvidia.com/gpu",
        "devices": "GPU-a,GPU-b",
    }


def test_json_quoted_value_is_one_field_without_its_quotes(logger: logging.Logger):
    capture = json_lines(logger)
    reason = "unknown device IDs for nvidia.com/gpu: GPU-x, GPU-y"
    logger.warning("allocation refused resource=%s reason=%r", "nvidia.com/gpu", reason)
    entry = json.loads(capture.lines[0])
    assert entry["msg"] == "allocation refused"
    assert entry["reason"] == reason
    assert entry["level"] == "warning"


def test_json_value_that_repr_puts_in_double_quotes_is_unquoted_too():
    assert as_json("recovered unit=%s after=%r", "GPU-0", "XID 79: it's back")["after"] == "XID 79: it's back"


def test_json_key_value_inside_a_quoted_value_does_not_become_a_field():
    entry = as_json("refused reason=%r", "size=3 too big")
    assert entry["reason"] == "size=3 too big"
    assert "size" not in entry


def test_json_message_without_fields_is_all_msg():
    entry = as_json("serving the kubelet again")
    assert entry["msg"] == "serving the kubelet again"
    assert set(entry) == {"time", "level", "logger", "msg"}


def test_json_message_starting_with_a_field_has_an_empty_msg():
    entry = as_json("gpu=%s", "GPU-0")
    assert (entry["msg"], entry["gpu"]) == ("", "GPU-0")


def test_json_fields_cannot_overwrite_the_records_own_fields_and_the_first_of_a_key_wins():
    entry = as_json("odd level=debug msg=x time=0 logger=y gpu=GPU-0 gpu=GPU-1")
    assert entry["level"] == "info"
    assert entry["msg"] == "odd"
    assert entry["time"] == "2024-05-06T07:08:09.123Z"
    assert entry["logger"] == "agent"
    assert entry["gpu"] == "GPU-0"


def test_json_value_with_an_unbalanced_quote_is_kept_whole():
    assert as_json("odd name=%s", "'abc")["name"] == "'abc"
    assert as_json("odd name=%s", '"')["name"] == '"'


def test_json_exception_is_included_and_the_entry_stays_one_line(logger: logging.Logger):
    capture = json_lines(logger)
    try:
        raise RuntimeError("NVML went away")
    except RuntimeError:
        logger.exception("health watch failed gpu=%s", "GPU-0")
    (line,) = capture.lines
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "error"
    assert entry["gpu"] == "GPU-0"
    assert "RuntimeError: NVML went away" in entry["exception"]
    assert entry["exception"].startswith("Traceback")


def test_json_time_is_utc_with_milliseconds():
    assert as_json("tick")["time"] == "2024-05-06T07:08:09.123Z"


# ----- text ----------------------------------------------------------------------------------------


def test_text_line_is_utc_time_level_logger_and_message(logger: logging.Logger):
    capture = text_lines(logger)
    logger.warning("GPU lost gpus=%s", "GPU-0")
    logger.info("resource removed resource=%s", "nvidia.com/mig-1g.10gb")
    assert capture.lines == [
        "2024-05-06T07:08:09.123Z WARNING tessera.test.logs: GPU lost gpus=GPU-0",
        "2024-05-06T07:08:09.123Z INFO    tessera.test.logs: resource removed resource=nvidia.com/mig-1g.10gb",
    ]


def test_text_line_appends_the_traceback(logger: logging.Logger):
    capture = text_lines(logger)
    try:
        raise KeyError("GPU-9")
    except KeyError:
        logger.exception("lookup failed")
    first, *rest = capture.lines[0].splitlines()
    assert first.endswith("ERROR   tessera.test.logs: lookup failed")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "KeyError: 'GPU-9'"


# ----- configure -----------------------------------------------------------------------------------


@pytest.fixture
def restore_root() -> Iterator[None]:
    root, grpc = logging.getLogger(), logging.getLogger("grpc")
    saved = (root.handlers[:], root.level, grpc.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    grpc.setLevel(saved[2])


@pytest.mark.parametrize(("log_format", "formatter"), [("json", JsonFormatter), ("text", TextFormatter)])
def test_configure_installs_one_stderr_handler_with_the_chosen_format(
    restore_root: None, log_format: str, formatter: type[logging.Formatter]
):
    configure(log_format, "debug")
    root = logging.getLogger()
    (handler,) = root.handlers
    assert isinstance(handler, logging.StreamHandler)
    assert handler.stream is sys.stderr
    assert isinstance(handler.formatter, formatter)
    assert root.level == logging.DEBUG
    assert logging.getLogger("grpc").level == logging.WARNING
