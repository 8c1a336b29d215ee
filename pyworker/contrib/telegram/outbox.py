"""The end of each answered request: its status, its spend and the answer sent, reported to the
memory even when the database went away while the bot was answering.

What a request's end reports exists only in the bot until the database has it: the model's spend
and the text Telegram has already shown the user. The database cannot be asked for what it never
received, so the bot keeps it: :meth:`Outbox.settle` reports a :class:`RequestEnd` at once, and
when the database refuses it (:func:`~pyworker.contrib.telegram.redelivery.database_refused`),
keeps it in a SQLite file and reports it once the database takes writes again
(:meth:`Outbox.keep_retrying`, also after a restart of the bot: :meth:`Outbox.open` reads what
an earlier run kept). Reporting again is harmless: the answer's ``upsert_message`` and
``finish_request`` answer ``unchanged`` for what they already have.

The file holds answer texts until they are reported: it is created readable by its owner only,
and SQLite's ``secure_delete`` overwrites a reported entry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pyworker import errors
from pyworker.client import MemoryClient
from pyworker.contrib.telegram.redelivery import database_refused, longer
from pyworker.logs import event

MICRODOLLAR = Decimal("0.000001")


class SentAnswer(BaseModel):
    """The answer Telegram showed the user, to store as the request's assistant message."""

    model_config = ConfigDict(frozen=True)

    message_id: str
    speaker_id: str
    text: str
    retain_until: datetime | None = None  # the configured retention; the memory's own
    # boundary (answer_retention_boundary) is asked when the answer is stored


class RequestEnd(BaseModel):
    """How a request ended: ``succeeded`` with the answer sent, or ``failed``; its spend."""

    model_config = ConfigDict(frozen=True)

    workspace_id: str
    request_id: str
    status: Literal["succeeded", "failed"]
    spent_usd: Decimal
    answer: SentAnswer | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.workspace_id, self.request_id


def _earliest(*moments: datetime | None) -> datetime | None:
    known = [m for m in moments if m is not None]
    return min(known) if known else None


def report(memory: MemoryClient, end: RequestEnd) -> None:
    """Reports ``end``: the answer stored (with the earlier of the memory's retention boundary
    and the configured one), then the request finished with its spend. Raises what the database
    refused (to try again); our errors are logged and end the report (trying again would fail
    the same way). An answer the memory refuses (MB) leaves the request ``failed``: a
    conversation without its answer is no memory."""
    ws, request_id = end.key
    status = end.status
    try:
        if end.answer is not None and status == "succeeded":
            answer = end.answer
            try:
                boundary = memory.answer_retention_boundary(ws, request_id)
                memory.upsert_message(ws, answer.message_id, request_id, "assistant",
                                      answer.speaker_id, answer.text, directed=True,
                                      retain_until=_earliest(boundary, answer.retain_until))
            except errors.MemoryError_ as exc:
                event("answer_not_stored", logging.WARNING, workspace_id=ws,
                      request_id=request_id, error=f"{type(exc).__name__}: {exc}")
                status = "failed"
        memory.finish_request(ws, request_id, status, end.spent_usd.quantize(MICRODOLLAR))
    except errors.MemoryError_ as exc:  # an unknown request, one that ended otherwise: final
        event("request_end_refused", logging.ERROR, workspace_id=ws, request_id=request_id,
              status=status, spent_usd=str(end.spent_usd),
              error=f"{type(exc).__name__}: {exc}")
        return
    event("request_ended", workspace_id=ws, request_id=request_id, status=status,
          spent_usd=str(end.spent_usd))


