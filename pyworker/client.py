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
        tools = memory.tool_definitions("openai")            # offered to the model
        result = memory.call_tool("acme", "r9", "query_memories", '{"query": "tea"}', "call_1")
        cites = memory.request_citations("acme", "r9")       # the only ids you may cite
        memory.upsert_message("acme", "m92", "r9", "assistant", "helper", "Green tea.")
        memory.finish_request("acme", "r9", spent_usd="0.0031")

:class:`AsyncMemoryClient` has the same methods as coroutines, for asyncio code. docs/telegram.md
walks through a whole request; docs/api.md is the reference of every function.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Self, TypeVar, overload

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout
from pydantic import BaseModel, ConfigDict

from pyworker import errors
from pyworker.db import DatabaseUnavailable
from pyworker.routing import ROUTE_TTL, WHERE, Node, Routes
from pyworker.tools import SHAPES, ToolShape, in_shape

APPLICATION_NAME = "pimem-backend"

Money = Decimal | int | str
Upsert = Literal["inserted", "updated", "unchanged"]
MessageUpsert = Literal["inserted", "updated", "unchanged", "ignored"]
Finish = Literal["updated", "unchanged"]


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
    """A record as ``query_memories`` returns it. ``rank`` is its place in the answer, 1 first:
    a search gives literal matches (newest first), then the question ranked by its words (how
    rare they are in the scope, the line that holds them, a speaker it names), then typo and
    partial-word matches by similarity (``match`` says which); browsing gives the newest first.
    Every id list is bounded (20 each) and says how long it was and how much it left out."""

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
    match: Literal["literal", "words", "fuzzy"] | None = None
    rank: int | None = None
    speaker_count: int | None = None
    speakers_overflow: int | None = None
    thread_count: int | None = None
    threads_overflow: int | None = None


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


class WorkspaceNode(Answer):
    """``memory.workspace_node``: on a Citus cluster the node holding the workspace and whether
    it is the node asked (``here``); on one server no host and ``here`` true."""

    host: str | None = None
    port: int | None = None
    here: bool


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


def _money_or_none(value: Money | None) -> Decimal | None:
    return None if value is None else _money(value)


# Calls ------------------------------------------------------------------------------------------
#
# Every method is written once, as the call it makes (:class:`_Call`: the statement, its
# arguments, how the answer is read). MemoryClient runs a call over a connection pool,
# AsyncMemoryClient over an asyncio one; :class:`_Endpoint` gives each client the method with
# its own signature, returning the answer or an awaitable of it.

