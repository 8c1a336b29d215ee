"""The worker's side of a job (P12-P20): leases, checkpoints, failures, budgets, charges, config
changes and sources changing under a running job."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import (
    USAGE,
    advance,
    checkpoint,
    claim,
    commit,
    consolidation_of,
    extraction_of,
    fail,
    idle_private_world,
    job_row,
    jobs,
    maintenance,
    run_one_extraction,
    show_memories_with_batches,
    start,
)
from tests.records import copies_differing, invalid_reason, record_copy, usage_rows_missing

SCOPE_INDEX = ("memory_private.scopes s left join memory_private.scope_indexes i "
               "using (workspace_id, scope_id)")


def claimed(conn: psycopg.Connection, worker: str = "w1") -> dict[str, Any]:
    job = claim(conn, worker)
    assert job is not None
    return job


def counts_of(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(f"select count(*) from memory_private.{table}").fetchone()
    assert row is not None
    return int(row[0])


def extend(conn: psycopg.Connection, job: dict[str, Any]) -> Any:
    row = conn.execute("select memory.extend_lease(%s, %s, %s)",
                       (job["workspace_id"], job["job_id"], job["token"])).fetchone()
    assert row is not None
    return row[0]


def now(conn: psycopg.Connection) -> Any:
    row = conn.execute("select memory_private.clock_now()").fetchone()
    assert row is not None
    return row[0]


# The happy path and the payload ------------------------------------------------------------------


def test_claim_returns_the_full_payload_and_a_lease(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert set(job) >= {"job_id", "workspace_id", "token", "phase", "attempt", "lease_expires_at",
                        "scope", "origin_request_id", "model", "budget", "limits", "input",
                        "checkpoint"}
    assert (job["phase"], job["attempt"], job["checkpoint"]) == ("extract", 1, None)
    assert job["scope"] == {"scope_id": job["scope"]["scope_id"], "kind": "private",
                            "bot_id": "bot1", "chat_id": "dm-alice", "user_id": "alice",
                            "topic_id": None}
    assert job["model"] == {"provider": "fake", "id": "m"}
    # Dollars as exact decimal strings, like every amount the API takes.
    assert job["budget"] == {"request_left_usd": "1.000000", "workspace_left_usd": "100.000000"}
    assert job["limits"] == {"summary_bytes": 4000, "title_bytes": 300, "index_bytes": 4500,
                             "index_ids": 12, "batch_bytes": 24000, "candidates": 48}
    src = job["input"]["sources"]
    assert [(s["id"], s["role"], s["speaker_id"], s["thread_id"]) for s in src] == [
        ("r1-u", "user", "alice", "r1"), ("r1-a", "assistant", "bot1", "r1")]
    assert job["input"]["existing"] == []
    row = job_row(conn, job["job_id"])
    assert row["status"] == "running" and str(row["token"]) == job["token"]
    left = row["lease_expires_at"] - now(conn)
    assert timedelta(seconds=110) < left <= timedelta(minutes=2)
    assert claim(conn) is None, "one job at a time, and nothing else is pending"


def test_a_committed_extraction_cites_what_its_output_cites_and_depends_on_the_whole_batch(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="grp", user="alice", thread="t-9")
    w.message("ws1", "r1-u", "r1", "user", "alice", "ship on Friday", repositories=["repo-a"])
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "ok", repositories=["repo-b"])
    w.request("ws1", "r2", chat="grp", user="bob")
    w.message("ws1", "r2-u", "r2", "user", "bob", "I disagree")
    w.message("ws1", "r2-a", "r2", "assistant", "bot1", "noted")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    # The summary cites only alice's exchange.
    checkpoint(conn, job, {"title": "Release day", "summary": "Alice wants Friday.",
                           "source_ids": ["r1-u", "r1-a", "r1-u"]})
    result = commit(conn, job)
    assert result["status"] == "committed" and result["record_id"]
    assert (result["sources"], result["dependencies"], result["shown"]) == (2, 4, 2)
    rec = conn.execute("select kind, speaker_ids, thread_ids, repositories, bot_identity, "
                       "origin_request_id from memory_private.records").fetchone()
    assert rec == ("extracted", ["alice"], ["t-9"], ["repo-a", "repo-b"], "bot1-identity", "r2")
    sources = conn.execute("select message_id, position from memory_private.record_sources "
                           "order by position").fetchall()
    assert sources == [("r1-u", 1), ("r1-a", 2)], "cited once each, in the order given"
    deps = conn.execute("select message_id, d.content_hash = m.content_hash, via "
                        "from memory_private.record_dependencies d join memory_private.messages m "
                        "using (workspace_id, message_id) order by 1").fetchall()
    assert deps == [("r1-a", True, "cited"), ("r1-u", True, "cited"), ("r2-a", True, "shown"),
                    ("r2-u", True, "shown")], "the model saw bob's exchange: it may be in it"
    # The record's own copy, which the validity rule and query_memories read, says the same.
    assert record_copy(conn, "ws1", result["record_id"])[::2] == (
        ["r1-a", "r1-u", "r2-a", "r2-u"], ["r1-u", "r1-a"])
    assert copies_differing(conn) == 0
    assert usage_rows_missing(conn) == 0
    # ... so removing bob's uncited message takes the record too.
    w.remove("ws1", "r2-u")
    assert invalid_reason(conn, "ws1", result["record_id"]) == "source_removed"
    marked = conn.execute("select message_id, outcome from memory_private.extracted_sources "
                          "order by 1").fetchall()
    assert marked == [(m, "extracted") for m in ("r1-a", "r1-u", "r2-a", "r2-u")]
    assert job_row(conn, job["job_id"])["status"] == "succeeded"
    assert job_row(conn, job["job_id"])["checkpoint"] is None


def _second_extraction(conn: psycopg.Connection, w: World,
                       reuse_first: bool) -> tuple[int, int]:
    """A first record, then a second batch shown with it (the policy made to show one memory),
    whose output declares it reused the first record or not."""
    show_memories_with_batches(conn, 1)
    first = run_one_extraction(conn)["record_id"]
    run_one_extraction(conn)  # consolidation
    w.conversation("ws1", "r2", chat="dm-alice", user="alice",
                   user_text="more on the preference: I prefer tea in the morning")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert [e["id"] for e in job["input"]["existing"]] == [first], "chosen: it shares words"
    start(conn, job)
    output = {**extraction_of(job, "Greeting", "The user said hello to the bot."),
              **({"reused_ids": [first]} if reuse_first else {})}
    checkpoint(conn, job, output)
    second = commit(conn, job)["record_id"]
    return first, second


def _dependencies(conn: psycopg.Connection, record_id: int) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(
        "select message_id, via from memory_private.record_dependencies where record_id = %s "
        "order by 1", (record_id,))]


@pytest.mark.parametrize("reuse_declared", [False, True])
def test_a_memory_shown_with_a_batch_lends_its_dependencies_whatever_the_output_declares(
        fresh_conn: psycopg.Connection, reuse_declared: bool) -> None:
    conn = fresh_conn
    w = idle_private_world(conn)
    first, second = _second_extraction(conn, w, reuse_declared)
    assert _dependencies(conn, second) == [("r1-a", "inherited"), ("r1-u", "inherited"),
                                           ("r2-a", "cited"), ("r2-u", "cited")]
    assert record_copy(conn, "ws1", second)[::2] == (["r1-a", "r1-u", "r2-a", "r2-u"],
                                                     ["r2-u", "r2-a"])
    assert copies_differing(conn) == 0
    assert usage_rows_missing(conn) == 0
    assert [r[0] for r in conn.execute(
        "select message_id from memory_private.record_sources where record_id = %s "
        "order by position", (second,))] == ["r2-u", "r2-a"], "what it was shown cites nothing"
    w.remove("ws1", "r1-u")  # the first record's source
    assert invalid_reason(conn, "ws1", first) == "source_removed"
    assert invalid_reason(conn, "ws1", second) == "source_removed"


def test_no_memory_accompanies_a_batch_by_the_policy(conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    run_one_extraction(conn)
    run_one_extraction(conn)  # consolidation
    w.conversation("ws1", "r2", chat="dm-alice", user="alice",
                   user_text="more on the preference: I prefer tea in the morning")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert job["input"]["existing"] == []


def test_reuse_of_a_memory_not_shown_with_the_batch_is_refused(
        fresh_conn: psycopg.Connection) -> None:
    conn = fresh_conn
    show_memories_with_batches(conn, 1)
    w = idle_private_world(conn)
    first = run_one_extraction(conn)["record_id"]
    run_one_extraction(conn)
    w.conversation("ws1", "r2", chat="dm-alice", user="alice",
                   user_text="more on the preference: I prefer tea in the morning")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    for bad in ([first + 100], [1.5], [float(first)], ["1"], 7, [0]):
        with pytest.raises(psycopg.Error) as err:
            checkpoint(conn, job, {**extraction_of(job), "reused_ids": bad})
        assert err.value.sqlstate == "MB023", bad
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, {"title": "", "summary": "", "source_ids": [],
                               "reused_ids": [first]})
    assert err.value.sqlstate == "MB023", "a no-op reuses nothing"
    checkpoint(conn, job, {**extraction_of(job), "reused_ids": [first, first]})
    assert job_row(conn, job["job_id"])["checkpoint"]["output"]["reused_ids"] == [first]


def test_an_empty_output_is_a_noop_that_still_marks_the_batch(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, {"title": "", "summary": "", "source_ids": []})
    result = commit(conn, job)
    assert result["record_id"] is None and result["noop"] is True
    assert counts_of(conn, "records") == 0
    assert counts_of(conn, "extracted_sources") == 2
    assert conn.execute("select consolidation_due_at from memory_private.scopes").fetchone() == (
        None,)
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0


# Leases ------------------------------------------------------------------------------------------


def test_lease_expiry_lets_another_worker_take_over_and_refuses_the_old_owner(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    old = claimed(conn, "w-old")
    advance(conn, "3 minutes")
    assert maintenance(conn, "ws1")["leases_expired"] == 1
    assert job_row(conn, old["job_id"])["status"] == "pending"
    new = claimed(conn, "w-new")
    assert new["job_id"] == old["job_id"] and new["token"] != old["token"]
    # The old claim made no model call but lost its lease without a report: it counts (a
    # worker that dies on a job's content must not get it back for ever; test_claims_lost.py).
    assert new["attempt"] == 2
    for call in (lambda: commit(conn, old), lambda: extend(conn, old),
                 lambda: start(conn, old), lambda: fail(conn, old)):
        with pytest.raises(psycopg.Error) as err:
            call()
        assert err.value.sqlstate == "MB020"
    start(conn, new)
    checkpoint(conn, new, extraction_of(new))
    assert commit(conn, new)["status"] == "committed"


def test_an_expired_lease_is_refused_even_before_maintenance(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    advance(conn, "2 minutes 1 second")
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB020"
    assert counts_of(conn, "records") == 0


def test_extend_lease_moves_the_expiry_two_minutes_from_now(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    advance(conn, "90 seconds")
    until = extend(conn, job)
    assert until == job_row(conn, job["job_id"])["lease_expires_at"]
    advance(conn, "90 seconds")  # 3 minutes after the claim, 90 s after the extension
    assert maintenance(conn, "ws1")["leases_expired"] == 0
    start(conn, job)


def test_a_lease_lost_during_a_model_call_stops_the_job_as_unknown(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job, reserve="0.07")
    advance(conn, "3 minutes")
    counts = maintenance(conn, "ws1")
    assert counts["leases_expired"] == 1 and counts["attempts_unknown"] == 1
    row = job_row(conn, job["job_id"])
    assert row["status"] == "stopped" and "unknown" in row["last_error"]
    charge = conn.execute("select kind, outcome, cost_usd from memory_private.request_charges"
                          ).fetchone()
    assert charge == ("memory_extract", "unknown", Decimal("0.07"))
    assert claim(conn) is None
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0, "no automatic replay"


# Checkpoints -------------------------------------------------------------------------------------


def test_a_valid_checkpoint_is_returned_on_the_next_claim_and_committed_without_a_second_call(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    first = claimed(conn, "w-crashed")
    start(conn, first)
    output = extraction_of(first)
    checkpoint(conn, first, output)
    advance(conn, "3 minutes")   # the worker died before committing
    maintenance(conn, "ws1")
    second = claimed(conn, "w-new")
    assert second["job_id"] == first["job_id"]
    assert second["checkpoint"] == {"output": {**output, "reused_ids": []}, "usage": USAGE}
    with pytest.raises(psycopg.Error) as err:
        start(conn, second)
    assert err.value.sqlstate == "MB025", "no second model call for a checkpointed job"
    assert commit(conn, second)["status"] == "committed"
    assert counts_of(conn, "job_attempts") == 1
    assert counts_of(conn, "request_charges") == 1


def test_a_second_checkpoint_or_a_second_attempt_per_claim_is_refused(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, extraction_of(job))
    assert err.value.sqlstate == "MB025", "a checkpoint needs an open attempt"
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB025", "a commit needs a checkpoint"
    start(conn, job)
    with pytest.raises(psycopg.Error) as err:
        start(conn, job)
    assert err.value.sqlstate == "MB025"
    checkpoint(conn, job, extraction_of(job))
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, extraction_of(job))
    assert err.value.sqlstate == "MB025", "usage is never replayed"
    assert counts_of(conn, "request_charges") == 1


# Failures ----------------------------------------------------------------------------------------


def test_a_failure_backs_off_one_hour_and_the_third_claim_is_the_last(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    for attempt in (1, 2, 3):
        job = claimed(conn)
        assert job["attempt"] == attempt
        assert start(conn, job) == attempt
        fail(conn, job, "failed", "provider_error",
             usage={"input_tokens": 5, "output_tokens": 0, "cost_usd": 0.001})
        row = job_row(conn, job["job_id"])
        if attempt < 3:
            assert row["status"] == "pending" and row["claims"] == attempt
            gap = row["next_attempt_at"] - now(conn)
            assert timedelta(minutes=59, seconds=50) < gap <= timedelta(hours=1)
            advance(conn, "59 minutes")
            maintenance(conn, "ws1")
            assert claim(conn) is None, "still backing off"
            advance(conn, "1 minute")
        else:
            assert row["status"] == "stopped" and "third model call" in row["last_error"]
    advance(conn, "2 hours")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    assert claim(conn) is None
    charges = conn.execute("select outcome, cost_usd from memory_private.request_charges"
                           ).fetchall()
    assert charges == [("failed", Decimal("0.001"))] * 3


def test_an_unknown_outcome_is_charged_at_its_reserve_and_never_replayed(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job, reserve="0.2")
    fail(conn, job, "unknown", "call_aborted")
    row = job_row(conn, job["job_id"])
    assert row["status"] == "stopped"
    assert conn.execute("select outcome, cost_usd from memory_private.job_attempts").fetchone() == (
        "unknown", Decimal("0.2"))
    assert conn.execute("select outcome, cost_usd from memory_private.request_charges"
                        ).fetchone() == ("unknown", Decimal("0.2"))
    req = conn.execute("select memory_private.request_memory_spent('ws1', 'r1')").fetchone()
    assert req == (Decimal("0.2"),)
    advance(conn, "1 day")
    counts = maintenance(conn, "ws1")
    assert counts["extract_jobs_created"] == 0 and counts["replays_blocked"] == 1
    assert claim(conn) is None
    # A changed input is a new job (three fresh claims), not a replay.
    w.conversation("ws1", "r2", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


def test_unknown_needs_an_open_attempt_and_outcomes_are_checked(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    with pytest.raises(psycopg.Error) as err:
        fail(conn, job, "unknown")
    assert err.value.sqlstate == "MB025"
    with pytest.raises(psycopg.Error) as err:
        fail(conn, job, "maybe")
    assert err.value.sqlstate == "MB001"
    assert job_row(conn, job["job_id"])["status"] == "running"


# Budgets and charges -----------------------------------------------------------------------------


def test_a_reserve_over_the_request_budget_is_refused_before_any_call(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", budget=0.10, spent=0.07)
    w.message("ws1", "r1-u", "r1", "user", "alice", "hello")
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "hi")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert Decimal(job["budget"]["request_left_usd"]) == Decimal("0.03")
    with pytest.raises(psycopg.Error) as err:
        start(conn, job, reserve="0.05")
    assert err.value.sqlstate == "MB024"
    assert counts_of(conn, "job_attempts") == 0
    assert start(conn, job, reserve="0.03") == 1, "a reserve that fits is accepted"


def test_a_reserve_over_the_workspace_budget_is_refused(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.workspace("ws1", budget=5.0, spent=4.98)
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claimed(conn)
    with pytest.raises(psycopg.Error) as err:
        start(conn, job, reserve="0.05")
    assert err.value.sqlstate == "MB024"
    fail(conn, job, "failed", "budget_exceeded")   # the worker reports it: backoff, no charge
    assert job_row(conn, job["job_id"])["status"] == "pending"
    assert counts_of(conn, "request_charges") == 0


def test_charges_attach_to_the_originating_request_and_grow_its_memory_spend(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job),
               usage={"input_tokens": 1200, "output_tokens": 80, "cost_usd": 0.0123})
    commit(conn, job)
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert job["phase"] == "consolidate"
    assert Decimal(job["budget"]["request_left_usd"]) == 1 - Decimal("0.0123")
    start(conn, job)
    checkpoint(conn, job, consolidation_of(job),
               usage={"input_tokens": 300, "output_tokens": 40, "cost_usd": 0.002})
    commit(conn, job)
    rows = conn.execute("select request_id, kind, outcome, input_tokens, output_tokens, cost_usd "
                        "from memory_private.request_charges order by charge_id").fetchall()
    assert rows == [("r1", "memory_extract", "ok", 1200, 80, Decimal("0.0123")),
                    ("r1", "memory_consolidate", "ok", 300, 40, Decimal("0.002"))]
    req = conn.execute("select status, spent_usd, memory_private.request_memory_spent("
                       "workspace_id, request_id) from memory_private.requests").fetchone()
    assert req == ("succeeded", Decimal(0), Decimal("0.0143")), "recorded after the answer"
    ws = conn.execute("select memory_spent_usd from memory_private.workspace_memory").fetchone()
    assert ws == (Decimal("0.0143"),)


@pytest.mark.parametrize("usage", [
    None, [], {"input_tokens": 1, "output_tokens": 1},
    {"input_tokens": 1, "output_tokens": 1, "cost_usd": -1},
    {"input_tokens": 1.5, "output_tokens": 1, "cost_usd": 0},
    {"input_tokens": 1, "output_tokens": 1, "cost_usd": "0.1"},
    {"input_tokens": 1, "output_tokens": 1, "cost_usd": 0, "cached": 3},
])
def test_bad_usage_is_refused_and_changes_nothing(conn: psycopg.Connection, usage: Any) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                     (job["workspace_id"], job["job_id"], job["token"],
                      Jsonb(extraction_of(job)), Jsonb(usage) if usage is not None else None))
    assert err.value.sqlstate == "MB001"
    assert counts_of(conn, "request_charges") == 0
    assert job_row(conn, job["job_id"])["checkpoint"] is None


# Configuration changes (P20) ---------------------------------------------------------------------


def test_a_config_change_stops_stale_work(conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    w.workspace("ws1", config_version=2)
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB022"
    assert counts_of(conn, "records") == 0 and counts_of(conn, "extracted_sources") == 0
    counts = maintenance(conn, "ws1")
    assert counts["jobs_stopped_config_changed"] == 1
    assert job_row(conn, job["job_id"])["status"] == "stopped"
    # The conversation is extracted again under the new configuration, as a new job.
    assert counts["extract_jobs_created"] == 1
    [fresh] = [j for j in jobs(conn) if j["status"] == "pending"]
    assert fresh["config_version"] == 2


def test_a_pending_job_of_an_old_config_is_stopped_instead_of_claimed(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    w.workspace("ws1", config_version=3)
    assert claim(conn) is None
    [job] = jobs(conn)
    assert job["status"] == "stopped" and "configuration" in job["last_error"]


# Sources changing under a running job ------------------------------------------------------------


@pytest.mark.parametrize("change", ["edit", "remove", "expire", "tombstone", "disable"])
def test_a_source_changed_during_extraction_refuses_the_commit(conn: psycopg.Connection,
                                                               change: str) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    if change == "edit":
        w.message("ws1", "r1-u", "r1", "user", "alice", "actually I prefer coffee")
    elif change == "remove":
        w.remove("ws1", "r1-u")
    elif change == "expire":
        conn.execute("update memory_private.messages set retain_until = now() "
                     "where message_id = 'r1-a'")
    elif change == "tombstone":
        conn.execute("insert into memory_private.tombstones values ('ws1', %s, 'r1-u', now())",
                     (job["scope"]["scope_id"],))
    else:
        conn.execute("update memory_private.scopes set recall_enabled = false")
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB021"
    assert counts_of(conn, "records") == 0 and counts_of(conn, "extracted_sources") == 0
    assert job_row(conn, job["job_id"])["status"] == "running", "nothing half-written"
    # The next maintenance drops the stale job; an edited conversation gets a fresh snapshot.
    counts = maintenance(conn, "ws1")
    assert counts["jobs_superseded_stale"] == 1
    assert job_row(conn, job["job_id"])["status"] == "superseded"
    assert job_row(conn, job["job_id"])["checkpoint"] is None
    assert counts["extract_jobs_created"] == 0, "the edit is new activity: wait for idleness"
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == (1 if change == "edit" else 0)


@pytest.mark.parametrize("change", ["edit", "remove"])
def test_a_source_changed_during_consolidation_refuses_the_commit(conn: psycopg.Connection,
                                                                  change: str) -> None:
    w = idle_private_world(conn)
    run_one_extraction(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert job["phase"] == "consolidate"
    start(conn, job)
    checkpoint(conn, job, consolidation_of(job))
    if change == "edit":
        w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted something else.")
    else:
        w.remove("ws1", "r1-a")
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB021"
    assert conn.execute("select i.index_text, s.consolidation_due_at is not null "
                        f"from {SCOPE_INDEX}").fetchone() == (None, True)
    counts = maintenance(conn, "ws1")
    assert counts["jobs_superseded_stale"] == 1
    assert counts["indexes_cleared"] == 1, "no valid record is left to index"


def test_a_record_added_during_consolidation_keeps_the_scope_due(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    run_one_extraction(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, consolidation_of(job))
    scope_id = job["scope"]["scope_id"]
    rec = conn.execute(
        "insert into memory_private.records (workspace_id, scope_id, kind, title, summary, "
        "speaker_ids, thread_ids, bot_identity, origin_request_id, created_at) values "
        "('ws1', %s, 'note', 'Coffee', 'Also coffee.', '{alice}', '{r1}', 'bot1-identity', "
        "'r1', memory_private.clock_now()) returning record_id", (scope_id,)).fetchone()
    assert rec is not None
    result = commit(conn, job)
    assert result["consolidation_still_due"] is True
    scope = conn.execute("select i.record_ids, s.consolidation_due_at is not null "
                         f"from {SCOPE_INDEX}").fetchone()
    assert scope is not None and scope[1] is True and rec[0] not in scope[0]
    assert maintenance(conn, "ws1")["consolidate_jobs_created"] == 1


# State rules -------------------------------------------------------------------------------------


def test_illegal_status_transitions_raise_mb025(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    run_one_extraction(conn)
    with pytest.raises(psycopg.Error) as err:
        conn.execute("update memory_private.jobs set status = 'pending'")
    assert err.value.sqlstate == "MB025"


def test_only_one_running_job_per_workspace(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "a1", chat="dm-alice", user="alice")
    w.conversation("ws1", "b1", chat="dm-bob", user="bob")
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 2
    first = claimed(conn)
    assert claim(conn) is None, "the other job waits for this workspace's running job"
    start(conn, first)
    checkpoint(conn, first, extraction_of(first))
    commit(conn, first)
    assert claim(conn) is not None


def test_unknown_jobs_and_workspaces_are_not_found(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    with pytest.raises(psycopg.Error) as err:
        commit(conn, {**job, "job_id": 999})
    assert err.value.sqlstate == "MB002"
    World(conn).workspace("ws2")
    with pytest.raises(psycopg.Error) as err:
        commit(conn, {**job, "workspace_id": "ws2"})
    assert err.value.sqlstate == "MB002", "a job of ws1 does not exist in ws2"
    with pytest.raises(psycopg.Error) as err:
        maintenance(conn, "nowhere")
    assert err.value.sqlstate == "MB002"


def test_a_paused_workspace_is_not_claimed(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    conn.execute("update memory_private.workspaces set paused = true")
    assert claim(conn) is None
    conn.execute("update memory_private.workspaces set paused = false")
    assert claim(conn) is not None
