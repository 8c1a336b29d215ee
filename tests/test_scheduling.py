"""Scheduling (P2-P5, P10, P15, V5, V10): which conversations become extraction jobs, how a batch
is cut, and when consolidation is scheduled. Time moves through the database clock."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    extraction_of,
    jobs,
    maintenance,
    run_one_extraction,
    start,
)

SCOPE_INDEX = ("memory_private.scopes s left join memory_private.scope_indexes i "
               "using (workspace_id, scope_id)")


def extract_jobs(conn: psycopg.Connection, ws: str = "ws1", status: str = "pending") -> list[dict]:
    return [j for j in jobs(conn, ws) if j["phase"] == "extract" and j["status"] == status]


def batch_ids(job: dict) -> list[str]:
    return sorted(s["id"] for s in job["input"]["sources"])


# Eligibility -------------------------------------------------------------------------------


def test_an_idle_succeeded_private_conversation_gets_one_extraction_job(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 1
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"]
    assert (job["origin_request_id"], job["model_provider"], job["model_id"],
            job["config_version"]) == ("r1", "fake", "m", 1)
    # Idempotent: a second tick makes nothing new.
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    assert len(extract_jobs(conn)) == 1


@pytest.mark.parametrize("status", ["queued", "running", "awaiting_approval", "failed"])
def test_unfinished_or_failed_conversations_are_skipped(conn: psycopg.Connection,
                                                        status: str) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", status=status)
    advance(conn, "2 hours")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    assert jobs(conn) == []
    # The same conversation qualifies once it succeeds (and the scope is idle again).
    if status != "failed":
        w.request("ws1", "r1", chat="dm-alice", user="alice", status="succeeded")
        advance(conn, "31 minutes")
        assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


def test_a_running_conversation_does_not_hold_back_finished_ones_but_is_left_out(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    w.conversation("ws1", "r2", chat="dm-alice", user="alice", status="awaiting_approval")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"]


def test_the_idle_window_is_measured_per_conversation(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "29 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    # A new conversation in the same scope has its own window; r1's keeps running.
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    advance(conn, "2 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"], "r2 is only 2 minutes old"
    assert job["origin_request_id"] == "r1"
    advance(conn, "29 minutes")
    assert maintenance(conn, "ws1")["jobs_superseded_new_input"] == 1
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u", "r2-a", "r2-u"]
    assert job["origin_request_id"] == "r2", "the most recent request of the batch"


def test_the_idle_window_is_configurable_per_workspace(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.workspace("ws1", idle_minutes=5)
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "4 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    advance(conn, "2 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


def test_scheduled_requests_neither_feed_memories_nor_get_a_scope(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "s1", chat="dm-alice", user="alice", kind="scheduled")
    advance(conn, "2 hours")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    assert conn.execute("select count(*) from memory_private.scopes").fetchone() == (0,)


def test_non_directed_group_traffic_is_never_collected(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "g1", chat="grp", user="bob")
    assert w.message("ws1", "g1-u", "g1", "user", "bob", "chatter", directed=False) == "ignored"
    w.message("ws1", "g1-a", "g1", "assistant", "bot1", "a reply")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    # The same exchange, directed at the bot, qualifies.
    w.request("ws1", "g2", chat="grp", user="bob")
    w.message("ws1", "g2-u", "g2", "user", "bob", "@bot remember the release is Friday")
    w.message("ws1", "g2-a", "g2", "assistant", "bot1", "Noted.")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["g2-a", "g2-u"]


def test_a_scope_with_recall_disabled_gets_no_job(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    conn.execute("select memory.resolve_scope('ws1', 'r1')")
    conn.execute("update memory_private.scopes set recall_enabled = false")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    conn.execute("update memory_private.scopes set recall_enabled = true")
    # Written directly: the change manage_memory's enable-memory notes, noted by hand.
    conn.execute("select memory_private.note_change('ws1', 'updated')")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


def test_a_paused_workspace_gets_no_job(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    conn.execute("select memory.set_workspace_paused('ws1', true)")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    conn.execute("select memory.set_workspace_paused('ws1', false)")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


def test_a_conversation_needs_retained_user_and_assistant_messages(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "r1-u", "r1", "user", "alice", "only a question")
    w.conversation("ws1", "r2", chat="dm-bob", user="bob")
    w.remove("ws1", "r2-a")
    w.conversation("ws1", "r3", chat="dm-alice", user="alice")
    conn.execute("update memory_private.messages set retain_until = now() where message_id = 'r3-u'")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0


def test_tombstoned_sources_never_enter_a_batch(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    w.message("ws1", "r2-u2", "r2", "user", "alice", "and one more thing")
    scope = conn.execute("select scope_id from memory.resolve_scope('ws1', 'r1')").fetchone()
    assert scope is not None
    conn.execute("insert into memory_private.tombstones values ('ws1', %s, 'r1-u', now()),"
                 " ('ws1', %s, 'r2-u2', now())", (scope[0], scope[0]))
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r2-a", "r2-u"], "r1 lost its user message; r2-u2 is forgotten"


def test_extracted_sources_are_not_scheduled_again_until_edited(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    assert run_one_extraction(conn)["status"] == "committed"
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 0
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted, with a correction.")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"], "the pair is kept together"


# The 24,000-byte ceiling ---------------------------------------------------------------------


def test_a_batch_takes_the_most_recent_conversations_up_to_24000_bytes(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    # Each conversation is 10,000 bytes but only 5,000 characters ("ü" is two UTF-8 bytes).
    for i in (1, 2, 3):
        w.conversation("ws1", f"r{i}", chat="dm-alice", user="alice",
                       user_text="ü" * 2500, reply="ü" * 2500)
        advance(conn, "1 minute")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r2-a", "r2-u", "r3-a", "r3-u"], "20,000 bytes; r1 would exceed"
    assert job["origin_request_id"] == "r3"
    # The older conversation comes in the next batch.
    claimed = claim(conn)
    assert claimed is not None
    start(conn, claimed)
    checkpoint(conn, claimed, extraction_of(claimed))
    commit(conn, claimed)
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"]


def test_a_conversation_that_cannot_fit_is_skipped_recorded_and_not_retried(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "1 minute")
    # 12,000 characters of three-byte text: 36,000 bytes, over the ceiling on its own.
    w.conversation("ws1", "r2", chat="dm-alice", user="alice", user_text="€" * 12000,
                   reply="ok")
    advance(conn, "31 minutes")
    counts = maintenance(conn, "ws1")
    assert counts["batches_skipped"] == 1 and counts["extract_jobs_created"] == 1
    [skipped] = [j for j in jobs(conn) if j["status"] == "skipped"]
    assert batch_ids(skipped) == ["r2-a", "r2-u"]
    assert "r2" in skipped["last_error"] and "24000" in skipped["last_error"]
    assert skipped["claims"] == 0 and skipped["finished_at"] is not None
    [job] = extract_jobs(conn)
    assert batch_ids(job) == ["r1-a", "r1-u"], "older conversations still get extracted"
    # Not retried: later ticks record nothing new, and it is never claimable.
    for _ in range(3):
        advance(conn, "1 hour")
        assert maintenance(conn, "ws1")["batches_skipped"] == 0
    assert len([j for j in jobs(conn) if j["status"] == "skipped"]) == 1


def test_a_skipped_conversation_is_eligible_again_when_edited_to_fit(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="x" * 30000)
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["batches_skipped"] == 1
    w.message("ws1", "r1-u", "r1", "user", "alice", "short now")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


# New snapshots (P15) ---------------------------------------------------------------------------


def test_new_messages_replace_a_pending_snapshot(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [first] = extract_jobs(conn)
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 1 and counts["jobs_superseded_new_input"] == 1
    [second] = extract_jobs(conn)
    assert batch_ids(second) == ["r1-a", "r1-u", "r2-a", "r2-u"]
    statuses = {j["job_id"]: j["status"] for j in jobs(conn)}
    assert statuses[first["job_id"]] == "superseded"


def test_one_open_extraction_job_per_scope_while_running(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.workspace("ws1", idle_minutes=0)
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0, "the running job goes first"
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    commit(conn, job)
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    [nxt] = extract_jobs(conn)
    assert batch_ids(nxt) == ["r2-a", "r2-u"]


def test_scopes_are_scheduled_separately(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "a1", chat="dm-alice", user="alice")
    w.conversation("ws1", "b1", chat="dm-bob", user="bob")
    w.conversation("ws1", "g0", chat="grp", user="bob", topic=0)
    w.conversation("ws1", "g7", chat="grp", user="alice", topic=7)
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 4
    assert sorted(batch_ids(j)[0][:2] for j in extract_jobs(conn)) == ["a1", "b1", "g0", "g7"]


def test_a_newer_batch_resends_no_old_source_and_shows_no_memory_by_the_policy(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    run_one_extraction(conn)
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert job["input"]["existing"] == [], "docs/retention.md: what showing memories costs"
    assert batch_ids(job) == ["r2-a", "r2-u"], "old sources are not resent"


def test_a_batch_holds_at_most_200_messages(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    for i in range(3):  # 3 conversations of 80 messages: two fit, the third waits
        w.request("ws1", f"big{i}", chat="dm-alice", user="alice")
        for j in range(40):
            w.message("ws1", f"big{i}-u{j:02}", f"big{i}", "user", "alice", f"fact {i}.{j}")
            w.message("ws1", f"big{i}-a{j:02}", f"big{i}", "assistant", "bot1", "ok")
        advance(conn, "1 second")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = extract_jobs(conn)
    assert len(batch_ids(job)) == 160
    assert {i.split("-")[0] for i in batch_ids(job)} == {"big1", "big2"}, "the newest first"
    w.request("ws1", "huge", chat="dm-alice", user="alice")
    for j in range(101):
        w.message("ws1", f"huge-u{j:03}", "huge", "user", "alice", "x")
        w.message("ws1", f"huge-a{j:03}", "huge", "assistant", "bot1", "y")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    skipped = conn.execute(
        "select last_error from memory_private.jobs where status = 'skipped'").fetchall()
    assert len(skipped) == 1 and "202 messages" in skipped[0][0]


# Consolidation triggers (P10) -------------------------------------------------------------------


def test_an_extraction_marks_the_scope_and_maintenance_schedules_consolidation(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    run_one_extraction(conn)
    due = conn.execute("select consolidation_due_at is not null from memory_private.scopes"
                       ).fetchone()
    assert due == (True,)
    assert maintenance(conn, "ws1")["consolidate_jobs_created"] == 1
    assert maintenance(conn, "ws1")["consolidate_jobs_created"] == 0, "one open job per scope"
    result = run_one_extraction(conn)  # claims the consolidation
    assert result["phase"] == "consolidate" and result["consolidation_still_due"] is False
    scope = conn.execute("select i.index_text, i.record_ids, s.consolidation_due_at "
                         f"from {SCOPE_INDEX}").fetchone()
    assert scope is not None and scope[0] and scope[1] and scope[2] is None


def test_a_due_scope_without_valid_records_just_loses_its_index(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    run_one_extraction(conn)
    run_one_extraction(conn)  # consolidation: the index now names the record
    w.remove("ws1", "r1-u")   # the record is no longer valid
    conn.execute("update memory_private.scopes set consolidation_due_at = now()")
    counts = maintenance(conn, "ws1")
    assert counts["consolidate_jobs_created"] == 0 and counts["indexes_cleared"] == 1
    scope = conn.execute("select i.index_text, i.record_ids, s.consolidation_due_at "
                         f"from {SCOPE_INDEX}").fetchone()
    assert scope == (None, None, None)


def test_a_note_alone_triggers_consolidation(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    scope = conn.execute("select scope_id from memory.resolve_scope('ws1', 'r1')").fetchone()
    assert scope is not None
    rec = conn.execute(
        "insert into memory_private.records (workspace_id, scope_id, kind, title, summary, "
        "speaker_ids, thread_ids, bot_identity, origin_request_id, created_at) values "
        "('ws1', %s, 'note', 'Tea', 'Alice prefers tea.', '{alice}', '{r1}', 'bot1-identity', "
        "'r1', now()) returning record_id", (scope[0],)).fetchone()
    assert rec is not None
    conn.execute("insert into memory_private.record_dependencies values ('ws1', %s, 'r1-u', "
                 "memory_private.content_hash('hello'), 'cited', 1)", (rec[0],))
    conn.execute("select memory_private.mark_consolidation_due('ws1', %s)", (scope[0],))
    counts = maintenance(conn, "ws1")  # not idle yet: no extraction, but consolidation
    assert counts["extract_jobs_created"] == 0 and counts["consolidate_jobs_created"] == 1
    [job] = [j for j in jobs(conn) if j["phase"] == "consolidate"]
    assert job["input"]["candidates"] == [rec[0]] and job["origin_request_id"] == "r1"


def test_maintenance_of_all_workspaces_sums_counts(conn: psycopg.Connection) -> None:
    w = World(conn)
    for ws in ("ws1", "ws2"):
        w.basic(ws)
        w.conversation(ws, "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    counts = maintenance(conn)
    assert counts["extract_jobs_created"] == 2 and counts["workspaces"] == 2
    assert {"leases_expired", "consolidate_jobs_created"} <= set(counts)


@pytest.mark.parametrize(("total", "more", "expected"), [
    ({"a": 1, "why": "x"}, {"a": 2, "b": 3, "why": "y"}, {"a": 3, "b": 3, "why": "y"}),
    ({"a": 1}, {}, {"a": 1}),
    ({"a": 1}, None, {"a": 1}),
    (None, {}, {}),
    (None, {"a": 1.5}, {"a": 1.5}),
], ids=["adds_numbers_newer_text_wins", "empty", "null", "null_total", "into_null"])
def test_maintenance_counts_add_up_and_nothing_adds_nothing(
        conn: psycopg.Connection, total: dict | None, more: dict | None,
        expected: dict) -> None:
    [(result,)] = conn.execute("select memory_private.add_counts(%s::jsonb, %s::jsonb)",
                               (None if total is None else json.dumps(total),
                                None if more is None else json.dumps(more))).fetchall()
    assert result == expected
