"""Which failures to store an update are Telegram's to deliver again, and when one is given up.

An update is confirmed to Telegram only once what it says is stored. When the database refuses
the store, the update is left unconfirmed (:class:`NotReported`: polling keeps the offset before
it, the webhook answers 500) and Telegram delivers it again. "Refused" is the database's doing,
not the update's (:func:`database_refused`): the database cannot be reached, or it answers but
does not take the write (a read-only database or transaction, a statement cancelled by
``statement_timeout``, a lock wait, any other PostgreSQL error that is not ours). An update the
database judges bad (our MB errors, a value PostgreSQL cannot hold) will never be stored: the
bot logs it and confirms it.

One update must not hold the bot for ever (polling takes updates in order), yet an outage must
not lose what users said. :class:`Redeliveries` tells the two apart: after a refusal it writes
the update's workspace facts again (the probe). When the probe is refused too, the database is
refusing everyone: the update waits for it, however long (Telegram keeps an update 24 hours).
When the probe is taken, the database refused this update alone; after :data:`GIVE_UP_AFTER`
such refusals the update is given up: an error line names it, it is confirmed, and the sender
of a message is told the bot could not answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from aiogram.types import TelegramObject, Update

from pyworker import errors
from pyworker.db import DatabaseUnavailable
from pyworker.logs import event

GIVE_UP_AFTER = 5  # refusals of one update while the database took the probe write


def database_refused(exc: BaseException) -> bool:
    """Whether a failed store is the database's doing, worth trying again: it cannot be reached
    or does not take writes now. Not our MB errors (the input is wrong) nor a value PostgreSQL
    cannot hold (class 22, a NUL in a text): storing the same update again fails the same way."""
    if isinstance(exc, DatabaseUnavailable):
        return True
    if isinstance(exc, errors.MemoryError_ | psycopg.DataError):
        return False
    return isinstance(exc, psycopg.Error)


class NotReported(Exception):
    """The database refused to store (part of) an update: it must not be confirmed, so Telegram
    delivers it again. ``workspace_id`` is where the probe writes; ``on_give_up`` is what the
    bot does when the update is given up (tell the sender, end a request left running)."""

    def __init__(self, what: str, cause: BaseException, workspace_id: str,
                 on_give_up: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(f"{what}: {type(cause).__name__}: {str(cause).strip()}")
        self.what = what
        self.cause = cause
        self.workspace_id = workspace_id
        self.on_give_up = on_give_up


@dataclass
class _Refusals:
    attempts: int = 0
    alone: int = 0  # refusals while the database took the probe: this update's own


class Redeliveries:
    """The refusals of each update not yet stored, and the verdict on each new one.
    ``takes_writes(workspace_id)`` is the probe: whether the database stores that workspace's
    facts now."""

    def __init__(self, takes_writes: Callable[[str], Awaitable[bool]],
                 give_up_after: int = GIVE_UP_AFTER) -> None:
        self.takes_writes = takes_writes
        self.give_up_after = give_up_after
        self._refused: dict[int, _Refusals] = {}

    async def handle(self, handler: Callable[[TelegramObject, dict[str, Any]], Awaitable[Any]],
                     update: TelegramObject, data: dict[str, Any]) -> Any:
        """The handler's result (a dispatcher middleware's step). An update whose report the
        database refused goes back unconfirmed (:class:`NotReported` goes on) unless it is
        given up: then it is confirmed, and its ``on_give_up`` runs."""
        if not isinstance(update, Update):
            return await handler(update, data)
        try:
            result = await handler(update, data)
        except NotReported as refused:
            if not await self.give_up(update, refused):
                raise
            if refused.on_give_up is not None:
                await refused.on_give_up()
            return None
        self.forget(update.update_id)
        return result

    async def give_up(self, update: Update, refused: NotReported) -> bool:
        """Counts a refusal of ``update`` and logs it; whether to give the update up now (the
        database refused it alone :data:`GIVE_UP_AFTER` times) rather than have it delivered
        again."""
        seen = self._refused.setdefault(update.update_id, _Refusals())
        seen.attempts += 1
        if isinstance(refused.cause, DatabaseUnavailable):
            database = "away"
        elif await self.takes_writes(refused.workspace_id):
            database = "takes other writes"
            seen.alone += 1
        else:
            database = "refuses writes"
        fields = {"update_id": update.update_id, "kind": update.event_type,
                  "attempt": seen.attempts, "error": str(refused)}
        if seen.alone >= self.give_up_after:
            del self._refused[update.update_id]
            event("update_given_up", logging.ERROR, workspace_id=refused.workspace_id,
                  what=refused.what, refused_alone=seen.alone, **fields)
            return True
        event("update_not_stored", logging.WARNING, database=database, **fields)
        return False

    def forget(self, update_id: int) -> None:
        """The update was stored (or needs nothing stored): its refusals no longer count."""
        self._refused.pop(update_id, None)


def longer(wait: float, bounds: tuple[float, float]) -> float:
    """The next wait before trying again: doubling, within ``bounds`` (first, most)."""
    return min(max(wait * 2, bounds[0]), bounds[1])
