"""What waits to become a memory, and why (memory.waiting_status, sql/80_operator.sql): each
conversation not yet turned into a memory is counted under the first reason that holds it back,
computed in the database; and explain_record of a forgotten record says when and by whom."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

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
from tests.test_recall import manage


def waiting(conn: psycopg.Connection, ws: str = "ws1") -> dict[str, dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("select * from memory.waiting_status where workspace_id = %s",
                           (ws,)).fetchall()
    return {r["reason"]: r for r in rows}


def counts(conn: psycopg.Connection, ws: str = "ws1") -> dict[str, int]:
    return {k: v["conversations"] for k, v in waiting(conn, ws).items()}


def now(conn: psycopg.Connection) -> Any:
    row = conn.execute("select memory_private.clock_now()").fetchone()
    assert row is not None
    return row[0]


def test_waiting_counts_each_conversation_under_the_first_reason_that_holds_it(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic("ws1")
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea")
    w.request("ws1", "r2", chat="dm-bob", user="bob")
    w.message("ws1", "r2-u", "r2", "user", "bob", "I prefer coffee")
    w.conversation("ws1", "r3", chat="grp", user="bob", topic=7, user_text="we ship friday")
    w.conversation("ws1", "r4", chat="dm-alice", user="alice", status="failed")
    w.conversation("ws1", "r5", chat="dm-alice", user="alice", kind="scheduled")

    started = now(conn)
    found = waiting(conn)
    assert {k: v["conversations"] for k, v in found.items()} == {
        "request_not_finished": 1, "request_failed": 1, "no_assistant_message": 1,
        "idle_window": 1}
    # the idle window (30 minutes) from the conversation's last activity, just before now
    assert timedelta(minutes=29) < found["idle_window"]["next_change_at"] - started \
        <= timedelta(minutes=30)
    assert found["idle_window"]["messages"] == 2
    assert "upsert_request" in found["request_not_finished"]["explanation"]
    assert found["request_not_finished"]["next_change_at"] is None

    advance(conn, "31 minutes")
    assert counts(conn)["awaiting_maintenance"] == 1
    maintenance(conn, "ws1")
    assert counts(conn)["job_due"] == 1

    job = claim(conn)
    assert job is not None
    assert counts(conn)["job_running"] == 1
    fail(conn, job, "failed", "budget_exceeded")
    assert counts(conn)["no_budget"] == 1

    advance(conn, "61 minutes")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    fail(conn, job, "failed", "provider_error")
    found = waiting(conn)
    assert found["job_backoff"]["conversations"] == 1
    assert found["job_backoff"]["next_change_at"] > now(conn)

    advance(conn, "61 minutes")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    fail(conn, job, "unknown", "call_aborted")
    maintenance(conn, "ws1")
    assert counts(conn)["job_stopped"] == 1

    conn.execute("update memory_private.scopes set recall_enabled = false "
                 "where workspace_id = 'ws1' and kind = 'shared'")
    assert counts(conn)["recall_off"] == 1
    w.call("set_workspace_paused", "ws1", True)
    assert counts(conn) == {"workspace_paused": 4}


def test_a_committed_conversation_no_longer_waits_and_other_workspaces_are_apart(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic("ws1")
    w.basic("ws2")
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    w.conversation("ws2", "r1", chat="dm-alice", user="alice")
    w.bot("ws2", "bot1", active=False)
    advance(conn, "31 minutes")
    maintenance(conn)
    job = claim(conn)
    assert job is not None and job["workspace_id"] == "ws1"
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    commit(conn, job)
    assert counts(conn, "ws1") == {}
    assert counts(conn, "ws2") == {"bot_inactive": 1}


def test_the_worker_and_the_operator_read_what_waits_and_the_backend_does_not(
        conn: psycopg.Connection) -> None:
    for role, allowed in (("memory_operator", True), ("memory_worker", True),
                          ("memory_backend", False), ("public", False)):
        row = conn.execute("select has_table_privilege(%s, 'memory.waiting_status', 'select')",
                           (role,)).fetchone()
        assert row == (allowed,), role


def test_explain_record_of_a_forgotten_record_says_when_and_by_whom(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic("ws1")
    a, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    record = make_record(conn, "ws1", "h1", [a], summary="Alice likes tea")
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "Please forget that I like tea")
    outcome = manage(conn, "ws1", "r1", "c1",
                     {"action": "forget", "sourceId": "r1-u", "memoryId": record})
    assert outcome["status"] == "done"

    row = conn.execute("select memory.explain_record('ws1', %s)", (record,)).fetchone()
    assert row is not None
    data = row[0]
    assert data["exists"] is False and data["valid"] is False
    assert data["invalid_reason"] == "forgotten"
    gone = data["forgotten"]
    assert (gone["by_user_id"], gone["request_id"], gone["tool_call_id"]) == ("alice", "r1", "c1")
    assert gone["forgotten_ids"] == [record] and gone["at"]
    assert "tea" not in str(data)
