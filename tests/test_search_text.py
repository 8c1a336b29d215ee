"""query_memories' literal search reads the case-folded copy of title and summary stored on the
record (record_texts.search_text, written by a trigger); the answer is the same as folding title
and summary apart. It reads that text only in records whose three-character runs
(record_texts.grams, memory_private.text_grams) hold every run of the query: a signature that
never loses a record that contains the query, checked here on every part of texts in several
scripts. The word search's document (record_documents, written by a trigger) follows the text the same way,
each word with the lines it is on, which tell which lines a search found."""

from __future__ import annotations

import psycopg

from tests.factory import World
from tests.test_recall import ids, make_record, query


def live_request_and_message(conn: psycopg.Connection) -> str:
    """A running request "live" of alice in her private chat, and a message to make records of."""
    w = World(conn)
    w.basic()
    w.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    return str(u)


def test_search_text_is_the_folded_title_and_summary_and_follows_no_boundary(
        conn: psycopg.Connection) -> None:
    u = live_request_and_message(conn)
    rec = make_record(conn, "ws1", "h1", [u], title="Green ΣΟΦΊΑ",
                      summary="Alpha\nBeta 花生 ÄÖÜ")
    row = conn.execute("select t.search_text = lower(r.title) || e'\\n' || lower(r.summary), "
                       "  t.grams = memory_private.text_grams(lower(r.title)) "
                       "            | memory_private.text_grams(lower(r.summary)) "
                       "from memory_private.records r join memory_private.record_texts t "
                       "using (workspace_id, record_id) where record_id = %s", (rec,)).fetchone()
    assert row == (True, True)
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
    assert conn.execute("select t.grams = memory_private.text_grams('black coffee') "
                        "  | memory_private.text_grams(lower(r.summary)) "
                        "from memory_private.records r join memory_private.record_texts t "
                        "using (workspace_id, record_id) where record_id = %s",
                        (rec,)).fetchone() == (True,)


TEXTS = ["The Kubernetes cluster moved to eu-west-1 on 2026-03-04.\nAlice (PM) owns it.",
         "Ünïcödé straße ΣΟΦΊΑ σοφία ÅÄÖ",
         "我喜欢喝咖啡，也喜欢茶。日本語のテキスト。한국어 문장.",
         "emoji 🙂🙃 and tabs\tand\r\nnewlines ",
         "aaaaaaaaab abab"]


def test_a_text_holds_every_three_character_run_of_each_of_its_parts(
        conn: psycopg.Connection) -> None:
    # Every part of every text, from one character to twelve, at every offset: the text's
    # signature covers the part's. This is what makes skipping by signature lose nothing.
    missed = conn.execute(
        """select t.text, p.part
             from unnest(%s::text[]) as t(text)
            cross join lateral (
              select substr(lower(t.text), i, n) as part
                from generate_series(1, char_length(t.text)) i, generate_series(1, 12) n) p
            where memory_private.text_grams(lower(t.text)) & memory_private.text_grams(p.part)
                  <> memory_private.text_grams(p.part)""", (TEXTS,)).fetchall()
    assert missed == []
    # Fewer than three characters set no bit (every record is read), a run sets one.
    rows = conn.execute(
        "select length(replace(memory_private.text_grams(x)::text, '0', '')) "
        "from unnest(array['', 'a', '咖啡', 'abc', 'abcabc']) x").fetchall()
    assert [r[0] for r in rows] == [0, 0, 0, 1, 3]


def test_the_literal_search_finds_what_the_text_holds_and_not_its_runs_apart(
        conn: psycopg.Connection) -> None:
    u = live_request_and_message(conn)
    # Every run of "abcd" is in `apart` (abc, bcd), but "abcd" is not: the text decides.
    apart = make_record(conn, "ws1", "h1", [u], title="Apart", summary="abcx then bcd")
    holds = make_record(conn, "ws1", "h1", [u], title="Holds", summary="xabcdx")
    short = make_record(conn, "ws1", "h1", [u], title="Short", summary="喝咖啡 é")
    assert conn.execute(
        "select bool_and(t.grams & memory_private.text_grams('abcd') "
        "                = memory_private.text_grams('abcd')) "
        "from memory_private.record_texts t where record_id = any(%s)",
        ([apart, holds],)).fetchone() == (True,)
    found = [(r["id"], r["match"]) for r in query(conn, "ws1", "live", "q1",
                                                   {"query": "ABCD"})["records"]]
    assert [i for i, how in found if how == "literal"] == [holds], found
    # Queries too short to have a run read every record's text.
    assert ids(query(conn, "ws1", "live", "q2", {"query": "咖啡"})) == [short]
    assert ids(query(conn, "ws1", "live", "q3", {"query": "É"})) == [short]
    assert ids(query(conn, "ws1", "live", "q4", {"query": "bc"})) == [holds, apart]
    # ... and a short one spanning the title's end is no match ("Holds", "xabcdx").
    found = query(conn, "ws1", "live", "q5", {"query": "S\n"})["records"]
    assert [r["id"] for r in found if r["match"] == "literal"] == []
    # A longer one too, when the summary holds each of its runs elsewhere: the signature passes
    # and the folded text holds it only across the title's end ("Zab" + newline + "cy ...").
    spans = make_record(conn, "ws1", "h1", [u], title="Zab",
                        summary="cy then ab\nc and b\ncy")
    assert conn.execute(
        "select t.grams & memory_private.text_grams('ab\ncy') = memory_private.text_grams('ab\ncy'),"
        "       strpos(t.search_text, 'ab\ncy') > 0 "
        "from memory_private.record_texts t where record_id = %s", (spans,)).fetchone() == (
            True, True)
    found = query(conn, "ws1", "live", "q6", {"query": "AB\nCY"})["records"]
    assert [r["id"] for r in found if r["match"] == "literal"] == []
    assert ids(query(conn, "ws1", "live", "q7", {"query": "ab\nc AND"})) == [spans]


