"""A small typed client for bot backends: the ``memory`` API of the database, from Python.

One method per backend function of the ``memory`` schema (role ``memory_backend``), over a
psycopg connection pool. Every call is its own autocommit transaction, so a change is durable
when the method returns, whatever happens to the answer later (C4). Answers are parsed into
pydantic models; errors the database raises on purpose (SQLSTATE class MB, docs/errors.md) come
as the typed exceptions of :mod:`pyworker.errors`; a lost or unreachable database is
:class:`pyworker.db.DatabaseUnavailable`.

The client decides nothing: scope, visibility, validation, permissions, citations and retention
are the database's answers, passed on unchanged. :meth:`MemoryClient.call_tool` hands a model's
tool call (name, JSON arguments, tool call id) to the right function and gives back the text to
return to the model.

    with MemoryClient(dsn) as memory:
        memory.upsert_request("acme", "r9", bot_id="helper", chat_id="dm-alice", topic_id=0,
                              user_id="alice", kind="interactive", status="running",
                              model_provider="openai", model_id="gpt-4o-mini", budget_usd="0.50")
        memory.upsert_message("acme", "m91", "r9", "user", "alice", "What tea do I like?")
        recall = memory.recall("acme", "r9")                 # beside the conversation
        tools = memory.tool_definitions()                    # offered to the model
        result = memory.call_tool("acme", "r9", "query_memories", '{"query": "tea"}', "call_1")
        cites = memory.request_citations("acme", "r9")       # the only ids you may cite

docs/telegram.md walks through a whole request; docs/api.md is the reference of every function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal, Self

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout
from pydantic import BaseModel, ConfigDict

from pyworker import errors
from pyworker.db import DatabaseUnavailable

APPLICATION_NAME = "pimem-backend"

Money = Decimal | int | str
Upsert = Literal["inserted", "updated", "unchanged"]
MessageUpsert = Literal["inserted", "updated", "unchanged", "ignored"]


# Answers ----------------------------------------------------------------------------------------


class Answer(BaseModel):
    """An answer of the database. Keys a later schema adds are kept (``model_extra``)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def as_json(self) -> dict[str, Any]:
        """The answer as the database gave it (JSON types, no defaults filled in)."""
        return self.model_dump(mode="json", exclude_unset=True)


class Scope(Answer):
    """``memory.resolve_scope``: where a request's memories live."""

    scope_kind: Literal["private", "shared", "none"]
    scope_id: int | None = None
    bot_id: str | None = None
    chat_id: str | None = None
    user_id: str | None = None
    topic_id: int | None = None


class RecallRecord(Answer):
    """A record as recall shows it (the summary only in directory mode, cut at 300 chars)."""

    id: int
    kind: Literal["extracted", "note"]
    title: str
    speaker_ids: list[str]
    created_at: datetime
    summary: str | None = None


class Recall(Answer):
    """``memory.recall``: what a new interactive request starts with, historical data only."""

    mode: Literal["index", "directory", "none", "disabled"]
    label: str | None = None
    scope: Literal["private", "shared"] | None = None
    frozen_at: datetime | None = None
    index: str | None = None
    index_withdrawn: bool = False
    records: list[RecallRecord] = []
    dropped: int = 0


class MemoryRecord(Answer):
    """A record as ``query_memories`` returns it."""

    id: int
    kind: Literal["extracted", "note"]
    title: str
    summary: str
    speaker_ids: list[str]
    thread_ids: list[str]
    source_ids: list[str]
    source_count: int
    sources_overflow: int
    created_at: datetime
    last_used_at: datetime | None = None


class QueryResult(Answer):
    """``memory.query_memories``: the tool's answer."""

    mode: Literal["browse", "search", "id", "disabled"]
    label: str | None = None
    scope: Literal["private", "shared"] | None = None
    records: list[MemoryRecord] = []
    count: int = 0
    replayed: bool = False
    note: str | None = None


