"""Line-level citations: each summary line cites the sources it rests on ([m1] or [m1, m2]); the
database checks them against the output's sources, orders the sources by them, shows first the
sources of the lines a search finds, and explain_record says which line cites which source."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import advance, checkpoint, claim, commit, maintenance, start


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


def batch(conn: psycopg.Connection, turns: int) -> tuple[World, dict[str, Any]]:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    for i in range(1, turns + 1):
        w.message("ws1", f"m{i:02d}", "r1", "user" if i % 2 else "assistant",
                  "alice" if i % 2 else "bot1", f"turn {i} about topic {i}")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    return w, job


def test_a_line_may_cite_only_the_outputs_sources_and_brackets_that_are_not_ids_are_text(
        conn: psycopg.Connection) -> None:
    _, job = batch(conn, 4)
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, {"title": "t", "summary": "- a [m01]\n- b [m02, m03]",
                               "source_ids": ["m01", "m02"]})
    assert err.value.sqlstate == "MB023" and "not among source_ids" in str(err.value)
    # [REDACTED], [1] or an id of no batch message are text, not citations.
    checkpoint(conn, job, {"title": "t", "summary": "- key [REDACTED] [1] [m99] [m02]",
                           "source_ids": ["m02"]})
    assert commit(conn, job)["record_id"]


def test_sources_follow_the_lines_that_cite_them_and_explain_says_which_line_cites_what(
        conn: psycopg.Connection) -> None:
    _, job = batch(conn, 4)
    checkpoint(conn, job, {"title": "t",
                           "summary": "- first [m03]\n- no citation here\n- both [m01; m03]",
                           "source_ids": ["m01", "m04", "m03"]})
    record = commit(conn, job)["record_id"]
    assert [r[0] for r in conn.execute(
        "select message_id from memory_private.record_sources where record_id = %s "
        "order by position", (record,))] == ["m03", "m01", "m04"], \
        "by the first line that cites each, then the uncited in the order listed"
    lines = value(conn, "select memory.explain_record('ws1', %s) -> 'lines'", record)
    assert lines == [{"line": 1, "sources": ["m03"]}, {"line": 3, "sources": ["m03", "m01"]}]


def test_a_search_shows_first_the_sources_of_the_lines_it_found_and_they_may_be_cited(
        conn: psycopg.Connection) -> None:
    w, job = batch(conn, 30)
    ids = [f"m{i:02d}" for i in range(1, 31)]
    lines = [f"- note {i} [{mid}]" for i, mid in enumerate(ids[:28], start=1)]
    lines.append("- the espresso machine is broken [m29, m30]")
    checkpoint(conn, job, {"title": "office", "summary": "\n".join(lines), "source_ids": ids})
    record = commit(conn, job)["record_id"]
    w.request("ws1", "q", chat="dm-alice", user="alice", status="running")
    found = value(conn, "select memory.query_memories('ws1', 'q', 'c1', %s)",
                  Jsonb({"query": "espresso"}))["records"][0]
    assert found["id"] == record and found["source_ids"][:2] == ["m29", "m30"]
    assert len(found["source_ids"]) == 20 and found["sources_overflow"] == 10
    browse = value(conn, "select memory.query_memories('ws1', 'q', 'c2', '{}'::jsonb)")
    assert browse["records"][0]["source_ids"] == ids[:20], "browsing: the summary's order"
    cited = {r[0] for r in conn.execute(
        "select message_id from memory.request_citations('ws1', 'q')")}
    assert cited == set(ids[:20]) | {"m29", "m30"}, "what was shown may be cited, nothing else"


def test_line_citations_are_read_line_by_line(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        "select line_no, message_id from memory_private.line_citations("
        "'- a [x1, x2]\n- b [x3] and [not-an-id]\n\n- c [x2]', array['x1', 'x2', 'x3']) "
        "order by 1, 2").fetchall()
    assert rows == [(1, "x1"), (1, "x2"), (2, "x3"), (4, "x2")]


def test_a_literal_match_shows_first_the_sources_of_the_lines_holding_the_query(
        conn: psycopg.Connection) -> None:
    # Line 1 holds the query's words, line 3 the query itself: a literal match was found
    # through line 3, so its source comes first (the words' lines count for word matches).
    w, job = batch(conn, 4)
    checkpoint(conn, job, {"title": "office",
                           "summary": "- the machine is old and broken [m01]\n- tea [m02]\n"
                                      "- The Espresso Machine is broken [m03]",
                           "source_ids": ["m01", "m02", "m03"]})
    record = commit(conn, job)["record_id"]
    w.request("ws1", "q", chat="dm-alice", user="alice", status="running")
    found = value(conn, "select memory.query_memories('ws1', 'q', 'c1', %s)",
                  Jsonb({"query": "espresso machine IS"}))["records"][0]
    assert found["id"] == record and found["match"] == "literal"
    assert found["source_ids"] == ["m03", "m01", "m02"]
    words = value(conn, "select memory.query_memories('ws1', 'q', 'c2', %s)",
                  Jsonb({"query": "broken machines"}))["records"][0]
    assert words["match"] == "words" and words["source_ids"] == ["m01", "m03", "m02"]
