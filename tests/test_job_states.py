"""Finished jobs stay finished: the database refuses to reopen them (MB025)."""

from __future__ import annotations

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import advance, claim, fail, maintenance, start


@pytest.mark.parametrize("final", ["stopped", "succeeded", "superseded", "skipped"])
def test_a_finished_job_cannot_be_reopened(fresh_conn: psycopg.Connection, final: str) -> None:
    conn = fresh_conn  # a database of its own: the test disables a trigger for a moment
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    fail(conn, job, "unknown")  # an unknown outcome of an open call stops the job for good
    row = conn.execute("select status from memory_private.jobs where job_id = %s",
                       (job["job_id"],)).fetchone()
    assert row == ("stopped",)
    if final != "stopped":
        # Put the row in the other final states directly (as superuser) to test the rule itself.
        conn.execute("alter table memory_private.jobs disable trigger jobs_check_transition")
        conn.execute("update memory_private.jobs set status = %s where job_id = %s",
                     (final, job["job_id"]))
        conn.execute("alter table memory_private.jobs enable trigger jobs_check_transition")
    with pytest.raises(psycopg.Error) as err:
        conn.execute("update memory_private.jobs set status = 'pending', finished_at = null "
                     "where job_id = %s", (job["job_id"],))
    assert err.value.sqlstate == "MB025"


def test_fail_job_answers_the_status_it_decided(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    answers = []
    for _ in range(3):
        job = claim(conn)
        assert job is not None
        start(conn, job)  # the claim reaches the provider: it counts
        row = conn.execute("select memory.fail_job(%s, %s, %s, 'failed', 'provider_error')",
                           (job["workspace_id"], job["job_id"], job["token"])).fetchone()
        assert row is not None
        answers.append((row[0]["status"], row[0].get("why")))
        advance(conn, "61 minutes")
    assert answers == [("pending", None), ("pending", None), ("stopped", "third_claim")]
