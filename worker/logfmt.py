"""Structured logs: one event per line, in key=value (logfmt) or JSON form.

Router, prefill and decode workers log a request's events with the same
``request_id`` key (workers see the client's id plus ``#<attempt>``), so
one grep follows a request through every process:

    log_event(log, "prefill_done", request_id=rid, cached_tokens=32, kv_bytes=65536)
    -> event=prefill_done request_id=r1#3fa2 cached_tokens=32 kv_bytes=65536

``configure_logging("json")`` makes every record a JSON object with the
event's fields at the top level.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_FIELDS_ATTR = "tandem_fields"


def format_fields(fields: dict[str, object]) -> str:
    """``key=value`` pairs; values with spaces, quotes, ``=``, backslashes or any
    character that is not printable (newlines, control and format characters,
    whatever a client put in its request id) are JSON-quoted, escaped to ASCII,
    so that no value can end the line or forge a field."""
    parts = []
    for key, value in fields.items():
        if value is None:
            continue
        text = str(value)
        if not text or not text.isprintable() or any(c in text for c in ' "=\\'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def log_event(
    logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object
) -> None:
    """Log ``event`` with ``fields`` (None values are left out)."""
    if not logger.isEnabledFor(level):
        return
    record_fields = {"event": event, **{k: v for k, v in fields.items() if v is not None}}
    logger.log(level, "%s", format_fields(record_fields), extra={_FIELDS_ATTR: record_fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the
    event's fields when it came from ``log_event``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, _FIELDS_ATTR, None)
        if fields is not None:
            doc.update(fields)
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: LogFormat = "text", level: int = logging.INFO) -> None:
    """Set the root logger's handler to the chosen format (replaces earlier handlers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
