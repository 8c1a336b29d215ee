"""Polling: getUpdates, with the offset moved past an update only once it is reported.

aiogram's own polling confirms every update, whatever its handler did. Here each update is fed
to the dispatcher before the next is taken, and the next call's offset moves past it only once
its handler returned: an update whose report the database refused
(:class:`~pyworker.contrib.telegram.redelivery.NotReported`) is left unconfirmed, with those after
it, and Telegram delivers them again after a wait (``retry_seconds[0]`` doubling to
``retry_seconds[1]``). A handler's bug is logged and the update confirmed, as aiogram does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from contextlib import suppress
from typing import TypeVar

from aiogram import Bot, Dispatcher
from aiogram.methods import GetUpdates

from pyworker.contrib.telegram.redelivery import NotReported, longer
from pyworker.logs import event

T = TypeVar("T")


async def poll(bot: Bot, dispatcher: Dispatcher, stopped: asyncio.Event, *, timeout: int,
               retry_seconds: tuple[float, float]) -> None:
    """getUpdates (long polls of ``timeout`` seconds) until ``stopped``."""
    allowed = dispatcher.resolve_used_update_types()
    offset: int | None = None
    wait = 0.0
    while not stopped.is_set():
        if wait:
            with suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), wait)
            if stopped.is_set():
                break
        try:
            updates = await until_stopped(stopped, bot(
                GetUpdates(offset=offset, timeout=timeout, allowed_updates=allowed),
                request_timeout=int((bot.session.timeout or 0) + timeout)))
        except Exception as exc:  # noqa: BLE001 - Telegram unreachable: try again later
            wait = longer(wait, retry_seconds)
            event("updates_not_fetched", logging.WARNING, retry_s=wait,
                  error=f"{type(exc).__name__}: {exc}")
            continue
        if updates is None:
            break
        wait = 0.0
        for update in updates:
            try:
                await dispatcher.feed_update(bot, update)
            except NotReported:  # logged by the bot's Redeliveries
                wait = longer(wait, retry_seconds)
                break  # this one and those after it stay unconfirmed: delivered again
            except Exception as exc:  # noqa: BLE001 - a bug: confirmed, as aiogram does
                event("update_failed", logging.ERROR, update_id=update.update_id,
                      error=f"{type(exc).__name__}: {exc}")
            offset = update.update_id + 1
    if offset is not None:  # Telegram learns the offset from the next call: confirm now
        with suppress(Exception):
            await bot(GetUpdates(offset=offset, timeout=0, limit=1))


async def until_stopped(stopped: asyncio.Event, call: Awaitable[T]) -> T | None:
    """The call's result, or None when ``stopped`` came first (the call is cancelled)."""
    task = asyncio.ensure_future(call)
    stopping = asyncio.create_task(stopped.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()

