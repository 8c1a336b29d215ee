"""Forgetting holds whatever the model writes: a record depends on everything its model call
was shown (docs/retention.md).

Each attack below once escaped a rule that guessed dependencies from what a record's text looks
like: a copy re-spelt (a homoglyph, a non-breaking hyphen, a combining mark, a phone number or a
URL written another way), cut up (seven-word runs, three-word pieces reordered, split between
title and summary or across lines), restated by earlier records, or plainly paraphrased. The
model is stateless per call: whatever it writes, it can only write what it was shown, so
removing, expiring or forgetting what it was shown takes the record along, and after the sweep
no role reads the text and no table holds it.

Then: what an invalidation took away comes back (the rest of the batch is extracted again), and
a member's memories are listed and erased with one call each."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    consolidation_of,
    maintenance,
    show_memories_with_batches,
    start,
)
from tests.test_provenance import rows_holding
from tests.test_recall import manage, query, recall

PIN = "the vault code is 4711-zebra"
PROBES = itertools.count()


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


def extract(conn: psycopg.Connection, title: str, summary: str, cited: list[str]) -> dict[str, Any]:
    """The next extraction job, committed with this output."""
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None and job["phase"] == "extract", job
    start(conn, job)
    checkpoint(conn, job, {"title": title, "summary": summary, "source_ids": cited})
    return commit(conn, job)


def consolidate_all(conn: psycopg.Connection) -> None:
    maintenance(conn, "ws1")
    while (job := claim(conn)) is not None:
        assert job["phase"] == "consolidate", job
        start(conn, job)
        checkpoint(conn, job, consolidation_of(job))
        commit(conn, job)


def readable(conn: psycopg.Connection, needle: str, *, chat: str = "dm-alice",
             user: str = "alice", request: str | None = None) -> list[str]:
    """Where the memory_backend role reads ``needle`` through the API from a new request of the
    scope: its recall and a search and a browse of query_memories."""
    request = request or f"probe-{next(PROBES)}"
    w = World(conn)
    w.request("ws1", request, chat=chat, user=user, status="running")
    w.message("ws1", f"{request}-u", request, "user", user, "what do you remember?")
    found = []
    conn.execute("set role memory_backend")
    try:
        if needle.lower() in str(recall(conn, "ws1", request)).lower():
            found.append("recall")
        for call, args in (("s", {"query": needle}), ("b", {"limit": 12})):
            if needle.lower() in str(query(conn, "ws1", request, f"{request}-{call}",
                                           args)).lower():
                found.append(f"query_memories {args}")
    finally:
        conn.execute("reset role")
    return found


def private_batch(w: World, secret: str) -> None:
    """Alice's private chat: one conversation with the secret, one harmless one after it."""
    w.conversation("ws1", "c1", chat="dm-alice", user="alice", user_text=secret, reply="noted")
    w.conversation("ws1", "c2", chat="dm-alice", user="alice",
                   user_text="I moved to Berlin last month", reply="congratulations")


@pytest.fixture
def w(conn: psycopg.Connection) -> World:
    world = World(conn)
    world.basic()
    return world


# The attacks -----------------------------------------------------------------------------------
# (the secret message, the record's title and summary, the text to look for afterwards); each
# summary cites only c2's harmless message.
PHONE = "call me on +49 151 2345 6789 after six"
URL = "the staging board is at https://board.example.org/s/7f3a9 for now"
COPIES = {
    "a homoglyph (Cyrillic o and e)": (PIN, "Vault", "the vault cоde is 4711-zеbra [c2-u]",
                                       "zеbra"),
    "a non-breaking hyphen": (PIN, "Vault", "the vault code is 4711\u2011zebra [c2-u]",
                              "4711\u2011"),
    "a combining mark inside": (PIN, "Vault", "the vault code is 47\u030111-zebra [c2-u]",
                                "\u0301"),
    "a phone number re-formatted": (PHONE, "Phone", "Alice's number: 0049-151-23456789 [c2-u]",
                                    "0049-151-23456789"),
    "a URL without its scheme": (URL, "Board", "board.example.org/s/7f3a9 is the board [c2-u]",
                                 "example.org/s/7f3a9 is"),
    "seven-word runs joined by a filler": (
        PIN, "Vault", "the vault code is 4711-zebra so it is [c2-u]", "4711-zebra so"),
    "three-word pieces in another order": (
        PIN, "Vault", "4711-zebra is it; the vault code [c2-u]", "4711-zebra is it"),
    "split between title and summary": (PIN, "the vault code is", "4711-zebra [c2-u]",
                                        "4711-zebra [c2-u]"),
    "split across lines": (PIN, "Vault", "the vault code\nis 4711-\nzebra [c2-u]",
                           "zebra [c2-u]"),
    "a paraphrase": (PIN, "Alice", ("Alice, who keeps 4 7 1 1 zebra as her vault combination, "
                     "moved to Berlin [c2-u]"), "vault combination"),
}


