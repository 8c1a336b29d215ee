"""Builds realistic test worlds through the public ingest API (never by writing tables).

    w = World(conn)
    w.workspace("ws1")
    w.member("ws1", "alice", "owner")
    w.bot("ws1", "bot1")
    w.private_chat("ws1", "dm-alice", "alice")
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "m1", "r1", "user", "alice", "remember I prefer tea")

Every helper returns what the API returned, so tests can assert on it too.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg


class World:
    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def call(self, function: str, *args: Any) -> Any:
        # Dollar amounts go as numeric (PostgreSQL has no implicit float -> numeric cast).
        args = tuple(Decimal(str(a)) if isinstance(a, float) else a for a in args)
        placeholders = ", ".join(["%s"] * len(args))
        row = self.conn.execute(f"select memory.{function}({placeholders})", args).fetchone()
        return row[0] if row else None

    def workspace(self, ws: str, *, config_version: int = 1, budget: float = 100.0,
                  spent: float = 0.0, idle_minutes: int = 30) -> str:
        return self.call("upsert_workspace", ws, config_version, budget, spent, idle_minutes)

    def member(self, ws: str, user: str, role: str = "member", active: bool = True) -> str:
        return self.call("upsert_member", ws, user, role, active)

    def bot(self, ws: str, bot: str, identity: str | None = None, active: bool = True) -> str:
        return self.call("upsert_bot", ws, bot, identity or f"{bot}-identity", active)

    def private_chat(self, ws: str, chat: str, user: str) -> str:
        return self.call("upsert_chat", ws, chat, "private", user, True)

    def group_chat(self, ws: str, chat: str, linked: bool = True) -> str:
        return self.call("upsert_chat", ws, chat, "group", None, linked)

    def topic(self, ws: str, chat: str, topic: int, title: str | None = None) -> str:
        return self.call("upsert_topic", ws, chat, topic, title)

    def grant(self, ws: str, user: str, repo: str, granted: bool = True) -> str:
        return self.call("set_repository_grant", ws, user, repo, granted)

    def request(self, ws: str, request: str, *, chat: str, user: str, bot: str = "bot1",
                topic: int = 0, kind: str = "interactive", status: str = "succeeded",
                provider: str = "fake", model: str = "m", budget: float = 1.0,
                spent: float = 0.0, thread: str | None = None) -> str:
        return self.call("upsert_request", ws, request, bot, chat, topic, user, kind, status,
                         provider, model, budget, spent, thread)

    def message(self, ws: str, message: str, request: str, role: str, speaker: str, text: str,
                *, directed: bool = True, retain_until: datetime | None = None,
                repositories: list[str] | None = None) -> str:
        return self.call("upsert_message", ws, message, request, role, speaker, text, directed,
                         retain_until, repositories or [])

    def remove(self, ws: str, message: str) -> str:
        return self.call("remove_message", ws, message)

    # Common shapes -------------------------------------------------------------------------

    def basic(self, ws: str = "ws1", *, users: tuple[str, ...] = ("alice", "bob"),
              bot: str = "bot1") -> None:
        """A workspace with an owner (the first user), members, one bot, a private chat per
        user (``dm-<user>``) and a linked group ``grp`` with topic 0 and topic 7."""
        self.workspace(ws)
        for i, user in enumerate(users):
            self.member(ws, user, "owner" if i == 0 else "member")
            self.private_chat(ws, f"dm-{user}", user)
        self.bot(ws, bot)
        self.group_chat(ws, "grp")
        self.topic(ws, "grp", 7, "planning")

    def conversation(self, ws: str, request: str, *, chat: str, user: str, bot: str = "bot1",
                     topic: int = 0, user_text: str = "hello", reply: str = "hi",
                     status: str = "succeeded", kind: str = "interactive") -> tuple[str, str]:
        """A request with one user message and one assistant reply; returns their ids."""
        self.request(ws, request, chat=chat, user=user, bot=bot, topic=topic, status=status,
                     kind=kind)
        self.message(ws, f"{request}-u", request, "user", user, user_text)
        self.message(ws, f"{request}-a", request, "assistant", bot, reply)
        return f"{request}-u", f"{request}-a"
