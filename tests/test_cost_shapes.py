"""What a tick, a scrub, a lookup and an idle worker read (issue 40, part 4): plan and call
shapes, never timings (the figures are `pimem bench`'s, docs/benchmarks.md). Plans are taken
with auto_explain, its nested statements sent to this connection as notices."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from pyworker.adapters.offline import OfflineAdapter
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World
from tests.jobs_world import advance

pytestmark = pytest.mark.no_citus(
    "it reads plans with auto_explain on its connection: on a cluster the statements it looks "
    "for are planned on the workspace's node, and the coordinator's auto_explain beside Citus "
    "fails the call (cache lookup failed for type)")


@contextmanager
def plans(conn: psycopg.Connection) -> Iterator[list[str]]:
    """The plans of every statement run inside, nested ones too."""
    seen: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "plan:" in diag.message_primary:
            seen.append(diag.message_primary)

    conn.add_notice_handler(keep)
    conn.execute("load 'auto_explain'")
    for name, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                        ("log_level", "notice"), ("log_analyze", "off")):
        conn.execute(f"set auto_explain.{name} = '{value}'")
    try:
        yield seen
    finally:
        conn.execute("set auto_explain.log_min_duration = '-1'")
        conn.remove_notice_handler(keep)


def imported(conn: psycopg.Connection, ws: str, n: int) -> None:
    """``n`` conversations reported through the API in one transaction (a bulk import)."""
    with conn.transaction():
        conn.execute(
            """select memory.upsert_request(%(ws)s, 'c' || i, 'bot1', 'grp', 0, 'alice',
                                            'interactive', 'succeeded', 'fake', 'm', 1, 0, null),
                      memory.upsert_message(%(ws)s, 'c' || i || '-u', 'c' || i, 'user', 'alice',
                                            'a question, number ' || i, true, null, '{}'),
                      memory.upsert_message(%(ws)s, 'c' || i || '-a', 'c' || i, 'assistant',
                                            'bot1', 'an answer, number ' || i, true, null, '{}')
                 from generate_series(1, %(n)s) i""", {"ws": ws, "n": n})


def test_a_request_lookup_after_a_bulk_import_takes_the_primary_key(
        conn: psycopg.Connection, db_dsn: str) -> None:
    """A generic plan made while the workspace was small (and the statistics know nothing of
    it) is kept after the import: a lookup of one request by its id can only take the
    primary key, never read the workspace's requests through the scope index."""
    w = World(conn)
    w.basic("ws1")
    for i in range(8):  # plans made, generic ones among them, on a near-empty table
        w.request("ws1", f"w{i}", chat="grp", user="alice", status="running")
        w.call("finish_request", "ws1", f"w{i}")
    imported(conn, "ws1", 1500)
    with plans(conn) as seen:
        w.request("ws1", "late", chat="grp", user="alice", status="running")
        w.message("ws1", "late-u", "late", "user", "alice", "one more")
        w.call("finish_request", "ws1", "late")
    lookups = [p for p in seen if "memory_private.requests" in p and "request_id =" in p]
    assert lookups, seen
    assert not [p for p in seen if "requests_scope_idx" in p], \
        "a lookup by id read the workspace's requests through the scope index"


def test_a_tick_after_a_bulk_import_reads_each_conversations_own_messages(
        conn: psycopg.Connection, db_dsn: str) -> None:
    """The tick that finds 1,000 conversations changed refreshes the statistics first, so the
    verdict reads each conversation's messages through messages_request_idx, not all of the
    workspace's messages for each (the quadratic tick)."""
    w = World(conn)
    w.basic("ws0")  # what the statistics know: another workspace, and none of ws1
    imported(conn, "ws0", 300)
    conn.execute("analyze memory_private.requests, memory_private.messages")
    w.basic("ws1")
    w.workspace("ws1", idle_minutes=0)
    conn.execute("select memory.run_maintenance('ws1')")
    imported(conn, "ws1", 1000)
    with plans(conn) as seen:
        counts = conn.execute("select memory.run_maintenance('ws1')").fetchone()
    assert counts is not None and counts[0]["statistics_refreshed"] == 1
    assert counts[0]["extract_jobs_created"] == 1
    verdict = [p for p in seen if "extraction_candidates(" in p]
    assert verdict
    assert any("messages_request_idx" in p for p in verdict)
    assert not [p for p in verdict if "Index Scan using messages_pkey on messages m" in p]