@pytest.mark.parametrize("how", ["removed", "expired", "forgotten"])
@pytest.mark.parametrize("attack", sorted(COPIES))
def test_a_record_restating_what_it_was_shown_goes_with_it_in_any_spelling(
        conn: psycopg.Connection, w: World, attack: str, how: str) -> None:
    secret, title, summary, needle = COPIES[attack]
    w.conversation("ws1", "c1", chat="dm-alice", user="alice", user_text=secret, reply="noted")
    if how == "expired":
        w.message("ws1", "c1-u", "c1", "user", "alice", secret,
                  retain_until=value(conn, "select memory_private.clock_now()")
                  + timedelta(days=1))
    w.conversation("ws1", "c2", chat="dm-alice", user="alice",
                   user_text="I moved to Berlin last month", reply="congratulations")
    advance(conn, "31 minutes")
    record = extract(conn, title, summary, ["c2-u"])["record_id"]
    consolidate_all(conn)
    assert value(conn, "select via from memory_private.record_dependencies "
                       "where record_id = %s and message_id = 'c1-u'", record) == "shown"
    assert readable(conn, needle, request="before"), "the copy is recalled before"
    if how == "removed":
        w.remove("ws1", "c1-u")
    elif how == "expired":
        advance(conn, "2 days")
    else:
        w.request("ws1", "f", chat="dm-alice", user="alice", status="running")
        w.message("ws1", "f-u", "f", "user", "alice", "please forget that")
        # alice forgets the record made with her secret: everything it was shown is tombstoned
        out = manage(conn, "ws1", "f", "f1", {"action": "forget", "sourceId": "f-u",
                                              "memoryId": record})
        assert out["status"] == "done", out
    maintenance(conn, "ws1")
    assert readable(conn, needle) == []
    held = rows_holding(conn, needle)
    if how == "forgotten":  # a forget keeps the original chat message (T8)
        assert held.pop("messages", 0) <= 1
    assert held == {}, "no table holds the copy after the sweep"
    if how != "forgotten":
        assert rows_holding(conn, secret) == {}, "nor the secret itself"


def test_a_fact_restated_by_earlier_records_goes_with_its_source_however_many_restate_it(
        fresh_conn: psycopg.Connection) -> None:
    """With memories shown with batches (the policy made to show two), each record that restates
    the fact inherits what the memory it was shown rests on; the fourth is no stock phrase."""
    conn = fresh_conn
    show_memories_with_batches(conn, 2)
    w = World(conn)
    w.basic()
    w.conversation("ws1", "c0", chat="dm-alice", user="alice", user_text=PIN, reply="noted")
    advance(conn, "31 minutes")
    made = [extract(conn, "Vault", "Alice: the vault code is 4711-zebra [c0-u]",
                    ["c0-u"])["record_id"]]
    for i in range(1, 5):
        consolidate_all(conn)
        w.conversation("ws1", f"c{i}", chat="dm-alice", user="alice",
                       user_text=f"what was the vault code again, take {i}?", reply="see notes")
        advance(conn, "31 minutes")
        made.append(extract(conn, "Vault", f"The vault code is 4711-zebra [c{i}-u]",
                            [f"c{i}-u"])["record_id"])
    rests = {r[0] for r in conn.execute(
        "select record_id from memory_private.record_dependencies where message_id = 'c0-u'")}
    assert rests == set(made), "every restatement rests on the message that said it"
    w.remove("ws1", "c0-u")
    maintenance(conn, "ws1")
    assert rows_holding(conn, "4711-zebra") == {}


