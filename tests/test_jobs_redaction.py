"""Credential redaction (P8, T9): the shared vectors, inputs before serialization, outputs
before storage."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import advance, checkpoint, claim, commit, extraction_of, maintenance, start

VECTORS_PATH = Path(__file__).resolve().parent.parent / "pyworker" / "data" / "redaction_vectors.json"
VECTORS = json.loads(VECTORS_PATH.read_text())


def test_the_vector_file_is_a_list_of_named_cases_with_both_kinds() -> None:
    assert isinstance(VECTORS, list) and len(VECTORS) >= 30
    names = [v["name"] for v in VECTORS]
    assert len(names) == len(set(names)), "vector names are unique"
    assert all(set(v) == {"name", "input", "expected"} for v in VECTORS)
    assert any(v["input"] == v["expected"] for v in VECTORS), "negative cases exist"
    assert sum(v["input"] != v["expected"] for v in VECTORS) >= 20


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_sql_redaction_matches_the_shared_vector(conn: psycopg.Connection,
                                                 vector: dict[str, str]) -> None:
    got = conn.execute("select memory_private.redact(%s)", (vector["input"],)).fetchone()
    assert got == (vector["expected"],)
    again = conn.execute("select memory_private.redact(%s)", (vector["expected"],)).fetchone()
    assert again == (vector["expected"],), "redacting twice changes nothing"


def test_json_redaction_reaches_every_string_and_keeps_keys(conn: psycopg.Connection) -> None:
    value = {"password=abcd1234": ["sk-abcdefghijklmnopqrstuvwx", {"t": "token=abcd1234"}],
             "n": 3, "b": True, "z": None}
    got = conn.execute("select memory_private.redact_json_strings(%s)", (Jsonb(value),)).fetchone()
    assert got is not None
    assert got[0] == {"password=abcd1234": ["[REDACTED]", {"t": "token=[REDACTED]"}],
                      "n": 3, "b": True, "z": None}


SECRET = "sk-proj-AbCdEf0123456789XyZaBcDeF"


def test_claim_payload_carries_redacted_sources_and_stored_text_is_untouched(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice",
                   user_text=f"my key is {SECRET}, remember it", reply="password=hunter22 noted")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    texts = [s["text"] for s in job["input"]["sources"]]
    assert texts == ["my key is [REDACTED], remember it", "password=[REDACTED] noted"]
    assert SECRET not in json.dumps(job)
    body = conn.execute("select body from memory_private.messages where message_id = 'r1-u'"
                        ).fetchone()
    assert body == (f"my key is {SECRET}, remember it",), "the original message is not changed"


def test_model_output_is_redacted_before_it_is_stored(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    checkpoint(conn, job, extraction_of(job, title=f"Key {SECRET}",
                                        summary="Uses Authorization: Bearer abc123xyz daily."))
    stored = conn.execute("select checkpoint from memory_private.jobs where job_id = %s",
                          (job["job_id"],)).fetchone()
    assert stored is not None and SECRET not in json.dumps(stored[0])
    commit(conn, job)
    row = conn.execute("select title, summary from memory_private.records").fetchone()
    assert row == ("Key [REDACTED]", "Uses Authorization: Bearer [REDACTED] daily.")


def test_consolidation_candidates_and_index_are_redacted(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    commit(conn, job)
    # A note written by someone else without redaction still reaches the model redacted.
    conn.execute("update memory_private.records set summary = %s", (f"key {SECRET}",))
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None and job["phase"] == "consolidate"
    assert job["input"]["candidates"][0]["summary"] == "key [REDACTED]"
    start(conn, job)
    checkpoint(conn, job, {"index": f"- tea ({SECRET})",
                           "record_ids": [job["input"]["candidates"][0]["id"]]})
    commit(conn, job)
    assert conn.execute("select index_text from memory_private.scope_indexes").fetchone() == (
        "- tea ([REDACTED])",)
