"""Ingest: idempotent upserts keyed by the backend's ids, hashing in the database, validation."""

from __future__ import annotations

import hashlib
from decimal import Decimal

import psycopg
import pytest

from tests.factory import World


def stored_hash(conn: psycopg.Connection, ws: str, message: str) -> str | None:
    row = conn.execute(
        "select content_hash from memory_private.messages where workspace_id = %s "
        "and message_id = %s", (ws, message)).fetchone()
    return row[0] if row else None


def test_upserts_are_idempotent_and_report_what_they_did(conn: psycopg.Connection) -> None:
    w = World(conn)
    assert w.workspace("ws1") == "inserted"
    assert w.workspace("ws1") == "unchanged"
    assert w.workspace("ws1", budget=5) == "updated"
    assert w.member("ws1", "alice", "owner") == "inserted"
    assert w.member("ws1", "alice", "owner") == "unchanged"
    assert w.member("ws1", "alice", "admin") == "updated"
    assert w.bot("ws1", "bot1") == "inserted"
    assert w.bot("ws1", "bot1") == "unchanged"
    assert w.private_chat("ws1", "dm", "alice") == "inserted"
    assert w.private_chat("ws1", "dm", "alice") == "unchanged"
    assert w.group_chat("ws1", "grp") == "inserted"
    assert w.group_chat("ws1", "grp", linked=False) == "updated"
    assert w.topic("ws1", "grp", 3) == "inserted"
    assert w.topic("ws1", "grp", 3) == "unchanged"
    assert w.grant("ws1", "alice", "repo") == "inserted"
    assert w.grant("ws1", "alice", "repo") == "unchanged"
    assert w.grant("ws1", "alice", "repo", False) == "updated"
    assert w.request("ws1", "r1", chat="dm", user="alice", status="running") == "inserted"
    assert w.request("ws1", "r1", chat="dm", user="alice", status="running") == "unchanged"
    assert w.request("ws1", "r1", chat="dm", user="alice") == "updated"
    assert w.message("ws1", "m1", "r1", "user", "alice", "hi") == "inserted"
    assert w.message("ws1", "m1", "r1", "user", "alice", "hi") == "unchanged"
    counts = conn.execute(
        "select (select count(*) from memory_private.workspaces),"
        " (select count(*) from memory_private.messages),"
        " (select count(*) from memory_private.topics)").fetchone()
    assert counts == (1, 1, 3)  # topics: dm/0, grp/0, grp/3


def test_the_database_computes_the_hash_and_an_edit_changes_it(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "m1", "r1", "user", "alice", "I like green tea 🍵")
    first = stored_hash(conn, "ws1", "m1")
    assert first == hashlib.sha256("I like green tea 🍵".encode()).hexdigest()
    assert w.message("ws1", "m1", "r1", "user", "alice", "I like black tea") == "updated"
    second = stored_hash(conn, "ws1", "m1")
    assert second == hashlib.sha256(b"I like black tea").hexdigest() and second != first
    edited = conn.execute("select edited_at is not null from memory_private.messages "
                          "where message_id = 'm1'").fetchone()
    assert edited == (True,)