def test_forgetting_a_memory_reaches_a_copy_of_it_in_any_spelling(
        fresh_conn: psycopg.Connection) -> None:
    conn = fresh_conn
    show_memories_with_batches(conn, 1)
    w = World(conn)
    w.basic()
    w.conversation("ws1", "c0", chat="dm-alice", user="alice", user_text=PIN, reply="noted")
    advance(conn, "31 minutes")
    original = extract(conn, "Vault", "the vault code is 4711-zebra [c0-u]",
                       ["c0-u"])["record_id"]
    consolidate_all(conn)
    w.conversation("ws1", "c1", chat="dm-alice", user="alice",
                   user_text="the vault is in the basement", reply="ok")
    advance(conn, "31 minutes")
    copy = extract(conn, "Vault", "the vаult in the basement has code 4711-zеbra [c1-u]",
                   ["c1-u"])["record_id"]
    w.request("ws1", "f", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "f-u", "f", "user", "alice", "forget the vault code")
    out = manage(conn, "ws1", "f", "f1", {"action": "forget", "sourceId": "f-u",
                                          "memoryId": original})
    assert out["status"] == "done" and sorted(out["forgotten_ids"]) == sorted([original, copy])
    maintenance(conn, "ws1")
    assert rows_holding(conn, "zеbra") == {}
    assert rows_holding(conn, "4711-zebra") == {"messages": 1}, "only the original message (T8)"


def test_a_paraphrase_of_a_memory_shown_with_a_batch_goes_with_its_source(
        fresh_conn: psycopg.Connection) -> None:
    """The case no rule about text can catch: "alice works at Siemens" is shown with a new
    batch; the model writes "alice, who works at Siemens, moved to Berlin" citing only the
    Berlin message. When alice removes the Siemens message, the new memory goes too."""
    conn = fresh_conn
    show_memories_with_batches(conn, 1)
    w = World(conn)
    w.basic()
    w.conversation("ws1", "s", chat="dm-alice", user="alice", user_text="I work at Siemens",
                   reply="noted")
    advance(conn, "31 minutes")
    extract(conn, "Work", "Alice works at Siemens [s-u]", ["s-u"])
    consolidate_all(conn)
    w.conversation("ws1", "b", chat="dm-alice", user="alice",
                   user_text="I moved to Berlin for work", reply="congratulations")
    advance(conn, "31 minutes")
    moved = extract(conn, "Berlin", "Alice, who works at Siemens, moved to Berlin [b-u]",
                    ["b-u"])["record_id"]
    assert value(conn, "select via from memory_private.record_dependencies "
                       "where record_id = %s and message_id = 's-u'", moved) == "inherited"
    w.remove("ws1", "s-u")
    maintenance(conn, "ws1")
    assert readable(conn, "Siemens") == []
    assert rows_holding(conn, "Siemens") == {}


def test_a_jobs_database_cost_does_not_grow_with_what_its_text_copies(
        conn: psycopg.Connection, w: World) -> None:
    """A hostile 4,000-byte summary against a full batch: no rule compares texts any more, so the
    commit writes one row per message shown, whatever the summary holds."""
    for i in range(20):
        w.conversation("ws1", f"h{i}", chat="dm-alice", user="alice",
                       user_text=" ".join(f"word{i}x{j}" for j in range(60)), reply="ok")
    advance(conn, "31 minutes")
    hostile = " ".join(f"word{i}x{j}" for i in range(20) for j in range(0, 60, 3))[:3990]
    result = extract(conn, "All of it", hostile + " [h0-u]", ["h0-u"])
    assert result["dependencies"] == 40 and result["shown"] == 39


# What an invalidation took away comes back -------------------------------------------------------


def pending_batch(conn: psycopg.Connection) -> list[str] | None:
    row = conn.execute("select array(select s ->> 'id' from jsonb_array_elements(input -> "
                       "'sources') s order by 1) from memory_private.jobs "
                       "where phase = 'extract' and status = 'pending'").fetchone()
    return None if row is None else list(row[0])


