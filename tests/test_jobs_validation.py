"""Model output validation in the database (P6, P8, P9): JSON shapes, UTF-8 byte limits, ids
within the snapshot. A refused output changes nothing; fail_job then records the attempt."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    fail,
    idle_private_world,
    job_row,
    maintenance,
    run_one_extraction,
    start,
)


def extraction_job(conn: psycopg.Connection) -> dict[str, Any]:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    return job


def consolidation_job(conn: psycopg.Connection, records: int = 13) -> dict[str, Any]:
    w = World(conn)
    w.basic()
    for i in range(records):
        w.conversation("ws1", f"r{i}", chat="dm-alice", user="alice", user_text=f"fact {i}")
        advance(conn, "31 minutes")
        run_one_extraction(conn)
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None and job["phase"] == "consolidate"
    start(conn, job)
    return job


def refused(conn: psycopg.Connection, job: dict[str, Any], output: Any) -> str:
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, output)
    assert err.value.sqlstate == "MB023", err.value
    # Nothing changed: no checkpoint, the attempt is still open, nothing charged.
    assert job_row(conn, job["job_id"])["checkpoint"] is None
    assert conn.execute("select outcome from memory_private.job_attempts where job_id = %s",
                        (job["job_id"],)).fetchall() == [("open",)]
    assert conn.execute("select count(*) from memory_private.request_charges where job_id = %s",
                        (job["job_id"],)).fetchone() == (0,)
    return str(err.value)


GOOD = {"title": "T", "summary": "S", "source_ids": ["r1-u"]}


@pytest.mark.parametrize("output", [
    [], "text", 3, None,
    {"title": "T", "summary": "S"},
    {"title": "T", "summary": "S", "source_ids": ["r1-u"], "confidence": 0.9},
    {"title": 1, "summary": "S", "source_ids": ["r1-u"]},
    {"title": "T", "summary": ["S"], "source_ids": ["r1-u"]},
    {"title": "T", "summary": "S", "source_ids": "r1-u"},
    {"title": "T", "summary": "S", "source_ids": [1]},
    {"title": "", "summary": "S", "source_ids": ["r1-u"]},
    {"title": "T", "summary": "   ", "source_ids": ["r1-u"]},
    {"title": "T", "summary": "S", "source_ids": []},
    {"title": "", "summary": "", "source_ids": ["r1-u"]},
], ids=["array", "string", "number", "null", "missing-key", "unknown-key", "title-number",
        "summary-array", "ids-string", "ids-numbers", "no-title", "blank-summary", "no-ids",
        "empty-with-ids"])
def test_bad_extraction_shapes_are_refused(conn: psycopg.Connection, output: Any) -> None:
    job = extraction_job(conn)
    if output is None:
        with pytest.raises(psycopg.Error) as err:
            conn.execute("select memory.save_checkpoint(%s, %s, %s, null, %s)",
                         (job["workspace_id"], job["job_id"], job["token"],
                          '{"input_tokens": 1, "output_tokens": 1, "cost_usd": 0}'))
        assert err.value.sqlstate == "MB023"
        return
    refused(conn, job, output)


def test_title_and_summary_limits_are_utf8_bytes_not_characters(conn: psycopg.Connection) -> None:
    job = extraction_job(conn)
    # 151 "é" are 151 characters but 302 bytes; 1,334 "€" are 4,002 bytes.
    assert "302 bytes" in refused(conn, job, {**GOOD, "title": "é" * 151})
    assert "4002 bytes" in refused(conn, job, {**GOOD, "summary": "€" * 1334})
    checkpoint(conn, job, {**GOOD, "title": "é" * 150, "summary": "€" * 1333})
    assert commit(conn, job)["status"] == "committed"


def test_source_ids_must_be_within_the_snapshot(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    w.conversation("ws1", "b1", chat="dm-bob", user="bob")  # another scope's messages
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    other = "b1-u" if job["input"]["sources"][0]["id"].startswith("r1") else "r1-u"
    message = refused(conn, job, {**GOOD, "source_ids": [job["input"]["sources"][0]["id"],
                                                         other]})
    assert "1 source id(s) are not messages of the job's batch" in message
    assert other not in message, "the error names the contract, never what the model wrote"
    refused(conn, job, {**GOOD, "source_ids": ["nonexistent"]})


def test_a_refused_output_is_then_reported_as_a_failed_attempt(conn: psycopg.Connection) -> None:
    job = extraction_job(conn)
    refused(conn, job, {"title": "T"})
    fail(conn, job, "failed", "output_refused",
         usage={"input_tokens": 10, "output_tokens": 3, "cost_usd": 0.004})
    assert conn.execute("select outcome, cost_usd from memory_private.job_attempts").fetchone() == (
        "failed", Decimal("0.004"))
    assert job_row(conn, job["job_id"])["status"] == "pending"


def test_consolidation_output_is_validated(conn: psycopg.Connection) -> None:
    job = consolidation_job(conn)
    ids = [c["id"] for c in job["input"]["candidates"]]
    assert len(ids) == 13
    assert "13 ids" in refused(conn, job, {"index": "x", "record_ids": ids})
    refused(conn, job, {"index": "x", "record_ids": [max(ids) + 100]})
    refused(conn, job, {"index": "x", "record_ids": [ids[0], ids[0]]})
    refused(conn, job, {"index": "", "record_ids": ids[:2]})
    refused(conn, job, {"index": "  \n", "record_ids": ids[:2]})
    refused(conn, job, {"index": "x", "record_ids": []})
    refused(conn, job, {"index": "x", "record_ids": [str(ids[0])]})
    refused(conn, job, {"index": "x", "record_ids": [ids[0] + 0.5]})
    refused(conn, job, {"index": "x", "record_ids": ids[:2], "extra": 1})
    refused(conn, job, {"index": ["x"], "record_ids": ids[:2]})
    refused(conn, job, {"title": "T", "summary": "S", "source_ids": []})
    assert "4502 bytes" in refused(conn, job, {"index": "ü" * 2251, "record_ids": ids[:2]})
    checkpoint(conn, job, {"index": "ü" * 2250, "record_ids": ids[:12]})
    result = commit(conn, job)
    assert result["index_record_ids"] == ids[:12]
    scope = conn.execute("select octet_length(index_text), record_ids "
                         "from memory_private.scope_indexes").fetchone()
    assert scope == (4500, ids[:12])