class Outbox:
    """The request ends the database has not taken yet, kept in ``path`` (SQLite) until it
    does. Thread-safe."""

    def __init__(self, memory: MemoryClient, path: Path) -> None:
        self.memory = memory
        self.path = path
        self._kept: dict[tuple[str, str], RequestEnd] = {}
        self._lock = threading.Lock()  # _kept and the file
        self._retrying = threading.Lock()  # one retry pass at a time
        self._more = asyncio.Event()  # an end was kept

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    @contextmanager
    def _file(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30)) as db, db:
            db.execute("pragma secure_delete = on")
            yield db

    def open(self) -> int:
        """Creates the file (its directory too; both for the owner only) or reads what an
        earlier run kept; how many request ends wait to be reported. OSError or sqlite3.Error
        when the file cannot be made or read."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(self.path, 0o600)  # SQLite gives its journal the file's mode
        with self._file() as db:
            db.execute("create table if not exists request_ends (workspace_id text not null, "
                       "request_id text not null, body text not null, "
                       "primary key (workspace_id, request_id))")
            rows = db.execute("select body from request_ends order by rowid").fetchall()
        with self._lock:
            for (body,) in rows:
                end = RequestEnd.model_validate_json(body)
                self._kept[end.key] = end
            return len(self._kept)

    def _keep(self, end: RequestEnd) -> None:
        with self._lock:
            self._kept[end.key] = end
            try:
                with self._file() as db:
                    db.execute("insert or replace into request_ends values (?, ?, ?)",
                               (*end.key, end.model_dump_json()))
            except sqlite3.Error as exc:  # kept in memory: reported if the bot runs on
                event("request_end_not_saved", logging.ERROR, path=str(self.path),
                      workspace_id=end.workspace_id, request_id=end.request_id,
                      error=f"{type(exc).__name__}: {exc}")

    def _done(self, end: RequestEnd) -> None:
        with self._lock:
            self._kept.pop(end.key, None)
            with suppress(sqlite3.Error), self._file() as db:
                db.execute("delete from request_ends where workspace_id = ? and request_id = ?",
                           end.key)

    def _settle(self, end: RequestEnd) -> bool:
        try:
            report(self.memory, end)
        except Exception as exc:
            if not database_refused(exc):
                raise
            event("request_end_kept", logging.WARNING, workspace_id=end.workspace_id,
                  request_id=end.request_id, status=end.status, spent_usd=str(end.spent_usd),
                  error=f"{type(exc).__name__}: {str(exc).strip()}")
            self._keep(end)
            return False
        return True

    async def settle(self, end: RequestEnd) -> None:
        """Reports ``end`` now; when the database refuses it, keeps it to report later."""
        if not await asyncio.to_thread(self._settle, end):
            self._more.set()

    def retry(self, stopping: Callable[[], bool] = lambda: False) -> int:
        """Reports the kept ends, oldest first, until the database refuses one (or
        ``stopping()``); how many are left."""
        if not self._retrying.acquire(blocking=False):
            return len(self)
        try:
            with self._lock:
                waiting = list(self._kept.values())
            for end in waiting:
                if stopping():
                    break
                try:
                    report(self.memory, end)
                except Exception as exc:  # noqa: BLE001 - logged; the end stays kept
                    error = f"{type(exc).__name__}: {str(exc).strip()}"
                    if database_refused(exc):
                        event("request_ends_wait", logging.WARNING, kept=len(self),
                              error=error)
                        break
                    event("request_end_failed", logging.ERROR, workspace_id=end.workspace_id,
                          request_id=end.request_id, error=error)
                    continue
                self._done(end)
            return len(self)
        finally:
            self._retrying.release()

    async def keep_retrying(self, stopped: asyncio.Event,
                            seconds: tuple[float, float]) -> None:
        """Until ``stopped``: reports what is kept, waiting ``seconds[0]`` doubling to
        ``seconds[1]`` while the database refuses."""
        wait = 0.0
        while not stopped.is_set():
            if not len(self):
                self._more.clear()
                waiting = asyncio.ensure_future(self._more.wait())
                await _first(waiting, stopped)
                continue
            wait = longer(wait, seconds)
            with suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait)
            if not stopped.is_set() and not await asyncio.to_thread(self.retry,
                                                                    stopped.is_set):
                wait = 0.0


async def _first(waiting: asyncio.Future[Any], stopped: asyncio.Event) -> None:
    """Until ``waiting`` is done or ``stopped`` is set."""
    other = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({waiting, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, other):
            task.cancel()
