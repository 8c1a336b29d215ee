"""manage_memory: direct requests only (C1, C2), remember saves the actual message (C3), durable
on return (C4), who may do what in private and group scopes (C5-C7), disable/enable (C8),
replays (C9), forget with tombstones and overlap (T7, T8)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.records import (
    copies_differing,
    record_copy,
    scope_id,
    set_index,
    usage_rows_missing,
)
from tests.test_recall import ids, make_record, manage, query, recall

PHRASINGS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "manage_phrasings.json").read_text())


def classify(conn: psycopg.Connection, text: str) -> str | None:
    row = conn.execute("select memory_private.classify_request(%s)", (text,)).fetchone()
    assert row is not None
    return row[0]


def count(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(f"select count(*) from memory_private.{table}").fetchone()
    assert row is not None
    return int(row[0])


def turn(w: World, request: str, text: str, *, chat: str = "dm-alice", user: str = "alice",
         topic: int = 0) -> str:
    """A running request whose current human message says ``text``; returns the message id."""
    w.request("ws1", request, chat=chat, user=user, topic=topic, status="running")
    w.message("ws1", f"{request}-u", request, "user", user, text)
    return f"{request}-u"


@pytest.fixture
def w(conn: psycopg.Connection) -> World:
    world = World(conn)
    world.basic(users=("alice", "bob", "carol"))
    world.member("ws1", "dave", "admin")
    return world


# Direct requests ------------------------------------------------------------------------------


def test_the_phrasing_table_is_big_enough_and_bilingual() -> None:
    assert len(PHRASINGS) >= 40
    chinese = [p for p in PHRASINGS if any("\u4e00" <= c <= "\u9fff" for c in p["text"])]
    assert len(chinese) >= 15 and len(PHRASINGS) - len(chinese) >= 15
    assert {p["expect"] for p in PHRASINGS} == {"remember", "forget", "enable-memory",
                                                "disable-memory", None}


@pytest.mark.parametrize("case", PHRASINGS, ids=[p["text"][:40] for p in PHRASINGS])
def test_each_phrasing_is_classified(conn: psycopg.Connection, case: dict[str, Any]) -> None:
    assert classify(conn, case["text"]) == case["expect"], case.get("why")


def test_each_phrasing_is_accepted_or_refused_by_the_tool(conn: psycopg.Connection,
                                                          w: World) -> None:
    for i, case in enumerate(PHRASINGS):
        chat = f"dm-{i}"  # a private chat of its own, so toggles do not interfere
        w.private_chat("ws1", chat, "alice")
        action = case.get("attempt") or case["expect"]
        args: dict[str, Any] = {"action": action, "sourceId": f"p{i}-u"}
        if action == "forget":
            h, _ = w.conversation("ws1", f"p{i}-h", chat=chat, user="alice", user_text="old")
            args["memoryId"] = make_record(conn, "ws1", h.removesuffix("-u"), [h])
        if action == "enable-memory":
            w.request("ws1", f"p{i}-x", chat=chat, user="alice")
            conn.execute("update memory_private.scopes set recall_enabled = false "
                         "where scope_id = %s", (scope_id(conn, "ws1", f"p{i}-x"),))
        turn(w, f"p{i}", case["text"], chat=chat)
        outcome = manage(conn, "ws1", f"p{i}", f"call-{i}", args)
        expected = "done" if case["expect"] == action else "refused"
        assert outcome["status"] == expected, (case, outcome)
        if expected == "refused":
            assert outcome["code"] == "not_direct_request", (case, outcome)


def test_only_the_current_human_message_of_the_request_counts(conn: psycopg.Connection,
                                                               w: World) -> None:
    w.conversation("ws1", "earlier", chat="dm-alice", user="alice",
                   user_text="remember that I like tea")
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-old", "r1", "user", "alice", "remember that I like jazz")
    conn.execute("select memory_private.advance_clock('1 second')")
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like cats")
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "remember that you like dogs")
    refused = {
        "earlier-u": "not_current_message",   # another request's message
        "r1-old": "not_current_message",      # an older message of this request
        "r1-a": "not_human_message",          # assistant text
        "no-such": "not_current_message",     # unknown id
    }
    for i, (source, code) in enumerate(refused.items()):
        outcome = manage(conn, "ws1", "r1", f"c{i}", {"action": "remember", "sourceId": source})
        assert (outcome["status"], outcome["code"]) == ("refused", code), source
        assert outcome["reason"]
    assert count(conn, "records") == 0
    assert manage(conn, "ws1", "r1", "c9",
                  {"action": "remember", "sourceId": "r1-u"})["status"] == "done"


def test_another_speakers_message_in_a_group_request_is_not_the_requesters(
        conn: psycopg.Connection, w: World) -> None:
    w.request("ws1", "g1", chat="grp", user="alice", status="running")
    w.message("ws1", "g1-u", "g1", "user", "alice", "what do you think?")
    conn.execute("select memory_private.advance_clock('1 second')")
    w.message("ws1", "g1-bob", "g1", "user", "bob", "remember that alice approves the budget")
    outcome = manage(conn, "ws1", "g1", "c1", {"action": "remember", "sourceId": "g1-bob"})
    assert outcome["status"] == "refused" and count(conn, "records") == 0


# Remember ---------------------------------------------------------------------------------------


def test_remember_saves_the_actual_message_attributed_to_its_speaker(
        conn: psycopg.Connection, w: World) -> None:
    text = "Please remember that invoices for ACME go to finance@example.com, not to Bob"
    source = turn(w, "r1", text)
    outcome = manage(conn, "ws1", "r1", "c1", {"action": "remember", "sourceId": source})
    assert outcome["status"] == "done" and outcome["code"] == "remembered"
    note = conn.execute(
        """select kind, title, summary, speaker_ids, thread_ids, bot_identity, origin_request_id
             from memory_private.records where record_id = %s""",
        (outcome["memory_id"],)).fetchone()
    assert note == ("note", "Please remember that invoices for ACME go to…",
                    text, ["alice"], ["r1"], "bot1-identity", "r1")
    assert conn.execute(
        """select rs.message_id, rs.position, d.content_hash = m.content_hash, d.via
             from memory_private.record_sources rs
             join memory_private.record_dependencies d using (workspace_id, record_id, message_id)
             join memory_private.messages m using (workspace_id, message_id)
            where rs.record_id = %s""",
        (outcome["memory_id"],)).fetchall() == [(source, 1, True, "cited")]
    assert record_copy(conn, "ws1", outcome["memory_id"])[::2] == ([source], [source])
    assert copies_differing(conn) == 0
    assert usage_rows_missing(conn) == 0
    due = conn.execute("select consolidation_due_at from memory_private.scopes "
                       "where scope_id = %s", (scope_id(conn, "ws1", "r1"),)).fetchone()
    assert due is not None and due[0] is not None, "a note marks the scope for consolidation"
    # A later request finds it (directory, since consolidation is pending) and can query it.
    w.request("ws1", "r2", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "r2")["mode"] == "directory"
    assert ids(query(conn, "ws1", "r2", "q", {"query": "FINANCE@"})) == [outcome["memory_id"]]


def test_remember_takes_a_given_title_and_redacts_credentials(conn: psycopg.Connection,
                                                              w: World) -> None:
    source = turn(w, "r1", "remember that the deploy token is ghp_abcdefghijklmnopqrstuvwxyz0123456789")
    outcome = manage(conn, "ws1", "r1", "c1",
                     {"action": "remember", "sourceId": source, "title": "the deploy  token"})
    row = conn.execute("select title, summary from memory_private.records where record_id = %s",
                       (outcome["memory_id"],)).fetchone()
    assert row is not None
    title, summary = row
    assert title == "the deploy token"
    assert "ghp_abcdefghijklmnopqrstuvwxyz0123456789" not in summary
    # A title of what redaction took out is the redacted part: it carries no secret.
    again = turn(w, "r2", "remember the deploy token is ghp_abcdefghijklmnopqrstuvwxyz0123456789")
    outcome = manage(conn, "ws1", "r2", "c2",
                     {"action": "remember", "sourceId": again,
                      "title": "token is ghp_abcdefghijklmnopqrstuvwxyz0123456789"})
    assert outcome["status"] == "done"
    row = conn.execute("select title from memory_private.records where record_id = %s",
                       (outcome["memory_id"],)).fetchone()
    assert row is not None and "ghp_" not in row[0] and row[0].startswith("token is ")
    assert summary.startswith("remember that the deploy token is")


@pytest.mark.parametrize("title", [
    "Deploy token",                          # not letter for letter (a capital)
    "the deploy tоken",                      # a Cyrillic o
    "the deploy\u00adtoken",                # a soft hyphen
    "the pin of the safe is 4711",           # another message of the conversation
])
def test_a_note_title_that_is_not_a_part_of_the_message_is_refused(
        conn: psycopg.Connection, w: World, title: str) -> None:
    """A note carries nothing its asking message did not say: a model-supplied title that is
    not a part of the message, letter for letter, is refused and nothing is stored."""
    w.request("ws1", "r0", chat="dm-alice", user="alice")
    w.message("ws1", "r0-u", "r0", "user", "alice", "the pin of the safe is 4711")
    source = turn(w, "r1", "remember that the deploy token is ghp_abcdefghijklmnopqrstuvwxyz0123456789")
    before = count(conn, "records")
    outcome = manage(conn, "ws1", "r1", "c1",
                     {"action": "remember", "sourceId": source, "title": title})
    assert outcome["status"] == "refused" and outcome["code"] == "title_not_in_message", outcome
    assert count(conn, "records") == before
    row = conn.execute(
        "select (select count(*) from memory_private.records "
        "         where workspace_id = 'ws1' and strpos(title, '4711') > 0) "
        "     + (select count(*) from memory_private.record_texts "
        "         where workspace_id = 'ws1' and strpos(search_text, '4711') > 0)").fetchone()
    assert row == (0,)


def test_remember_twice_keeps_one_note_and_too_long_is_refused(conn: psycopg.Connection,
                                                                w: World) -> None:
    source = turn(w, "r1", "remember that I like tea")
    first = manage(conn, "ws1", "r1", "c1", {"action": "remember", "sourceId": source})
    second = manage(conn, "ws1", "r1", "c2", {"action": "remember", "sourceId": source})
    assert second["status"] == "done" and second["code"] == "already_remembered"
    assert second["memory_id"] == first["memory_id"] and count(conn, "records") == 1
    long_source = turn(w, "r2", "remember that " + "长" * 1400)  # 4,214 bytes
    outcome = manage(conn, "ws1", "r2", "c1", {"action": "remember", "sourceId": long_source})
    assert (outcome["status"], outcome["code"]) == ("refused", "too_long")
    assert count(conn, "records") == 1


def test_a_change_is_durable_when_the_call_returns_even_if_the_answer_fails(
        conn: psycopg.Connection, db_dsn: str, w: World) -> None:
    source = turn(w, "r1", "remember that I like tea")
    with psycopg.connect(db_dsn, autocommit=True) as backend:
        manage(backend, "ws1", "r1", "c1", {"action": "remember", "sourceId": source})
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="failed")
    assert count(conn, "records") == 1


# Forget -----------------------------------------------------------------------------------------


def test_forget_removes_overlapping_records_tombstones_sources_and_clears_the_index(
        conn: psycopg.Connection, w: World) -> None:
    a, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    b, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="I like jazz")
    c, _ = w.conversation("ws1", "h3", chat="dm-alice", user="alice", user_text="I like cats")
    r_a = make_record(conn, "ws1", "h1", [a], summary="tea")
    r_ab = make_record(conn, "ws1", "h2", [a, b], summary="tea and jazz")
    r_b = make_record(conn, "ws1", "h2", [b], summary="jazz")
    r_c = make_record(conn, "ws1", "h3", [c], summary="cats")
    set_index(conn, "ws1", "h1", [r_a, r_c], "tea, cats")
    w.request("ws1", "inflight", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "inflight")["index"] == "tea, cats"

    source = turn(w, "r1", "Please forget that I like tea")
    outcome = manage(conn, "ws1", "r1", "c1",
                     {"action": "forget", "sourceId": source, "memoryId": r_a})
    assert outcome["status"] == "done" and outcome["memory_id"] == r_a
    assert sorted(outcome["forgotten_ids"]) == sorted([r_a, r_ab])
    # r_b shares a source with r_ab only, not with what was forgotten: it stays.
    assert sorted(r[0] for r in conn.execute("select record_id from memory_private.records")) \
        == sorted([r_b, r_c])
    assert [r[0] for r in conn.execute("select message_id from memory_private.tombstones")] \
        == [a]
    assert conn.execute("select count(*) from memory_private.tombstones t "
                        "where t.message_id not in (select message_id "
                        "from memory_private.messages)").fetchone() == (0,)
    row = conn.execute("select i.index_text, s.consolidation_due_at from "
                       "memory_private.scopes s left join memory_private.scope_indexes i "
                       "using (workspace_id, scope_id) where s.scope_id = %s", (scope_id(conn, "ws1", "h1"),)).fetchone()
    assert row is not None
    index, due = row
    assert index is None and due is not None
    # The original chat messages are kept.
    assert conn.execute("select body from memory_private.messages where message_id = %s",
                        (a,)).fetchone() == ("I like tea",)
    # In-flight recall loses the index and the forgotten record.
    frozen = recall(conn, "ws1", "inflight")
    assert frozen["index"] is None and ids(frozen) == [r_c]
    assert conn.execute("select index_text from memory_private.request_recall "
                        "where request_id = 'inflight'").fetchone() == (None,)
    # A record built again on a forgotten source is never valid (extraction cannot restore it).
    again = make_record(conn, "ws1", "h1", [a])
    assert ids(query(conn, "ws1", "inflight", "q", {})) == [r_c, r_b]
    assert again not in ids(query(conn, "ws1", "inflight", "q2", {"id": again}))


def test_forget_refuses_what_the_user_cannot_see(conn: psycopg.Connection, w: World) -> None:
    h, _ = w.conversation("ws1", "hb", chat="dm-bob", user="bob", user_text="bob's secret")
    bobs = make_record(conn, "ws1", "hb", [h])
    hg, _ = w.conversation("ws1", "hg", chat="grp", user="alice", user_text="group thing")
    groups = make_record(conn, "ws1", "hg", [hg])
    source = turn(w, "r1", "forget that")
    for i, memory_id in enumerate([bobs, groups, 999999]):
        outcome = manage(conn, "ws1", "r1", f"c{i}",
                         {"action": "forget", "sourceId": source, "memoryId": memory_id})
        assert (outcome["status"], outcome["code"]) == ("refused", "memory_not_found")
    assert count(conn, "records") == 2 and count(conn, "tombstones") == 0


# Group rules --------------------------------------------------------------------------------------


def group_records(conn: psycopg.Connection, w: World) -> dict[str, int]:
    a, _ = w.conversation("ws1", "ga", chat="grp", user="alice", user_text="alice says A")
    b, _ = w.conversation("ws1", "gb", chat="grp", user="bob", user_text="bob says B")
    b2, b2a = w.conversation("ws1", "gb2", chat="grp", user="bob", user_text="bob says C")
    return {
        "alice": make_record(conn, "ws1", "ga", [a]),
        "bob": make_record(conn, "ws1", "gb", [b]),
        "mixed": make_record(conn, "ws1", "ga", [a, b]),
        # Bob's own, sharing nothing with the others; the bot's answer in his request is his
        # conversation too.
        "bob_alone": make_record(conn, "ws1", "gb2", [b2, b2a]),
    }


def test_a_participant_adds_an_attributed_note_and_forgets_only_their_own(
        conn: psycopg.Connection, w: World) -> None:
    made = group_records(conn, w)
    source = turn(w, "n1", "remember that I review PRs on Tuesdays", chat="grp", user="bob")
    note = manage(conn, "ws1", "n1", "c1", {"action": "remember", "sourceId": source})
    assert note["status"] == "done"
    assert conn.execute("select speaker_ids from memory_private.records where record_id = %s",
                        (note["memory_id"],)).fetchone() == (["bob"],)

    source = turn(w, "f1", "please forget that", chat="grp", user="bob")
    # Alice's record, the mixed one, and even Bob's own: forgetting his would also remove the
    # mixed record that shares his message and holds Alice's statement (T7 reaches it, so C6
    # must hold for it too).
    for i, key in enumerate(["alice", "mixed", "bob"]):
        refused = manage(conn, "ws1", "f1", f"c{i}",
                         {"action": "forget", "sourceId": source, "memoryId": made[key]})
        assert (refused["status"], refused["code"]) == ("refused", "not_allowed"), key
        assert "owner or admin" in refused["reason"] and "nothing was forgotten" in \
            refused["reason"]
        assert "alice" not in refused["reason"], "no other participant is named"
    assert count(conn, "records") == 5 and count(conn, "tombstones") == 0
    done = manage(conn, "ws1", "f1", "c9", {"action": "forget", "sourceId": source,
                                             "memoryId": made["bob_alone"]})
    assert done["status"] == "done"
    assert done["forgotten_ids"] == [made["bob_alone"]]
    assert done["forgotten_by_person"] == {"bob": 1}
    assert count(conn, "records") == 4


@pytest.mark.parametrize("who", ["alice", "dave"])  # alice is the owner, dave an admin
def test_an_owner_or_admin_forgets_others_and_mixed_records(conn: psycopg.Connection, w: World,
                                                            who: str) -> None:
    made = group_records(conn, w)
    source = turn(w, "f1", "forget the mixed memory", chat="grp", user=who)
    outcome = manage(conn, "ws1", "f1", "c1", {"action": "forget", "sourceId": source,
                                               "memoryId": made["mixed"]})
    assert outcome["status"] == "done"
    # The answer says how many records went, and whose statements they held.
    assert sorted(outcome["forgotten_ids"]) == sorted([made["alice"], made["bob"],
                                                       made["mixed"]])
    assert outcome["forgotten_by_person"] == {"alice": 2, "bob": 2}
    assert "2 related memories" in outcome["reason"] and "alice: 2, bob: 2" in outcome["reason"]
    source = turn(w, "f2", "forget bob's memory", chat="grp", user=who)
    assert manage(conn, "ws1", "f2", "c1", {"action": "forget", "sourceId": source,
                                            "memoryId": made["bob"]})["status"] == "refused", \
        "already gone with the mixed record it overlapped"
    assert count(conn, "records") == 1


def test_group_recall_toggles_need_an_owner_or_admin(conn: psycopg.Connection,
                                                     w: World) -> None:
    made = group_records(conn, w)
    source = turn(w, "t1", "turn off memory", chat="grp", user="bob")
    outcome = manage(conn, "ws1", "t1", "c1", {"action": "disable-memory", "sourceId": source})
    assert (outcome["status"], outcome["code"]) == ("refused", "not_allowed")
    assert ids(query(conn, "ws1", "t1", "q1", {})) != []
    source = turn(w, "t2", "关闭记忆", chat="grp", user="dave")
    assert manage(conn, "ws1", "t2", "c1",
                  {"action": "disable-memory", "sourceId": source})["status"] == "done"
    assert query(conn, "ws1", "t2", "q1", {})["records"] == []
    # The owner's role is what counts, not being in the group before.
    w.member("ws1", "dave", "member")
    source = turn(w, "t3", "打开记忆", chat="grp", user="dave")
    assert manage(conn, "ws1", "t3", "c1",
                  {"action": "enable-memory", "sourceId": source})["status"] == "refused"
    source = turn(w, "t4", "turn memory back on", chat="grp", user="alice")
    assert manage(conn, "ws1", "t4", "c1",
                  {"action": "enable-memory", "sourceId": source})["status"] == "done"
    assert sorted(ids(query(conn, "ws1", "t4", "q1", {}))) == sorted(made.values())


def test_inactive_members_unlinked_groups_and_inactive_bots_change_nothing(
        conn: psycopg.Connection, w: World) -> None:
    source = turn(w, "a1", "remember that we ship friday", chat="grp", user="bob")
    w.member("ws1", "bob", "member", active=False)
    assert manage(conn, "ws1", "a1", "c1",
                  {"action": "remember", "sourceId": source})["code"] == "not_allowed"
    source = turn(w, "a2", "remember that we ship friday", chat="grp", user="alice")
    w.group_chat("ws1", "grp", linked=False)
    assert manage(conn, "ws1", "a2", "c1",
                  {"action": "remember", "sourceId": source})["code"] == "not_allowed"
    source = turn(w, "a3", "remember that I like tea")
    w.bot("ws1", "bot1", active=False)
    assert manage(conn, "ws1", "a3", "c1",
                  {"action": "remember", "sourceId": source})["code"] == "not_allowed"
    assert count(conn, "records") == 0


# Private scope, disable/enable ---------------------------------------------------------------------


def test_disable_keeps_records_reads_nothing_refuses_notes_and_enable_restores(
        conn: psycopg.Connection, w: World) -> None:
    h, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    r = make_record(conn, "ws1", "h1", [h], summary="tea")
    source = turn(w, "d1", "Please turn off memory")
    outcome = manage(conn, "ws1", "d1", "c1", {"action": "disable-memory", "sourceId": source})
    assert outcome["status"] == "done" and outcome["changed"] is True
    assert count(conn, "records") == 1, "records are kept"
    w.request("ws1", "d2", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "d2") == {"mode": "disabled"}
    assert query(conn, "ws1", "d2", "q1", {})["records"] == []
    assert conn.execute("select coalesce(sum(usage_count), 0) "
                        "from memory_private.record_usage").fetchone() == (0,)
    source = turn(w, "d3", "remember that I like jazz")
    assert manage(conn, "ws1", "d3", "c1",
                  {"action": "remember", "sourceId": source})["code"] == "recall_disabled"
    assert count(conn, "records") == 1, "nothing is generated while off"
    source = turn(w, "d4", "turn off memory")
    again = manage(conn, "ws1", "d4", "c1", {"action": "disable-memory", "sourceId": source})
    assert again["status"] == "done" and again["changed"] is False
    source = turn(w, "d5", "开启记忆")
    assert manage(conn, "ws1", "d5", "c1",
                  {"action": "enable-memory", "sourceId": source})["changed"] is True
    w.request("ws1", "d6", chat="dm-alice", user="alice", status="running")
    assert ids(recall(conn, "ws1", "d6")) == [r]
    # Another user's private scope is unaffected by Alice's toggles and vice versa.
    source = turn(w, "b1", "turn off memory", chat="dm-bob", user="bob")
    manage(conn, "ws1", "b1", "c1", {"action": "disable-memory", "sourceId": source})
    w.request("ws1", "d7", chat="dm-alice", user="alice", status="running")
    assert ids(recall(conn, "ws1", "d7")) == [r]


# Replays ------------------------------------------------------------------------------------------


def test_a_replayed_remember_is_not_applied_twice(conn: psycopg.Connection, w: World) -> None:
    source = turn(w, "r1", "remember that I like tea")
    args = {"action": "remember", "sourceId": source}
    first = manage(conn, "ws1", "r1", "c1", args)
    replay = manage(conn, "ws1", "r1", "c1", args)
    assert replay["replayed"] is True and first["replayed"] is False and replay["holds"] is True
    assert {k: v for k, v in replay.items() if k not in ("replayed", "holds")} == \
        {k: v for k, v in first.items() if k != "replayed"}
    assert count(conn, "records") == 1
    # Even after the note was forgotten, the replay does not bring it back, and says so.
    conn.execute("select memory_private.forget_records('ws1', %s, %s, array[%s]::bigint[])",
                 (scope_id(conn, "ws1", "r1"), first["memory_id"], first["memory_id"]))
    later = manage(conn, "ws1", "r1", "c1", args)
    assert (later["status"], later["code"], later["holds"]) == ("done", "no_longer_holds", False)
    assert count(conn, "records") == 0
    with pytest.raises(psycopg.Error) as err:
        manage(conn, "ws1", "r1", "c1", {**args, "title": "other"})
    assert err.value.sqlstate == "MB003"


def test_a_replayed_forget_reports_the_same_and_forgets_nothing_more(
        conn: psycopg.Connection, w: World) -> None:
    a, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    r = make_record(conn, "ws1", "h1", [a])
    source = turn(w, "f1", "forget that I like tea")
    args = {"action": "forget", "sourceId": source, "memoryId": r}
    first = manage(conn, "ws1", "f1", "c1", args)
    assert first["status"] == "done"
    tombstones = count(conn, "tombstones")
    replay = manage(conn, "ws1", "f1", "c1", args)
    assert replay["status"] == "done" and replay["forgotten_ids"] == first["forgotten_ids"]
    assert count(conn, "tombstones") == tombstones


def test_a_replay_after_access_was_lost_is_refused(conn: psycopg.Connection, w: World) -> None:
    source = turn(w, "t1", "turn off memory", chat="grp", user="dave")
    args = {"action": "disable-memory", "sourceId": source}
    assert manage(conn, "ws1", "t1", "c1", args)["status"] == "done"
    w.member("ws1", "dave", "member")  # demoted
    replay = manage(conn, "ws1", "t1", "c1", args)
    assert (replay["status"], replay["code"], replay["replayed"]) == \
        ("refused", "access_lost", True)
    source = turn(w, "r1", "remember that I like tea")
    args = {"action": "remember", "sourceId": source}
    assert manage(conn, "ws1", "r1", "c1", args)["status"] == "done"
    w.member("ws1", "alice", "owner", active=False)
    assert manage(conn, "ws1", "r1", "c1", args)["code"] == "access_lost"


def test_a_refused_call_is_decided_again_on_replay(conn: psycopg.Connection, w: World) -> None:
    source = turn(w, "t1", "turn off memory", chat="grp", user="bob")
    args = {"action": "disable-memory", "sourceId": source}
    assert manage(conn, "ws1", "t1", "c1", args)["status"] == "refused"
    w.member("ws1", "bob", "admin")
    assert manage(conn, "ws1", "t1", "c1", args)["status"] == "done"


# Validation ---------------------------------------------------------------------------------------

BAD_ARGS: list[tuple[str, Any, str]] = [
    ("unknown action", {"action": "save", "sourceId": "r1-u"}, "MB001"),
    ("missing action", {"sourceId": "r1-u"}, "MB001"),
    ("missing sourceId", {"action": "remember"}, "MB001"),
    ("empty sourceId", {"action": "remember", "sourceId": ""}, "MB001"),
    ("sourceId a number", {"action": "remember", "sourceId": 5}, "MB001"),
    ("unknown key", {"action": "remember", "sourceId": "r1-u", "scope": "all"}, "MB001"),
    ("forget without memoryId", {"action": "forget", "sourceId": "r1-u"}, "MB001"),
    ("memoryId a string", {"action": "forget", "sourceId": "r1-u", "memoryId": "1"}, "MB001"),
    ("memoryId for remember", {"action": "remember", "sourceId": "r1-u", "memoryId": 1}, "MB001"),
    ("title for forget", {"action": "forget", "sourceId": "r1-u", "memoryId": 1, "title": "x"},
     "MB001"),
    ("title too long", {"action": "remember", "sourceId": "r1-u", "title": "x" * 301}, "MB004"),
    ("args an array", ["remember"], "MB001"),
]


@pytest.mark.parametrize("args,code", [(a, c) for _, a, c in BAD_ARGS],
                         ids=[n for n, _, _ in BAD_ARGS])
def test_bad_arguments_raise_and_change_nothing(conn: psycopg.Connection, w: World, args: Any,
                                                code: str) -> None:
    turn(w, "r1", "remember that I like tea")
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.manage_memory('ws1', 'r1', 'c1', %s::jsonb)",
                     (json.dumps(args),))
    assert err.value.sqlstate == code, err.value
    assert count(conn, "records") == 0 and count(conn, "tool_calls") == 0


def test_scheduled_requests_cannot_manage_memory(conn: psycopg.Connection, w: World) -> None:
    w.request("ws1", "s1", chat="dm-alice", user="alice", kind="scheduled", status="running")
    w.message("ws1", "s1-u", "s1", "user", "alice", "remember that I like tea")
    with pytest.raises(psycopg.Error) as err:
        manage(conn, "ws1", "s1", "c1", {"action": "remember", "sourceId": "s1-u"})
    assert err.value.sqlstate == "MB005"
    assert count(conn, "records") == 0 and count(conn, "scopes") == 0


# Races --------------------------------------------------------------------------------------------


def wait_until_blocked(conn: psycopg.Connection, pid: int) -> None:
    """Polls until the backend ``pid`` waits on a lock (no fixed sleep). On a Citus
    coordinator the call waits on the node holding the workspace: there, the cluster's lock
    waits (citus_lock_waits) name the blocked distributed transaction."""
    citus = conn.execute("select exists (select 1 from pg_extension where extname = 'citus')"
                         ).fetchone() == (True,)
    for _ in range(2000):
        row = conn.execute(
            "select exists (select 1 from citus_lock_waits)" if citus else
            "select wait_event_type = 'Lock' from pg_stat_activity where pid = %s",
            () if citus else (pid,)).fetchone()
        if row is not None and row[0]:
            return
        conn.execute("select pg_sleep(0.005)")
    raise AssertionError(f"backend {pid} never waited on a lock")


@pytest.mark.parametrize("tool", ["manage_memory", "query_memories"])
def test_a_call_replayed_concurrently_is_applied_and_counted_once(
        conn: psycopg.Connection, db_dsn: str, w: World, tool: str) -> None:
    h, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    r = make_record(conn, "ws1", "h1", [h])
    source = turn(w, "r1", "remember that I like jazz")
    call = (manage, {"action": "remember", "sourceId": source}) if tool == "manage_memory" \
        else (query, {})
    results: list[dict[str, Any]] = []
    with psycopg.connect(db_dsn) as first, psycopg.connect(db_dsn, autocommit=True) as second:
        results.append(call[0](first, "ws1", "r1", "c1", call[1]))  # open transaction
        pid = second.info.backend_pid
        worker = threading.Thread(
            target=lambda: results.append(call[0](second, "ws1", "r1", "c1", call[1])))
        worker.start()
        wait_until_blocked(conn, pid)
        first.commit()
        worker.join(timeout=30)
    assert [res["replayed"] for res in results] == [False, True]
    if tool == "manage_memory":
        assert count(conn, "records") == 2 and results[0]["memory_id"] == results[1]["memory_id"]
    else:
        assert conn.execute("select usage_count from memory_private.record_usage "
                            "where record_id = %s", (r,)).fetchone() == (1,)
