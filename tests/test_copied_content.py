"""Provenance by content: a record depends on every batch message and every memory shown with
the batch whose content it copies, cited or not (memory_private.copied_sources, docs/retention.md
"What a record copies").

Each test commits a hostile extraction output through the job API: it copies without citing,
then the copied message is removed (or the copied memory forgotten) and the sweep runs; nothing
made from it may be left. And the rule must not fire on trivial messages or on text that shares
only common words, or dependencies would balloon."""

from __future__ import annotations

import sys
import unicodedata
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    consolidation_of,
    maintenance,
    start,
)
from tests.records import invalid_reason, record_exists, sweep

DOOR = "My door code is 4711-ZEBRA."
# Every table that keeps text made from a record's title and summary.
RECORD_TABLES = ("records", "record_texts", "record_documents", "scope_words")


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


def extract(conn: psycopg.Connection, output: dict[str, Any]) -> dict[str, Any]:
    """Runs maintenance and commits pending consolidations until the extraction job comes, then
    commits ``output`` for it (validated by the database)."""
    for _ in range(4):
        maintenance(conn, "ws1")
        job = claim(conn)
        assert job is not None
        start(conn, job)
        if job["phase"] == "consolidate":
            checkpoint(conn, job, consolidation_of(job))
            commit(conn, job)
            continue
        checkpoint(conn, job, output)
        return commit(conn, job)
    raise AssertionError("no extraction job came")


def deps(conn: psycopg.Connection, record_id: int) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(
        "select message_id, via from memory_private.record_dependencies where record_id = %s "
        "order by 1", (record_id,))]


def copied_by(conn: psycopg.Connection, record_id: int, message_id: str) -> list[str] | None:
    return value(conn, "select copied_by from memory_private.record_dependencies "  # type: ignore[no-any-return]
                       "where record_id = %s and message_id = %s", record_id, message_id)


def batch(w: World, request: str, texts: dict[str, str], *, reply: str = "Noted.") -> None:
    """alice's conversation ``request``: her messages (id -> text), then the bot's reply."""
    w.request("ws1", request, chat="dm-alice", user="alice")
    for mid, text in texts.items():
        w.message("ws1", mid, request, "user", "alice", text)
    w.message("ws1", f"{request}-a", request, "assistant", "bot1", reply)


def world(conn: psycopg.Connection) -> World:
    w = World(conn)
    w.basic()
    return w


def query(conn: psycopg.Connection, call: str, args: dict[str, Any]) -> dict[str, Any]:
    """query_memories as alice in a new request of her private chat."""
    request = f"q-{call}"
    World(conn).request("ws1", request, chat="dm-alice", user="alice", status="running")
    World(conn).message("ws1", f"{request}-u", request, "user", "alice", "what do you know?")
    return dict(value(conn, "select memory.query_memories('ws1', %s, %s, %s::jsonb)",
                      request, call, Jsonb(args)))


def rows_holding(conn: psycopg.Connection, needle: str) -> dict[str, int]:
    """How many rows of each table that keeps record text hold ``needle`` (any column)."""
    found = {}
    for table in RECORD_TABLES:
        n = value(conn, f"select count(*) from memory_private.{table} t "
                        "where strpos(lower(t::text), lower(%s)) > 0", needle)
        if n:
            found[table] = n
    return found


# The four ways a copy escaped --------------------------------------------------------------


def test_a_short_message_copied_whole_goes_with_its_source(conn: psycopg.Connection) -> None:
    """Case 1: six words, copied word for word; the summary cites only a harmless message."""
    w = world(conn)
    batch(w, "r1", {"k1": DOOR, "k2": "Please water the plants on Friday."})
    advance(conn, "31 minutes")
    result = extract(conn, {"title": "Household",
                            "summary": f"Alice asked to water the plants on Friday [k2].\n{DOOR}",
                            "source_ids": ["k2"]})
    rid = result["record_id"]
    assert deps(conn, rid) == [("k1", "copied"), ("k2", "cited")]
    assert copied_by(conn, rid, "k1") == ["message", "token"]
    assert result["copied"] == 1 and result["copied_by"]["message"] == 1
    assert set(rows_holding(conn, "4711")) == set(RECORD_TABLES)
    w.remove("ws1", "k1")
    assert invalid_reason(conn, "ws1", rid) == "source_removed"
    sweep(conn, "ws1")
    assert not record_exists(conn, "ws1", rid)
    assert query(conn, "c1", {"query": "door code"})["count"] == 0
    assert query(conn, "c2", {})["count"] == 0
    assert rows_holding(conn, "4711") == {}


