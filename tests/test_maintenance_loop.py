"""The worker's maintenance walk: one workspace per short transaction (P16)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import advance


def next_ws(conn: psycopg.Connection, after: str | None = None) -> dict[str, Any] | None:
    row = conn.execute("select memory.maintain_next_workspace(%s)", (after,)).fetchone()
    assert row is not None
    return row[0]


def test_the_walk_maintains_every_workspace_once_in_id_order(conn: psycopg.Connection) -> None:
    w = World(conn)
    for ws in ("b", "a", "c"):
        w.basic(ws)
        w.conversation(ws, "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    seen, after = [], None
    while (counts := next_ws(conn, after)) is not None:
        assert counts["extract_jobs_created"] == 1
        after = counts["workspace_id"]
        seen.append(after)
    assert seen == ["a", "b", "c"]
    stamped = conn.execute("select count(*) from memory.workspace_status "
                           "where maintained_at is not null").fetchone()
    assert stamped == (3,), "operators see when maintenance last ran for each workspace"


def test_a_workspace_being_maintained_is_skipped_not_waited_for(
    conn: psycopg.Connection, db_dsn: str
) -> None:
    w = World(conn)
    w.basic("a")
    w.basic("b")
    with psycopg.connect(db_dsn) as holder:
        holder.execute("select memory_private.lock_workspace('a')")  # a memory write of a
        conn.execute("set lock_timeout = '500ms'")
        counts = next_ws(conn)
        assert counts is not None and counts["workspace_id"] == "b"
        assert next_ws(conn, "b") is None
        holder.rollback()
    counts = next_ws(conn)
    assert counts is not None and counts["workspace_id"] == "a"


def test_the_worker_walk_holds_no_lock_across_workspaces(conn: psycopg.Connection,
                                                         db_dsn: str) -> None:
    """Between two workspaces of the walk, the worker's session holds no workspace lock."""
    from pyworker.db import Database

    w = World(conn)
    for ws in ("a", "b", "c"):
        w.basic(ws)
    held: list[int] = []

    class Watched(Database):
        def call(self, function: str, *args: Any) -> Any:
            result = super().call(function, *args)
            if function == "maintain_next_workspace":
                pid = self._connection().info.backend_pid
                row = conn.execute("select count(*) from pg_locks where pid = %s "
                                   "and locktype in ('relation', 'tuple', 'transactionid')",
                                   (pid,)).fetchone()
                held.append(int(row[0]) if row else -1)
            return result

    db = Watched(db_dsn)
    try:
        assert db.run_maintenance()["workspaces"] == 3
    finally:
        db.close()
    assert held == [0, 0, 0, 0], held


def test_an_unknown_cursor_is_just_a_position(conn: psycopg.Connection) -> None:
    World(conn).basic("m")
    assert next_ws(conn, "zzz") is None
    with pytest.raises(psycopg.Error):
        conn.execute("select memory.maintain_next_workspace(1, 2)")


def test_the_worker_walks_all_once_per_interval_and_in_between_only_its_last_job_workspace(
    conn: psycopg.Connection, db_dsn: str
) -> None:
    from pyworker.adapters import make_adapter
    from pyworker.worker import Worker, WorkerConfig

    w = World(conn)
    for ws in ("a", "b"):
        w.basic(ws)
    w.conversation("a", "r1", chat="dm-alice", user="alice",
                   user_text="Please remember that I prefer tea. We decided to ship on Friday.",
                   reply="Noted: tea, and shipping on Friday.")
    advance(conn, "31 minutes")

    def stamps() -> dict[str, Any]:
        return dict(conn.execute("select workspace_id, maintained_at "
                                 "from memory_private.workspace_memory").fetchall())

    worker = Worker(WorkerConfig(dsn=db_dsn, interval=3600), make_adapter("offline"))
    try:
        first = worker.tick()  # walks a and b, then extracts in a
        assert first.status == "committed"
        walked = stamps()
        assert all(walked.values())
        advance(conn, "1 minute")
        second = worker.tick()  # maintains only a: its consolidation is scheduled at once
        assert (second.status, second.phase) == ("committed", "consolidate")
        now = stamps()
        assert now["a"] > walked["a"] and now["b"] == walked["b"]
    finally:
        worker.adapter.close()
        worker.db.close()
