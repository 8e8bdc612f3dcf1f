"""Process logging: plain text lines or JSON objects, one per record, on stderr.

``server.log_format: json`` (or ``--log-format json``) writes each record as one JSON
object: ``ts`` (UTC, RFC 3339), ``level``, ``logger``, ``msg``, then the record's own
fields (the access log's ``request_id``, ``status``, ``duration_ms``, ``engine``,
``reason``, ...), and ``exc`` with the traceback when there is one. Log collectors
(Loki, Elasticsearch, Cloud Logging) index those keys without parsing the message.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import msgspec

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Attributes every LogRecord has; anything else was passed with ``extra=``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
_encode = msgspec.json.Encoder(enc_hook=str).encode


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _encode(entry).decode()


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """kvroute's own handler, so reconfiguring replaces it and nothing else."""


def configure_logging(level: str, fmt: str = "text") -> None:
    """Set the root logger's level and kvroute's handler format (safe to call again)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(sys.stderr)
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    root.setLevel(level.upper())