@pytest.mark.parametrize("how", ["remove", "forget"])
def test_a_shown_memory_copied_without_declaring_reuse_is_reused(
        conn: psycopg.Connection, how: str) -> None:
    """Case 2: a memory shown with the batch, copied word for word (its citation included) with
    no reused_ids: its dependencies become the copy's, so removing its source or forgetting it
    takes the copy too."""
    w = world(conn)
    batch(w, "r1", {"k1": DOOR})
    advance(conn, "31 minutes")
    original_summary = "Alice's door code is 4711-ZEBRA, she told the bot on a rainy Monday [k1]."
    original = extract(conn, {"title": "Door code", "summary": original_summary,
                              "source_ids": ["k1"]})["record_id"]
    batch(w, "r2", {"n1": "Let us plan the garden for the spring."})
    advance(conn, "31 minutes")
    result = extract(conn, {"title": "Garden plans",
                            "summary": f"Alice plans the garden for spring [n1].\n"
                                       f"{original_summary}",
                            "source_ids": ["n1"]})
    copy = result["record_id"]
    job_input = value(conn, "select input from memory_private.jobs where job_id = "
                            "(select max(job_id) from memory_private.jobs where phase = 'extract')")
    assert job_input["existing"] == [original], "the original was shown with the batch"
    assert deps(conn, copy) == [("k1", "reused"), ("n1", "cited")]
    assert copied_by(conn, copy, "k1") == ["run", "token"]
    assert result["copied_memories"] == 1
    if how == "remove":
        w.remove("ws1", "k1")
        sweep(conn, "ws1")
    else:
        w.request("ws1", "f", chat="dm-alice", user="alice", status="running")
        w.message("ws1", "f-u", "f", "user", "alice", "forget my door code")
        out = value(conn, "select memory.manage_memory('ws1', 'f', 'c0', %s::jsonb)",
                    Jsonb({"action": "forget", "sourceId": "f-u", "memoryId": original}))
        assert out["status"] == "done"
        assert sorted(out["forgotten_ids"]) == sorted([original, copy])
    assert not record_exists(conn, "ws1", original) and not record_exists(conn, "ws1", copy)
    assert query(conn, "c1", {"query": "4711"})["count"] == 0
    assert rows_holding(conn, "4711") == {}


def test_a_title_repeating_eight_words_of_an_uncited_message_depends_on_it(
        conn: psycopg.Connection) -> None:
    """Case 3: the rule reads the title as well as the summary."""
    w = world(conn)
    batch(w, "r1", {"k1": "We moved the garden party to the old boathouse by the lake this year.",
                    "k2": "I like green tea in the morning."})
    advance(conn, "31 minutes")
    rid = extract(conn, {"title": "The garden party to the old boathouse by the lake",
                         "summary": "Alice likes green tea [k2].",
                         "source_ids": ["k2"]})["record_id"]
    assert ("k1", "copied") in deps(conn, rid)
    assert copied_by(conn, rid, "k1") == ["run"]
    w.remove("ws1", "k1")
    sweep(conn, "ws1")
    assert not record_exists(conn, "ws1", rid)
    assert rows_holding(conn, "boathouse") == {}


SPARE_KEY = "I keep the spare key under the blue flower pot by the back door."


def disguise(text: str, how: str) -> str:
    """``text`` with an invisible character inside every word of two letters or more, or in
    full-width letters."""
    if how == "fullwidth":
        return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)
    return " ".join(word[:1] + how + word[1:] if len(word) > 1 else word for word in text.split())


@pytest.mark.parametrize("how", ["\u200b", "\u00ad", "\u2060", "\ufeff", "\u200d\u200c",
                                 "\u2062", "\U000e0041", "fullwidth"],
                         ids=["zero-width-space", "soft-hyphen", "word-joiner", "bom",
                              "zwj-zwnj", "invisible-times", "tag", "fullwidth"])