def test_the_scrub_reads_the_jobs_that_name_the_erased_message(
        conn: psycopg.Connection, db_dsn: str) -> None:
    """After a removal the sweep rewrites the job inputs that keep its hash, found through
    jobs_sources_idx: not every job the workspace ever had."""
    w = World(conn)
    w.basic("ws1")
    w.conversation("ws1", "r1", chat="grp", user="alice")
    advance(conn, "31 minutes")
    conn.execute("select memory.run_maintenance('ws1')")  # the job holding r1's messages
    conn.execute(
        """insert into memory_private.jobs
             (workspace_id, scope_id, phase, status, input, input_hash, origin_request_id,
              model_provider, model_id, config_version, claims, next_attempt_at, created_at,
              updated_at, finished_at)
           select 'ws1', scope_id, 'extract', 'succeeded',
                  jsonb_build_object('bot_identity', 'bot1-identity', 'existing', '[]'::jsonb,
                                     'sources', jsonb_build_array(jsonb_build_object(
                                       'id', 'past-' || j, 'hash', md5(j::text)))),
                  md5(j::text), 'r1', 'fake', 'm', 1, 1, now(), now(), now(), now()
             from memory_private.scopes, generate_series(1, 2000) j
            where workspace_id = 'ws1' and kind = 'shared' and topic_id = 0""")
    conn.execute("analyze memory_private.jobs")
    w.remove("ws1", "r1-u")
    with plans(conn) as seen:
        counts = conn.execute("select memory.run_maintenance('ws1')").fetchone()
    assert counts is not None and counts[0]["messages_scrubbed"] == 1
    scrub = [p for p in seen if "job_source_keys" in p and "memory_private.jobs" in p]
    assert scrub and all("jobs_sources_idx" in p for p in scrub), scrub
    row = conn.execute("select count(*) from memory_private.jobs where workspace_id = 'ws1' "
                       "and input -> 'sources' @> '[{\"id\": \"r1-u\"}]' "
                       "and jsonb_path_exists(input, '$.sources[*] ? (@.id == \"r1-u\").hash')"
                       ).fetchone()
    assert row == (0,), "the removed message's hash is gone from every job"


def test_an_idle_worker_reads_only_the_workspaces_it_maintained(
        conn: psycopg.Connection, db_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    w = World(conn)
    for ws in ("ws1", "ws2", "ws3"):
        w.basic(ws)
        w.conversation(ws, "r1", chat="dm-alice", user="alice")
    worker = Worker(WorkerConfig(dsn=db_dsn, worker_id="idle"), OfflineAdapter())
    logger = logging.getLogger("pimem")
    propagate, logger.propagate = logger.propagate, True
    caplog.set_level(logging.INFO, logger="pimem")
    try:
        worker.maintain()
        assert worker.report_waiting() == {"idle_window": 3}
        assert worker.report_waiting() == {}, "nothing maintained since: nothing read"
        w.conversation("ws2", "r2", chat="dm-bob", user="bob")
        worker._walked_at = None  # the next interval's walk
        worker.maintain()
        assert worker.report_waiting() == {"idle_window": 2}
    finally:
        logger.propagate = propagate
        worker.db.close()
    reports = [r.fields["workspaces"] for r in caplog.records  # type: ignore[attr-defined]
               if r.getMessage() == "no_work"]
    assert reports == [3, 0, 1]


def test_waiting_status_of_one_workspace_reads_that_workspace_alone(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    for ws in ("ws1", "ws2"):
        w.basic(ws)
        w.conversation(ws, "r1", chat="dm-alice", user="alice")
    with plans(conn) as seen:
        rows = conn.execute("select reason, conversations from memory.waiting_status('ws1')"
                            ).fetchall()
    assert rows == [("idle_window", 1)]
    assert seen and not [p for p in seen if "'ws2'" in p]


def test_a_topic_s_verdict_reads_that_topic_s_requests_through_the_index(
        conn: psycopg.Connection) -> None:
    """A group with many topics, under a cached (generic) plan as a worker's long-lived
    connection has one: each topic scope's conversations are read by their topic in the index,
    never the chat's every request for each scope (an OR with the private scope's "every topic"
    did that: a tick after 10,000 conversations in 100 topics took 27 s, 100x the 1,000's)."""
    w = World(conn)
    w.basic("ws1")
    for topic in range(1, 6):
        w.topic("ws1", "grp", topic)
    with conn.transaction():
        conn.execute(
            """select memory.upsert_request('ws1', 'c' || i, 'bot1', 'grp', i % 6, 'alice',
                                            'interactive', 'succeeded', 'fake', 'm', 1, 0, null),
                      memory.upsert_message('ws1', 'c' || i || '-u', 'c' || i, 'user', 'alice',
                                            'a question, number ' || i, true, null, '{}'),
                      memory.upsert_message('ws1', 'c' || i || '-a', 'c' || i, 'assistant',
                                            'bot1', 'an answer, number ' || i, true, null, '{}')
                 from generate_series(1, 1200) i""")  # a bulk import: the tick analyses first
    advance(conn, "31 minutes")
    conn.execute("set plan_cache_mode = force_generic_plan")
    with plans(conn) as seen:
        counts = conn.execute("select memory.run_maintenance('ws1')").fetchone()
    conn.execute("reset plan_cache_mode")
    assert counts is not None and counts[0]["extract_jobs_created"] == 6, "a job a topic"
    assert counts[0]["statistics_refreshed"] == 1
    verdict = [p for p in seen if "extraction_candidates(" in p]
    assert verdict
    for plan in verdict:
        lines = plan.splitlines()
        at = [n for n, line in enumerate(lines) if "requests_scope_idx" in line]
        assert at, plan
        for n in at:
            cond = next(line for line in lines[n + 1:] if "Index Cond" in line)
            assert "topic_id >=" in cond and "topic_id <=" in cond, cond
        assert "Seq Scan on requests" not in plan
