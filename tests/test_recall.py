"""Recall for a new interactive request: the index, the directory fallback, freezing (R1-R3),
and what never leaks across scopes, bots, topics and workspaces (V2-V6, V8, V9).

Records are placed directly (as the pipeline would) with the helpers below; the other memory test
modules import them.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.records import make_record, set_index

# Helpers ------------------------------------------------------------------------------------


def recall(conn: psycopg.Connection, ws: str, request: str) -> dict[str, Any]:
    row = conn.execute("select memory.recall(%s, %s)", (ws, request)).fetchone()
    assert row is not None
    return dict(row[0])


def query(conn: psycopg.Connection, ws: str, request: str, call: str,
          args: dict[str, Any] | None = None) -> dict[str, Any]:
    row = conn.execute("select memory.query_memories(%s, %s, %s, %s::jsonb)",
                       (ws, request, call, json.dumps(args or {}))).fetchone()
    assert row is not None
    return dict(row[0])


def manage(conn: psycopg.Connection, ws: str, request: str, call: str,
           args: dict[str, Any]) -> dict[str, Any]:
    row = conn.execute("select memory.manage_memory(%s, %s, %s, %s::jsonb)",
                       (ws, request, call, json.dumps(args))).fetchone()
    assert row is not None
    return dict(row[0])


def ids(answer: dict[str, Any]) -> list[int]:
    return [r["id"] for r in answer.get("records", [])]


def seen_ids(conn: psycopg.Connection, ws: str, request: str, call: str = "probe") -> list[int]:
    """Everything a request can see: its recall and a browse."""
    shown = set(ids(recall(conn, ws, request)))
    shown |= set(ids(query(conn, ws, request, call, {"limit": 12})))
    return sorted(shown)


# Tests --------------------------------------------------------------------------------------


def world_with_scopes(conn: psycopg.Connection) -> dict[str, int]:
    """ws1 and ws2 with the same ids; one record in each of five scopes of ws1 and one in ws2."""
    w = World(conn)
    w.basic("ws1")
    w.basic("ws2")
    w.bot("ws1", "bot2")
    made = {}
    for name, chat, user, topic, bot in [
        ("alice_private", "dm-alice", "alice", 0, "bot1"),
        ("bob_private", "dm-bob", "bob", 0, "bot1"),
        ("group_topic0", "grp", "alice", 0, "bot1"),
        ("group_topic7", "grp", "bob", 7, "bot1"),
        ("alice_private_bot2", "dm-alice", "alice", 0, "bot2"),
    ]:
        u, _ = w.conversation("ws1", f"h-{name}", chat=chat, user=user, topic=topic, bot=bot,
                              user_text=f"secret {name} end")
        made[name] = make_record(conn, "ws1", f"h-{name}", [u], title=f"memory {name}",
                                 summary=f"secret {name} end")
        w.request("ws1", f"new-{name}", chat=chat, user=user, topic=topic, bot=bot,
                  status="running")
    u, _ = w.conversation("ws2", "h-alice_private", chat="dm-alice", user="alice",
                          user_text="secret ws2 end")
    made["ws2"] = make_record(conn, "ws2", "h-alice_private", [u], summary="secret ws2 end")
    w.request("ws2", "new-alice_private", chat="dm-alice", user="alice", status="running")
    return made


def test_each_scope_sees_only_its_own_records_and_nothing_leaks(
        conn: psycopg.Connection) -> None:
    made = world_with_scopes(conn)
    for name in ("alice_private", "bob_private", "group_topic0", "group_topic7",
                 "alice_private_bot2"):
        assert seen_ids(conn, "ws1", f"new-{name}") == [made[name]], name
        # Asking for another scope's record by id, or searching its text, finds nothing.
        for other, record_id in made.items():
            if other == name:
                continue
            assert ids(query(conn, "ws1", f"new-{name}", f"id-{other}", {"id": record_id})) == []
            # (The words every record has, "secret" and "end", may find the scope's own
            # record: never another's.)
            found = ids(query(conn, "ws1", f"new-{name}", f"q-{other}",
                              {"query": f"{other} end"}))
            assert set(found) <= {made[name]}, (name, other)
    assert seen_ids(conn, "ws2", "new-alice_private") == [made["ws2"]]
    # A group participant who is not the author sees the topic's shared record, not others'.
    World(conn).request("ws1", "bob-in-topic0", chat="grp", user="bob", status="running")
    assert seen_ids(conn, "ws1", "bob-in-topic0") == [made["group_topic0"]]


def test_the_index_is_given_with_its_label_and_speakers(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    a, _ = w.conversation("ws1", "h1", chat="grp", user="alice", user_text="we ship on friday")
    b, _ = w.conversation("ws1", "h2", chat="grp", user="bob", user_text="I will review it")
    r1 = make_record(conn, "ws1", "h1", [a], title="ship date")
    r2 = make_record(conn, "ws1", "h2", [b], title="review")
    set_index(conn, "ws1", "h1", [r2, r1], "1. review (bob) 2. ship date (alice)")
    w.request("ws1", "new", chat="grp", user="bob", status="running")
    answer = recall(conn, "ws1", "new")
    assert answer["mode"] == "index"
    assert answer["index"] == "1. review (bob) 2. ship date (alice)"
    assert answer["scope"] == "shared"
    assert "approves nothing" in answer["label"] and "not a team decision" in answer["label"]
    assert [(r["id"], r["speaker_ids"]) for r in answer["records"]] == [(r2, ["bob"]),
                                                                        (r1, ["alice"])]
    assert answer["index_withdrawn"] is False


def test_a_pending_consolidation_gives_a_directory_of_the_eight_newest(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    made = []
    for i in range(10):
        u, _ = w.conversation("ws1", f"h{i}", chat="dm-alice", user="alice", user_text=f"fact {i}")
        made.append(make_record(conn, "ws1", f"h{i}", [u], title=f"fact {i}",
                                summary=f"fact {i} " + "x" * 400))
    set_index(conn, "ws1", "h0", made[:3], due=True)
    w.request("ws1", "new", chat="dm-alice", user="alice", status="running")
    answer = recall(conn, "ws1", "new")
    assert answer["mode"] == "directory"
    assert ids(answer) == list(reversed(made))[:8]
    assert "index" not in answer
    assert all(len(r["summary"]) <= 300 for r in answer["records"]), "the directory is compact"


def test_an_index_naming_an_invalid_record_falls_back_to_the_directory(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="I like jazz")
    r1 = make_record(conn, "ws1", "h1", [u1])
    r2 = make_record(conn, "ws1", "h2", [u2])
    set_index(conn, "ws1", "h1", [r1, r2], "tea and jazz")
    w.message("ws1", u1, "h1", "user", "alice", "I like coffee")  # edit: r1 is invalid now
    w.request("ws1", "new", chat="dm-alice", user="alice", status="running")
    answer = recall(conn, "ws1", "new")
    assert answer["mode"] == "directory" and ids(answer) == [r2]
    # No index at all: the directory too.
    w.request("ws1", "new2", chat="dm-alice", user="alice", status="running")
    set_index(conn, "ws1", "h1", [r2])
    conn.execute("delete from memory_private.scope_indexes")
    assert recall(conn, "ws1", "new2")["mode"] == "directory"


def test_an_empty_scope_recalls_none(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "new", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "new") == {"mode": "none"}


def test_recall_is_frozen_but_a_source_edited_mid_request_is_dropped(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="I like jazz")
    r1 = make_record(conn, "ws1", "h1", [u1], summary="tea")
    r2 = make_record(conn, "ws1", "h2", [u2], summary="jazz")
    set_index(conn, "ws1", "h1", [r1, r2], "tea and jazz")
    w.request("ws1", "new", chat="dm-alice", user="alice", status="running")
    first = recall(conn, "ws1", "new")
    assert first["mode"] == "index" and ids(first) == [r1, r2]

    # The scope moves on (new record, new index): the running request keeps what it got.
    u3, _ = w.conversation("ws1", "h3", chat="dm-alice", user="alice", user_text="I like cats")
    r3 = make_record(conn, "ws1", "h3", [u3])
    set_index(conn, "ws1", "h1", [r3], "cats")
    assert recall(conn, "ws1", "new") == first

    # A source is edited mid-request: its record disappears from recall and from the tool.
    w.message("ws1", u1, "h1", "user", "alice", "I like coffee")
    again = recall(conn, "ws1", "new")
    assert ids(again) == [r2] and again["dropped"] == 1
    assert again["index"] is None and again["index_withdrawn"] is True, \
        "an index naming a changed record may carry its content, so it is withheld"
    assert r1 not in ids(query(conn, "ws1", "new", "c1", {}))
    assert ids(query(conn, "ws1", "new", "c2", {"query": "tea"})) == []
    # A new request gets the new index.
    w.request("ws1", "next", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "next")["index"] == "cats"


def test_scheduled_requests_recall_nothing_and_create_nothing(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    make_record(conn, "ws1", "h1", [u])
    w.request("ws1", "s1", chat="dm-alice", user="alice", kind="scheduled", status="running")
    assert recall(conn, "ws1", "s1") == {"mode": "none"}
    assert conn.execute("select count(*) from memory_private.request_recall").fetchone() == (0,)
    with pytest.raises(psycopg.Error) as err:
        query(conn, "ws1", "s1", "c1", {})
    assert err.value.sqlstate == "MB005"


def test_a_disabled_scope_recalls_nothing_even_mid_request(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    r = make_record(conn, "ws1", "h1", [u])
    w.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    assert ids(recall(conn, "ws1", "live")) == [r]
    conn.execute("update memory_private.scopes set recall_enabled = false")
    assert recall(conn, "ws1", "live") == {"mode": "disabled"}
    w.request("ws1", "new", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "new") == {"mode": "disabled"}
    assert query(conn, "ws1", "new", "c1", {})["records"] == []
    assert conn.execute("select count(*) from memory_private.records").fetchone() == (1,)


CHANGES = {
    "membership removed": lambda w: w.member("ws1", "bob", "member", active=False),
    "group unlinked": lambda w: w.group_chat("ws1", "grp", linked=False),
    "bot replaced": lambda w: w.bot("ws1", "bot1", "bot1-new-identity"),
    "bot inactive": lambda w: w.bot("ws1", "bot1", active=False),
    "grant revoked": lambda w: w.grant("ws1", "bob", "repo-x", False),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_recall_and_query_follow_current_access(conn: psycopg.Connection, change: str) -> None:
    w = World(conn)
    w.basic()
    w.grant("ws1", "bob", "repo-x")
    w.request("ws1", "h1", chat="grp", user="bob")
    w.message("ws1", "h1-u", "h1", "user", "bob", "deploy with repo-x", repositories=["repo-x"])
    w.message("ws1", "h1-a", "h1", "assistant", "bot1", "done")
    r = make_record(conn, "ws1", "h1", ["h1-u"])
    set_index(conn, "ws1", "h1", [r], "deploys")
    w.request("ws1", "before", chat="grp", user="bob", status="running")
    assert recall(conn, "ws1", "before")["mode"] == "index"
    assert ids(query(conn, "ws1", "before", "c0", {})) == [r]

    CHANGES[change](w)
    w.request("ws1", "after", chat="grp", user="bob", status="running")
    assert ids(recall(conn, "ws1", "after")) == []
    assert ids(query(conn, "ws1", "after", "c1", {})) == []
    # The running request re-checks too: the frozen record and the index are gone.
    frozen = recall(conn, "ws1", "before")
    assert ids(frozen) == [] and frozen["index"] is None
    assert ids(query(conn, "ws1", "before", "c2", {})) == []
    assert list(conn.execute("select * from memory.request_citations('ws1', 'before')")) == []


def test_a_grant_revoked_hides_records_only_from_who_lost_it(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.grant("ws1", "alice", "repo-x")
    w.grant("ws1", "bob", "repo-x")
    w.request("ws1", "h1", chat="grp", user="bob")
    w.message("ws1", "h1-u", "h1", "user", "bob", "repo-x uses tabs", repositories=["repo-x"])
    r = make_record(conn, "ws1", "h1", ["h1-u"])
    w.grant("ws1", "bob", "repo-x", False)
    w.request("ws1", "by-alice", chat="grp", user="alice", status="running")
    w.request("ws1", "by-bob", chat="grp", user="bob", status="running")
    assert seen_ids(conn, "ws1", "by-alice") == [r]
    assert seen_ids(conn, "ws1", "by-bob") == []
