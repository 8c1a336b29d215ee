"""Every change reaches a job (issue 40, part 3): an edit, a removal, a re-report, a grant
change or a config change, followed by any number of maintenance ticks (the worker walks the
due workspaces about once a minute), then the idle window, is scheduled: the conversation is
extracted from what it says now. Each case runs with 0, 1 and 4 ticks in between, on a
conversation never extracted and on one extracted before the change; memory.waiting_status
says what the scheduler then does at every step. Also run in the Citus profile."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.factory import World
from tests.jobs_world import advance, checkpoint, claim, commit, extraction_of, start


def walk(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """One walk of the worker: maintain_next_workspace until NULL; the counts of each tick."""
    ticks, after = [], None
    while True:
        row = conn.execute("select memory.maintain_next_workspace(%s)", (after,)).fetchone()
        assert row is not None
        if row[0] is None:
            return ticks
        ticks.append(row[0])
        after = row[0]["workspace_id"]


def settle(conn: psycopg.Connection) -> None:
    for _ in range(6):
        if not walk(conn):
            return
    raise AssertionError("never settled")


def open_extractions(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "select job_id, status, config_version, input -> 'sources' as sources "
            "from memory_private.jobs where workspace_id = 'ws1' and phase = 'extract' "
            "and status in ('pending', 'running') order by job_id").fetchall()


def current(conn: psycopg.Connection, ids: list[str]) -> list[dict[str, str]]:
    return [{"id": r[0], "hash": r[1]} for r in conn.execute(
        "select message_id, content_hash from memory_private.messages "
        "where workspace_id = 'ws1' and message_id = any(%s) order by message_id",
        (ids,)).fetchall()]


def waiting(conn: psycopg.Connection) -> dict[str, int]:
    return {r[0]: r[1] for r in conn.execute(
        "select reason, conversations from memory.waiting_status('ws1')").fetchall()}


def extract_everything(conn: psycopg.Connection) -> None:
    """Runs the open jobs to their commit: the conversation is extracted (and consolidated)."""
    for _ in range(4):
        job = claim(conn)
        if job is None:
            return
        start(conn, job)
        if job["phase"] == "extract":
            checkpoint(conn, job, extraction_of(job))
        else:
            checkpoint(conn, job, {"index": "- tea", "record_ids": [
                c["id"] for c in job["input"]["candidates"]][:12]})
        commit(conn, job)
        settle(conn)
    raise AssertionError("jobs kept coming")


def world(conn: psycopg.Connection, *, extracted: bool) -> World:
    """Alice's conversation in the group (three directed messages), finished; extracted before
    the change when ``extracted``."""
    w = World(conn)
    w.basic("ws1")
    w.grant("ws1", "alice", "repo1")
    w.request("ws1", "r1", chat="grp", user="alice")
    w.message("ws1", "r1-u1", "r1", "user", "alice", "I prefer tea", repositories=["repo1"])
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted: tea.")
    w.message("ws1", "r1-u2", "r1", "user", "alice", "and biscuits with it")
    settle(conn)
    if extracted:
        advance(conn, "31 minutes")
        settle(conn)
        extract_everything(conn)
        assert open_extractions(conn) == [] and waiting(conn) == {}
    return w


ALL = ["r1-a", "r1-u1", "r1-u2"]
# change: (what it does, the sources its extraction takes, whether it is new work when the
# conversation was extracted before)
CHANGES: dict[str, tuple[Any, list[str], bool]] = {
    "edit": (lambda w: w.message("ws1", "r1-u1", "r1", "user", "alice", "I prefer coffee",
                                 repositories=["repo1"]), ALL, True),
    "removal": (lambda w: w.remove("ws1", "r1-u2"), ["r1-a", "r1-u1"], True),
    "re-report as not directed": (
        lambda w: w.message("ws1", "r1-u2", "r1", "user", "alice", "and biscuits with it",
                            directed=False), ["r1-a", "r1-u1"], True),
    "re-report with a retention end": (
        lambda w: w.message("ws1", "r1-u2", "r1", "user", "alice", "and biscuits with it",
                            retain_until=w.conn.execute(
                                "select memory_private.clock_now() + interval '300 days'"
                            ).fetchone()[0]), ALL, False),  # type: ignore[index]
    "grant change": (lambda w: w.grant("ws1", "alice", "repo1", granted=False), ALL, False),
    "config change": (lambda w: w.workspace("ws1", config_version=2), ALL, False),
}


@pytest.mark.parametrize("ticks", [0, 1, 4])
@pytest.mark.parametrize("extracted", [False, True], ids=["new", "extracted"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_then_ticks_then_the_idle_window_is_scheduled(
        conn: psycopg.Connection, change: str, extracted: bool, ticks: int) -> None:
    w = world(conn, extracted=extracted)
    advance(conn, "5 minutes")
    act, sources, new_work = CHANGES[change]
    act(w)
    for _ in range(ticks):
        advance(conn, "1 minute")
        walk(conn)
        assert open_extractions(conn) == [], "nothing before the idle window ends"
        if extracted and not new_work:
            assert waiting(conn) == {}
        else:
            assert set(waiting(conn)) == {"idle_window"}, waiting(conn)
    advance(conn, "31 minutes")
    if extracted and not new_work:
        settle(conn)
        assert open_extractions(conn) == [] and waiting(conn) == {}, \
            "nothing it says changed: it stays extracted"
        return
    if ticks or not extracted:
        # (with no tick yet, the record resting on the removed text still holds its batch:
        # the next tick's sweep frees it, and then schedules it)
        assert waiting(conn) == {"awaiting_maintenance": 1}
    settle(conn)
    found = open_extractions(conn)
    assert len(found) == 1, found
    assert sorted(found[0]["sources"], key=lambda s: s["id"]) == current(conn, sources)
    assert found[0]["config_version"] == (2 if change == "config change" else 1)
    assert waiting(conn) == {"job_due": 1}


@pytest.mark.parametrize("ticks", [0, 1, 4])
def test_a_config_change_stops_the_waiting_job_and_schedules_it_anew(
        conn: psycopg.Connection, ticks: int) -> None:
    world(conn, extracted=False)
    advance(conn, "31 minutes")
    settle(conn)
    [before] = open_extractions(conn)
    World(conn).workspace("ws1", config_version=2)
    for _ in range(ticks):
        advance(conn, "1 minute")
        walk(conn)
    settle(conn)
    [after] = open_extractions(conn)
    assert after["job_id"] != before["job_id"] and after["config_version"] == 2
    assert after["sources"] == before["sources"]


def test_a_conversation_ends_and_changes_and_ends_again_one_row_at_a_time(
        conn: psycopg.Connection) -> None:
    """However busy a conversation, a tick keeps one foreseen row for its idle end (moved by
    each change), not one per change."""
    w = world(conn, extracted=False)
    for i in range(40):
        advance(conn, "20 seconds")
        w.message("ws1", f"r1-x{i}", "r1", "user", "alice", f"and one more thing, number {i}")
        if i % 4 == 0:
            walk(conn)
    walk(conn)
    rows = conn.execute("select request_id, count(*) from memory_private.maintenance_due "
                        "where workspace_id = 'ws1' and foreseen and request_id is not null "
                        "group by 1").fetchall()
    assert rows == [("r1", 1)]
    advance(conn, "31 minutes")
    settle(conn)
    [job] = open_extractions(conn)
    assert len(job["sources"]) == 43
