"""Logging setup shared by every pagedserve process: one line per event, as text or as JSON.

Call sites log an event name and pass what it concerns as `extra` fields, so both formats carry
the same facts and the JSON form stays machine-readable:

    log.info("request admitted", extra={"request_id": rid, "worker": worker_id})

Text:  2026-01-05 10:00:00,123 INFO pagedserve.router request admitted request_id=r1 worker=w0
JSON:  {"ts": "...", "level": "INFO", "logger": "pagedserve.router", "msg": "request admitted",
        "request_id": "r1", "worker": "w0"}
"""

from __future__ import annotations

import json
import logging
import sys

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")

# Attributes every LogRecord has; whatever else a record carries came in through `extra`.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, object]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD_ATTRIBUTES}


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message key=value ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{key}={value}" for key, value in _extra_fields(record).items())
        return f"{line} {fields}" if fields else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the `extra` fields as top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": self.formatTime(record), "level": record.levelname, "logger": record.name,
            "msg": record.getMessage(), **_extra_fields(record)}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Sends every logger's records to stderr in the given format, replacing earlier setup."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