@pytest.mark.parametrize("change", ["removed", "edited", "expired"])
def test_after_an_invalidation_the_rest_of_the_batch_is_extracted_again(
        conn: psycopg.Connection, w: World, change: str) -> None:
    private_batch(w, PIN)
    if change == "expired":
        w.message("ws1", "c1-u", "c1", "user", "alice", PIN,
                  retain_until=value(conn, "select memory_private.clock_now()")
                  + timedelta(hours=3))
    advance(conn, "31 minutes")
    gone = extract(conn, "Alice", "Alice moved to Berlin [c2-u]; her vault code is known "
                   "[c1-u]", ["c1-u", "c2-u"])["record_id"]
    consolidate_all(conn)
    calls_before = value(conn, "select count(*) from memory_private.jobs where phase = 'extract'")
    if change == "removed":
        w.remove("ws1", "c1-u")
    elif change == "edited":
        w.message("ws1", "c1-u", "c1", "user", "alice", "actually, forget the code")
    else:
        advance(conn, "3 hours")
    maintenance(conn, "ws1")
    assert value(conn, "select count(*) from memory_private.records where record_id = %s",
                 gone) == 0
    # The conversations that did not change are extracted again at once; one that changed
    # waits for its own idle window (an edit or removal is activity).
    expected_now = ["c2-a", "c2-u"]
    assert pending_batch(conn) == expected_now
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    # a conversation that lost its user message has no exchange left to extract
    expected_later = {"removed": ["c2-a", "c2-u"], "edited": ["c1-a", "c1-u", "c2-a", "c2-u"],
                      "expired": ["c2-a", "c2-u"]}[change]
    assert pending_batch(conn) == expected_later
    back = extract(conn, "Alice", "Alice moved to Berlin [c2-u]", ["c2-u"])["record_id"]
    assert back != gone
    # The cost: one more extraction (one model call) per invalidated record's batch.
    calls_after = value(conn, "select count(*) from memory_private.jobs "
                              "where phase = 'extract' and status <> 'superseded'")
    assert calls_after == calls_before + 1
    assert readable(conn, "Berlin") != []
    assert rows_holding(conn, "4711") == {} or change == "edited"


def test_a_forget_is_not_undone_by_extracting_again(conn: psycopg.Connection, w: World) -> None:
    private_batch(w, PIN)
    advance(conn, "31 minutes")
    record = extract(conn, "Alice", "Alice moved to Berlin [c2-u], code 4711-zebra [c1-u]",
                     ["c1-u", "c2-u"])["record_id"]
    w.request("ws1", "f", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "f-u", "f", "user", "alice", "forget all that")
    assert manage(conn, "ws1", "f", "f1", {"action": "forget", "sourceId": "f-u",
                                           "memoryId": record})["status"] == "done"
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    assert pending_batch(conn) is None, "everything the record was shown is tombstoned"


# A member's memories: access and erasure -------------------------------------------------------


def group_world(w: World) -> None:
    """The group topic: alice and bob each talk to the bot; alice's private chat too."""
    w.conversation("ws1", "ga", chat="grp", user="alice", user_text="alice's plan: ship Friday",
                   reply="noted, Friday")
    w.conversation("ws1", "gb", chat="grp", user="bob", user_text="bob's plan: ship Monday",
                   reply="noted, Monday")
    w.conversation("ws1", "pa", chat="dm-alice", user="alice",
                   user_text="my allergy is peanuts", reply="noted")
    w.conversation("ws1", "pb", chat="dm-bob", user="bob", user_text="I like chess",
                   reply="noted")


def extract_all(conn: psycopg.Connection) -> dict[str, int]:
    """Every pending extraction committed, citing the first message it was shown and holding the
    text of all; record ids by that first message."""
    made = {}
    maintenance(conn, "ws1")
    while (job := claim(conn)) is not None:
        start(conn, job)
        if job["phase"] == "extract":
            ids = [s["id"] for s in job["input"]["sources"]]
            texts = " ".join(s["text"] for s in job["input"]["sources"])
            checkpoint(conn, job, {"title": "Notes", "summary": f"{texts} [{ids[0]}]",
                                   "source_ids": [ids[0]]})
            made[ids[0]] = commit(conn, job)["record_id"]
        else:
            checkpoint(conn, job, consolidation_of(job))
            commit(conn, job)
        maintenance(conn, "ws1")
    return made


def test_a_members_memories_are_every_one_that_holds_their_statements(
        conn: psycopg.Connection, w: World) -> None:
    group_world(w)
    advance(conn, "31 minutes")
    made = extract_all(conn)
    group, alice_private, bob_private = made["ga-u"], made["pa-u"], made["pb-u"]
    answer = value(conn, "select memory.member_memories('ws1', 'alice')")
    assert answer["count"] == 2
    listed = {m["id"]: m for m in answer["memories"]}
    assert set(listed) == {group, alice_private}, "bob's private memory is not alice's"
    assert "alice's plan" in listed[group]["summary"]
    assert listed[group]["member_message_ids"] == ["ga-a", "ga-u"]
    assert listed[alice_private]["scope"]["kind"] == "private"
    assert all(m["hidden_because"] is None for m in answer["memories"])
    assert {m["id"] for m in value(conn, "select memory.member_memories('ws1', 'bob')"
                                   )["memories"]} == {group, bob_private}
    w.member("ws1", "alice", "member", active=False)
    hidden = value(conn, "select memory.member_memories('ws1', 'alice')")["memories"]
    assert {m["hidden_because"] for m in hidden} == {"membership"}


