"""The bot never confirms what it did not store, and finishes what an outage interrupted (issue 40).

A real PostgreSQL that refuses writes (the database read-only, a statement cancelled by
``statement_timeout``, a fault injected into one update's store) or goes away (its connections
terminated, new ones refused) and comes back, under the bot running against the fake Bot API:

- an update whose store is refused is not confirmed (polling: the offset stays; webhook: 500),
  is delivered again and is stored once the database takes writes, with a log line for each
  refusal; an update the database refuses alone is given up after five refusals, named in an
  error line, confirmed, and its sender told;
- a request whose answer met an outage is finished once the database is back, with its spend
  and its answer, also by the next run of the bot, and its conversation becomes a memory; an
  end the database judges bad (not a refusal) is logged, not kept for ever.

(A forward with only the legacy ``forward_from``/``forward_date`` fields is a forward:
test_telegram_outage.py runs its forward tests with both kinds.)

Nothing waits for time: each step waits for what the bot did (a log line, a call to the fake
Bot API, a row)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from pyworker.client import MemoryClient
from pyworker.contrib.telegram.outbox import Outbox, RequestEnd, SentAnswer
from pyworker.contrib.telegram.redelivery import GIVE_UP_AFTER
from pyworker.logs import LOGGER
from tests.fake_chat import say
from tests.fake_telegram import JsonDict
from tests.telegram_world import CALL_COST, World, telegram_world

pytestmark = pytest.mark.no_citus(
    "it makes the database refuse writes and go away by altering it, terminating its sessions "
    "and a trigger on messages: on a cluster the workspace's statements run on its worker node, "
    "which the coordinator's database settings do not reach, and Citus takes no trigger on a "
    "distributed table (the bot's handling does not depend on the engine)")

ALICE_WS = "tg:user:101"
SORRY = "Sorry, I could not answer this time."


class Events(logging.Handler):
    """The bot's log lines (``pyworker.logs.event``), as (event, fields), for the test to wait
    for and read."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.seen.append((record.getMessage(), dict(getattr(record, "fields", {}))))
            self.cond.notify_all()

    def named(self, name: str, **fields: Any) -> list[dict[str, Any]]:
        with self.cond:
            return [f for n, f in self.seen if n == name
                    and all(f.get(k) == v for k, v in fields.items())]

    def wait(self, name: str, count: int = 1, timeout: float = 60, **fields: Any) -> None:
        with self.cond:
            done = self.cond.wait_for(lambda: len(self.named(name, **fields)) >= count,
                                      timeout)
        assert done, f"no {count} {name} {fields}; seen: {[n for n, _ in self.seen][-30:]}"


@pytest.fixture
def logged() -> Iterator[Events]:
    handler, level = Events(), LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)


@pytest.fixture
def client(db_dsn: str) -> Iterator[MemoryClient]:
    """The bot's client, named as the bot names its own (the tests end its sessions by name);
    a lost database is reported after 2 s rather than the default 10."""
    c = MemoryClient(db_dsn, max_size=8, timeout=2, application_name="pimem-telegram",
                     statement_timeout_ms=1000)
    try:
        yield c
    finally:
        c.close()


class Database:
    """What happens to the bot's database, done as its superuser (on the test's own clone)."""

    def __init__(self, dsn: str) -> None:
        self.name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        # From another database: a session cannot disallow connections to its own.
        self.admin = psycopg.connect(psycopg.conninfo.make_conninfo(dsn, dbname="postgres"),
                                     autocommit=True)

    def end_bot_sessions(self) -> None:
        """Terminates the bot's connections (the bot's pool opens new ones)."""
        self.admin.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                           "where datname = %s and application_name = 'pimem-telegram'",
                           (self.name,))

    def read_only(self, on: bool) -> None:
        """New sessions read-only (or not); the bot's sessions end, so its new ones are."""
        action = "set default_transaction_read_only = on" if on \
            else "reset default_transaction_read_only"
        self.admin.execute(f'alter database "{self.name}" {action}'.encode())
        self.end_bot_sessions()

    def away(self) -> None:
        """The database goes away: the bot's sessions end and it cannot open new ones."""
        self.admin.execute(f'alter database "{self.name}" allow_connections false'.encode())
        self.end_bot_sessions()

    def back(self) -> None:
        self.admin.execute(f'alter database "{self.name}" allow_connections true'.encode())

    def close(self) -> None:
        self.back()
        self.admin.execute(f'alter database "{self.name}" reset all'.encode())
        self.admin.close()


