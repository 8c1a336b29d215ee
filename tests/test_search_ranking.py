"""How query_memories ranks a whole question (sql/48_search.sql, issue 42): rare words outrank
common ones, a speaker the question names is preferred in the line's speaker (and is not
content), a summary's labels, citations and notes are not searched, the light stemmer keeps
derived words apart, the best line's sources come first; and every id list of an answer is
bounded, with an overflow marker."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.records import make_record
from tests.test_recall import query


@pytest.fixture
def w(conn: psycopg.Connection) -> World:
    """Alice's private chat with a running request "live" that searches."""
    world = World(conn)
    world.basic()
    world.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    return world


def add(conn: psycopg.Connection, w: World, key: str, title: str, summary: str,
        speakers: list[str] | None = None, cited: int = 1) -> tuple[int, list[str]]:
    """A record citing ``cited`` messages of its own (m-<key>-1 ...), in the summary's terms."""
    sources = []
    for i in range(1, cited + 1):
        u, _ = w.conversation("ws1", f"h-{key}-{i}", chat="dm-alice", user="alice",
                              user_text=f"{key} {i}")
        sources.append(u)
    rid = make_record(conn, "ws1", f"h-{key}-1", sources, title=title, summary=summary,
                      speakers=speakers)
    return rid, sources


def found(answer: dict[str, Any]) -> list[tuple[int, str | None]]:
    return [(r["id"], r["match"]) for r in answer["records"]]


def test_a_rare_word_outranks_a_common_one(conn: psycopg.Connection, w: World) -> None:
    violin, _ = add(conn, w, "v", "Music", "Melanie took a violin lesson")  # the oldest
    gardens = [add(conn, w, f"g{i}", "Weekend", f"a walk in the garden, part {i}")[0]
               for i in range(3)]
    answer = query(conn, "ws1", "live", "q1", {"query": "Did she play the violin in the garden?"})
    # "violin" is in one record of four, "garden" in three: the older record holding the rare
    # word comes first, then the others, newest first.
    assert found(answer) == [(violin, "words"), *[(g, "words") for g in reversed(gardens)]]


def test_a_speaker_named_in_the_question_is_preferred_and_is_not_content(
        conn: psycopg.Connection, w: World) -> None:
    # Both records hold "trip" once and both titles name both speakers; the line in bob's
    # record is bob's. Without the preference the newer (alice's) would come first.
    bobs, _ = add(conn, w, "b", "alice and bob: travel",
                  "- fact: bob: the trip to Rome was long [h-b-1-u]", ["alice", "bob"])
    alices, _ = add(conn, w, "a", "alice and bob: travel",
                    "- fact: alice: the trip to Oslo, said to bob [h-a-1-u]", ["alice", "bob"])
    answer = query(conn, "ws1", "live", "q1", {"query": "What did Bob say about the trip?"})
    assert found(answer) == [(bobs, "words"), (alices, "words")]
    answer = query(conn, "ws1", "live", "q2", {"query": "What did Alice say about the trip?"})
    assert found(answer) == [(alices, "words"), (bobs, "words")]
    # The name alone is a speaker, not a word of the records: a record that only names bob in
    # its title (no line of his) is not found by it.
    other, _ = add(conn, w, "o", "bob", "- fact: alice: nothing else [h-o-1-u]", ["alice"])
    assert other not in [i for i, _ in found(
        query(conn, "ws1", "live", "q3", {"query": "What did Bob say about the trip?"}))]


def test_labels_citations_and_notes_are_not_searched(conn: psycopg.Connection, w: World) -> None:
    rec, _ = add(conn, w, "l", "Groceries",
                 "- open item: alice: buy milk [h-l-1-u]\n"
                 "(offline heuristic summary: sentences picked by patterns)")
    doc = conn.execute("select document::text from memory_private.record_documents "
                       "where record_id = %s", (rec,)).fetchone()
    assert doc is not None
    for scaffold in ("'open'", "'item'", "'h-l-1-u'", "'heurist", "'pattern"):
        assert scaffold not in doc[0], doc
    assert "'milk':2" in doc[0] and "'@alice':2" in doc[0]  # line 1 of the summary is position 2
    # "items" is no literal substring; its stem is in no document and no word is like it.
    assert found(query(conn, "ws1", "live", "q1", {"query": "open items?"})) == []
    assert found(query(conn, "ws1", "live", "q2", {"query": "heuristics patterns"})) == []
    assert found(query(conn, "ws1", "live", "q3", {"query": "Who buys milk?"})) == [
        (rec, "words")]