@pytest.mark.parametrize(("args", "code"), [
    (("ws1", None), "MB001"), (("ws1", ""), "MB001"), (("ws1", "x" * 300), "MB001"),
    (("nope", "alice"), "MB002"), (("ws1", "mallory"), "MB002"), ((None, "alice"), "MB001"),
])
def test_bad_member_requests_raise_their_code_and_change_nothing(
        conn: psycopg.Connection, w: World, args: tuple[Any, Any], code: str) -> None:
    group_world(w)
    before = value(conn, "select count(*) from memory_private.messages where body is not null")
    for function in ("member_memories", "erase_member"):
        with pytest.raises(psycopg.Error) as err:
            conn.execute(f"select memory.{function}(%s, %s)", args)
        assert err.value.sqlstate == code, function
    assert value(conn, "select count(*) from memory_private.messages "
                       "where body is not null") == before


def test_only_the_backend_and_the_operator_may_list_or_erase_a_member(
        conn: psycopg.Connection, w: World) -> None:
    group_world(w)
    for role, allowed in (("memory_backend", True), ("memory_operator", True),
                          ("memory_worker", False)):
        conn.execute(f"set role {role}")
        try:
            if allowed:
                conn.execute("select memory.member_memories('ws1', 'alice')")
            else:
                for function in ("member_memories", "erase_member"):
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        conn.execute(f"select memory.{function}('ws1', 'alice')")
        finally:
            conn.execute("reset role")


def test_erasing_a_member_leaves_nothing_they_said_and_the_others_memories_come_back(
        conn: psycopg.Connection, w: World) -> None:
    group_world(w)
    advance(conn, "31 minutes")
    made = extract_all(conn)
    # Bob asked about alice's plan and got it from memory: an answer derived from it.
    w.request("ws1", "q", chat="grp", user="bob", status="running")
    w.message("ws1", "q-u", "q", "user", "bob", "what was the plan?")
    assert "alice's plan" in str(query(conn, "ws1", "q", "q1", {"query": "plan"}))
    w.message("ws1", "q-a", "q", "assistant", "bot1", "alice's plan was Friday")
    w.call("finish_request", "ws1", "q", "succeeded")
    counts = value(conn, "select memory.erase_member('ws1', 'alice')")
    assert counts["messages_erased"] == 4 and counts["answers_erased"] == 1
    assert counts["records_deleted"] == 2, "the group record and alice's private one"
    for needle in ("alice's plan", "ship Friday", "noted, Friday", "peanuts",
                   "alice's plan was Friday"):
        assert rows_holding(conn, needle) == {}, needle
        assert readable(conn, needle, chat="grp", user="bob") == []
    assert value(conn, "select memory.member_memories('ws1', 'alice')")["count"] == 0
    assert made["pb-u"] in {m["id"] for m in value(
        conn, "select memory.member_memories('ws1', 'bob')")["memories"]}
    # Nothing comes back: the rows stay without text, and cannot be reported again.
    assert value(conn, "select count(*) from memory_private.messages where removal_reason = "
                       "'member_erased' and body is null and content_hash is null") == 4
    with pytest.raises(psycopg.Error) as err:
        w.message("ws1", "ga-u", "ga", "user", "alice", "alice's plan: ship Friday")
    assert err.value.sqlstate == "MB003"
    # Bob's own words in the group come back, without alice's.
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    assert pending_batch(conn) == ["gb-a", "gb-u"]
    again = value(conn, "select memory.erase_member('ws1', 'alice')")
    assert again["messages_erased"] == 0 and again["records_deleted"] == 0
    # A member may still talk afterwards: erasure is of what was said.
    w.conversation("ws1", "later", chat="dm-alice", user="alice", user_text="hello again")
    assert value(conn, "select body from memory_private.messages where message_id = 'later-u'"
                 ) == "hello again"