@pytest.fixture
def database(db_dsn: str) -> Iterator[Database]:
    db = Database(db_dsn)
    try:
        yield db
    finally:
        db.close()


def stored(world: World, text_like: str) -> list[dict[str, Any]]:
    return world.rows("select message_id, request_id, role, body from memory_private.messages "
                      "where workspace_id = %s and body like %s order by created_at",
                      ALICE_WS, text_like)


def request(world: World, request_id: str) -> dict[str, Any]:
    [row] = world.rows("select status, spent_usd from memory_private.requests "
                       "where workspace_id = %s and request_id = %s", ALICE_WS, request_id)
    return row


def wait_for(ready: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Until ``ready()`` (read from the database, which the bot writes to on its own)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Updates the database refuses -------------------------------------------------------------------

def test_polling_a_message_the_read_only_database_refuses_waits_unconfirmed_until_it_takes_writes(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, database: Database,
        logged: Events) -> None:
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")
        tg.wait(lambda: "getUpdates" in tg.methods(), 30, "polling")
        database.read_only(True)
        tg.message(tg.private(alice), alice, "my locker is number 12")
        update_id = tg.updates[-1]["update_id"]
        # Refused again and again, each time with a log line; every write is refused (the probe
        # too), so the update is not given up however often: it waits for the database.
        logged.wait("update_not_stored", GIVE_UP_AFTER + 2, update_id=update_id,
                    database="refuses writes")
        refused = logged.named("update_not_stored", update_id=update_id,
                               database="refuses writes")
        assert all("read-only transaction" in r["error"] and r["kind"] == "message"
                   for r in refused)
        assert logged.named("update_given_up") == []
        assert tg.confirmed <= update_id, "a refused update is never confirmed"
        assert tg.sent == [], "no Sorry: the message is not lost, it comes again"
        assert stored(world, "%locker%") == []

        database.read_only(False)
        tg.wait(lambda: tg.confirmed > update_id, 60, "the update confirmed")
        wait_for(lambda: request(world, "101:1")["status"] == "succeeded", "the answer")
        assert [(r["message_id"], r["role"]) for r in stored(world, "%locker%")] == [
            ("101:1", "user"), ("101:2", "assistant")]
        assert request(world, "101:1") == {"status": "succeeded", "spent_usd": CALL_COST}
        assert [m["text"] for m in tg.sent] == ["You said: my locker is number 12"]
        assert len(world.chat.requests) == 1, "answered once"


def test_an_edit_that_removes_a_secret_is_not_confirmed_until_the_memory_has_it(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, database: Database,
        logged: Events) -> None:
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")
        secret = world.say(tg.private(alice), alice, "the vault code is 9931")
        wait_for(lambda: request(world, "101:1")["status"] == "succeeded", "the answer")
        database.read_only(True)
        tg.edit(secret, "the vault code is (removed)")
        update_id = tg.updates[-1]["update_id"]
        logged.wait("update_not_stored", 3, update_id=update_id, kind="edited_message",
                    database="refuses writes")
        assert tg.confirmed <= update_id
        assert [r["body"] for r in stored(world, "the vault code%")] == [
            "the vault code is 9931"], "the memory still has the secret: not confirmed"

        database.read_only(False)
        tg.wait(lambda: tg.confirmed > update_id, 60, "the edit confirmed")
        assert [r["body"] for r in stored(world, "the vault code%")] == [
            "the vault code is (removed)"]
        assert logged.named("edit_reported", message_id="101:1")[0]["outcome"] == "updated"


def test_webhook_a_message_whose_store_times_out_is_answered_500_until_the_lock_is_gone(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, logged: Events) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/tg/hook"
    headers = {"X-Telegram-Bot-Api-Secret-Token": "hook-secret_1"}
    with telegram_world(conn, db_dsn, memory=client, mode="webhook", webhook_url=url,
                        webhook_port=port, webhook_secret="hook-secret_1") as world:
        tg = world.tg
        tg.wait(lambda: tg.webhook is not None, 30, "setWebhook")
        alice = tg.user(101, "Alice", "alice")
        dm = tg.private(alice)
        tg.message(dm, alice, "hello")
        assert httpx.post(url, json=tg.updates[-1], headers=headers, timeout=30).is_success
        tg.wait_sent(1)
        wait_for(lambda: request(world, "101:1")["status"] == "succeeded", "the first answer")
        # A long transaction holds Alice's workspace: every store there waits for it until
        # the bot's statement_timeout cancels it.
        with psycopg.connect(db_dsn) as holder:
            holder.execute("select 1 from memory_private.workspaces where workspace_id = %s "
                           "for update", (ALICE_WS,))
            locker = tg.message(dm, alice, "my locker is number 12")
            update = tg.updates[-1]
            for attempt in (1, 2):  # Telegram's deliveries
                refused = httpx.post(url, json=update, headers=headers, timeout=30)
                assert refused.status_code >= 500, "Telegram delivers it again"
                [line] = logged.named("update_not_stored", update_id=update["update_id"],
                                      attempt=attempt)
                assert "statement timeout" in line["error"]
                assert line["database"] == "refuses writes", "the probe waited on the lock too"
            assert len(tg.sent) == 1 and stored(world, "%locker%") == []
            holder.rollback()
        again = httpx.post(url, json=update, headers=headers, timeout=30)
        assert again.status_code == 200
        wait_for(lambda: request(world, f"101:{locker['message_id']}")["status"]
                 == "succeeded", "the answer")
        assert [r["role"] for r in stored(world, "%locker%")] == ["user", "assistant"]
        assert tg.sent[-1]["text"] == "You said: my locker is number 12"


POISON = """
create function public.injected_fault() returns trigger language plpgsql as $$
begin
  raise exception 'injected fault' using errcode = 'XX000';
end $$;
create trigger injected_fault before insert on memory_private.messages
  for each row when (new.body like '%poison%') execute function public.injected_fault();
"""


def test_an_update_the_database_refuses_alone_is_given_up_after_five_refusals(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, logged: Events) -> None:
    conn.execute(POISON.encode())
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")
        dm = tg.private(alice)
        poison = tg.message(dm, alice, "this one is poison")
        behind = tg.message(dm, alice, "and this one comes after it")
        world.deliver(tg.updates[-1])
        update_id = tg.updates[-2]["update_id"]
        # Refused five times while the database took the probe's writes: this update alone.
        refusals = logged.named("update_not_stored", update_id=update_id)
        assert [r["database"] for r in refusals] == ["takes other writes"] * (GIVE_UP_AFTER - 1)
        assert all("injected fault" in r["error"] for r in refusals)
        [given_up] = logged.named("update_given_up")
        assert (given_up["update_id"], given_up["attempt"], given_up["workspace_id"]) == (
            update_id, GIVE_UP_AFTER, ALICE_WS)
        assert given_up["what"] == f"message 101:{poison['message_id']}"
        # Confirmed, its sender told, its request ended; the update behind it was answered.
        tg.wait(lambda: tg.confirmed > update_id, 30, "the given-up update confirmed")
        tg.wait_sent(2)
        assert [m["text"] for m in tg.sent] == [SORRY, "You said: and this one comes after it"]
        assert request(world, f"101:{poison['message_id']}") == {"status": "failed",
                                                                  "spent_usd": 0}
        assert request(world, f"101:{behind['message_id']}")["status"] == "succeeded"
        assert stored(world, "%poison%") == []


# A request whose answer met an outage -----------------------------------------------------------

def test_an_answer_sent_as_the_database_went_away_is_stored_and_its_request_finished_once_it_is_back(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, database: Database,
        logged: Events) -> None:
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")
        dm = tg.private(alice)

        def away_once_sent(sent: JsonDict) -> None:
            tg.on_send = None
            database.away()

        tg.on_send = away_once_sent
        first = tg.message(dm, alice, "I prefer tea to coffee")
        request_id = f"101:{first['message_id']}"
        logged.wait("request_end_kept", request_id=request_id)
        # The answer reached Alice; the database has neither it nor the request's end yet.
        assert [m["text"] for m in tg.sent] == ["You said: I prefer tea to coffee"]
        assert request(world, request_id) == {"status": "running", "spent_usd": 0}
        # A message while the database is away: not confirmed, delivered again.
        tg.message(dm, alice, "and green tea best")
        update_id = tg.updates[-1]["update_id"]
        logged.wait("update_not_stored", 2, update_id=update_id, database="away")
        assert tg.confirmed <= update_id

        database.back()  # the bot's pool connects again after its back-off (up to 30 s here)
        wait_for(lambda: request(world, request_id)["status"] == "succeeded", "the request end",
                 timeout=120)
        assert request(world, request_id) == {"status": "succeeded", "spent_usd": CALL_COST}
        assert [r["role"] for r in stored(world, "%prefer tea%")] == ["user", "assistant"]
        tg.wait_sent(2, timeout=60)
        assert [m["text"] for m in tg.sent] == ["You said: I prefer tea to coffee",
                                                "You said: and green tea best"]
        assert world.make_memories() >= 2, "the conversations became memories"
        index = world.value("select index_text from memory_private.scope_indexes "
                            "where workspace_id = %s", ALICE_WS)
        assert "I prefer tea to coffee" in index


def test_the_spend_of_an_answer_the_outage_failed_is_reported_by_the_next_run_of_the_bot(
        conn: psycopg.Connection, db_dsn: str, client: MemoryClient, database: Database,
        logged: Events) -> None:
    with telegram_world(conn, db_dsn, memory=client) as world:
        tg = world.tg
        alice = tg.user(101, "Alice", "alice")

        def outage_during_the_model_call(body: JsonDict) -> JsonDict:
            database.away()
            return say("an answer the bot cannot cite for")

        world.chat.responder = outage_during_the_model_call
        msg = tg.message(tg.private(alice), alice, "what do you know about tea?")
        request_id = f"101:{msg['message_id']}"
        tg.wait_sent(1)
        assert tg.sent[-1]["text"] == SORRY
        logged.wait("request_end_kept", request_id=request_id, status="failed")
        world.bot.stop()  # the bot stops while the database is away: the end is in its file
        [state] = list(world.bot.settings.state_dir.iterdir())
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600
        with sqlite3.connect(state) as kept:
            assert kept.execute("select request_id from request_ends").fetchall() == [
                (request_id,)]
        assert request(world, request_id) == {"status": "running", "spent_usd": 0}

        database.back()
        world.restart_bot()
        logged.wait("telegram_started", 2)
        wait_for(lambda: request(world, request_id)["status"] == "failed", "the request end")
        assert request(world, request_id) == {"status": "failed", "spent_usd": CALL_COST}
        [started] = logged.named("telegram_started", request_ends_kept=1)
        assert started["state"] == str(state)
        with sqlite3.connect(state) as kept:
            assert kept.execute("select count(*) from request_ends").fetchone() == (0,)


def test_a_request_end_the_memory_judges_bad_is_logged_not_kept(
        conn: psycopg.Connection, db_dsn: str, tmp_path: Path, logged: Events) -> None:
    """Only the database's refusals are kept for later: an end it judges bad (our MB errors)
    would fail the same way for ever, so it is logged and dropped; an answer it refuses leaves
    the request failed, with its spend (a conversation without its answer is no memory)."""
    with MemoryClient(db_dsn) as memory:
        memory.upsert_workspace(ALICE_WS, 1, "10")
        memory.upsert_member(ALICE_WS, "101", "owner")
        memory.upsert_bot(ALICE_WS, "telegram", "tg:1")
        memory.upsert_chat(ALICE_WS, "101", "private", "101")
        memory.upsert_request(ALICE_WS, "101:1", bot_id="telegram", chat_id="101", topic_id=0,
                              user_id="101", kind="interactive", status="running",
                              model_provider="fake", model_id="m", budget_usd="0.50")
        outbox = Outbox(memory, tmp_path / "state" / "telegram-1.sqlite3")
        assert outbox.open() == 0
        assert stat.S_IMODE(os.stat(outbox.path.parent).st_mode) == 0o700

        asyncio.run(outbox.settle(RequestEnd(workspace_id=ALICE_WS, request_id="101:404",
                                             status="failed", spent_usd=Decimal("0.01"))))
        [refused] = logged.named("request_end_refused")
        assert refused["request_id"] == "101:404" and "NotFound" in refused["error"]
        too_long = SentAnswer(message_id="101:2", speaker_id="telegram", text="x" * 70_000)
        asyncio.run(outbox.settle(RequestEnd(workspace_id=ALICE_WS, request_id="101:1",
                                             status="succeeded", spent_usd=CALL_COST,
                                             answer=too_long)))
        assert "TooLarge" in logged.named("answer_not_stored")[0]["error"]
        assert len(outbox) == 0 and outbox.open() == 0, "nothing kept"
    assert conn.execute("select status, spent_usd from memory_private.requests "
                        "where workspace_id = %s and request_id = '101:1'",
                        (ALICE_WS,)).fetchone() == ("failed", CALL_COST)