def test_stemming_keeps_inflections_together_and_derived_words_apart(
        conn: psycopg.Connection, w: World) -> None:
    stems = dict(conn.execute(
        "select x, memory_private.word_stem(x) from unnest(%s::text[]) x",
        (["paints", "painted", "painting", "painter", "organization", "organized",
          "organizes", "families", "running", "2024"],)).fetchall())
    assert {stems["paints"], stems["painted"], stems["painting"]} == {"paint"}
    assert stems["painter"] == "painter" and stems["organization"] == "organization"
    assert stems["organized"] == stems["organizes"] != stems["organization"]
    assert stems["families"] == "famili" and stems["running"] == "run" and stems["2024"] == "2024"
    club, _ = add(conn, w, "c", "Club", "the organization of the chess club")
    party, _ = add(conn, w, "p", "Party", "we organized a party")
    answer = found(query(conn, "ws1", "live", "q1", {"query": "who organizes parties"}))
    assert answer[0] == (party, "words") and (club, "words") not in answer


def test_the_sources_of_the_best_line_come_first(conn: psycopg.Connection, w: World) -> None:
    rec, src = add(conn, w, "s", "Week",
                   "- she went to the market [h-s-1-u]\n"
                   "- the market sold a rare quince [h-s-2-u]\n"
                   "- she likes the market [h-s-3-u]", cited=3)
    add(conn, w, "x", "Other", "the market again")
    answer = query(conn, "ws1", "live", "q1", {"query": "Where did she buy the quince at the market?"})
    assert found(answer)[0] == (rec, "words")
    # line 2 holds the rare word and the common one: its source first, then the others in order
    assert answer["records"][0]["source_ids"] == [src[1], src[0], src[2]]


def test_every_id_list_of_an_answer_is_bounded_with_an_overflow_marker(
        conn: psycopg.Connection, w: World) -> None:
    u, _ = w.conversation("ws1", "h-wide", chat="dm-alice", user="alice", user_text="wide")
    rid = make_record(conn, "ws1", "h-wide", [u], title="Wide", summary="a wide memory",
                      speakers=[f"s{i:02d}" for i in range(25)])
    conn.execute("update memory_private.records set thread_ids = %s "
                 "where workspace_id = 'ws1' and record_id = %s",
                 ([f"t{i:04d}" for i in range(1000)], rid))
    narrow, _ = add(conn, w, "n", "Narrow", "a narrow memory")
    answer = query(conn, "ws1", "live", "q1", {"query": "memory"})
    by_id = {r["id"]: r for r in answer["records"]}
    wide = by_id[rid]
    assert wide["speaker_ids"] == [f"s{i:02d}" for i in range(20)]
    assert (wide["speaker_count"], wide["speakers_overflow"]) == (25, 5)
    assert wide["thread_ids"] == [f"t{i:04d}" for i in range(20)]
    assert (wide["thread_count"], wide["threads_overflow"]) == (1000, 980)
    assert (wide["source_count"], wide["sources_overflow"]) == (1, 0)
    small = by_id[narrow]
    assert (small["speaker_count"], small["speakers_overflow"]) == (1, 0)
    assert small["threads_overflow"] == 0 and small["thread_count"] == len(small["thread_ids"])
    # The answer stays small: 1,000 thread ids would be about 8 KB.
    size = conn.execute("select octet_length(memory.query_memories('ws1', 'live', 'q2', "
                        "'{\"query\": \"wide\"}')::text)").fetchone()
    assert size is not None and size[0] < 2000, size
