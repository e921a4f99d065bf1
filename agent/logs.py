"""Logging: one line per event, ``event key=value ...`` as text, or the same as JSON (``--log-format json``)."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_PAIR = re.compile(r"""(\w+)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)""")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"{stamp}.{int(record.msecs):03d}Z {record.levelname:<7} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """The message's leading words become ``msg``; its ``key=value`` pairs become fields."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        first = _PAIR.search(message)
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": message[: first.start()].strip() if first else message,
        }
        for key, value in _PAIR.findall(message):
            quoted = len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0]
            entry.setdefault(key, value[1:-1] if quoted else value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(log_format: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)
