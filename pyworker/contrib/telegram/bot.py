"""The reference Telegram bot: aiogram 3 on top of :class:`pyworker.client.MemoryClient`.

Every directed message (all of a private chat; in a group a mention, a reply to the bot or a
command) becomes one request of the memory, in this order:

1. the facts: workspace, bot identity (``getMe``), chat, topic and the sender's membership
   (``getChatMember`` in groups) are reported; the request is reported ``running`` and the
   message stored;
2. ``memory.recall`` gives what the request starts with; the chat model gets it beside the
   conversation, with the two memory tools; each tool call goes to the database with its id;
3. the answer's citations are only those ``memory.request_citations`` returns; the answer is
   sent, stored with the retention ``memory.answer_retention_boundary`` allows, and the request
   reported ``succeeded`` with its spend, or ``failed`` with the spend so far.

``/memory`` shows the recall of a request of its own (nothing is stored). ``edited_message``
re-reports the text; an edit that no longer addresses the bot removes the message from the
memory. ``my_chat_member`` keeps the group's linked state (and a private user's active flag),
``chat_member`` and the member service messages keep members and roles current. Non-directed
group traffic is dropped before anything is sent to the database (V10). A forward is reported
as a quotation (someone else's words, never a request of the member who forwarded it).

An update is confirmed to Telegram only once it is reported (step 1): when the database refuses
the report (it cannot be reached, or does not take the write) the update is left unconfirmed and
Telegram delivers it again (:mod:`~pyworker.contrib.telegram.polling`; the webhook answers 500),
within the bound of :mod:`~pyworker.contrib.telegram.redelivery`. Updates are reported one at a
time, in order; the answers (steps 2-3) run after their report, one at a time per chat and in
order, chats concurrently. A request's end (step 3) that the database refuses is kept and
reported once it takes writes again (:mod:`~pyworker.contrib.telegram.outbox`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sqlite3
import time
import weakref
from collections.abc import Awaitable, Callable
from contextlib import suppress
from datetime import datetime, timedelta
from decimal import Decimal
from importlib import resources
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit

import psycopg
from aiogram import Bot, Dispatcher, Router
from aiogram.client.session.aiohttp import AiohttpSession
from aiogram.client.telegram import PRODUCTION, TelegramAPIServer
from aiogram.enums import ChatType
from aiogram.exceptions import TelegramAPIError
from aiogram.types import Chat, ChatMemberUpdated, Message, TelegramObject, Update, User

from pyworker import errors
from pyworker.client import ManageResult, MemoryClient, Recall
from pyworker.contrib.telegram import mapping
from pyworker.contrib.telegram.chat import ChatFailure, ChatModel, function_tools
from pyworker.contrib.telegram.config import Settings, SettingsError
from pyworker.contrib.telegram.outbox import Outbox, RequestEnd, SentAnswer
from pyworker.contrib.telegram.polling import poll
from pyworker.contrib.telegram.redelivery import NotReported, Redeliveries, database_refused
from pyworker.db import DatabaseUnavailable
from pyworker.logs import event

P = ParamSpec("P")
T = TypeVar("T")

HELP = (
    "I answer with a long-term memory of this chat. In a group I answer only messages that "
    "mention me, reply to me or are commands for me; nothing else reaches my memory.\n"
    "/memory shows what I remember here.\n"
    "Ask me in words to remember something (\"remember that ...\"), to forget something "
    "(\"forget ...\"), or to turn memory off or on in this chat.")
SORRY = "Sorry, I could not answer this time."
# What can go wrong with the memory: its own coded errors, a lost database, anything else of it.
DB_ERRORS = (errors.MemoryError_, DatabaseUnavailable, psycopg.Error)
RETRY_SECONDS = (0.5, 30.0)  # the wait before the next try, doubling: first, most


FollowUp = Callable[[], Awaitable[None]]  # what a message handler leaves to do after its report


def render_recall(recall: Recall) -> str:
    """``/memory``: a recall answer for people."""
    if recall.mode == "disabled":
        return ("Memory is off in this chat: what I remembered is kept, but I neither use it nor "
                "remember anything new until memory is turned on again.")
    if recall.mode == "none" or (not recall.records and not recall.index):
        return "I remember nothing in this chat yet."
    lines = ["What I remember here (notes from earlier conversations, maybe out of date):"]
    if recall.index:
        lines += ["", recall.index]
    lines.append("")
    for record in recall.records:
        line = f"#{record.id} {record.title}"
        if recall.mode == "directory" and record.summary:
            line += f": {record.summary}"
        if recall.scope == "shared":
            line += f" (from {', '.join(record.speaker_ids)})"
        lines.append(line + f", {record.created_at:%Y-%m-%d}")
    return "\n".join(lines).strip()


class MemoryBot:
    """The bot. ``await run()`` polls (or serves the webhook) until ``await stop()``."""

    def __init__(self, settings: Settings, *, memory: MemoryClient | None = None,
                 chat: ChatModel | None = None) -> None:
        self.settings = settings
        self._owns_memory = memory is None
        self.memory = memory or MemoryClient(settings.dsn, max_size=8,
                                             application_name="pimem-telegram")
        self.chat = chat or ChatModel(base_url=settings.model_url, api_key=settings.model_key,
                                      model=settings.model, price=settings.price,
                                      max_tool_rounds=settings.max_tool_rounds,
                                      timeout=settings.model_timeout)
        api = (TelegramAPIServer.from_base(settings.api_base) if settings.api_base
               else PRODUCTION)
        self.bot = Bot(settings.token, session=AiohttpSession(api=api))
        self.dispatcher = Dispatcher()
        self.dispatcher.update.outer_middleware(self._in_order)
        router = Router(name="pimem-memory")
        router.message.register(self.on_message)
        router.edited_message.register(self.on_edited_message)
        router.my_chat_member.register(self.on_my_chat_member)
        router.chat_member.register(self.on_chat_member)
        self.dispatcher.include_router(router)
        self.tools: list[dict[str, Any]] = []  # the database's tool definitions, at run()
        self.system_template = resources.files("pyworker").joinpath(
            "prompts", "telegram.txt").read_text()
        self.on_update_handled: Callable[[Update], None] | None = None  # tests, metrics
        self.webhook_address: tuple[str, int] | None = None
        self._locks: weakref.WeakValueDictionary[int, asyncio.Lock] = (
            weakref.WeakValueDictionary())
        self._answer_locks: weakref.WeakValueDictionary[int, asyncio.Lock] = (
            weakref.WeakValueDictionary())
        self._tasks: set[asyncio.Task[None]] = set()  # answers running after their report
        self._stopped = asyncio.Event()
        self._inflight = 0  # updates being handled
        self._idle = asyncio.Event()
        self.drain_seconds = 30.0
        self.retry_seconds = RETRY_SECONDS
        self.me: User | None = None  # getMe, before the first update
        # What the database refused: updates Telegram delivers again, and request ends kept
        # (one file per Telegram bot: the id before the token's colon is the bot's user id).
        self.redeliveries = Redeliveries(self._takes_writes)
        number = settings.token.partition(":")[0]
        self.outbox = Outbox(self.memory, settings.state_dir / (
            f"telegram-{number if number.isdigit() else 'bot'}.sqlite3"))

    # Running ------------------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> None:
        """Polls, or serves the webhook, until :meth:`stop` (or SIGTERM/SIGINT); then lets the
        answers in progress finish (up to ``drain_seconds``)."""
        retrying: asyncio.Task[None] | None = None
        try:
            try:
                kept = await asyncio.to_thread(self.outbox.open)
            except (OSError, sqlite3.Error) as exc:
                raise SettingsError(f"PIMEM_TG_STATE_DIR: the bot cannot keep its state in "
                                    f"{self.outbox.path}: {exc}") from exc
            self.me = me = await self.bot.me()
            await self._db(self.memory.schema_version)
            self.tools = function_tools(await self._db(self.memory.tool_definitions))
            await asyncio.to_thread(self.outbox.retry)  # what an earlier run kept goes first
            retrying = asyncio.create_task(
                self.outbox.keep_retrying(self._stopped, self.retry_seconds))
            event("telegram_started", bot=me.username, bot_user_id=me.id,
                  mode=self.settings.mode, model=self.settings.model.qualified,
                  request_ends_kept=kept, state=str(self.outbox.path))
            if self.settings.mode == "webhook":
                await self._serve_webhook(handle_signals)
            else:
                await self.bot.delete_webhook()
                await self._poll(handle_signals)
                await self._drain()
        finally:
            if retrying is not None:
                self._stopped.set()
                await retrying
            await self.aclose()
            event("telegram_stopped", unfinished=self._inflight,
                  request_ends_kept=len(self.outbox))

    async def _drain(self) -> None:
        """Lets the updates being handled finish, up to ``drain_seconds``."""
        if self._inflight:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.drain_seconds)

    async def stop(self) -> None:
        """Stops taking updates (thread-safe through ``run_coroutine_threadsafe``)."""
        self._stopped.set()

    async def _poll(self, handle_signals: bool) -> None:
        """getUpdates until :meth:`stop` (:func:`~pyworker.contrib.telegram.polling.poll`:
        an update is confirmed only once reported)."""
        if handle_signals:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self._stopped.set)
        await poll(self.bot, self.dispatcher, self._stopped,
                   timeout=self.settings.polling_timeout, retry_seconds=self.retry_seconds)

    async def aclose(self) -> None:
        await self.bot.session.close()
        await self.chat.aclose()
        if self._owns_memory:
            await asyncio.to_thread(self.memory.close)

    async def _serve_webhook(self, handle_signals: bool) -> None:
        from aiogram.webhook.aiohttp_server import SimpleRequestHandler
        from aiohttp import web

        s = self.settings
        assert s.webhook_url is not None
        app = web.Application()
        # Not in the background: Telegram gets its answer once the update is reported, and an
        # error status (NotReported: the database could not be reached) when it was not, so it
        # delivers the update again. The answer to a message runs after the report.
        SimpleRequestHandler(self.dispatcher, self.bot, secret_token=s.webhook_secret,
                             handle_in_background=False).register(
            app, path=urlsplit(s.webhook_url).path or "/")
        runner = web.AppRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, s.webhook_host, s.webhook_port).start()
            host, port = runner.addresses[0][:2]
            self.webhook_address = (str(host), int(port))
            await self.bot.set_webhook(
                s.webhook_url, secret_token=s.webhook_secret,
                allowed_updates=self.dispatcher.resolve_used_update_types())
            event("webhook_serving", host=host, port=port, url=s.webhook_url)
            if handle_signals:
                loop = asyncio.get_running_loop()
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(signum, self._stopped.set)
            await self._stopped.wait()
            await self._drain()  # before the server's shutdown closes the bot's session
        finally:
            await runner.cleanup()

    async def _in_order(self, handler: Callable[[TelegramObject, dict[str, Any]], Awaitable[Any]],
                        update: TelegramObject, data: dict[str, Any]) -> Any:
        """Updates of one chat one at a time, in the order they came; chats concurrently. A
        handler that leaves an answer to give (a :data:`FollowUp`, once its message is
        reported) has it run in the background, after the chat's earlier answers."""
        chat = getattr(getattr(update, "event", None), "chat", None)
        key = chat.id if isinstance(chat, Chat) else 0
        began = time.monotonic()
        self._enter()
        follows = False
        try:
            async with self._lock(self._locks, key):
                result = await self.redeliveries.handle(handler, update, data)
            if callable(result):
                follows = True
                task = asyncio.create_task(self._follow(key, result, update, began))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return None
            return result
        finally:
            if not follows:
                self._leave(update, began)

    async def _follow(self, key: int, follow_up: FollowUp, update: TelegramObject,
                      began: float) -> None:
        try:
            async with self._lock(self._answer_locks, key):
                await follow_up()
        except Exception as exc:  # noqa: BLE001 - logged; the bot goes on
            event("answer_crashed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._leave(update, began)

    @staticmethod
    def _lock(locks: weakref.WeakValueDictionary[int, asyncio.Lock], key: int) -> asyncio.Lock:
        lock = locks.get(key)
        if lock is None:
            lock = locks[key] = asyncio.Lock()
        return lock

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self, update: TelegramObject, began: float) -> None:
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()
        if isinstance(update, Update):
            event("update_handled", update_id=update.update_id, kind=update.event_type,
                  ms=round((time.monotonic() - began) * 1000))
            if self.on_update_handled is not None:
                self.on_update_handled(update)

    async def _report(self, what: str, workspace_id: str, report: Callable[[], None],
                      on_give_up: FollowUp | None = None, **fields: Any) -> bool:
        """Runs ``report`` (facts for the database) off the event loop; logs ``what`` or why
        it failed. Whether it worked; NotReported when the database refused it (Telegram then
        delivers the update again)."""
        try:
            await self._db(report)
        except DB_ERRORS as exc:
            event("facts_not_reported", logging.WARNING, workspace_id=workspace_id, what=what,
                  error=f"{type(exc).__name__}: {exc}")
            if database_refused(exc):
                raise NotReported(what, exc, workspace_id, on_give_up) from exc
            return False
        event(what, workspace_id=workspace_id, **fields)
        return True

    async def _takes_writes(self, workspace_id: str) -> bool:
        """Whether the database stores a workspace's facts now (the probe of
        :class:`Redeliveries`: is it one update the database refuses, or every write?)."""
        try:
            await self._db(self._report_workspace, workspace_id)
        except DB_ERRORS as exc:
            return not database_refused(exc)
        return True

    @staticmethod
    async def _db(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """One client call, off the event loop."""
        return await asyncio.to_thread(function, *args, **kwargs)

    # Facts --------------------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """The bot's platform identity: its Telegram user id from getMe. Another bot behind the
        same bot id is a replaced bot, and the old bot's memories are no longer recalled."""
        assert self.me is not None, "getMe first"
        return f"tg:{self.me.id}"

    def _retain_until(self, sent_at: datetime) -> datetime | None:
        days = self.settings.retain_days
        return None if days is None else sent_at + timedelta(days=days)

    def _report_workspace(self, workspace_id: str) -> None:
        s = self.settings
        self.memory.upsert_workspace(workspace_id, s.config_version, s.workspace_budget_usd, 0,
                                     s.idle_minutes)
        self.memory.upsert_bot(workspace_id, s.bot_id, self.identity)

    def _report_place(self, place: mapping.Place, user_id: str,
                      membership: tuple[mapping.Role, bool] | None) -> None:
        ws = place.workspace_id
        self._report_workspace(ws)
        if place.kind == "private":
            self.memory.upsert_chat(ws, place.chat_id, "private", user_id, True)
            self.memory.upsert_member(ws, user_id, "owner", True)
        else:
            self.memory.upsert_chat(ws, place.chat_id, "group", None, True)
            if membership is not None:
                self.memory.upsert_member(ws, user_id, *membership)
        if place.topic_id:
            self.memory.upsert_topic(ws, place.chat_id, place.topic_id)

    def _report_request(self, place: mapping.Place, user_id: str, request_id: str) -> None:
        """The request ``running`` (its end is the outbox's: :class:`RequestEnd`)."""
        s = self.settings
        self.memory.upsert_request(
            place.workspace_id, request_id, bot_id=s.bot_id, chat_id=place.chat_id,
            topic_id=place.topic_id, user_id=user_id, kind="interactive", status="running",
            model_provider=s.model.provider, model_id=s.model.id,
            budget_usd=s.request_budget_usd, thread_id=place.thread_id)

    async def _membership(self, chat: Chat, user: User) -> tuple[mapping.Role, bool] | None:
        """The user's standing in a group now, as Telegram says (None when it cannot say)."""
        try:
            return mapping.role_of(await self.bot.get_chat_member(chat.id, user.id))
        except TelegramAPIError as exc:
            event("membership_unknown", logging.WARNING, chat_id=chat.id, user_id=user.id,
                  error=str(exc))
            return None

    # Messages -----------------------------------------------------------------------------------

    async def on_message(self, message: Message) -> FollowUp | None:
        me = self.me
        assert me is not None
        chat = message.chat
        if chat.type not in (ChatType.PRIVATE, *mapping.GROUP_TYPES):
            return None
        if message.migrate_to_chat_id is not None:  # became a supergroup: a new chat id
            await self._link_group(chat, linked=False, admins=[])
            return None
        if message.new_chat_members or message.left_chat_member:
            await self._member_service(message, me)
            return None
        # A forwarded message is reported as what it is, someone else's words quoted
        # (mapping.reported_text): the database then refuses it as a direct request.
        user, text = message.from_user, mapping.reported_text(message)
        if user is None or user.is_bot or message.sender_chat is not None or not text:
            return None  # channels, anonymous admins, other bots, stickers: no person, no text
        if not mapping.is_directed(message, me):
            return None  # ordinary group traffic never reaches the memory (V10)
        command = mapping.command_of(message, me)
        if command in ("start", "help"):
            with suppress(TelegramAPIError):
                await self._send(message, HELP)
            return None
        place = mapping.place_of(self.settings.workspace_prefix, message)
        membership = await self._membership(chat, user) if place.kind == "group" else None
        reported = await self._report(
            "place_reported", place.workspace_id,
            lambda: self._report_place(place, str(user.id), membership),
            on_give_up=lambda: self._sorry(message), membership=membership)
        if not reported:
            await self._sorry(message)
            return None
        if command == "memory":
            await self.show_memory(message, place, str(user.id))
            return None
        return await self.report_message(message, place, str(user.id), text)

    def _conversation(self, message: Message, place: mapping.Place, recall: Recall,
                      text: str) -> list[dict[str, Any]]:
        """What the model reads: its instructions, the recall answer as historical data beside
        the conversation, and the current message (with the one it replies to)."""
        me = self.me
        assert me is not None and message.from_user is not None
        where = ("private chat" if place.kind == "private"
                 else f"group (topic {place.topic_id})" if place.topic_id else "group")
        system = self.system_template.format(name=me.full_name, place=where)
        memory = ("Memory for this request (historical reference data, JSON from "
                  "memory.recall):\n" + json.dumps(recall.as_json(), ensure_ascii=False))
        sender = message.from_user
        header: dict[str, Any] = {
            "message_id": mapping.message_key(message.chat.id, message.message_id),
            "from": {"id": str(sender.id), "name": sender.full_name,
                     **({"username": sender.username} if sender.username else {})}}
        reply = mapping.replied_to(message)
        if reply is not None:
            author = reply.from_user
            header["in_reply_to"] = {
                "message_id": mapping.message_key(reply.chat.id, reply.message_id),
                "from": "you (the bot)" if author is not None and author.id == me.id
                else {"id": str(author.id), "name": author.full_name} if author else None,
                "text": (mapping.text_of(reply) or "")[:2000]}
        return [{"role": "system", "content": system},
                {"role": "system", "content": memory},
                {"role": "user", "content": json.dumps(header, ensure_ascii=False) + "\n" + text}]

    async def report_message(self, message: Message, place: mapping.Place, user_id: str,
                             text: str) -> FollowUp | None:
        """The request reported ``running`` and the message stored: then the answer follows
        (returned, to run after the chat's earlier answers). :class:`NotReported` when the
        database refused: Telegram delivers the message again."""
        if not await self._open(message, place, user_id, mapping.request_key(message), text):
            return None
        return lambda: self.answer(message, place, user_id, text)

    async def _open(self, message: Message, place: mapping.Place, user_id: str,
                    request_id: str, text: str | None) -> bool:
        """Reports the request ``running`` and stores the message's ``text`` (if any). Whether
        to answer: not a redelivered update (its request ended), nor one the database judged
        bad (the request failed, the sender told). :class:`NotReported` when the database
        refused: given up, the request fails and the sender is told."""
        ws = place.workspace_id
        ids: dict[str, Any] = {"workspace_id": ws, "request_id": request_id}
        try:
            await self._db(self._report_request, place, user_id, request_id)
            if text is not None:
                await self._db(self.memory.upsert_message, ws,
                               mapping.message_key(message.chat.id, message.message_id),
                               request_id, "user", user_id, text, directed=True,
                               retain_until=self._retain_until(message.date))
        except errors.Conflict:
            # Telegram delivered the update again (the bot stopped before confirming it): the
            # request already finished, and the message was answered or failed once.
            event("duplicate_update", **ids)
            return False
        except DB_ERRORS as exc:
            if not database_refused(exc):
                await self._fail(message, place, request_id, Decimal(0), exc)
                return False
            event("message_not_reported", logging.WARNING,
                  error=f"{type(exc).__name__}: {exc}", **ids)

            async def give_up() -> None:
                await self.outbox.settle(RequestEnd(workspace_id=ws, request_id=request_id,
                                                    status="failed", spent_usd=Decimal(0)))
                await self._sorry(message)

            raise NotReported(f"message {request_id}", exc, ws, give_up) from exc
        return True

    async def answer(self, message: Message, place: mapping.Place, user_id: str,
                     text: str) -> None:
        """One answer, one request (reported ``running``, its message stored): the model's
        answer, then the request ``succeeded`` or ``failed`` with its spend (kept by the
        outbox until the database takes it)."""
        ws, request_id = place.workspace_id, mapping.request_key(message)
        ids: dict[str, Any] = {"workspace_id": ws, "request_id": request_id}
        spent = Decimal(0)
        try:
            recall = await self._db(self.memory.recall, ws, request_id)
            await self._typing(message)

            async def on_tool_call(name: str, arguments: str, call_id: str) -> str:
                result = await self._db(self.memory.call_tool, ws, request_id, name, arguments,
                                        call_id)
                answer = result.answer
                outcome = (result.error_code if answer is None else answer.code
                           if isinstance(answer, ManageResult) else answer.mode)
                event("tool_call", tool=name, tool_call_id=call_id, outcome=outcome, **ids)
                return result.content

            reply = await self.chat.reply(self._conversation(message, place, recall, text),
                                          self.tools, on_tool_call)
            spent = reply.cost_usd
            cited = await self._db(self.memory.request_citations, ws, request_id)
            shown = mapping.render_citations(reply.text, cited)
            sent = await self._send(message, shown)
        except ChatFailure as exc:
            await self._fail(message, place, request_id, exc.cost_usd, exc)
            return
        except (*DB_ERRORS, TelegramAPIError) as exc:
            await self._fail(message, place, request_id, spent, exc)
            return
        event("answered", recall=recall.mode, model_calls=reply.calls, tools=reply.trace,
              citations=len(cited), spent_usd=str(spent), **ids)
        await self.outbox.settle(RequestEnd(
            workspace_id=ws, request_id=request_id, status="succeeded", spent_usd=spent,
            answer=SentAnswer(message_id=mapping.message_key(sent.chat.id, sent.message_id),
                              speaker_id=self.settings.bot_id, text=shown,
                              retain_until=self._retain_until(sent.date))))

    async def show_memory(self, message: Message, place: mapping.Place, user_id: str) -> None:
        """``/memory``: the recall of a request of its own; it stores no message."""
        request_id = mapping.memory_request_key(message)
        if not await self._open(message, place, user_id, request_id, None):
            return
        try:
            recall = await self._db(self.memory.recall, place.workspace_id, request_id)
            await self._send(message, render_recall(recall))
        except (*DB_ERRORS, TelegramAPIError) as exc:
            await self._fail(message, place, request_id, Decimal(0), exc)
            return
        await self.outbox.settle(RequestEnd(workspace_id=place.workspace_id,
                                            request_id=request_id, status="succeeded",
                                            spent_usd=Decimal(0)))

    async def _fail(self, message: Message, place: mapping.Place, request_id: str,
                    spent: Decimal, why: Exception) -> None:
        """The request ``failed`` with its spend (kept until the database takes it); the
        sender is told."""
        event("answer_failed", logging.WARNING, workspace_id=place.workspace_id,
              request_id=request_id, spent_usd=str(spent), error=f"{type(why).__name__}: {why}")
        await self.outbox.settle(RequestEnd(workspace_id=place.workspace_id,
                                            request_id=request_id, status="failed",
                                            spent_usd=spent))
        await self._sorry(message)

    async def _sorry(self, message: Message) -> None:
        with suppress(TelegramAPIError):
            await self._send(message, SORRY)

    async def _send(self, message: Message, text: str) -> Message:
        """Sends ``text`` (cut to Telegram's limit) in the message's chat and topic, as a reply
        in groups; returns the first message sent."""
        chunks = mapping.split_text(text)
        if message.chat.type == ChatType.PRIVATE:
            first = await message.answer(chunks[0])
        else:
            first = await message.reply(chunks[0])
        for chunk in chunks[1:]:
            await message.answer(chunk)
        return first

    async def _typing(self, message: Message) -> None:
        with suppress(TelegramAPIError):
            await self.bot.send_chat_action(
                message.chat.id, "typing",
                message_thread_id=message.message_thread_id if message.is_topic_message
                else None)

    async def on_edited_message(self, message: Message) -> None:
        """An edit re-reports the text (an edit invalidates the memories built on the old
        one); an edit that no longer addresses the bot takes the message out of the memory.
        A message the memory never stored stays unknown to it."""
        me = self.me
        assert me is not None
        user = message.from_user
        if message.chat.type not in (ChatType.PRIVATE, *mapping.GROUP_TYPES) or user is None \
                or user.is_bot or message.sender_chat is not None:
            return
        place = mapping.place_of(self.settings.workspace_prefix, message)
        key = mapping.message_key(message.chat.id, message.message_id)
        text = mapping.reported_text(message)
        outcome: str
        try:
            if text and mapping.is_directed(message, me):
                outcome = await self._db(
                    self.memory.upsert_message, place.workspace_id, key,
                    mapping.request_key(message), "user", str(user.id), text, directed=True,
                    retain_until=self._retain_until(message.date))
            else:
                outcome = await self._db(self.memory.remove_message, place.workspace_id, key)
        except (errors.NotFound, errors.Conflict):
            outcome = "not_stored"  # never directed, a command, or removed or expired since
        except DB_ERRORS as exc:
            event("edit_not_reported", logging.WARNING, workspace_id=place.workspace_id,
                  message_id=key, error=f"{type(exc).__name__}: {exc}")
            if database_refused(exc):  # given up, the memory keeps the text before the edit
                raise NotReported(f"edit of message {key} (the memory keeps its earlier text)",
                                  exc, place.workspace_id) from exc
            return
        event("edit_reported", workspace_id=place.workspace_id, message_id=key, outcome=outcome)

    # Membership and the group's linked state ---------------------------------------------------

    async def _link_group(self, chat: Chat, *, linked: bool, admins: list[Any]) -> None:
        ws = mapping.workspace_id(self.settings.workspace_prefix, chat)

        def report() -> None:
            self._report_workspace(ws)
            self.memory.upsert_chat(ws, str(chat.id), "group", None, linked)
            for admin in admins:
                if not admin.user.is_bot:
                    self.memory.upsert_member(ws, str(admin.user.id), *mapping.role_of(admin))

        await self._report("group_linked" if linked else "group_unlinked", ws, report,
                           admins=len(admins))

    async def _report_members(self, chat: Chat,
                              members: list[tuple[User, tuple[mapping.Role, bool]]]) -> None:
        ws = mapping.workspace_id(self.settings.workspace_prefix, chat)

        def report() -> None:
            self._report_workspace(ws)
            if chat.type == ChatType.PRIVATE:
                self.memory.upsert_chat(ws, str(chat.id), "private", str(chat.id), True)
            for user, (role, active) in members:
                self.memory.upsert_member(ws, str(user.id), role, active)

        await self._report("members_reported", ws, report,
                           members={str(u.id): [role, active] for u, (role, active) in members})

    async def on_my_chat_member(self, update: ChatMemberUpdated) -> None:
        """The bot added to or removed from a group (its linked state; the owner and admins
        are read when it joins), or a user who blocked or restarted it in a private chat."""
        chat = update.chat
        inside = mapping.bot_is_in(update.new_chat_member)
        if chat.type == ChatType.PRIVATE:
            await self._report_members(chat, [(update.from_user, ("owner", inside))])
        elif chat.type in mapping.GROUP_TYPES:
            admins: list[Any] = []
            if inside:
                try:
                    admins = list(await self.bot.get_chat_administrators(chat.id))
                except TelegramAPIError as exc:
                    event("admins_unknown", logging.WARNING, chat_id=chat.id, error=str(exc))
            await self._link_group(chat, linked=inside, admins=admins)

    async def on_chat_member(self, update: ChatMemberUpdated) -> None:
        """A member joined, left, was promoted, demoted, restricted or banned."""
        member = update.new_chat_member
        if update.chat.type in mapping.GROUP_TYPES and not member.user.is_bot:
            await self._report_members(update.chat, [(member.user, mapping.role_of(member))])

    async def _member_service(self, message: Message, me: User) -> None:
        """The "joined" and "left" service messages, for groups where the bot is no admin
        (it gets chat_member updates only as an admin)."""
        changes: list[tuple[User, tuple[mapping.Role, bool]]] = []
        for user in message.new_chat_members or []:
            if not user.is_bot:
                changes.append((user, await self._membership(message.chat, user)
                                or ("member", True)))
        left = message.left_chat_member
        if left is not None and not left.is_bot:
            changes.append((left, ("member", False)))
        if changes:
            await self._report_members(message.chat, changes)


async def serve(settings: Settings) -> None:
    """``pimem telegram``: the bot until SIGTERM or SIGINT."""
    bot = MemoryBot(settings)
    await bot.run(handle_signals=True)