T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One call of a ``memory`` function (``query``, ``args``), and how its answer is read:
    its rows (``rows``) or its single value, given to ``parse``. An error of ``recover`` becomes
    ``on_error``'s answer instead of an exception. Without a ``query`` the answer is
    ``parse(None)``, and the database is not asked. A call of a ``workspace`` goes to the node
    holding it (:mod:`pyworker.routing`)."""

    query: sql.Composed | None
    args: tuple[Any, ...] = ()
    parse: Callable[[Any], T] = lambda raw: raw
    rows: bool = False
    recover: tuple[type[errors.MemoryError_], ...] = ()
    on_error: Callable[[errors.MemoryError_], T] | None = None
    workspace: Any = None  # the workspace the call works on: sent to its node (routing)

    @property
    def params(self) -> tuple[Any, ...]:
        return tuple(Jsonb(a) if isinstance(a, dict) else a for a in self.args)

    def fetch(self, rows: list[dict[str, Any]]) -> Any:
        """The raw answer from the rows the statement gave."""
        return rows if self.rows else (rows[0] if rows else {}).get("value")

    def fail(self, exc: Exception) -> T:
        """The answer to an error: ``on_error``'s for an error of ``recover``; otherwise the
        error raised as the client's exception (an MB error typed, a lost database
        :class:`DatabaseUnavailable`)."""
        mapped = _mapped_error(exc)
        if self.on_error is not None and isinstance(mapped, self.recover):
            return self.on_error(mapped)
        if mapped is exc:
            raise exc
        raise mapped from exc


def _mapped_error(exc: Exception) -> Exception:
    """The client's exception for a transport error: the typed MB error, DatabaseUnavailable
    for no connection or a lost one, anything else as it is."""
    if isinstance(exc, PoolTimeout):
        return DatabaseUnavailable(f"no database connection: {exc}")
    if not isinstance(exc, psycopg.Error):
        return exc
    mapped = errors.translate(exc)
    if mapped is not exc:
        return mapped
    state = exc.sqlstate or ""
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and (
            not state or state.startswith(("08", "57P"))):
        return DatabaseUnavailable(str(exc).strip())
    return exc


def _statement(function: str, arity: int, *, table: bool = False) -> sql.Composed:
    call = sql.SQL("{}({})").format(sql.Identifier("memory", function),
                                    sql.SQL(", ").join([sql.Placeholder()] * arity))
    if table:
        return sql.SQL("select * from {}").format(call)
    return sql.SQL("select {} as value").format(call)


def _value(function: str, workspace_id: Any, *args: Any) -> _Call[Any]:
    """``select memory.<function>(workspace_id, args...)``: its single value."""
    return _Call(_statement(function, 1 + len(args)), (workspace_id, *args),
                 workspace=workspace_id)


def _table(function: str, workspace_id: Any, *args: Any,
           parse: Callable[[list[dict[str, Any]]], T]) -> _Call[T]:
    """``select * from memory.<function>(workspace_id, args...)``: its rows, read by
    ``parse``."""
    return _Call(_statement(function, 1 + len(args), table=True), (workspace_id, *args), parse,
                 rows=True, workspace=workspace_id)


def _single_scope(rows: list[dict[str, Any]]) -> Scope:
    [row] = rows
    return Scope.model_validate(row)


def _tool_call(workspace_id: str, request_id: str, name: str,
               arguments: str | dict[str, Any] | None, tool_call_id: str) -> _Call[ToolResult]:
    """A model's tool call as the call of its function, or a refusal without one (see
    :meth:`_MemoryApi.call_tool`)."""

    def refused(code: str, message: str) -> ToolResult:
        content = json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False)
        return ToolResult(tool_call_id, name, content, None, code)

    def answered(answer: QueryResult | ManageResult) -> ToolResult:
        return ToolResult(tool_call_id, name, json.dumps(answer.as_json(), ensure_ascii=False),
                          answer)

    models: dict[str, type[QueryResult | ManageResult]] = {
        "query_memories": QueryResult, "manage_memory": ManageResult}
    model = models.get(name)
    if model is None:
        return _Call(None, parse=lambda _: refused(
            "unknown_tool", f"there is no tool {name!r}; the tools are {', '.join(models)}"))
    args: Any = arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        args = {}
    elif isinstance(arguments, str):
        try:
            args = json.loads(arguments)
        except ValueError as exc:
            problem = f"the arguments are not JSON: {exc}"
            return _Call(None, parse=lambda _: refused("invalid_json", problem))
    return _Call(_statement(name, 4), (workspace_id, request_id, tool_call_id, Jsonb(args)),
                 lambda raw: answered(model.model_validate(raw)), recover=MODEL_ERRORS,
                 on_error=lambda exc: refused(exc.code, exc.message), workspace=workspace_id)


class _Endpoint(Generic[P, T]):
    """A method of both clients, written once as the call it makes: MemoryClient's runs the
    call and answers, AsyncMemoryClient's answers an awaitable."""

    def __init__(self, build: Callable[Concatenate[Any, P], _Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> Callable[Concatenate[Any, P], _Call[T]]: ...
    @overload
    def __get__(self, obj: MemoryClient, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncMemoryClient,
                owner: type | None = None) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.build
        build, execute = self.build, obj._execute

        @functools.wraps(build)
        def method(*args: P.args, **kwargs: P.kwargs) -> Any:
            return execute(build(obj, *args, **kwargs))

        return method


def endpoint(build: Callable[Concatenate[Any, P], _Call[T]]) -> _Endpoint[P, T]:
    return _Endpoint(build)


class _MemoryApi:
    """The ``memory`` backend functions, one method each, shared by both clients."""

    # Facts the backend mirrors (docs/api.md, Ingest) ---------------------------------------------

    @endpoint
    def schema_version(self) -> _Call[int]:
        return _Call(_statement("schema_version", 0), parse=int)

    @endpoint
    def upsert_workspace(self, workspace_id: str, config_version: int, budget_usd: Money,
                         spent_usd: Money = 0, idle_minutes: int = 30) -> _Call[Upsert]:
        """``idle_minutes``: how long a finished conversation stays quiet before it is made
        into a memory (0: at the next maintenance pass)."""
        return _value("upsert_workspace", workspace_id, config_version,
                      _money(budget_usd), _money(spent_usd), idle_minutes)

    @endpoint
    def upsert_member(self, workspace_id: str, user_id: str,
                      role: Literal["owner", "admin", "member"],
                      active: bool = True) -> _Call[Upsert]:
        return _value("upsert_member", workspace_id, user_id, role, active)

    @endpoint
    def upsert_bot(self, workspace_id: str, bot_id: str, identity: str,
                   active: bool = True) -> _Call[Upsert]:
        return _value("upsert_bot", workspace_id, bot_id, identity, active)

    @endpoint
    def upsert_chat(self, workspace_id: str, chat_id: str, kind: Literal["private", "group"],
                    private_user_id: str | None = None, linked: bool = True) -> _Call[Upsert]:
        return _value("upsert_chat", workspace_id, chat_id, kind, private_user_id, linked)

    @endpoint
    def upsert_topic(self, workspace_id: str, chat_id: str, topic_id: int,
                     title: str | None = None) -> _Call[Upsert]:
        return _value("upsert_topic", workspace_id, chat_id, topic_id, title)

    @endpoint
    def set_repository_grant(self, workspace_id: str, user_id: str, repository_id: str,
                             granted: bool) -> _Call[Upsert]:
        return _value("set_repository_grant", workspace_id, user_id, repository_id, granted)

    @endpoint
    def upsert_request(self, workspace_id: str, request_id: str, *, bot_id: str, chat_id: str,
                       topic_id: int, user_id: str,
                       kind: Literal["interactive", "scheduled"],
                       status: Literal["queued", "running", "awaiting_approval", "succeeded",
                                       "failed"],
                       model_provider: str, model_id: str, budget_usd: Money,
                       spent_usd: Money = 0, thread_id: str | None = None) -> _Call[Upsert]:
        return _value("upsert_request", workspace_id, request_id,
                      bot_id, chat_id, topic_id, user_id, kind, status, model_provider,
                      model_id, _money(budget_usd), _money(spent_usd), thread_id)

    @endpoint
    def finish_request(self, workspace_id: str, request_id: str,
                       status: Literal["succeeded", "failed"] = "succeeded",
                       spent_usd: Money | None = None) -> _Call[Finish]:
        """Marks a reported request finished (``succeeded`` by default), with its final spend
        when given; nothing else about it is sent again. ``unchanged`` when it already was."""
        return _value("finish_request", workspace_id, request_id, status,
                      _money_or_none(spent_usd))

    @endpoint
    def upsert_message(self, workspace_id: str, message_id: str, request_id: str,
                       role: Literal["user", "assistant"], speaker_id: str, text: str, *,
                       directed: bool = True, retain_until: datetime | None = None,
                       repositories: Iterable[str] = ()) -> _Call[MessageUpsert]:
        return _value("upsert_message", workspace_id, message_id, request_id, role, speaker_id,
                      text, directed, retain_until, list(repositories))

    @endpoint
    def remove_message(self, workspace_id: str, message_id: str) -> _Call[Upsert]:
        return _value("remove_message", workspace_id, message_id)

    @endpoint
    def resolve_scope(self, workspace_id: str, request_id: str) -> _Call[Scope]:
        return _table("resolve_scope", workspace_id, request_id, parse=_single_scope)

    # A request's memory (docs/api.md, Recall and tools) ------------------------------------------

    @endpoint
    def recall(self, workspace_id: str, request_id: str) -> _Call[Recall]:
        """What a new request starts with. Frozen at the request's first call: a memory made
        later comes to the requests that start after it."""
        return _Call(_statement("recall", 2), (workspace_id, request_id), Recall.model_validate,
                     workspace=workspace_id)

    @endpoint
    def query_memories(self, workspace_id: str, request_id: str, tool_call_id: str,
                       args: Any) -> _Call[QueryResult]:
        """The ``query_memories`` tool; ``args`` as the model gave them (validated there)."""
        return _Call(_statement("query_memories", 4),
                     (workspace_id, request_id, tool_call_id, Jsonb(args)),
                     QueryResult.model_validate, workspace=workspace_id)

    @endpoint
    def manage_memory(self, workspace_id: str, request_id: str, tool_call_id: str,
                      args: Any) -> _Call[ManageResult]:
        """The ``manage_memory`` tool; a refusal is an answer (``status == "refused"``)."""
        return _Call(_statement("manage_memory", 4),
                     (workspace_id, request_id, tool_call_id, Jsonb(args)),
                     ManageResult.model_validate, workspace=workspace_id)

    @endpoint
    def request_citations(self, workspace_id: str, request_id: str) -> _Call[list[str]]:
        """The message ids the request's answer may cite, and no others."""
        return _table("request_citations", workspace_id, request_id,
                      parse=lambda rows: [row["message_id"] for row in rows])

    @endpoint
    def answer_retention_boundary(self, workspace_id: str,
                                  request_id: str) -> _Call[datetime | None]:
        """Keep the request's answer no longer than this (``None``: no limit from memory)."""
        return _value("answer_retention_boundary", workspace_id, request_id)

    @endpoint
    def delete_workspace(self, workspace_id: str) -> _Call[dict[str, Any]]:
        return _value("delete_workspace", workspace_id)

    @endpoint
    def member_memories(self, workspace_id: str, user_id: str) -> _Call[dict[str, Any]]:
        """Every memory holding the member's statements, for export (``memory.member_memories``:
        ids, scope, title and summary, speakers, the member's message ids, hidden_because)."""
        return _value("member_memories", workspace_id, user_id)

    @endpoint
    def erase_member(self, workspace_id: str, user_id: str) -> _Call[dict[str, Any]]:
        """Erases the member's statements in every scope and everything made from them, now
        (``memory.erase_member``); answers the counts."""
        return _value("erase_member", workspace_id, user_id)

    @endpoint
    def workspace_node(self, workspace_id: str) -> _Call[WorkspaceNode]:
        """Where the workspace's calls run best (the client sends them there by itself: this
        is for a look). Asked on the node the client routes to, so ``here`` is true once the
        route is right."""
        return _table("workspace_node", workspace_id,
                      parse=lambda rows: WorkspaceNode.model_validate(rows[0]))

    # The model's tools ---------------------------------------------------------------------------

    @endpoint
    def tool_definitions(self, shape: ToolShape = "database") -> _Call[list[dict[str, Any]]]:
        """The two tools as the database serves them (``memory.tool_definitions()``: JSON
        schemas whose limits are the ones the tools' functions enforce): ``database``
        ``[{name, description, parameters}]``, or in the shape of a model API, ``openai``
        (``{"type": "function", "function": {...}}``) or ``anthropic`` (``{name,
        description, input_schema}``); :func:`pyworker.tools.in_shape`."""
        if shape not in SHAPES:
            raise ValueError(f"no tool shape {shape!r}: the shapes are {', '.join(SHAPES)}")
        return _Call(_statement("tool_definitions", 0),
                     parse=lambda definitions: in_shape(definitions, shape))

    @endpoint
    def call_tool(self, workspace_id: str, request_id: str, name: str,
                  arguments: str | dict[str, Any] | None, tool_call_id: str) -> _Call[ToolResult]:
        """Hands one tool call of the model to its function, arguments and id unchanged.

        ``arguments`` is the JSON text the model produced (or its parsed value). Text that is
        not JSON, an unknown tool name, and the errors its arguments cause in the database
        (:data:`MODEL_ERRORS`) become an ``{"error": ...}`` result for the model, with nothing
        changed. Other errors are raised.
        """
        return _tool_call(workspace_id, request_id, name, arguments, tool_call_id)


PoolT = TypeVar("PoolT", ConnectionPool, AsyncConnectionPool)


@dataclass(frozen=True)
class _PoolSpec:
    """How a client makes its pools: for the DSN given and, on a Citus cluster, for each node
    a workspace's call goes to (the same user, database and settings)."""

    min_size: int
    max_size: int
    timeout: float
    application_name: str
    statement_timeout_ms: int

    def make(self, factory: Callable[..., PoolT], dsn: str) -> PoolT:
        """A pool of ``factory`` for ``dsn`` (autocommit connections, the statement timeout),
        not opened."""
        return factory(dsn, min_size=self.min_size, max_size=self.max_size,
                       timeout=self.timeout, open=False, name=self.application_name,
                       kwargs={"autocommit": True, "application_name": self.application_name,
                               "connect_timeout": 10,
                               "options": f"-c statement_timeout={self.statement_timeout_ms}"})


class _Routed(_MemoryApi):
    """What both clients share: the pool of the DSN given, the routes of workspaces to nodes
    and a pool per node (:mod:`pyworker.routing`)."""

    pool: Any

    def _setup(self, factory: Callable[..., PoolT], dsn: str | None, pool: PoolT | None,
               spec: _PoolSpec, route: bool, route_ttl: float) -> None:
        if (dsn is None) == (pool is None):
            raise ValueError("give a dsn or a pool")
        self._spec = spec
        self._dsn = dsn
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else spec.make(factory, dsn or "")
        self.routes = Routes(route_ttl)
        if not route or dsn is None:  # a pool of the caller's: its connections only
            self.routes.stop("routing turned off" if dsn is not None else "a pool was given")
        self._node_pools: dict[Node, Any] = {}


class MemoryClient(_Routed):
    """The ``memory`` backend API over a connection pool (thread-safe; one call, one transaction).

    Give a DSN (the client opens and owns a pool) or a pool of your own (connections must be
    autocommit). The login role needs ``memory_backend`` only. From asyncio code (aiogram, ...)
    use :class:`AsyncMemoryClient`, which has the same methods.

    On a Citus cluster, given the coordinator's DSN, each workspace's calls go to the node
    holding it, over a pool per node (docs/scaling.md, "Routing"); ``route=False`` (or a pool of
    your own) sends every call to the DSN given. A route is checked on its node after
    ``route_ttl`` seconds. On one server every call goes to the DSN given.
    """

    def __init__(self, dsn: str | None = None, *, pool: ConnectionPool | None = None,
                 min_size: int = 1, max_size: int = 4, timeout: float = 10.0,
                 application_name: str = APPLICATION_NAME,
                 statement_timeout_ms: int = 30_000, route: bool = True,
                 route_ttl: float = ROUTE_TTL) -> None:
        self._setup(ConnectionPool, dsn, pool,
                    _PoolSpec(min_size, max_size, timeout, application_name,
                              statement_timeout_ms), route, route_ttl)
        self._lock = threading.Lock()
        if self._owns_pool:
            self.pool.open()

    def close(self) -> None:
        with self._lock:
            pools, self._node_pools = list(self._node_pools.values()), {}
        for node_pool in pools:
            node_pool.close()
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pool(self, node: Node | None) -> ConnectionPool:
        if node is None:
            return self.pool  # type: ignore[no-any-return]
        with self._lock:
            found = self._node_pools.get(node)
            if found is None:
                found = self._node_pools[node] = self._spec.make(ConnectionPool,
                                                                 node.dsn(self._dsn or ""))
                found.open()
            return found

    def _locate(self, workspace_id: str, node: Node | None) -> Node | None:
        """Asks where the workspace is (``memory.workspace_node``) on its node, or on the DSN
        given, and answers the node to send its calls to."""
        for asked in self.routes.askings(node):
            try:
                with self._pool(asked).connection() as conn:
                    rows = conn.execute(WHERE, (workspace_id,)).fetchall()
            except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if self.routes.failed(asked, exc, reached=False):
                    continue
                return None
            except psycopg.Error as exc:
                if self.routes.failed(asked, exc, reached=True):
                    continue
                return None
            return self.routes.learn(workspace_id, asked, rows[0] if rows else None)
        return None

    def _execute(self, call: _Call[T]) -> T:
        """Runs one call in its own autocommit transaction, on its workspace's node."""
        if call.query is None:
            return call.parse(None)
        node, check = self.routes.want(call.workspace)
        if check:
            node = self._locate(call.workspace, node)
        for target in ([node, None] if node is not None else [None]):
            try:
                with self._pool(target).connection() as conn, \
                        conn.cursor(row_factory=dict_row) as cur:
                    cur.execute(call.query, call.params)
                    raw = call.fetch(cur.fetchall())
            except PoolTimeout as exc:
                if target is not None:  # the node is not reached, nothing was sent
                    self.routes.unreachable(target)
                    continue
                return call.fail(exc)
            except psycopg.Error as exc:
                if target is not None and isinstance(_mapped_error(exc), DatabaseUnavailable):
                    self.routes.forget(call.workspace)
                return call.fail(exc)
            return call.parse(raw)
        raise AssertionError("unreachable: the DSN given answers or fails")


class AsyncMemoryClient(_Routed):
    """:class:`MemoryClient` for asyncio: the same methods, each a coroutine, over psycopg's
    asyncio pool (``AsyncConnection``s), routed the same way.

        async with AsyncMemoryClient(dsn) as memory:
            recall = await memory.recall("acme", "r9")

    Give a DSN (the client owns a pool, opened by ``async with`` or :meth:`open`) or an
    ``AsyncConnectionPool`` of your own (open, connections autocommit).
    """

    def __init__(self, dsn: str | None = None, *, pool: AsyncConnectionPool | None = None,
                 min_size: int = 1, max_size: int = 4, timeout: float = 10.0,
                 application_name: str = APPLICATION_NAME,
                 statement_timeout_ms: int = 30_000, route: bool = True,
                 route_ttl: float = ROUTE_TTL) -> None:
        self._setup(AsyncConnectionPool, dsn, pool,
                    _PoolSpec(min_size, max_size, timeout, application_name,
                              statement_timeout_ms), route, route_ttl)

    async def open(self) -> Self:
        if self._owns_pool:
            await self.pool.open()
        return self

    async def close(self) -> None:
        pools, self._node_pools = list(self._node_pools.values()), {}
        for node_pool in pools:
            await node_pool.close()
        if self._owns_pool:
            await self.pool.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _pool(self, node: Node | None) -> AsyncConnectionPool:
        if node is None:
            return self.pool  # type: ignore[no-any-return]
        found = self._node_pools.get(node)
        if found is None:
            # No await between the look-up and the store: one pool per node.
            found = self._node_pools[node] = self._spec.make(AsyncConnectionPool,
                                                             node.dsn(self._dsn or ""))
            await found.open()
        return found

    async def _locate(self, workspace_id: str, node: Node | None) -> Node | None:
        """:meth:`MemoryClient._locate`, awaited."""
        for asked in self.routes.askings(node):
            try:
                async with (await self._pool(asked)).connection() as conn:
                    rows = await (await conn.execute(WHERE, (workspace_id,))).fetchall()
            except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if self.routes.failed(asked, exc, reached=False):
                    continue
                return None
            except psycopg.Error as exc:
                if self.routes.failed(asked, exc, reached=True):
                    continue
                return None
            return self.routes.learn(workspace_id, asked, rows[0] if rows else None)
        return None

    async def _execute(self, call: _Call[T]) -> T:
        """Runs one call in its own autocommit transaction, on its workspace's node."""
        if call.query is None:
            return call.parse(None)
        node, check = self.routes.want(call.workspace)
        if check:
            node = await self._locate(call.workspace, node)
        for target in ([node, None] if node is not None else [None]):
            try:
                async with (await self._pool(target)).connection() as conn, \
                        conn.cursor(row_factory=dict_row) as cur:
                    await cur.execute(call.query, call.params)
                    raw = call.fetch(await cur.fetchall())
            except PoolTimeout as exc:
                if target is not None:
                    self.routes.unreachable(target)
                    continue
                return call.fail(exc)
            except psycopg.Error as exc:
                if target is not None and isinstance(_mapped_error(exc), DatabaseUnavailable):
                    self.routes.forget(call.workspace)
                return call.fail(exc)
            return call.parse(raw)
        raise AssertionError("unreachable: the DSN given answers or fails")
