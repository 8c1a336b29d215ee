"""Structured logs: one JSON object a line on stderr, with the workspace, job and request ids
of the work in hand, so an operator can follow one job across workers and restarts."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = logging.getLogger("pimem")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        value: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        value.update(getattr(record, "fields", {}))
        if record.exc_info:
            value["exception"] = self.formatException(record.exc_info)
        return json.dumps(value, default=str, ensure_ascii=False)


def setup(level: str = "INFO", stream: Any = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level.upper())
    LOGGER.propagate = False


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Logs one event with its fields (``event("job_claimed", job_id=7, ...)``)."""
    LOGGER.log(level, name, extra={"fields": fields})