class ManageResult(Answer):
    """``memory.manage_memory``: done or refused, with a code and a sentence for the user."""

    status: Literal["done", "refused"]
    action: str
    code: str
    reason: str
    memory_id: int | None = None
    replayed: bool = False
    forgotten_ids: list[int] = []
    forgotten_by_person: dict[str, int] = {}
    changed: bool | None = None


@dataclass(frozen=True)
class ToolResult:
    """What became of one tool call of the model.

    ``content`` is the text to hand back to the model as the tool's result: the database's
    answer as JSON, or ``{"error": {"code", "message"}}`` when the call was refused as an error
    the model can correct (its arguments). ``answer`` is the parsed answer, ``None`` on error.
    """

    tool_call_id: str
    name: str
    content: str
    answer: QueryResult | ManageResult | None = None
    error_code: str | None = None


# The errors a tool call's arguments (the model) cause, handed back to the model as the tool's
# result so it can correct them: malformed arguments (MB001), a tool call id reused with other
# arguments (MB003), a text over its limit (MB004). Anything else is the backend's problem (an
# unknown workspace or request, a scheduled request, a lost database) and is raised.
MODEL_ERRORS: tuple[type[errors.MemoryError_], ...] = (
    errors.InvalidArgument, errors.Conflict, errors.TooLarge)


def _money(value: Money) -> Decimal:
    return value if isinstance(value, Decimal) else Decimal(str(value))


