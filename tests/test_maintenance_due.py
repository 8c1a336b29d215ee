"""Maintenance follows change: a pass visits only the workspaces that are due (issue 34).

A workspace is due when something changed it (ingest, manage_memory, a job leaving running, an
operator's pause or retry) or when a time-based event its last tick foresaw comes (a
retention end, a pruning horizon, a conversation's idle end, an expired lease). An idle
workspace is not read: its maintained_at stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pyworker.adapters.offline import OfflineAdapter
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    extraction_of,
    fail,
    maintenance,
    start,
)
from tests.records import make_record


def walk(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    """One walk of the worker: maintain_next_workspace until it answers NULL; the counts of
    every workspace it visited, by workspace."""
    seen: dict[str, dict[str, Any]] = {}
    after = None
    while True:
        row = conn.execute("select memory.maintain_next_workspace(%s)", (after,)).fetchone()
        assert row is not None
        if row[0] is None:
            return seen
        after = row[0]["workspace_id"]
        seen[after] = row[0]


def walk_busy(conn: psycopg.Connection) -> dict[str, Any]:
    """A walk that must visit workspace busy alone; its counts."""
    seen = walk(conn)
    assert list(seen) == ["busy"], seen
    return seen["busy"]


def maintained_at(conn: psycopg.Connection, ws: str) -> datetime | None:
    row = conn.execute("select maintained_at from memory_private.workspace_memory "
                       "where workspace_id = %s", (ws,)).fetchone()
    assert row is not None
    return row[0]


def settled(conn: psycopg.Connection, *workspaces: str) -> None:
    """Walks until nothing is due now (a tick's own job changes make one more tick due)."""
    for _ in range(5):
        if not walk(conn):
            return
    raise AssertionError(f"{workspaces} never settled")


def two_workspaces(conn: psycopg.Connection) -> World:
    w = World(conn)
    w.basic("idle")
    w.basic("busy")
    settled(conn)
    return w


def test_a_pass_does_not_visit_an_idle_workspace(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    before = maintained_at(conn, "idle")
    assert before is not None, "a new workspace is due once"
    advance(conn, "1 minute")
    w.conversation("busy", "r1", chat="dm-alice", user="alice")
    assert list(walk(conn)) == ["busy"]
    row = conn.execute("select memory.run_maintenance(null)").fetchone()
    assert row is not None and row[0]["workspaces"] == 0, "nothing changed since"
    assert maintained_at(conn, "idle") == before
    assert maintained_at(conn, "busy") != before


def _manage(w: World, conn: psycopg.Connection) -> None:
    w.request("busy", "q1", chat="dm-alice", user="alice", status="running")
    w.message("busy", "q1-u", "q1", "user", "alice", "turn memory off")
    settled(conn)
    conn.execute("select memory.manage_memory('busy', 'q1', 't1', %s)",
                 (Jsonb({"action": "disable-memory", "sourceId": "q1-u"}),))


def _pause(w: World, conn: psycopg.Connection) -> None:
    conn.execute("select memory.set_workspace_paused('busy', true)")


CHANGES: dict[str, Callable[[World, psycopg.Connection], Any]] = {
    "workspace": lambda w, c: w.workspace("busy", budget=50.0),
    "member": lambda w, c: w.member("busy", "carol"),
    "bot": lambda w, c: w.bot("busy", "bot2"),
    "chat": lambda w, c: w.private_chat("busy", "dm-carol", "alice"),
    "topic": lambda w, c: w.topic("busy", "grp", 9, "later"),
    "grant": lambda w, c: w.grant("busy", "alice", "repo1"),
    "request": lambda w, c: w.request("busy", "q1", chat="dm-alice", user="alice",
                                      status="running"),
    "message": lambda w, c: w.conversation("busy", "q1", chat="dm-alice", user="alice"),
    "manage_memory": _manage,
    "pause": _pause,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_kind_of_change_makes_its_workspace_due(conn: psycopg.Connection,
                                                     change: str) -> None:
    w = two_workspaces(conn)
    CHANGES[change](w, conn)
    assert list(walk(conn)) == ["busy"]


def test_an_upsert_that_changes_nothing_makes_nothing_due(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    assert w.member("busy", "alice", "owner") == "unchanged"
    assert w.bot("busy", "bot1") == "unchanged"
    assert walk(conn) == {}


def test_finishing_and_removing_make_the_workspace_due(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    w.request("busy", "q1", chat="dm-alice", user="alice", status="running")
    w.message("busy", "q1-u", "q1", "user", "alice", "hello")
    settled(conn)
    assert conn.execute("select memory.finish_request('busy', 'q1')").fetchone() == ("updated",)
    assert list(walk(conn)) == ["busy"]
    settled(conn)
    assert w.remove("busy", "q1-u") == "updated"
    assert list(walk(conn)) == ["busy"]


def _idle_extraction(conn: psycopg.Connection) -> dict[str, Any]:
    w = two_workspaces(conn)
    w.conversation("busy", "r1", chat="dm-alice", user="alice")
    settled(conn)
    advance(conn, "31 minutes")
    # the conversation's idle end makes it due
    assert walk_busy(conn)["extract_jobs_created"] == 1
    job = claim(conn)
    assert job is not None
    return job


def test_the_end_of_a_conversations_idle_window_makes_it_due(conn: psycopg.Connection) -> None:
    _idle_extraction(conn)


def test_a_shorter_idle_window_is_planned_anew(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    w.conversation("busy", "r1", chat="dm-alice", user="alice")
    settled(conn)
    advance(conn, "2 minutes")
    w.workspace("busy", idle_minutes=5)  # the conversation is now idle at +5, not +30
    settled(conn)
    advance(conn, "4 minutes")
    assert walk_busy(conn)["extract_jobs_created"] == 1


def test_a_job_leaving_running_makes_its_workspace_due(conn: psycopg.Connection) -> None:
    job = _idle_extraction(conn)
    settled(conn)
    start(conn, job)
    fail(conn, job)
    assert list(walk(conn)) == ["busy"]


def test_a_commit_makes_its_workspace_due_for_the_consolidation(
    conn: psycopg.Connection
) -> None:
    job = _idle_extraction(conn)
    settled(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    commit(conn, job)
    assert walk_busy(conn)["consolidate_jobs_created"] == 1


def test_an_expired_lease_makes_its_workspace_due(conn: psycopg.Connection) -> None:
    _idle_extraction(conn)
    settled(conn)
    advance(conn, "3 minutes")
    assert walk_busy(conn)["leases_expired"] == 1


def test_a_retention_end_makes_its_workspace_due(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    now = conn.execute("select memory_private.clock_now()").fetchone()
    assert now is not None
    w.request("busy", "q1", chat="dm-alice", user="alice")
    w.message("busy", "q1-u", "q1", "user", "alice", "short-lived",
              retain_until=now[0] + timedelta(days=2))
    settled(conn)
    advance(conn, "1 hour")
    assert walk(conn) == {}, "no assistant message: no idle end to plan (the verdict's reason)"
    advance(conn, "23 hours")
    assert walk(conn) == {}
    advance(conn, "1 day")
    assert walk_busy(conn)["messages_expired"] == 1


def test_a_pruning_horizon_makes_its_workspace_due(conn: psycopg.Connection) -> None:
    w = two_workspaces(conn)
    w.conversation("busy", "r1", chat="dm-alice", user="alice")
    make_record(conn, "busy", "r1", ["r1-u", "r1-a"])  # written directly: no change noted
    maintenance(conn, "busy")  # a tick plans the record's pruning horizon
    advance(conn, "31 minutes")
    settled(conn)
    advance(conn, "29 days")
    assert walk(conn) == {}
    advance(conn, "1 day")
    assert walk_busy(conn)["records_pruned"] == 1


def expired_backlog(conn: psycopg.Connection, count: int) -> None:
    """``count`` messages of workspace busy past their retention (written directly)."""
    w = two_workspaces(conn)
    w.request("busy", "q1", chat="dm-alice", user="alice")
    conn.execute(
        """insert into memory_private.messages
             (workspace_id, message_id, request_id, role, speaker_id, body, content_hash,
              directed, retain_until, created_at)
           select 'busy', 'm' || i, 'q1', 'user', 'alice', 'text ' || i,
                  memory_private.content_hash('text ' || i), true,
                  memory_private.clock_now() + interval '1 hour', memory_private.clock_now()
             from generate_series(1, %s) i""", (count,))
    maintenance(conn, "busy")
    advance(conn, "2 hours")


def unerased(conn: psycopg.Connection) -> int:
    row = conn.execute("select count(*) from memory_private.messages "
                       "where workspace_id = 'busy' and body is not null").fetchone()
    assert row is not None
    return int(row[0])


def test_a_large_expiry_is_swept_a_batch_per_tick_until_none_is_left(
    conn: psycopg.Connection
) -> None:
    expired_backlog(conn, 125)
    erased = []
    for _ in range(5):
        seen = walk(conn)
        if not seen:
            break
        erased.append(seen["busy"]["messages_expired"])
        assert seen["busy"]["sweep_backlog"] == (1 if sum(erased) < 125 else 0)
    assert erased == [50, 50, 25], erased
    assert unerased(conn) == 0


def test_the_worker_sweeps_on_without_waiting_while_a_backlog_remains(
    conn: psycopg.Connection, db_dsn: str
) -> None:
    expired_backlog(conn, 300)
    # A one-shot run stops at its first idle tick, unless the sweep left a backlog.
    worker = Worker(WorkerConfig(dsn=db_dsn, interval=3600.0, worker_id="sweeper"),
                    OfflineAdapter())
    assert worker.run(until_idle=True) == 0
    assert unerased(conn) == 0


def _stopped_input(conn: psycopg.Connection) -> World:
    """Workspace busy whose private scope of alice holds a stopped input (an unknown
    outcome, never replayed), found blocked by the tick after it."""
    w = two_workspaces(conn)
    w.conversation("busy", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    walk(conn)
    job = claim(conn)
    assert job is not None
    start(conn, job)
    fail(conn, job, "unknown", "call_aborted")
    assert walk_busy(conn)["replays_blocked"] == 1, "the job's own scope is derived again"
    settled(conn)
    return w


def test_a_blocked_input_is_not_derived_again_after_a_change_elsewhere(
    conn: psycopg.Connection
) -> None:
    w = _stopped_input(conn)
    w.conversation("busy", "g1", chat="grp", user="bob")  # another scope
    advance(conn, "31 minutes")
    seen = walk_busy(conn)
    assert seen["extract_jobs_created"] == 1, "the other scope is scheduled"
    assert "replays_blocked" not in seen, "the stopped input is not derived again"


def test_a_blocked_input_is_derived_again_when_its_scope_changes(
    conn: psycopg.Connection
) -> None:
    w = _stopped_input(conn)
    w.conversation("busy", "r2", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    seen = walk_busy(conn)
    assert seen["extract_jobs_created"] == 1, "a changed input is a new job, not a replay"


def test_a_blocked_input_is_derived_again_after_a_workspace_wide_change(
    conn: psycopg.Connection
) -> None:
    w = _stopped_input(conn)
    w.member("busy", "carol")
    seen = walk_busy(conn)
    assert seen["replays_blocked"] == 1


def test_an_edit_elsewhere_derives_only_its_own_conversations_scope(
    conn: psycopg.Connection
) -> None:
    """A message belongs to one conversation of one scope: what its edit can change is that
    scope's input and the records resting on it (the sweep then derives every scope)."""
    w = _stopped_input(conn)
    w.conversation("busy", "g1", chat="grp", user="bob")
    settled(conn)
    w.message("busy", "g1-u", "g1", "user", "bob", "hello again")
    seen = walk_busy(conn)
    assert "replays_blocked" not in seen, "the stopped input elsewhere is not derived again"
    advance(conn, "31 minutes")
    assert walk_busy(conn)["extract_jobs_created"] == 1, "the edited conversation, once idle"