def test_the_document_follows_the_summary_line_by_line(conn: psycopg.Connection) -> None:
    # Each word once, with the lines it is on as positions: 1 the title, n + 1 summary line n.
    w = World(conn)
    w.basic()
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    rec = make_record(conn, "ws1", "h1", [u], title="Drinks",
                      summary="Alice paints on Sundays\nShe drinks 咖啡 daily\n\nThe paint dried")

    def lines(word: str) -> list[int]:
        row = conn.execute(
            "select u.positions from memory_private.record_documents d, unnest(d.document) u "
            "where d.record_id = %s and u.lexeme = memory_private.word_stem(%s)",
            (rec, word)).fetchone()
        return [] if row is None else list(row[0])

    assert lines("painting") == [2, 5]  # "paints" on line 1, "paint" on line 4
    assert lines("drink") == [1, 3]  # the title, and line 2
    assert lines("咖啡") == [3]  # by its CJK pair
    assert lines("the") == []  # a stop word
    conn.execute("update memory_private.records set summary = 'Bob paints\nNothing else' "
                 "where record_id = %s", (rec,))
    assert lines("painting") == [2] and lines("daily") == []


def test_the_lines_a_query_finds_are_numbered_as_in_the_summary(
        conn: psycopg.Connection) -> None:
    # found_lines folds each summary whole and searches its folded lines: line n of the
    # folded summary is line n of the summary.
    u = live_request_and_message(conn)
    rec = make_record(conn, "ws1", "h1", [u], title="Trips",
                      summary="ÉTÉ in Σάμος\nNothing here\n\nPlans for the ÉTÉ trip [m1]\nÉté")

    def found(q: str) -> list[int]:
        return [n for _, n in conn.execute(
            "select r.record_id, l.line_no from memory_private.records r "
            "cross join lateral memory_private.found_lines(r.summary, memory_private.fold(%s)) l "
            "where r.record_id = %s order by 2", (q, rec)).fetchall()]

    assert found("été") == [1, 4, 5]
    assert found("Σάμος") == [1]
    assert found("absent") == []
    for q in ("été", "ΣΆΜΟΣ", "nothing", "É", "e", "ÉTÉ TRIP [M1]"):
        # the same lines as folding each line apart
        apart = conn.execute(
            "select l.n::integer from memory_private.records r "
            "cross join lateral string_to_table(r.summary, e'\\n') with ordinality l(line, n) "
            "where r.record_id = %s and strpos(lower(l.line), lower(%s)) > 0 order by 1",
            (rec, q)).fetchall()
        assert found(q) == [n for (n,) in apart], q


def test_the_folding_is_lower_in_the_databases_collation(conn: psycopg.Connection) -> None:
    # memory_private.fold computes ASCII text byte by byte; every text folds as lower() does.
    # This database takes that path (UTF-8, ASCII capitals fold to small letters):
    assert conn.execute("select current_setting('server_encoding'), "
                        "lower('ABCDEFGHIJKLMNOPQRSTUVWXYZ')").fetchone() == (
        "UTF8", "abcdefghijklmnopqrstuvwxyz")
    texts = ["Kubernetes UPGRADE", "ABCDEFGHIJKLMNOPQRSTUVWXYZ @[`{ 0-9 \t\n~", "", "ÉTÉ",
             "Mixed ASCII and Ωμέγα", "Kelvin \u212a, dotted \u0130", "咖啡 and TEA", "ß STRASSE",
             "line one [M1]\nLINE TWO [m2]"]
    rows = conn.execute("select t, memory_private.fold(t) = lower(t), memory_private.fold(t) "
                        "from unnest(%s::text[]) t", (texts,)).fetchall()
    assert [r[1] for r in rows] == [True] * len(texts), rows
    assert rows[0][2] == "kubernetes upgrade"
    assert conn.execute("select memory_private.fold(null)").fetchone() == (None,)