class MemoryClient:
    """The ``memory`` backend API over a connection pool (thread-safe; one call, one transaction).

    Give a DSN (the client opens and owns a pool) or a pool of your own (connections must be
    autocommit). The login role needs ``memory_backend`` only. From async code (aiogram, ...)
    call the methods with ``asyncio.to_thread``: each is a short database round trip.
    """

    def __init__(self, dsn: str | None = None, *, pool: ConnectionPool | None = None,
                 min_size: int = 1, max_size: int = 4, timeout: float = 10.0,
                 application_name: str = APPLICATION_NAME,
                 statement_timeout_ms: int = 30_000) -> None:
        if (dsn is None) == (pool is None):
            raise ValueError("give a dsn or a pool")
        self._owns_pool = pool is None
        if dsn is not None:
            pool = ConnectionPool(
                dsn, min_size=min_size, max_size=max_size, timeout=timeout, open=True,
                name=application_name,
                kwargs={"autocommit": True, "application_name": application_name,
                        "connect_timeout": 10,
                        "options": f"-c statement_timeout={statement_timeout_ms}"})
        assert pool is not None
        self.pool = pool

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Transport ----------------------------------------------------------------------------------

    def _run(self, query: sql.Composed, args: tuple[Any, ...],
             fetch: Callable[[psycopg.Cursor[Any]], Any]) -> Any:
        params = tuple(Jsonb(a) if isinstance(a, dict) else a for a in args)
        try:
            with self.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
                cur.execute(query, params)
                return fetch(cur)
        except PoolTimeout as exc:
            raise DatabaseUnavailable(f"no database connection: {exc}") from exc
        except psycopg.Error as exc:
            mapped = errors.translate(exc)
            if mapped is not exc:
                raise mapped from exc
            state = exc.sqlstate or ""
            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and (
                    not state or state.startswith(("08", "57P"))):
                raise DatabaseUnavailable(str(exc).strip()) from exc
            raise

    @staticmethod
    def _query(function: str, arity: int, *, table: bool = False) -> sql.Composed:
        call = sql.SQL("{}({})").format(sql.Identifier("memory", function),
                                        sql.SQL(", ").join([sql.Placeholder()] * arity))
        if table:
            return sql.SQL("select * from {}").format(call)
        return sql.SQL("select {} as value").format(call)

    def _value(self, function: str, *args: Any) -> Any:
        """``select memory.<function>(args...)``: its single value."""
        return self._run(self._query(function, len(args)), args,
                         lambda cur: (cur.fetchone() or {}).get("value"))

    def _table(self, function: str, *args: Any) -> list[dict[str, Any]]:
        """``select * from memory.<function>(args...)``: its rows."""
        rows: list[dict[str, Any]] = self._run(self._query(function, len(args), table=True),
                                               args, lambda cur: cur.fetchall())
        return rows

    def _upsert(self, function: str, *args: Any) -> Upsert:
        """An ``upsert_*`` function's answer: 'inserted', 'updated' or 'unchanged'."""
        answer: Upsert = self._value(function, *args)
        return answer

    # Facts the backend mirrors (docs/api.md, Ingest) ---------------------------------------------

    def schema_version(self) -> int:
        return int(self._value("schema_version"))

    def upsert_workspace(self, workspace_id: str, config_version: int, budget_usd: Money,
                         spent_usd: Money = 0, idle_minutes: int = 30) -> Upsert:
        return self._upsert("upsert_workspace", workspace_id, config_version,
                            _money(budget_usd), _money(spent_usd), idle_minutes)

    def upsert_member(self, workspace_id: str, user_id: str,
                      role: Literal["owner", "admin", "member"], active: bool = True) -> Upsert:
        return self._upsert("upsert_member", workspace_id, user_id, role, active)

    def upsert_bot(self, workspace_id: str, bot_id: str, identity: str,
                   active: bool = True) -> Upsert:
        return self._upsert("upsert_bot", workspace_id, bot_id, identity, active)

    def upsert_chat(self, workspace_id: str, chat_id: str, kind: Literal["private", "group"],
                    private_user_id: str | None = None, linked: bool = True) -> Upsert:
        return self._upsert("upsert_chat", workspace_id, chat_id, kind,
                            private_user_id, linked)

    def upsert_topic(self, workspace_id: str, chat_id: str, topic_id: int,
                     title: str | None = None) -> Upsert:
        return self._upsert("upsert_topic", workspace_id, chat_id, topic_id, title)

    def set_repository_grant(self, workspace_id: str, user_id: str, repository_id: str,
                             granted: bool) -> Upsert:
        return self._upsert("set_repository_grant", workspace_id, user_id,
                            repository_id, granted)

    def upsert_request(self, workspace_id: str, request_id: str, *, bot_id: str, chat_id: str,
                       topic_id: int, user_id: str,
                       kind: Literal["interactive", "scheduled"],
                       status: Literal["queued", "running", "awaiting_approval", "succeeded",
                                       "failed"],
                       model_provider: str, model_id: str, budget_usd: Money,
                       spent_usd: Money = 0, thread_id: str | None = None) -> Upsert:
        return self._upsert("upsert_request", workspace_id, request_id,
                            bot_id, chat_id, topic_id, user_id, kind, status, model_provider,
                            model_id, _money(budget_usd), _money(spent_usd), thread_id)

    def finish_request(self, workspace_id: str, request_id: str,
                       status: Literal["succeeded", "failed"] = "succeeded",
                       spent_usd: Money | None = None) -> Literal["updated", "unchanged"]:
        """Marks a reported request finished (``succeeded`` by default), with its final spend
        when given; nothing else about it is sent again. ``unchanged`` when it already was."""
        answer: Literal["updated", "unchanged"] = self._value(
            "finish_request", workspace_id, request_id, status,
            None if spent_usd is None else _money(spent_usd))
        return answer

    def upsert_message(self, workspace_id: str, message_id: str, request_id: str,
                       role: Literal["user", "assistant"], speaker_id: str, text: str, *,
                       directed: bool = True, retain_until: datetime | None = None,
                       repositories: Iterable[str] = ()) -> MessageUpsert:
        answer: MessageUpsert = self._value(
            "upsert_message", workspace_id, message_id, request_id, role, speaker_id, text,
            directed, retain_until, list(repositories))
        return answer

    def remove_message(self, workspace_id: str, message_id: str) -> Upsert:
        return self._upsert("remove_message", workspace_id, message_id)

    def resolve_scope(self, workspace_id: str, request_id: str) -> Scope:
        [row] = self._table("resolve_scope", workspace_id, request_id)
        return Scope.model_validate(row)

    # A request's memory (docs/api.md, Recall and tools) ------------------------------------------

    def recall(self, workspace_id: str, request_id: str) -> Recall:
        return Recall.model_validate(self._value("recall", workspace_id, request_id))

    def query_memories(self, workspace_id: str, request_id: str, tool_call_id: str,
                       args: Any) -> QueryResult:
        """The ``query_memories`` tool; ``args`` as the model gave them (validated there)."""
        return QueryResult.model_validate(self._value(
            "query_memories", workspace_id, request_id, tool_call_id, Jsonb(args)))

    def manage_memory(self, workspace_id: str, request_id: str, tool_call_id: str,
                      args: Any) -> ManageResult:
        """The ``manage_memory`` tool; a refusal is an answer (``status == "refused"``)."""
        return ManageResult.model_validate(self._value(
            "manage_memory", workspace_id, request_id, tool_call_id, Jsonb(args)))

    def request_citations(self, workspace_id: str, request_id: str) -> list[str]:
        """The message ids the request's answer may cite, and no others."""
        return [row["message_id"]
                for row in self._table("request_citations", workspace_id, request_id)]

    def answer_retention_boundary(self, workspace_id: str, request_id: str) -> datetime | None:
        """Keep the request's answer no longer than this (``None``: no limit from memory)."""
        boundary: datetime | None = self._value("answer_retention_boundary",
                                                workspace_id, request_id)
        return boundary

    def delete_workspace(self, workspace_id: str) -> dict[str, Any]:
        deleted: dict[str, Any] = self._value("delete_workspace", workspace_id)
        return deleted

    # The model's tools ---------------------------------------------------------------------------

    def tool_definitions(self) -> list[dict[str, Any]]:
        """The two tools as ``{name, description, parameters}`` function definitions, as the
        database serves them (``memory.tool_definitions()``: JSON schemas whose limits are the
        ones the tools' functions enforce)."""
        definitions: list[dict[str, Any]] = self._value("tool_definitions")
        return definitions

    def call_tool(self, workspace_id: str, request_id: str, name: str,
                  arguments: str | dict[str, Any] | None, tool_call_id: str) -> ToolResult:
        """Hands one tool call of the model to its function, arguments and id unchanged.

        ``arguments`` is the JSON text the model produced (or its parsed value). Text that is
        not JSON, an unknown tool name, and the errors its arguments cause in the database
        (:data:`MODEL_ERRORS`) become an ``{"error": ...}`` result for the model, with nothing
        changed. Other errors are raised.
        """
        functions: dict[str, Callable[[str, str, str, Any], QueryResult | ManageResult]] = {
            "query_memories": self.query_memories, "manage_memory": self.manage_memory}

        def refused(code: str, message: str) -> ToolResult:
            content = json.dumps({"error": {"code": code, "message": message}},
                                 ensure_ascii=False)
            return ToolResult(tool_call_id, name, content, None, code)

        function = functions.get(name)
        if function is None:
            return refused("unknown_tool", f"there is no tool {name!r}; the tools are "
                                           f"{', '.join(functions)}")
        args: Any = arguments
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            args = {}
        elif isinstance(arguments, str):
            try:
                args = json.loads(arguments)
            except ValueError as exc:
                return refused("invalid_json", f"the arguments are not JSON: {exc}")
        try:
            answer = function(workspace_id, request_id, tool_call_id, args)
        except MODEL_ERRORS as exc:
            return refused(exc.code, exc.message)
        return ToolResult(tool_call_id, name, json.dumps(answer.as_json(), ensure_ascii=False),
                          answer)
