"""Helpers for the memory job tests: a world with idle conversations, and the worker's calls.

Time moves through the database clock (``memory_private.advance_clock``), never by sleeping.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from tests.factory import World

USAGE = {"input_tokens": 100, "output_tokens": 20, "cost_usd": 0.01}


def advance(conn: psycopg.Connection, interval: str) -> None:
    conn.execute("select memory_private.advance_clock(%s::interval)", (interval,))


def maintenance(conn: psycopg.Connection, ws: str | None = None) -> dict[str, Any]:
    row = conn.execute("select memory.run_maintenance(%s)", (ws,)).fetchone()
    assert row is not None
    return row[0]


def claim(conn: psycopg.Connection, worker: str = "w1") -> dict[str, Any] | None:
    row = conn.execute("select memory.claim_job(%s)", (worker,)).fetchone()
    assert row is not None
    return row[0]


def start(conn: psycopg.Connection, job: dict[str, Any], reserve: str = "0.05") -> int:
    row = conn.execute("select memory.start_attempt(%s, %s, %s, %s)",
                       (job["workspace_id"], job["job_id"], job["token"],
                        Decimal(reserve))).fetchone()
    assert row is not None
    return row[0]


def checkpoint(conn: psycopg.Connection, job: dict[str, Any], output: Any,
               usage: Any = None) -> None:
    conn.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                 (job["workspace_id"], job["job_id"], job["token"], Jsonb(output),
                  Jsonb(usage if usage is not None else USAGE)))


def commit(conn: psycopg.Connection, job: dict[str, Any]) -> dict[str, Any]:
    row = conn.execute("select memory.commit_job(%s, %s, %s)",
                       (job["workspace_id"], job["job_id"], job["token"])).fetchone()
    assert row is not None
    return row[0]


def fail(conn: psycopg.Connection, job: dict[str, Any], outcome: str = "failed",
         error: str = "provider_error", usage: Any = None) -> None:
    conn.execute("select memory.fail_job(%s, %s, %s, %s, %s, %s)",
                 (job["workspace_id"], job["job_id"], job["token"], outcome, error,
                  Jsonb(usage) if usage is not None else None))


def extraction_of(job: dict[str, Any], title: str = "Tea preference",
                  summary: str = "The user said they prefer tea.") -> dict[str, Any]:
    """A valid extraction output citing every source of the claimed batch."""
    ids = [s["id"] for s in job["input"]["sources"]]
    return {"title": title, "summary": summary, "source_ids": ids}


def consolidation_of(job: dict[str, Any], index: str = "- tea preference") -> dict[str, Any]:
    ids = [c["id"] for c in job["input"]["candidates"]][:12]
    return {"index": index, "record_ids": ids}


def job_row(conn: psycopg.Connection, job_id: int) -> dict[str, Any]:
    cur = conn.execute("select * from memory_private.jobs where job_id = %s", (job_id,))
    names = [d.name for d in cur.description or []]
    row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def jobs(conn: psycopg.Connection, ws: str = "ws1") -> list[dict[str, Any]]:
    cur = conn.execute("select * from memory_private.jobs where workspace_id = %s order by job_id",
                       (ws,))
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def sqlstate_of(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None)


def idle_private_world(conn: psycopg.Connection, ws: str = "ws1", *, turns: int = 1,
                       idle: str = "31 minutes") -> World:
    """ws with alice's private chat holding ``turns`` finished conversations, then idle."""
    w = World(conn)
    w.basic(ws)
    for i in range(1, turns + 1):
        w.conversation(ws, f"r{i}", chat="dm-alice", user="alice",
                       user_text=f"please remember preference {i}: I prefer tea",
                       reply=f"Noted preference {i}.")
    advance(conn, idle)
    return w


def run_one_extraction(conn: psycopg.Connection, ws: str = "ws1") -> dict[str, Any]:
    """Maintenance, claim, attempt, checkpoint, commit: the happy path of one job."""
    maintenance(conn, ws)
    job = claim(conn)
    assert job is not None
    start(conn, job)
    if job["phase"] == "extract":
        checkpoint(conn, job, extraction_of(job))
    else:
        checkpoint(conn, job, consolidation_of(job))
    return commit(conn, job)


def show_memories_with_batches(conn: psycopg.Connection, count: int) -> None:
    """Makes the policy show up to ``count`` memories with each extraction batch (the policy
    shows none: docs/retention.md). A schema change: the test asks for ``fresh_conn``."""
    row = conn.execute("select pg_get_functiondef('memory_private.policy()'::regprocedure)"
                       ).fetchone()
    assert row is not None
    old = "    0,                      -- existing_with_batch"
    assert old in row[0]
    conn.execute(row[0].replace(old, f"    {count},                      -- existing_with_batch"))