def test_invisible_characters_inside_words_do_not_hide_a_copy(
        conn: psycopg.Connection, how: str) -> None:
    """Case 4: format characters (Unicode category Cf) inside words split them for a rule that
    reads runs of letters; full-width letters are other letters. Text is normalised first
    (NFKC, format characters removed, lower case), so the copy is found."""
    w = world(conn)
    batch(w, "r1", {"k1": SPARE_KEY, "k2": "I like green tea in the morning."})
    advance(conn, "31 minutes")
    summary = f"Alice likes green tea [k2].\n{disguise(SPARE_KEY, how)}"
    rid = extract(conn, {"title": "Tea", "summary": summary, "source_ids": ["k2"]})["record_id"]
    assert ("k1", "copied") in deps(conn, rid)
    assert copied_by(conn, rid, "k1") == ["message", "run"]
    w.remove("ws1", "k1")
    sweep(conn, "ws1")
    assert not record_exists(conn, "ws1", rid)


# Distinctive tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["4711-ZEBRA", "Tr0ub4dor&3", "alice.smith@example.org",
                                   "https://example.org/party", "deploy_key_main", "20260415"])
def test_a_distinctive_token_shared_with_an_uncited_message_makes_it_a_dependency(
        conn: psycopg.Connection, token: str) -> None:
    w = world(conn)
    batch(w, "r1", {"k1": f"By the way, the thing I mentioned is {token} so please keep that "
                          "between the two of us.",
                    "k2": "I like green tea in the morning."})
    advance(conn, "31 minutes")
    rid = extract(conn, {"title": "Tea", "summary": f"Alice likes green tea [k2]; {token}.",
                         "source_ids": ["k2"]})["record_id"]
    assert deps(conn, rid) == [("k1", "copied"), ("k2", "cited")]
    assert copied_by(conn, rid, "k1") == ["token"]


def test_which_tokens_are_distinctive(conn: psycopg.Connection) -> None:
    got = value(conn, "select memory_private.distinctive_tokens(%s)",
                "Call 4711-ZEBRA, mail Alice.Smith@Example.org, see https://x.org/a?b=1 or "
                "db_host; at 10:30 in 2026. Not: 42, e.g., well-known, U2, ok..., don't, "
                "hello, 我的密码是ＡＢ１２３４。")
    assert sorted(got) == sorted(["4711-zebra", "alice.smith@example.org",
                                  "https://x.org/a?b=1", "db_host", "10:30", "2026", "ab1234"])


# Normalisation -----------------------------------------------------------------------------


def test_normalisation_removes_every_format_character_and_folds_compatibility_forms(
        conn: psycopg.Connection) -> None:
    """Every code point of Unicode category Cf (Python's Unicode database) inside a word leaves
    the word whole; full-width letters and digits, ligatures and capitals fold to plain ones."""
    cf = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]
    assert len(cf) > 150
    words = value(conn, "select array(select array_to_string("
                        "memory_private.copy_words('do' || c || 'or'), ' ') "
                        "from unnest(%s::text[]) c)", cf)
    assert [hex(ord(c)) for c, got in zip(cf, words, strict=True) if got != "door"] == []
    assert value(conn, "select memory_private.copy_words(%s)", "Ｄｏｏｒ ＣＯＤＥ ４７１１ ﬁne") \
        == ["door", "code", "4711", "fine"]
    assert value(conn, "select memory_private.copy_words(%s)", "我喜欢Tea") == \
        ["我", "喜", "欢", "tea"]


# What does not count ------------------------------------------------------------------------


