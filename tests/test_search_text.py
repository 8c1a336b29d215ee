"""query_memories' literal search reads the case-folded copy of title and summary stored on the
record (record_texts.search_text, written by a trigger); the answer is the same as folding title
and summary apart. The
word search's document (record_documents, written by a trigger) follows the text the same way,
and so do the documents of the summary's lines (record_lines) that tell which lines a search
found."""

from __future__ import annotations

import psycopg

from tests.factory import World
from tests.test_recall import ids, make_record, query


def test_search_text_is_the_folded_title_and_summary_and_follows_no_boundary(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    rec = make_record(conn, "ws1", "h1", [u], title="Green ΣΟΦΊΑ",
                      summary="Alpha\nBeta 花生 ÄÖÜ")
    row = conn.execute("select t.search_text = lower(r.title) || e'\\n' || lower(r.summary) "
                       "from memory_private.records r join memory_private.record_texts t "
                       "using (workspace_id, record_id) where record_id = %s", (rec,)).fetchone()
    assert row == (True,)
    assert ids(query(conn, "ws1", "live", "q1", {"query": "σοφία"})) == [rec]
    assert ids(query(conn, "ws1", "live", "q2", {"query": "äöü"})) == [rec]
    assert ids(query(conn, "ws1", "live", "q3", {"query": "alpha\nbeta"})) == [rec]
    # The newline joining title and summary in search_text is not text of the record: no
    # literal match, only the two words.
    answer = query(conn, "ws1", "live", "q4", {"query": "σοφία\nalpha"})
    assert [(r["id"], r["match"]) for r in answer["records"]] == [(rec, "words")]
    # An edited title is folded again (the trigger), as a note's would be.
    conn.execute("update memory_private.records set title = 'Black Coffee' "
                 "where record_id = %s", (rec,))
    assert ids(query(conn, "ws1", "live", "q5", {"query": "COFFEE"})) == [rec]
    assert ids(query(conn, "ws1", "live", "q6", {"query": "green"})) == []


def test_line_documents_follow_the_summary_line_by_line(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    rec = make_record(conn, "ws1", "h1", [u], title="Drinks",
                      summary="Alice paints on Sundays\nShe drinks 咖啡 daily\n\nThe end")

    def lines() -> list[tuple[int, bool]]:
        return conn.execute(
            "select d.line_no, d.document = memory_private.text_document(l.line) "
            "from memory_private.record_lines d "
            "join memory_private.records r using (workspace_id, record_id) "
            "cross join lateral regexp_split_to_table(r.summary, e'\\n') "
            "  with ordinality as l(line, n) "
            "where d.record_id = %s and l.n = d.line_no order by 1", (rec,)).fetchall()

    def found(query: str) -> list[int]:
        rows = conn.execute(
            "select m.record_id, m.line_no from memory_private.matching_lines('ws1', "
            "array[%s::bigint], %s, array[%s::bigint], memory_private.search_terms(%s)) m "
            "order by 2", (rec, query, rec, query)).fetchall()
        assert all(r == rec for r, _ in rows)
        return [n for _, n in rows]

    assert lines() == [(1, True), (2, True), (3, True), (4, True)]
    assert found("painting") == [1]  # by its English stem
    assert found("咖啡") == [2]  # by its CJK pair
    assert found("drinks 咖啡") == [2]  # literally
    assert found("sundays daily") == [1, 2]
    conn.execute("update memory_private.records set summary = 'Bob paints\nNothing else' "
                 "where record_id = %s", (rec,))
    assert lines() == [(1, True), (2, True)]
    assert found("painting") == [1] and found("daily") == []
