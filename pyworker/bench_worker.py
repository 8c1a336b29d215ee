"""Worker overhead per model call and peak RSS (placeholder)."""

from __future__ import annotations

from typing import Any

from pyworker.bench_db import not_available


def measure(dsn: str, *, calls: int) -> tuple[dict[str, Any], dict[str, Any]]:
    reason = "the worker and its adapters have not landed yet"
    return not_available(reason), not_available(reason)
