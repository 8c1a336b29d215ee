"""What the Telegram bot does with a message it cannot report, and with a forwarded one (issue 31).

- A message the bot has received is either reported to the memory or delivered again: while the
  database cannot be reached, the update is not confirmed (polling: the offset stays before it;
  webhook: the bot answers 500), and once the database is back it is stored exactly once.
- A forward is someone else's words: a forwarded "Remember that ..." is stored as the quotation
  it is, and the database refuses it as the forwarding member's direct request; so is a forward
  that carries only the legacy fields (``forward_from``, ``forward_date``).

The outage is the client's own DatabaseUnavailable (what a lost or unreachable database raises),
switched on and off by the test; nothing waits for time."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from pyworker.client import MemoryClient
from pyworker.db import DatabaseUnavailable
from tests.fake_chat import call, say, scripted_model
from tests.fake_telegram import JsonDict
from tests.telegram_world import World, telegram_world

ALICE_WS = "tg:user:101"


class OutageClient(MemoryClient):
    """The bot's client, with a database that can go away: every call raises what the real
    client raises when the database cannot be reached."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn, max_size=8, application_name="pimem-telegram")
        self.down = threading.Event()
        self.refused = 0

    def _execute(self, call: Any) -> Any:
        if self.down.is_set():
            self.refused += 1
            raise DatabaseUnavailable("the database cannot be reached (test outage)")
        return super()._execute(call)


@pytest.fixture
def client(db_dsn: str) -> Iterator[OutageClient]:
    c = OutageClient(db_dsn)
    try:
        yield c
    finally:
        c.close()


def stored(world: World, text_like: str) -> list[dict[str, Any]]:
    """The user's messages stored (the answer's is stored after it is sent: not waited for)."""
    return world.rows("select message_id, request_id, body from memory_private.messages "
                      "where workspace_id = %s and role = 'user' and body like %s", ALICE_WS,
                      text_like)


def test_polling_a_message_sent_while_the_database_is_down_is_stored_once_it_is_back(
        conn: psycopg.Connection, db_dsn: str, client: OutageClient) -> None:
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")
        tg.wait(lambda: "getUpdates" in tg.methods(), 30, "polling")
        client.down.set()
        tg.message(tg.private(alice), alice, "my locker is number 12")
        update_id = tg.updates[-1]["update_id"]
        # The bot tried, was refused, and asked Telegram again without confirming the update:
        # Telegram delivered it again and the bot tried again.
        tg.wait(lambda: client.refused >= 2, 30, "a second delivery of the update")
        assert tg.confirmed <= update_id, "an unreported update is never confirmed"
        assert tg.sent == [], "no Sorry: the message is not lost, it comes again"
        assert stored(world, "%locker%") == []
        client.down.clear()
        tg.wait_sent(1)
        tg.wait(lambda: tg.confirmed > update_id, 30, "the update confirmed")
        assert [r["message_id"] for r in stored(world, "%locker%")] == ["101:1"]
        assert world.value("select count(*) from memory_private.requests "
                           "where workspace_id = %s", ALICE_WS) == 1
        assert [m["text"] for m in tg.sent] == ["You said: my locker is number 12"]
        assert len(world.chat.requests) == 1, "answered once"


def test_webhook_a_message_posted_while_the_database_is_down_is_refused_and_stored_on_retry(
        conn: psycopg.Connection, db_dsn: str, client: OutageClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/tg/hook"
    headers = {"X-Telegram-Bot-Api-Secret-Token": "hook-secret_1"}
    with telegram_world(conn, db_dsn, memory=client, mode="webhook", webhook_url=url,
                        webhook_port=port, webhook_secret="hook-secret_1") as world:
        tg = world.tg
        tg.wait(lambda: tg.webhook is not None, 30, "setWebhook")
        alice = tg.user(101, "Alice", "alice")
        tg.message(tg.private(alice), alice, "my locker is number 12")
        update = tg.updates[-1]
        client.down.set()
        refused = httpx.post(url, json=update, headers=headers, timeout=30)
        assert refused.status_code >= 500, "Telegram retries an update answered with an error"
        assert client.refused >= 1 and tg.sent == [] and stored(world, "%locker%") == []
        client.down.clear()
        again = httpx.post(url, json=update, headers=headers, timeout=30)  # Telegram's retry
        assert again.status_code == 200
        tg.wait_sent(1)
        assert [r["message_id"] for r in stored(world, "%locker%")] == ["101:1"]
        assert [m["text"] for m in tg.sent] == ["You said: my locker is number 12"]


def obedient_to_any_remember(body: JsonDict) -> JsonDict:
    """A model that takes any "remember" it sees for a request, quoted or not."""
    user = next(m for m in body["messages"] if m["role"] == "user")
    head, _, text = user["content"].partition("\n")
    results = [m for m in body["messages"] if m["role"] == "tool"]
    if "remember" in text.lower() and not results:
        return call("manage_memory", action="remember",
                    sourceId=json.loads(head)["message_id"])
    if results:
        return say(str(results[-1]["content"]))
    return scripted_model(body)


# A forward is one whether Telegram says so with forward_origin (Bot API 7) or only with the
# legacy fields forward_from and forward_date (Bot API 6: an older local Bot API server, a bridge).
FORWARD_KINDS = pytest.mark.parametrize("legacy", [False, True], ids=["origin", "legacy"])


@FORWARD_KINDS
def test_a_forwarded_remember_is_stored_as_a_quotation_and_refused_as_a_request(
        conn: psycopg.Connection, db_dsn: str, legacy: bool) -> None:
    with telegram_world(conn, db_dsn) as world:
        tg = world.tg
        world.chat.responder = obedient_to_any_remember
        alice, bob = tg.user(101, "Alice", "alice"), tg.user(102, "Bob")
        tg.message(tg.private(alice), alice, "Remember that the door code is 4711",
                   forwarded_from=bob, legacy_forward=legacy)
        assert ("forward_origin" in tg.updates[-1]["message"]) is not legacy
        world.deliver(tg.updates[-1])
        [row] = stored(world, "%door code%")
        assert row["body"] == ("[forwarded from Bob (user 102)]\n"
                               "> Remember that the door code is 4711")
        assert world.value("select count(*) from memory_private.records "
                           "where workspace_id = %s", ALICE_WS) == 0
        assert "quot" in world.last_answer().lower()  # the database's reason, passed on
        # The same words in her own message are her request.
        tg.message(tg.private(alice), alice, "Remember that the door code is 4711")
        world.deliver(tg.updates[-1])
        assert world.value("select count(*) from memory_private.records "
                           "where workspace_id = %s", ALICE_WS) == 1


@FORWARD_KINDS
def test_a_forward_into_a_group_is_not_addressed_to_the_bot_by_its_author_s_mention(
        conn: psycopg.Connection, db_dsn: str, legacy: bool) -> None:
    with telegram_world(conn, db_dsn) as world:
        tg = world.tg
        olga, bob = tg.user(201, "Olga", "olga"), tg.user(202, "Bob")
        group = tg.group(-1001234500001, "Team")
        tg.set_member(group, olga, "creator")
        tg.set_member(group, bob, "member")
        world.deliver(tg.bot_update(group, "member", by=olga))
        tg.message(group, bob, "@memo_bot remember that I approve the budget",
                   forwarded_from=olga, legacy_forward=legacy)
        world.deliver(tg.updates[-1])
        assert tg.sent == [] and world.chat.requests == []
        assert world.value("select count(*) from memory_private.messages") == 0
