"""The operator's views and admin functions (sql/80_operator.sql): who may use them, what they
show (and never show), and the runbook's DBA flow: why is a job stopped, retry it, explain an
invalid record, pause a workspace, purge a workspace."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    extraction_of,
    fail,
    idle_private_world,
    maintenance,
    run_one_extraction,
    start,
)
from tests.records import invalid_reason, make_record

VIEWS = ["workspace_status", "scope_status", "record_status", "job_status",
         "request_memory_charges"]
FUNCTIONS = ["retry_job(text, bigint)", "set_workspace_paused(text, boolean)",
             "explain_record(text, bigint, text)", "workspace_status(text, boolean)",
             "scope_status(text)", "record_status(text)", "job_status(text)",
             "request_memory_charges(text)"]
SECRET = "my locker code is tea-and-biscuits"


def rows(conn: psycopg.Connection, sql: str, *args: Any) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.encode(), args).fetchall()  # type: ignore[call-overload, no-any-return]


def one(conn: psycopg.Connection, sql: str, *args: Any) -> dict[str, Any]:
    found = rows(conn, sql, *args)
    assert len(found) == 1, found
    return found[0]


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


def sqlstate(call: Any) -> str | None:
    with pytest.raises(psycopg.Error) as err:
        call()
    return err.value.sqlstate


@pytest.fixture
def operator(conn: psycopg.Connection, db_dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection as a login role that is only a member of memory_operator."""
    name = "op_" + str(value(conn, "select current_database()"))
    conn.execute(f"create role {name} login in role memory_operator")
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    info["user"] = name
    try:
        with psycopg.connect(psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in
                                                               info.items()}),
                             autocommit=True) as c:
            yield c
    finally:
        conn.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                     "where usename = %s", (name,))
        conn.execute(f"drop owned by {name}")
        conn.execute(f"drop role {name}")


def stopped_job(conn: psycopg.Connection, ws: str = "ws1") -> dict[str, Any]:
    """A private conversation whose extraction ended 'unknown' (the provider may have run):
    the job is stopped and is not replayed automatically."""
    maintenance(conn, ws)
    job = claim(conn)
    assert job is not None and job["phase"] == "extract"
    start(conn, job)
    fail(conn, job, "unknown", "call_aborted")
    return job


# Grants ----------------------------------------------------------------------------------------


def test_only_the_operator_reads_the_views_and_calls_the_admin_functions(
        conn: psycopg.Connection) -> None:
    for view in VIEWS:
        assert value(conn, "select has_table_privilege('memory_operator', %s, 'select')",
                     f"memory.{view}"), view
        for role in ("memory_backend", "memory_worker", "public"):
            assert not value(conn, "select has_table_privilege(%s, %s, 'select')",
                             role, f"memory.{view}"), (role, view)
    for fn in FUNCTIONS:
        assert value(conn, "select has_function_privilege('memory_operator', %s, 'execute')",
                     f"memory.{fn}"), fn
        for role in ("memory_backend", "memory_worker", "public"):
            assert not value(conn, "select has_function_privilege(%s, %s, 'execute')",
                             role, f"memory.{fn}"), (role, fn)