def test_removal_erases_text_and_hash_and_is_idempotent(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    assert w.remove("ws1", "r1-u") == "updated"
    assert w.remove("ws1", "r1-u") == "unchanged"
    row = conn.execute("select body, content_hash, removed_at is not null "
                       "from memory_private.messages where message_id = 'r1-u'").fetchone()
    assert row == (None, None, True)
    with pytest.raises(psycopg.Error) as err:
        w.message("ws1", "r1-u", "r1", "user", "alice", "back again")
    assert err.value.sqlstate == "MB003"


def test_group_messages_not_directed_at_the_bot_are_never_stored(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "g1", chat="grp", user="bob")
    assert w.message("ws1", "chatter", "g1", "user", "bob", "lunch?", directed=False) == "ignored"
    assert w.message("ws1", "asked", "g1", "user", "bob", "@bot help", directed=True) == "inserted"
    ids = [r[0] for r in conn.execute("select message_id from memory_private.messages")]
    assert ids == ["asked"]


@pytest.mark.parametrize(
    ("call", "args", "code"),
    [
        ("upsert_workspace", ("", 1, 1, 0, 30), "MB001"),
        ("upsert_workspace", ("w\n", 1, 1, 0, 30), "MB001"),
        ("upsert_workspace", ("x" * 201, 1, 1, 0, 30), "MB001"),
        ("upsert_workspace", ("w", -1, 1, 0, 30), "MB001"),
        ("upsert_workspace", ("w", 1, -5, 0, 30), "MB001"),
        ("upsert_workspace", ("w", 1, 1, 0, -1), "MB001"),
        ("upsert_member", ("nope", "u", "member", True), "MB002"),
        ("upsert_member", ("ws1", "u", "king", True), "MB001"),
        ("upsert_member", ("ws1", "u", "member", None), "MB001"),
        ("upsert_bot", ("ws1", "b", "", True), "MB001"),
        ("upsert_chat", ("ws1", "c", "private", None, True), "MB001"),
        ("upsert_chat", ("ws1", "c", "group", "alice", True), "MB001"),
        ("upsert_chat", ("ws1", "c", "channel", None, True), "MB001"),
        ("upsert_chat", ("ws1", "dm-alice", "group", None, True), "MB003"),
        ("upsert_chat", ("ws1", "dm-alice", "private", "bob", True), "MB003"),
        ("upsert_topic", ("ws1", "nochat", 1, None), "MB002"),
        ("upsert_topic", ("ws1", "grp", -1, None), "MB001"),
        ("upsert_request", ("ws1", "r", "bot1", "grp", 99, "bob", "interactive", "succeeded",
                            "p", "m", 1, 0, None), "MB002"),
        ("upsert_request", ("ws1", "r", "ghost", "grp", 0, "bob", "interactive", "succeeded",
                            "p", "m", 1, 0, None), "MB002"),
        ("upsert_request", ("ws1", "r", "bot1", "grp", 0, "bob", "batch", "succeeded",
                            "p", "m", 1, 0, None), "MB001"),
        ("upsert_request", ("ws1", "r", "bot1", "grp", 0, "bob", "interactive", "done",
                            "p", "m", 1, 0, None), "MB001"),
        ("upsert_request", ("ws1", "r", "bot1", "dm-alice", 0, "bob", "interactive",
                            "succeeded", "p", "m", 1, 0, None), "MB003"),
        ("upsert_message", ("ws1", "m", "nope", "user", "alice", "x", True, None, []), "MB002"),
        ("upsert_message", ("ws1", "m", "r0", "system", "alice", "x", True, None, []), "MB001"),
        ("upsert_message", ("ws1", "m", "r0", "user", "alice", None, True, None, []), "MB001"),
        ("upsert_message", ("ws1", "m", "r0", "user", "alice", "é" * 32001, True, None, []),
         "MB004"),
        ("upsert_message", ("ws1", "m", "r0", "user", "alice", "x", True, None, [""]), "MB001"),
        ("remove_message", ("ws1", "nope"), "MB002"),
        ("finish_request", ("ws1", "nope", "succeeded", None), "MB002"),
        ("finish_request", ("nowhere", "r0", "succeeded", None), "MB002"),
        ("finish_request", ("ws1", "", "succeeded", None), "MB001"),
        ("finish_request", ("ws1", "r0", "done", None), "MB001"),
        ("finish_request", ("ws1", "r0", None, None), "MB001"),
        ("finish_request", ("ws1", "r0", "succeeded", -1), "MB001"),
        ("finish_request", ("ws1", "r0", "failed", None), "MB003"),
    ],
)
def test_bad_input_gets_a_coded_error_and_changes_nothing(
    conn: psycopg.Connection, call: str, args: tuple[object, ...], code: str
) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r0", chat="dm-alice", user="alice")
    before = conn.execute("select (select count(*) from memory_private.messages),"
                          " (select count(*) from memory_private.requests),"
                          " (select count(*) from memory_private.chats),"
                          " (select count(*) from memory_private.workspaces)").fetchone()
    with pytest.raises(psycopg.Error) as err:
        w.call(call, *args)
    assert err.value.sqlstate == code, err.value
    after = conn.execute("select (select count(*) from memory_private.messages),"
                         " (select count(*) from memory_private.requests),"
                         " (select count(*) from memory_private.chats),"
                         " (select count(*) from memory_private.workspaces)").fetchone()
    assert before == after


def test_a_finished_request_cannot_be_reopened_or_moved(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="grp", user="bob")
    for kwargs in ({"status": "running"}, {"topic": 7}, {"kind": "scheduled"}):
        with pytest.raises(psycopg.Error) as err:
            w.request("ws1", "r1", **{"chat": "grp", "user": "bob", **kwargs})  # type: ignore[arg-type]
        assert err.value.sqlstate == "MB003"


def test_finish_request_ends_a_request_without_repeating_where_it_ran(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running", spent=0.25)

    def row() -> tuple[object, ...]:
        found = conn.execute(
            "select status, spent_usd, finished_at is not null, bot_id, chat_id, user_id "
            "from memory_private.requests where workspace_id = 'ws1' and request_id = 'r1'"
        ).fetchone()
        assert found is not None
        return tuple(found)

    assert w.call("finish_request", "ws1", "r1") == "updated"
    assert row() == ("succeeded", Decimal("0.25"), True, "bot1", "dm-alice", "alice"), \
        "the default is succeeded; a spend left out keeps the spend reported before"
    assert w.call("finish_request", "ws1", "r1", "succeeded") == "unchanged"
    assert w.call("finish_request", "ws1", "r1", "succeeded", Decimal("0.4")) == "updated"
    assert row()[1] == Decimal("0.4")
    with pytest.raises(psycopg.Error) as err:
        w.call("finish_request", "ws1", "r1", "failed")
    assert err.value.sqlstate == "MB003"
    assert row()[0] == "succeeded"

    w.request("ws1", "r2", chat="dm-alice", user="alice", status="running")
    assert w.call("finish_request", "ws1", "r2", "failed", Decimal("0.01")) == "updated"
    with pytest.raises(psycopg.Error) as err:
        w.call("upsert_request", "ws1", "r2", "bot1", "dm-alice", 0, "alice", "interactive",
               "succeeded", "fake", "m", 1, 0, None)
    assert err.value.sqlstate == "MB003", "upsert_request holds the same rule"


def test_a_request_by_its_ids_fails_on_the_first_bad_part_in_order(
        conn: psycopg.Connection) -> None:
    """memory_private.known_request (every call made for a request: recall, the tools, ingest of
    its messages) looks the request up first and checks only when it finds nothing; the error
    still names the first bad part: the workspace id, the workspace, the request id, the
    request."""
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    cases = [
        (("", "r1"), "MB001", "workspace_id is required"),
        (("x" * 201, ""), "MB001", "workspace_id is longer than 200 bytes"),
        (("nope", ""), "MB002", "workspace nope is unknown"),
        (("nope", "r1"), "MB002", "workspace nope is unknown"),
        (("ws1", ""), "MB001", "request_id is required"),
        (("ws1", None), "MB001", "request_id is required"),
        (("ws1", "x" * 201), "MB001", "request_id is longer than 200 bytes"),
        (("ws1", "r2"), "MB002", "request r2 is unknown in workspace ws1"),
    ]
    for args, code, text in cases:
        with pytest.raises(psycopg.Error) as err:
            conn.execute("select memory.recall(%s, %s)", args)
        assert (err.value.sqlstate, err.value.diag.message_primary) == (code, text), args
    assert conn.execute("select memory.recall('ws1', 'r1') ->> 'mode'").fetchone() is not None
