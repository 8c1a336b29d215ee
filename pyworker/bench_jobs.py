"""Job machinery throughput: ours (claim + checkpoint + commit) vs procrastinate (placeholder)."""

from __future__ import annotations

from typing import Any

from pyworker.bench_db import not_available


def measure(dsn: str, *, jobs: int, peer_jobs: int) -> dict[str, Any]:
    return not_available("the job machinery (sql/40_jobs.sql) has not landed yet")
