"""Scope resolution: private, group topic, topic 0, scheduled (V2-V5)."""

from __future__ import annotations

import psycopg

from tests.factory import World


def resolve(conn: psycopg.Connection, ws: str, request: str) -> tuple[object, ...]:
    row = conn.execute("select * from memory.resolve_scope(%s, %s)", (ws, request)).fetchone()
    assert row is not None
    return tuple(row)


def test_a_private_request_resolves_to_bot_chat_and_user(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    kind, scope_id, bot, chat, user, topic = resolve(conn, "ws1", "r1")
    assert (kind, bot, chat, user, topic) == ("private", "bot1", "dm-alice", "alice", None)
    # Another request of the same user, another thread, same scope; another bot, another scope.
    w.request("ws1", "r2", chat="dm-alice", user="alice", thread="t2")
    assert resolve(conn, "ws1", "r2")[1] == scope_id
    w.bot("ws1", "bot2")
    w.request("ws1", "r3", chat="dm-alice", user="alice", bot="bot2")
    assert resolve(conn, "ws1", "r3")[1] != scope_id


def test_a_private_chat_with_topics_is_one_scope_across_them(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.topic("ws1", "dm-alice", 5)
    w.request("ws1", "r1", chat="dm-alice", user="alice", topic=0)
    w.request("ws1", "r2", chat="dm-alice", user="alice", topic=5)
    assert resolve(conn, "ws1", "r1")[1] == resolve(conn, "ws1", "r2")[1]


def test_group_topics_are_separate_scopes_and_topic_zero_is_one(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "g0a", chat="grp", user="alice", topic=0)
    w.request("ws1", "g0b", chat="grp", user="bob", topic=0)
    w.request("ws1", "g7", chat="grp", user="bob", topic=7)
    a, b, c = (resolve(conn, "ws1", r) for r in ("g0a", "g0b", "g7"))
    assert a[0] == "shared" and a[5] == 0 and a[4] is None
    assert a[1] == b[1], "participants of one topic share its scope"
    assert c[1] != a[1] and c[5] == 7


def test_scheduled_requests_resolve_to_no_scope(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "s1", chat="dm-alice", user="alice", kind="scheduled")
    assert resolve(conn, "ws1", "s1") == ("none", None, None, None, None, None)
    assert conn.execute("select count(*) from memory_private.scopes").fetchone() == (0,)


def test_the_same_ids_in_two_workspaces_are_two_scopes(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic("ws1")
    w.basic("ws2")
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.request("ws2", "r1", chat="dm-alice", user="alice")
    assert resolve(conn, "ws1", "r1")[1] != resolve(conn, "ws2", "r1")[1]