def test_operator_login_cannot_touch_private_tables(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    World(conn).basic()
    assert sqlstate(lambda: operator.execute("select * from memory_private.jobs")) == "42501"
    assert sqlstate(lambda: operator.execute(
        "select memory_private.record_invalid_reason(null, null)")) == "42501"
    # ... but reads every view, and the views run the read-time rules for it.
    for view in VIEWS:
        operator.execute(f"select * from memory.{view}").fetchall()


# What the views show ---------------------------------------------------------------------------


def test_views_show_no_message_text_title_summary_or_index(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    w.conversation("ws1", "r9", chat="dm-alice", user="alice", user_text=SECRET, reply=SECRET)
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    checkpoint(conn, job, extraction_of(job, title=SECRET[:40], summary=SECRET))
    commit(conn, job)
    run_one_extraction(conn)  # the consolidation: an index naming the record
    assert value(conn, "select count(*) from memory_private.scope_indexes")
    dumped = ""
    for view in VIEWS:
        dumped += json.dumps(rows(operator, f"select * from memory.{view}"), default=str)
    record_id = value(conn, "select record_id from memory_private.records")
    dumped += json.dumps(value(operator, "select memory.explain_record('ws1', %s)", record_id))
    assert "locker" not in dumped and "biscuits" not in dumped and "tea" not in dumped.lower()


def test_scope_and_workspace_status_count_records_by_reason_index_age_and_tombstones(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    for i in range(1, 4):
        w.conversation("ws1", f"r{i}", chat="dm-alice", user="alice", user_text=f"note {i}")
    ok = make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    edited = make_record(conn, "ws1", "r2", ["r2-u"])
    removed = make_record(conn, "ws1", "r3", ["r3-u"])
    w.message("ws1", "r2-u", "r2", "user", "alice", "note 2, edited")
    w.remove("ws1", "r3-u")
    scope = value(conn, "select scope_id from memory_private.records where record_id = %s", ok)
    conn.execute("select memory_private.install_index('ws1', %s, '- x', %s, %s, 'bot1-identity')",
                 (scope, [ok], [ok]))
    conn.execute("insert into memory_private.tombstones values ('ws1', %s, 'r3-a', now())",
                 (scope,))
    advance(conn, "2 hours")

    s = one(operator, "select * from memory.scope_status where workspace_id = 'ws1'")
    assert (s["kind"], s["user_id"], s["recall_enabled"]) == ("private", "alice", True)
    assert (s["records_valid"], s["records_invalid"]) == (1, 2)
    assert s["invalid_by_reason"] == {"source_edited": 1, "source_removed": 1}
    assert s["index_records"] == 1 and s["index_bytes"] == 3
    assert timedelta(hours=2) <= s["index_age"] < timedelta(hours=2, minutes=1)
    assert s["tombstones"] == 1 and s["consolidation_pending"] is False

    ws = one(operator, "select * from memory.workspace_status where workspace_id = 'ws1'")
    assert (ws["records_valid"], ws["records_invalid"], ws["tombstones"]) == (1, 2, 1)
    assert ws["invalid_by_reason"] == {"source_edited": 1, "source_removed": 1}
    assert ws["paused"] is False and ws["scopes"] == 1 and ws["scopes_recall_off"] == 0

    by_id = {r["record_id"]: r for r in rows(operator, "select * from memory.record_status")}
    assert by_id[ok]["valid"] and by_id[ok]["in_index"] and by_id[ok]["sources"] == 2
    assert by_id[edited]["invalid_reason"] == "source_edited"
    assert by_id[removed]["invalid_reason"] == "source_removed"


def test_job_status_and_charges_after_one_extraction(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    idle_private_world(conn)
    run_one_extraction(conn)
    maintenance(conn, "ws1")  # schedules the consolidation
    jobs = rows(operator, "select * from memory.job_status order by job_id")
    assert [(j["phase"], j["status"]) for j in jobs] == [("extract", "succeeded"),
                                                         ("consolidate", "pending")]
    done, pending = jobs
    assert (done["claims"], done["last_attempt_no"], done["last_attempt_outcome"]) == (1, 1, "ok")
    assert done["cost_usd"] == Decimal("0.01") and done["input_items"] == 2
    assert pending["next_attempt_at"] is not None and pending["claims_left"] == 3
    assert pending["stale_reason"] is None and pending["config_current"]
    s = one(operator, "select * from memory.scope_status")
    assert s["consolidation_pending"] and s["consolidate_job_id"] == pending["job_id"]
    assert s["consolidate_job_status"] == "pending" and s["extract_job_id"] is None

    c = one(operator, "select * from memory.request_memory_charges")
    assert (c["request_id"], c["attempts"], c["extract_attempts"]) == ("r1", 1, 1)
    assert (c["input_tokens"], c["output_tokens"]) == (100, 20)
    assert c["extract_usd"] == Decimal("0.01") and c["consolidate_usd"] == 0
    assert c["budget_left_usd"] == Decimal("0.99")


# The status functions of a workspace ----------------------------------------------------------


def two_workspaces(conn: psycopg.Connection) -> None:
    """ws1 with a stopped job, a record and an invalid record; ws2 with a private and a group
    scope, records in both and a conversation waiting."""
    idle_private_world(conn)
    stopped_job(conn)
    w = World(conn)
    w.conversation("ws1", "b1", chat="dm-bob", user="bob", user_text="I prefer tea")
    make_record(conn, "ws1", "b1", ["b1-u", "b1-a"])
    w.message("ws1", "b1-u", "b1", "user", "bob", "I prefer coffee")
    w.basic("ws2")
    w.conversation("ws2", "p1", chat="dm-alice", user="alice", user_text="blue")
    w.request("ws2", "g1", chat="grp", user="bob", topic=7)
    w.message("ws2", "g1-u", "g1", "user", "bob", "green")
    make_record(conn, "ws2", "p1", ["p1-u"])
    make_record(conn, "ws2", "g1", ["g1-u"])


def calls(conn: psycopg.Connection, query: str, function: str) -> int:
    """How many times ``query`` calls the PL/pgSQL ``function``: the counts not yet flushed
    (pg_stat_xact_user_functions) before and after it, in one transaction (nothing is flushed
    inside one)."""
    count = ("select coalesce(sum(calls), 0) from pg_stat_xact_user_functions "
             "where schemaname || '.' || funcname = %s")
    with conn.transaction():
        conn.execute("set local track_functions = 'pl'")
        before = int(value(conn, count, function))
        conn.execute(query.encode())
        return int(value(conn, count, function)) - before


def compare_to_the_view(operator: psycopg.Connection, view: str) -> None:
    """The view is its function with NULL; with a workspace, the function gives the view's rows
    of that workspace (one transaction: one clock reading, so the ages are equal)."""
    with operator.transaction():
        every = rows(operator, f"select * from memory.{view}")
        present = {"ws1"} if view in ("job_status", "request_memory_charges") else {"ws1", "ws2"}
        assert {r["workspace_id"] for r in every} >= present, view
        assert every == rows(operator, f"select * from memory.{view}(null)"), view
        for ws in ("ws1", "ws2"):
            mine = rows(operator, f"select * from memory.{view}(%s)", ws)
            assert mine == [r for r in every if r["workspace_id"] == ws], (view, ws)


def test_each_view_is_its_function_over_every_workspace(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    two_workspaces(conn)
    for view in [*VIEWS, "waiting_status"]:
        compare_to_the_view(operator, view)


@pytest.mark.no_citus("counts the calls in the coordinator's statistics; on a cluster a "
                      "workspace's statements run on its node")
def test_a_workspace_given_is_read_alone_and_the_rule_runs_once_per_scope(
        conn: psycopg.Connection) -> None:
    two_workspaces(conn)
    scopes = {ws: value(conn, "select count(*) from memory_private.scopes where workspace_id = %s",
                        ws) for ws in ("ws1", "ws2")}
    assert scopes == {"ws1": 2, "ws2": 2}
    for view in ("record_status", "scope_status", "workspace_status"):
        assert calls(conn, f"select * from memory.{view}('ws1')",
                     "memory_private.invalid_records") == scopes["ws1"], view
        assert calls(conn, f"select * from memory.{view}(null)",
                     "memory_private.invalid_records") == sum(scopes.values()), view
    assert calls(conn, "select * from memory.waiting_status('ws2')",
                 "memory_private.extraction_verdict") == 1
    assert calls(conn, "select * from memory.waiting_status(null)",
                 "memory_private.extraction_verdict") == 2
    assert calls(conn, "select * from memory.workspace_status('ws1', false)",
                 "memory_private.invalid_records") == 0


def test_pimem_status_counts_each_scope_once_and_sums_them_per_workspace(
        conn: psycopg.Connection, db_dsn: str, operator: psycopg.Connection,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pyworker.db import Database
    from pyworker.status import gather_status

    two_workspaces(conn)
    asked: list[tuple[str, str | None, bool]] = []
    read = Database.view_rows

    def spy(self: Database, view: str, **kw: Any) -> list[dict[str, Any]]:
        asked.append((view, kw.get("workspace_id"), kw.get("count_records", True)))
        return read(self, view, **kw)

    monkeypatch.setattr(Database, "view_rows", spy)
    db = Database(operator_dsn(conn, db_dsn))
    try:
        for ws in (None, "ws2"):
            asked.clear()
            data = gather_status(db, ws)
            # the workspaces are read without their counts; every view of the one asked for
            assert ("workspace_status", ws, False) in asked
            assert {(v, w) for v, w, _ in asked} == {
                (v, ws) for v in ("scope_status", "workspace_status", "job_status",
                                  "request_memory_charges", "waiting_status")}
            expected = rows(operator, "select workspace_id, records_valid, records_invalid, "
                                      "invalid_by_reason from memory.workspace_status(%s)", ws)
            assert [{k: w[k] for k in expected[0]} for w in data["workspaces"]] == expected
    finally:
        db.close()
    assert {w["workspace_id"]: w["records_invalid"] for w in data["workspaces"]} == {"ws2": 0}


def test_a_status_function_refuses_a_malformed_or_unknown_workspace(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    World(conn).basic("ws1")
    for view in [*VIEWS, "waiting_status"]:
        assert sqlstate(lambda v=view: operator.execute(  # type: ignore[misc]
            f"select * from memory.{v}('nope')")) == "MB002", view
        assert sqlstate(lambda v=view: operator.execute(  # type: ignore[misc]
            f"select * from memory.{v}(' ')")) == "MB001", view


# Retrying a stopped job ------------------------------------------------------------------------


def test_dba_finds_why_a_job_stopped_and_retries_it(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    idle_private_world(conn)
    job = stopped_job(conn)
    maintenance(conn, "ws1")
    assert claim(conn) is None  # not replayed automatically

    ws = one(operator, "select * from memory.workspace_status")
    assert ws["jobs_stopped"] == 1
    j = one(operator, "select * from memory.job_status where status = 'stopped'")
    assert j["job_id"] == job["job_id"] and j["last_attempt_outcome"] == "unknown"
    assert j["last_error"] == "outcome unknown, not replayed: call_aborted"
    assert j["retry_refusal"] is None and j["cost_usd"] == Decimal("0.05")  # the reserve

    result = value(operator, "select memory.retry_job('ws1', %s)", job["job_id"])
    assert result["status"] == "pending" and result["workspace_paused"] is False
    new_id = result["retried_as_job_id"]
    old, new = rows(operator, "select * from memory.job_status order by job_id")
    assert (old["status"], old["retried_as_job_id"]) == ("stopped", new_id)
    assert "already retried" in old["retry_refusal"]
    assert (new["job_id"], new["status"], new["claims"]) == (new_id, "pending", 0)
    assert f"operator retry of job {job['job_id']}" in new["last_error"]
    assert one(operator, "select jobs_stopped from memory.workspace_status")["jobs_stopped"] == 0

    # The retried job runs like any other and commits one record.
    again = claim(conn)
    assert again is not None and again["job_id"] == new_id and again["attempt"] == 1
    start(conn, again)
    checkpoint(conn, again, extraction_of(again))
    assert commit(conn, again)["status"] == "committed"
    assert value(conn, "select count(*) from memory_private.records") == 1
    # A second retry of the old job is refused and changes nothing.
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', %s)",
                                             (job["job_id"],))) == "MB025"


def test_three_failed_claims_stop_a_job_and_a_retry_gives_three_fresh_claims(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    for _ in range(3):
        job = claim(conn)
        assert job is not None
        start(conn, job)
        fail(conn, job, "failed", "provider_error")
        advance(conn, "61 minutes")
        maintenance(conn, "ws1")
    j = one(operator, "select * from memory.job_status")
    assert (j["status"], j["claims"], j["claims_left"]) == ("stopped", 3, 0)
    assert "third model call" in j["last_error"] and "provider_error" in j["last_error"]
    new_id = value(operator, "select memory.retry_job('ws1', %s)",
                   j["job_id"])["retried_as_job_id"]
    for attempt in (1, 2):
        job = claim(conn)
        assert job is not None and (job["job_id"], job["attempt"]) == (new_id, attempt)
        start(conn, job)  # attempts of the new job are numbered from 1 again
        fail(conn, job, "failed", "provider_error")
        advance(conn, "61 minutes")
    assert one(operator, "select status from memory.job_status where job_id = %s",
               new_id)["status"] == "pending"


def test_retry_of_a_job_whose_input_changed_is_refused_and_maintenance_takes_a_fresh_snapshot(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    job = stopped_job(conn)
    w.message("ws1", "r1-u", "r1", "user", "alice", "please remember: I prefer coffee")
    j = one(operator, "select * from memory.job_status")
    assert "source r1-u was edited" in j["stale_reason"]
    assert "changed" in j["retry_refusal"]
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', %s)",
                                             (job["job_id"],))) == "MB021"
    assert value(conn, "select count(*) from memory_private.jobs") == 1  # nothing changed
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    fresh = claim(conn)
    assert fresh is not None and fresh["job_id"] != job["job_id"]


def test_retry_after_a_config_change_is_refused(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    job = stopped_job(conn)
    w.workspace("ws1", config_version=2)
    assert "configuration changed" in one(
        operator, "select retry_refusal from memory.job_status")["retry_refusal"]
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', %s)",
                                             (job["job_id"],))) == "MB022"
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1  # afresh, under version 2


def test_retry_is_refused_while_a_newer_job_is_open_and_once_the_work_is_done(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    job = stopped_job(conn)
    w.conversation("ws1", "r2", chat="dm-alice", user="alice", user_text="and I like jazz")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")  # a new batch: both conversations
    with pytest.raises(psycopg.Error) as err:
        operator.execute("select memory.retry_job('ws1', %s)", (job["job_id"],))
    assert err.value.sqlstate == "MB025" and "already has pending extract job" in str(err.value)
    newer = claim(conn)
    assert newer is not None
    start(conn, newer)
    checkpoint(conn, newer, extraction_of(newer))
    commit(conn, newer)
    with pytest.raises(psycopg.Error) as err:
        operator.execute("select memory.retry_job('ws1', %s)", (job["job_id"],))
    assert err.value.sqlstate == "MB025" and "nothing is left to do" in str(err.value)


def test_retry_refuses_jobs_that_are_not_stopped_and_bad_arguments(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job_id = value(conn, "select job_id from memory_private.jobs")
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', %s)",
                                             (job_id,))) == "MB025"
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', null)")) == "MB001"
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws1', 999)")) == "MB002"
    assert sqlstate(lambda: operator.execute("select memory.retry_job('nope', %s)",
                                             (job_id,))) == "MB002"
    World(conn).workspace("ws2")
    assert sqlstate(lambda: operator.execute("select memory.retry_job('ws2', %s)",
                                             (job_id,))) == "MB002"  # another workspace's job


# Pausing ---------------------------------------------------------------------------------------


def test_pause_stops_scheduling_and_claims_a_running_job_finishes_resume_restores(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    running = claim(conn)
    assert running is not None
    paused = value(operator, "select memory.set_workspace_paused('ws1', true)")
    assert paused == {"workspace_id": "ws1", "paused": True, "changed": True,
                      "running_job_id": running["job_id"], "pending_jobs": 0}
    start(conn, running)
    checkpoint(conn, running, extraction_of(running))
    assert commit(conn, running)["status"] == "committed"  # the running claim finishes

    w.conversation("ws1", "r2", chat="dm-alice", user="alice", user_text="I like jazz")
    advance(conn, "31 minutes")
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 0 and counts["consolidate_jobs_created"] == 0
    assert claim(conn) is None
    assert one(operator, "select paused from memory.workspace_status")["paused"] is True

    resumed = value(operator, "select memory.set_workspace_paused('ws1', false)")
    assert resumed["changed"] is True and resumed["paused"] is False
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 1 and counts["consolidate_jobs_created"] == 1
    assert claim(conn) is not None


# Explaining a record ---------------------------------------------------------------------------


def breaks(case: str, conn: psycopg.Connection, w: World, scope: int) -> None:
    """Makes the record of the ``explain_world`` invalid in one way."""
    if case == "source_edited":
        w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer coffee now")
    elif case == "source_removed":
        w.remove("ws1", "r1-a")
    elif case == "source_expired":
        w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea",
                  retain_until=datetime.fromisoformat("2000-01-01T00:00:00+00:00"))
    elif case == "forgotten":
        conn.execute("insert into memory_private.tombstones values ('ws1', %s, 'r1-u', now())",
                     (scope,))
    elif case == "membership":
        w.member("ws1", "alice", "owner", active=False)
    elif case == "bot_inactive":
        w.bot("ws1", "bot1", active=False)
    elif case == "bot_replaced":
        w.bot("ws1", "bot1", identity="bot1-new-identity")
    elif case == "recall_disabled":
        conn.execute("update memory_private.scopes set recall_enabled = false")
    elif case == "grant_revoked":
        w.grant("ws1", "alice", "github:acme/api", granted=False)
    else:
        raise AssertionError(case)


CASES = ["source_edited", "source_removed", "source_expired", "forgotten", "membership",
         "bot_inactive", "bot_replaced", "recall_disabled", "grant_revoked"]


def explain_world(conn: psycopg.Connection) -> tuple[World, int, int]:
    w = World(conn)
    w.basic()
    w.grant("ws1", "alice", "github:acme/api")
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea",
              repositories=["github:acme/api"])
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted.")
    record_id = make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    scope = value(conn, "select scope_id from memory_private.records where record_id = %s",
                  record_id)
    return w, record_id, scope


def test_explain_record_of_a_valid_record_lists_sources_with_hashes_and_passing_checks(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    _, record_id, scope = explain_world(conn)
    e = value(operator, "select memory.explain_record('ws1', %s)", record_id)
    assert (e["valid"], e["invalid_reason"], e["record_id"]) == (True, None, record_id)
    assert e["scope"]["scope_id"] == scope and e["scope"]["user_id"] == "alice"
    assert e["record"]["repositories"] == ["github:acme/api"]
    assert e["record"]["title_bytes"] > 0 and "title" not in e["record"]
    assert all(c["ok"] for c in e["checks"]), e["checks"]
    assert [c["check"] for c in e["checks"]] == [
        "recall_enabled", "bot_active", "group_linked", "membership",
        "requester_is_scope_user", "bot_identity", "dependencies_current", "repository_grants"]
    hashes: dict[str, str] = dict(conn.execute("select message_id, content_hash from memory_private.messages"
                               ).fetchall())
    assert e["sources"] == ["r1-u", "r1-a"], "the cited messages, in summary order"
    assert [(s["message_id"], s["via"], s["recorded_hash"], s["current_hash"], s["state"])
            for s in e["dependencies"]] == [
        ("r1-a", "cited", hashes["r1-a"], hashes["r1-a"], "current"),
        ("r1-u", "cited", hashes["r1-u"], hashes["r1-u"], "current")]


@pytest.mark.parametrize("case", CASES)
def test_explain_record_names_the_reason_recall_gives(
        conn: psycopg.Connection, operator: psycopg.Connection, case: str) -> None:
    w, record_id, scope = explain_world(conn)
    breaks(case, conn, w, scope)
    e = value(operator, "select memory.explain_record('ws1', %s)", record_id)
    assert invalid_reason(conn, "ws1", record_id) == case
    assert (e["valid"], e["invalid_reason"]) == (False, case)
    failing = [c for c in e["checks"] if not c["ok"]]
    assert failing and failing[0]["reason"] == case, e["checks"]
    assert one(operator, "select invalid_reason from memory.record_status "
                         "where record_id = %s", record_id)["invalid_reason"] == case
    if case.startswith("source_") or case == "forgotten":
        bad = [s for s in e["dependencies"] if s["state"] != "current"]
        assert [s["state"] for s in bad] == [case]
        assert case in failing[0]["detail"] and bad[0]["message_id"] in failing[0]["detail"]
        if case == "source_edited":
            assert bad[0]["current_hash"] != bad[0]["recorded_hash"]


def test_explain_record_for_a_requester_of_a_shared_scope(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = World(conn)
    w.basic(users=("alice", "bob", "carol"))
    w.request("ws1", "g1", chat="grp", user="alice", topic=7)
    w.message("ws1", "g1-u", "g1", "user", "alice", "we decided on Postgres",
              repositories=["github:acme/db"])
    w.message("ws1", "g1-a", "g1", "assistant", "bot1", "Noted.")
    w.grant("ws1", "alice", "github:acme/db")
    w.member("ws1", "carol", "member", active=False)
    record_id = make_record(conn, "ws1", "g1", ["g1-u", "g1-a"])
    for requester, reason in [(None, None), ("alice", None), ("bob", "grant_revoked"),
                              ("carol", "membership"), ("mallory", "membership")]:
        e = value(operator, "select memory.explain_record('ws1', %s, %s)", record_id, requester)
        assert e["invalid_reason"] == reason == invalid_reason(conn, "ws1", record_id,
                                                                requester), requester
        failing = [c["reason"] for c in e["checks"] if not c["ok"]]
        assert (failing[0] if failing else None) == reason, (requester, e["checks"])
    w.group_chat("ws1", "grp", linked=False)
    e = value(operator, "select memory.explain_record('ws1', %s)", record_id)
    assert e["invalid_reason"] == "group_unlinked"
    assert [c["check"] for c in e["checks"] if not c["ok"]] == ["group_linked"]


def test_explain_record_arguments(conn: psycopg.Connection,
                                  operator: psycopg.Connection) -> None:
    _, record_id, _ = explain_world(conn)
    World(conn).workspace("ws2")
    assert sqlstate(lambda: operator.execute("select memory.explain_record('ws2', %s)",
                                             (record_id,))) == "MB002"
    assert sqlstate(lambda: operator.execute("select memory.explain_record('ws1', null)")
                    ) == "MB001"
    assert sqlstate(lambda: operator.execute("select memory.explain_record('ws1', %s, '')",
                                             (record_id,))) == "MB001"


# The whole DBA flow, ending with a purge -------------------------------------------------------


def test_dba_flow_stopped_job_retry_explain_and_purge(
        conn: psycopg.Connection, operator: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    World(conn).basic("ws2")
    job = stopped_job(conn)
    # 1. why is a job stopped?
    stopped = one(operator, "select job_id, last_attempt_outcome, last_error, retry_refusal "
                            "from memory.job_status where status = 'stopped' "
                            "and retried_as_job_id is null")
    assert stopped["job_id"] == job["job_id"] and stopped["last_attempt_outcome"] == "unknown"
    # 2. retry it; the worker takes it
    value(operator, "select memory.retry_job('ws1', %s)", stopped["job_id"])
    run_one_extraction(conn)
    record_id = value(conn, "select record_id from memory_private.records")
    # 3. a source is edited: why is the record invalid?
    w.message("ws1", "r1-u", "r1", "user", "alice", "please remember preference 1: coffee")
    invalid = one(operator, "select record_id, invalid_reason from memory.record_status "
                            "where not valid")
    assert invalid == {"record_id": record_id, "invalid_reason": "source_edited"}
    e = value(operator, "select memory.explain_record('ws1', %s)", record_id)
    assert "r1-u source_edited" in next(c for c in e["checks"] if not c["ok"])["detail"]
    # 4. purge the workspace: nothing of it is left in any view; ws2 is untouched
    purged = value(operator, "select memory.delete_workspace('ws1')")
    assert purged["records_deleted"] == 1
    for view in VIEWS:
        assert not rows(operator, f"select * from memory.{view} where workspace_id = 'ws1'")
    assert [r["workspace_id"] for r in rows(operator, "select * from memory.workspace_status")
            ] == ["ws2"]


# pimem status / pimem explain ------------------------------------------------------------------


def operator_dsn(conn: psycopg.Connection, db_dsn: str) -> str:
    name = "op_" + str(value(conn, "select current_database()"))
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    info["user"] = name
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def test_pimem_status_and_explain_show_the_views_as_tables(
        conn: psycopg.Connection, db_dsn: str, operator: psycopg.Connection) -> None:
    from typer.testing import CliRunner

    from pyworker.cli import app

    w = idle_private_world(conn)
    job = stopped_job(conn)
    w.conversation("ws1", "b1", chat="dm-bob", user="bob", user_text="I prefer tea")
    record_id = make_record(conn, "ws1", "b1", ["b1-u", "b1-a"])
    w.message("ws1", "b1-u", "b1", "user", "bob", "I prefer coffee")
    dsn = operator_dsn(conn, db_dsn)
    runner = CliRunner()

    result = runner.invoke(app, ["status", "--dsn", dsn], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for heading in ("Workspaces", "Scopes", "Jobs needing attention", "Memory charges"):
        assert heading in result.output
    assert "retry" in result.output and "stopped" in result.output
    assert "source_edited" in result.output
    assert "prefer" not in result.output and "coffee" not in result.output

    result = runner.invoke(app, ["status", "--dsn", dsn, "--workspace", "ws1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [(j["job_id"], j["retry_refusal"]) for j in data["jobs"]] == [(job["job_id"], None)]
    assert data["workspaces"][0]["records_invalid"] == 1
    result = runner.invoke(app, ["status", "--dsn", dsn, "--workspace", "nope"])
    assert result.exit_code == 1 and "workspace nope is unknown" in result.output

    result = runner.invoke(app, ["explain", "ws1", str(record_id), "--dsn", dsn],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "INVALID" in result.output and "source_edited" in result.output
    assert "b1-u" in result.output and "coffee" not in result.output
    result = runner.invoke(app, ["explain", "ws1", str(record_id), "--dsn", dsn, "--json",
                                 "--requester", "alice"])
    assert json.loads(result.output)["invalid_reason"] == "membership"

    result = runner.invoke(app, ["explain", "ws1", "999999", "--dsn", dsn])
    assert result.exit_code == 1 and "unknown" in result.output


def test_the_pg_cron_procedure_of_the_runbook_maintains_every_workspace(
        fresh_conn: psycopg.Connection) -> None:
    """docs/operations.md's procedure, called as pg_cron would call it."""
    conn = fresh_conn  # a database of its own: the test creates the procedure
    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    procedure = doc.split("create procedure public.pimem_maintenance()")[1].split("$$;")[0]
    conn.execute(("create procedure public.pimem_maintenance()" + procedure + "$$;").encode())
    for ws in ("ws1", "ws2", "ws3"):
        idle_private_world(conn, ws, idle="0 minutes")
    advance(conn, "31 minutes")
    conn.execute("call public.pimem_maintenance()")
    assert [r["workspace_id"] for r in rows(
        conn, "select distinct workspace_id from memory_private.jobs order by 1")] == [
        "ws1", "ws2", "ws3"]
    # A backlog of expired text (three ticks' worth) is erased by one call, not one a minute.
    conn.execute("""insert into memory_private.messages
                      (workspace_id, message_id, request_id, role, speaker_id, body,
                       content_hash, directed, retain_until, created_at)
                    select 'ws2', 'old' || i, 'r1', 'user', 'alice', 'text ' || i,
                           memory_private.content_hash('text ' || i), true,
                           memory_private.clock_now(), memory_private.clock_now()
                      from generate_series(1, 140) i""")
    conn.execute("select memory_private.note_change('ws2', 'updated')")
    advance(conn, "1 minute")
    conn.execute("call public.pimem_maintenance()")
    assert rows(conn, "select count(*) as n from memory_private.messages where "
                      "body is not null and retain_until <= memory_private.clock_now()") == [
        {"n": 0}]