def test_trivial_messages_and_common_words_make_no_dependency(conn: psycopg.Connection) -> None:
    """Short messages ("ok", "thanks"), a message of stop words, a run of seven words, short
    numbers and common words shared with an uncited message, and a shown memory that shares
    only common words: none is copied content."""
    w = world(conn)
    batch(w, "r1", {"k1": "I usually drink green tea in the morning before work."})
    advance(conn, "31 minutes")
    shown = extract(conn, {"title": "Tea", "summary": "Alice drinks green tea in the morning [k1].",
                           "source_ids": ["k1"]})["record_id"]
    batch(w, "r2", {"t1": "ok", "t2": "Thanks!", "t3": "Sounds good.", "t4": "It is what it is.",
                    "t5": "I have 2 kids and 3 cats and a very lazy old dog at home.",
                    "t6": "The wifi password changes every Monday now.",
                    "n1": "From now on I drink coffee in the evening."})
    advance(conn, "31 minutes")
    result = extract(conn, {
        "title": "Coffee in the evening",
        "summary": "Alice drinks coffee in the evening now [n1]. She said ok, thanks; sounds "
                   "good. It is what it is. She has 2 kids and 3 cats. The wifi password "
                   "changes every Monday, she says. Alice drinks green tea no more.",
        "source_ids": ["n1"]})
    assert deps(conn, result["record_id"]) == [("n1", "cited")]
    assert result["copied"] == 0 and result["copied_memories"] == 0
    assert shown


def test_a_trivial_message_is_short_or_only_stop_words(conn: psycopg.Connection) -> None:
    trivial = [r[0] for r in conn.execute(
        "select t from unnest(%s::text[]) t "
        "where memory_private.is_trivial(memory_private.copy_words(t))",
        (["ok", "Thanks!", "ok thanks", "Sounds good.", "Thank you!", "It is what it is.",
          "好的", DOOR, "I like green tea.", "我对花生过敏了"],))]
    assert trivial == ["ok", "Thanks!", "ok thanks", "Sounds good.", "Thank you!",
                       "It is what it is.", "好的"]


STOCK = "(summary written by the assistant from the marked lines of the conversation above)"


def test_stock_phrasing_of_the_model_is_not_a_copy_of_a_shown_memory(
        conn: psycopg.Connection) -> None:
    """A phrase the model writes into every record (a label) is not content of any message.
    Once two records citing different messages hold it, it is stock phrasing: a record repeating
    it copies no shown memory. The first time, with one record to compare, it cannot be told
    from a copy."""
    w = world(conn)
    records = []
    for i, topic in enumerate(("green tea in the morning", "a walk after lunch",
                               "jazz on Sunday evenings")):
        batch(w, f"r{i}", {f"k{i}": f"I like {topic}."})
        advance(conn, "31 minutes")
        records.append(extract(conn, {"title": f"Likes {i}",
                                      "summary": f"Alice likes {topic} [k{i}].\n{STOCK}",
                                      "source_ids": [f"k{i}"]}))
    first, second, third = records
    assert deps(conn, first["record_id"]) == [("k0", "cited")]
    assert second["copied_memories"] == 1, "one record to compare: taken as a copy"
    assert deps(conn, second["record_id"]) == [("k0", "reused"), ("k1", "cited")]
    assert third["copied_memories"] == 0
    assert deps(conn, third["record_id"]) == [("k2", "cited")]
    assert value(conn, "select cardinality(memory_private.stock_runs('ws1', "
                       "(select scope_id from memory_private.records where record_id = %s), "
                       "memory_private.word_runs(memory_private.copy_words(%s))))",
                 first["record_id"], STOCK) == 6, "every run of the label's 13 words"


def test_what_the_batch_itself_says_is_no_copy_of_a_shown_memory(
        conn: psycopg.Connection) -> None:
    """People repeat themselves: words the record shares with a shown memory that its own batch
    also says come from the batch, not from the memory."""
    w = world(conn)
    batch(w, "r1", {"k1": "It has been tough but I am gonna make it somehow, 4711 times over."})
    advance(conn, "31 minutes")
    extract(conn, {"title": "Tough times",
                   "summary": "Alice: it has been tough but I am gonna make it somehow, 4711 "
                              "times over [k1].",
                   "source_ids": ["k1"]})
    batch(w, "r2", {"n1": "Again: it has been tough but I am gonna make it somehow, 4711 times."})
    advance(conn, "31 minutes")
    result = extract(conn, {"title": "Again",
                            "summary": "Alice, again: it has been tough but I am gonna make it "
                                       "somehow, 4711 times [n1].",
                            "source_ids": ["n1"]})
    assert result["copied_memories"] == 0
    assert deps(conn, result["record_id"]) == [("n1", "cited")]
