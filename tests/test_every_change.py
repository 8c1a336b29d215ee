"""Every change reaches a job (issue 40): an edit, a removal, a re-report, a grant change or a
config change, followed by any number of ticks, then the idle window, is scheduled."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import advance, checkpoint, claim, commit, extraction_of, start
from tests.test_maintenance_due import walk


def settle(conn: psycopg.Connection) -> None:
    for _ in range(6):
        if not walk(conn):
            return
    raise AssertionError("never settled")


def open_extractions(conn: psycopg.Connection, ws: str = "ws1") -> list[dict[str, Any]]:
    rows = conn.execute(
        "select j.job_id, j.status, j.input -> 'sources', j.config_version "
        "from memory_private.jobs j where j.workspace_id = %s and j.phase = 'extract' "
        "and j.status in ('pending', 'running') order by j.job_id", (ws,)).fetchall()
    return [{"job_id": r[0], "status": r[1], "sources": r[2], "config": r[3]} for r in rows]


def current_sources(conn: psycopg.Connection, ids: list[str], ws: str = "ws1") -> list[dict]:
    rows = conn.execute("select message_id, content_hash from memory_private.messages "
                        "where workspace_id = %s and message_id = any(%s) order by message_id",
                        (ws, ids)).fetchall()
    return [{"id": r[0], "hash": r[1]} for r in rows]


def run_extraction(conn: psycopg.Connection) -> None:
    for _ in range(4):
        job = claim(conn)
        assert job is not None
        start(conn, job)
        if job["phase"] == "extract":
            checkpoint(conn, job, extraction_of(job))
            commit(conn, job)
            settle(conn)
            return
        conn.execute("select memory.fail_job(%s, %s, %s, 'failed', 'provider_error', null)",
                     (job["workspace_id"], job["job_id"], job["token"]))
    raise AssertionError("no extraction")


def world(conn: psycopg.Connection, *, extracted: bool) -> World:
    w = World(conn)
    w.basic("ws1")
    w.grant("ws1", "alice", "repo1")
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "r1-u1", "r1", "user", "alice", "I prefer tea", repositories=["repo1"])
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted: tea.")
    w.message("ws1", "r1-u2", "r1", "user", "alice", "and biscuits")
    settle(conn)
    if extracted:
        advance(conn, "31 minutes")
        settle(conn)
        run_extraction(conn)
        assert open_extractions(conn) == []
    return w


CHANGES = {
    "edit": lambda w: w.message("ws1", "r1-u1", "r1", "user", "alice", "I prefer coffee",
                                repositories=["repo1"]),
    "removal": lambda w: w.remove("ws1", "r1-u2"),
    "re-report": lambda w: w.message("ws1", "r1-u2", "r1", "user", "alice", "and biscuits",
                                     retain_until=None, repositories=["repo1"]),
    "grant": lambda w: w.grant("ws1", "alice", "repo1", granted=False),
    "config": lambda w: w.workspace("ws1", config_version=2),
}
EXPECTED = {"edit": ["r1-a", "r1-u1", "r1-u2"], "removal": ["r1-a", "r1-u1"],
            "re-report": ["r1-a", "r1-u1", "r1-u2"], "grant": ["r1-a", "r1-u1", "r1-u2"],
            "config": ["r1-a", "r1-u1", "r1-u2"]}


@pytest.mark.parametrize("ticks", [0, 1, 4])
@pytest.mark.parametrize("extracted", [False, True])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_then_ticks_then_the_idle_window_is_scheduled(
        conn: psycopg.Connection, change: str, extracted: bool, ticks: int) -> None:
    w = world(conn, extracted=extracted)
    advance(conn, "5 minutes")
    CHANGES[change](w)
    for _ in range(ticks):
        advance(conn, "1 minute")
        walk(conn)
    advance(conn, "31 minutes")
    settle(conn)
    found = open_extractions(conn)
    if extracted and change in ("grant", "config", "re-report"):
        # nothing changed in what the conversation says: it stays extracted
        assert found == [], found
        return
    assert len(found) == 1, found
    assert sorted(found[0]["sources"], key=lambda s: s["id"]) == current_sources(
        conn, EXPECTED[change])
