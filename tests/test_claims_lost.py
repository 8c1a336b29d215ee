"""Claims that never end (issue 31): a job that kills every worker that takes it stops after
three claims, with a reason the operator sees; a refusal before any model call costs no claim.

A worker that dies on a job's content (building its prompt, reading its payload) never opens a
model call: before, its lease expired, the job went back to pending, and the next worker took
it and died again, for ever. Time moves through the database clock, never by sleeping."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.jobs_world import (
    advance,
    claim,
    fail,
    idle_private_world,
    job_row,
    maintenance,
    start,
)


def claimed(conn: psycopg.Connection, worker: str) -> dict[str, Any]:
    job = claim(conn, worker)
    assert job is not None, "the job is claimable"
    return job


def abandon(conn: psycopg.Connection, worker: str) -> dict[str, Any]:
    """A worker claims the job and dies before any model call: the lease runs out and
    maintenance finds it."""
    job = claimed(conn, worker)
    advance(conn, "3 minutes")
    assert maintenance(conn, "ws1")["leases_expired"] == 1
    return job


def status_view(conn: psycopg.Connection, job_id: int) -> dict[str, Any]:
    cur = conn.execute("select status, claims, claims_left, last_error "
                       "from memory.job_status where job_id = %s", (job_id,))
    names = [d.name for d in cur.description or []]
    row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def test_a_job_that_kills_every_worker_stops_after_three_claims_with_a_visible_reason(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    first = abandon(conn, "w1")
    assert status_view(conn, first["job_id"])["claims"] == 1, "the lost claim counts"
    second = abandon(conn, "w2")
    assert second["job_id"] == first["job_id"] and second["attempt"] == 2
    assert job_row(conn, first["job_id"])["status"] == "pending"
    abandon(conn, "w3")
    seen = status_view(conn, first["job_id"])
    assert seen["status"] == "stopped" and seen["claims"] == 3 and seen["claims_left"] == 0
    assert "lease expired" in seen["last_error"] and "not replayed" in seen["last_error"]
    # It does not come back: not claimable, not rescheduled, an hour or a day later.
    for later in ("1 hour", "1 day"):
        advance(conn, later)
        counts = maintenance(conn, "ws1")
        assert counts.get("extract_jobs_created", 0) == 0
        assert claim(conn, "w4") is None


def test_a_job_the_worker_reports_it_broke_on_counts_a_claim_each_time(
        conn: psycopg.Connection) -> None:
    """The worker survives the job's content but cannot build the call (worker_error): that
    claim counts too, so such a job stops after three, instead of coming back every hour."""
    idle_private_world(conn)
    maintenance(conn, "ws1")
    for n in (1, 2, 3):
        job = claimed(conn, f"w{n}")
        fail(conn, job, error="worker_error")
        advance(conn, "61 minutes")
        maintenance(conn, "ws1")
    row = job_row(conn, job["job_id"])
    assert row["status"] == "stopped" and row["claims"] == 3
    assert "worker_error" in row["last_error"]
    assert claim(conn, "w4") is None


@pytest.mark.parametrize("refusal", ["budget_exceeded", "not_priced"])
def test_a_refusal_before_any_model_call_costs_no_claim(
        conn: psycopg.Connection, refusal: str) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    for n in range(5):
        job = claimed(conn, f"w{n}")
        if refusal == "budget_exceeded":  # the database's own refusal first (MB024)
            with pytest.raises(psycopg.Error) as err:
                start(conn, job, reserve="1000")
            assert err.value.sqlstate == "MB024"
        answer = conn.execute("select memory.fail_job(%s, %s, %s, 'failed', %s, null)",
                              (job["workspace_id"], job["job_id"], job["token"], refusal)
                              ).fetchone()
        assert answer is not None and answer[0]["status"] == "pending"
        assert job_row(conn, job["job_id"])["claims"] == 0
        advance(conn, "61 minutes")
        maintenance(conn, "ws1")
    # Refused five times, the job still has its three claims: abandoned three times, it stops.
    for n in range(3):
        abandon(conn, f"dead{n}")
    assert status_view(conn, job["job_id"])["status"] == "stopped"
