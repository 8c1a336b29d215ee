"""The world of the Telegram bot's tests: the fake Bot API, the fake chat model, the fake
extraction model, a real database, the real worker, and the bot running in-process (its own
event loop in a thread, as ``pimem telegram`` runs it) until the test ends."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pyworker.adapters.openai_compat import OpenAIAdapter, Price, load_prices
from pyworker.client import MemoryClient
from pyworker.contrib.telegram.bot import MemoryBot
from pyworker.contrib.telegram.config import Settings
from pyworker.payload import ModelRef
from pyworker.testing import FakeModel
from pyworker.worker import Worker, WorkerConfig
from tests.fake_chat import FakeChat
from tests.fake_telegram import FakeTelegram, JsonDict

PRICES = '{"fake/m": {"input": 3, "output": 15}}'
# One chat call: 1,000 input tokens at $3/M + 50 output tokens at $15/M.
CALL_COST = Decimal("0.00375")


def settings_for(tg: FakeTelegram, chat: FakeChat, dsn: str, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "token": tg.token, "dsn": dsn, "api_base": tg.url, "model": ModelRef(provider="fake",
                                                                              id="m"),
        "model_url": chat.url, "model_key": "test-key", "price": Price(Decimal(3), Decimal(15)),
        "polling_timeout": 1}
    values.update(changes)
    return Settings(**values)


# The waits before trying the database or Telegram again (the bot's: 0.5 s doubling to 30 s), short
# so that a test does not wait long for the next try once the database is back.
RETRY_SECONDS = (0.05, 1.0)


class RunningBot:
    """The bot on its own event loop in a thread; :meth:`wait_handled` follows its updates."""

    def __init__(self, settings: Settings, memory: MemoryClient | None = None) -> None:
        self.settings = settings
        self.memory = memory
        self.handled: set[int] = set()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.bot: MemoryBot | None = None
        self.thread = threading.Thread(target=self._main, daemon=True, name="telegram-bot")
        self.thread.start()
        assert self._ready.wait(30), "the bot did not start"
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        async def main() -> None:
            self.bot = MemoryBot(self.settings, memory=self.memory)
            self.bot.on_update_handled = self._handled
            self.bot.retry_seconds = RETRY_SECONDS
            self._ready.set()
            await self.bot.run(handle_signals=False)

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self._ready.set()
            with self._cond:
                self._cond.notify_all()
            self.loop.close()

    def _handled(self, update: Any) -> None:
        with self._cond:
            self.handled.add(update.update_id)
            self._cond.notify_all()

    def wait_handled(self, update_id: int, timeout: float = 30.0) -> None:
        with self._cond:
            done = self._cond.wait_for(
                lambda: update_id in self.handled or not self.thread.is_alive(), timeout)
        if self.error is not None:
            raise AssertionError(f"the bot died: {self.error!r}") from self.error
        assert done and update_id in self.handled, f"update {update_id} was not handled"

    def stop(self) -> None:
        if self.thread.is_alive() and self.bot is not None:
            asyncio.run_coroutine_threadsafe(self.bot.stop(), self.loop).result(10)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the bot did not stop"
        if self.error is not None:
            raise self.error


@dataclass
class World:
    conn: psycopg.Connection
    dsn: str
    tg: FakeTelegram
    chat: FakeChat
    extractor: FakeModel
    bot: RunningBot
    worker_runs: list[int] = field(default_factory=list)

    def deliver(self, update: JsonDict) -> JsonDict:
        """Waits until the bot handled the update; returns it."""
        self.bot.wait_handled(int(update["update_id"]))
        return update

    def say(self, chat: JsonDict, sender: JsonDict, text: str, **kw: Any) -> JsonDict:
        """A message from ``sender``, handled; returns the message."""
        msg = self.tg.message(chat, sender, text, **kw)
        self.deliver(self.tg.updates[-1])
        return msg

    def restart_bot(self) -> None:
        """Stops the bot and starts it again, with the same settings and state directory, as
        ``pimem telegram`` restarted by systemd: a new process, with a client of its own."""
        old = self.bot
        old.stop()
        self.bot = RunningBot(old.settings)

    def last_answer(self) -> str:
        return str(self.tg.sent[-1]["text"])

    def memory_given(self, index: int = -1) -> JsonDict:
        """The recall answer the chat model got beside the conversation (of its last call)."""
        content = self.chat.requests[index]["messages"][1]["content"]
        return dict(json.loads(content.split("\n", 1)[1]))

    def make_memories(self) -> int:
        """The idle window passes and the real worker runs until no job is left."""
        self.conn.execute("select memory_private.advance_clock('31 minutes')")
        adapter = OpenAIAdapter(base_url=self.extractor.url, api_key="test",
                                prices=load_prices(PRICES))
        worker = Worker(WorkerConfig(dsn=self.dsn, interval=60.0), adapter)
        worker.run(until_idle=True)
        self.worker_runs.append(worker.jobs_done)
        return worker.jobs_done

    def rows(self, query: str, *args: Any) -> list[dict[str, Any]]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            found = cur.execute(query.encode(), args)  # type: ignore[call-overload]
            return list(found.fetchall())

    def value(self, query: str, *args: Any) -> Any:
        row = self.conn.execute(query.encode(), args).fetchone()  # type: ignore[call-overload]
        return None if row is None else row[0]


@contextmanager
def telegram_world(conn: psycopg.Connection, dsn: str, *, memory: MemoryClient | None = None,
                   **settings: Any) -> Iterator[World]:
    """The world; ``memory`` replaces the bot's own client (the caller closes it). The bot keeps
    its state (``state_dir``) in a temporary directory unless the caller names one."""
    with FakeTelegram() as tg, FakeChat() as chat, FakeModel() as extractor, \
            tempfile.TemporaryDirectory(prefix="pimem-tg-") as state:
        settings.setdefault("state_dir", Path(state))
        bot = RunningBot(settings_for(tg, chat, dsn, **settings), memory)
        world = World(conn, dsn, tg, chat, extractor, bot)
        try:
            yield world
        finally:
            world.bot.stop()
