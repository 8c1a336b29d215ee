"""The one module that talks SQL: calls to the ``memory`` API functions, nothing else.

Our SQLSTATE codes (class MB) become :mod:`pyworker.errors` exceptions; a lost connection
becomes :class:`DatabaseUnavailable` and the next call reconnects.

On a Citus cluster, given the coordinator's DSN, the calls of a workspace go to the node holding
it (:mod:`pyworker.routing`), each node over a connection of its own; a claim goes to each node
in turn (memory.claim_job called on a worker node picks among the workspaces it holds), and the
calls of the job it gives go where it was claimed. Calls across workspaces (the maintenance
walk, the operator views) stay on the DSN given. On one server nothing changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pyworker.errors import translate
from pyworker.routing import NODES, WHERE, Node, Routes, no_routing

APPLICATION_NAME = "pimem-worker"

# The functions whose first argument is the workspace their call works on: sent to its node.
WORKSPACE_CALLS = frozenset({
    "extend_lease", "start_attempt", "save_checkpoint", "commit_job", "fail_job",
    "run_maintenance", "recall", "query_memories", "manage_memory", "explain_record",
    "retry_job", "set_workspace_paused"})


def _as_written(text: str) -> str:
    return text


class DatabaseUnavailable(Exception):
    """The connection is gone (server restart, network); the caller retries later."""


_HOME: Any = object()  # no node pinned: a call goes where its workspace is


class Database:
    """Autocommit connections, opened on first use and reopened after a loss: one to the DSN
    given and, on a Citus cluster, one to each node a workspace's call went to. ``routes`` may
    be shared with another Database of the same process (the worker's lease heartbeat);
    ``route=False`` sends every call to the DSN given."""

    def __init__(self, dsn: str, *, application_name: str = APPLICATION_NAME,
                 statement_timeout_ms: int = 30_000, routes: Routes | None = None,
                 route: bool = True) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.statement_timeout_ms = statement_timeout_ms
        self.routes = routes if routes is not None else Routes()
        if not route:
            self.routes.stop("routing turned off")
        self._conns: dict[Node | None, psycopg.Connection[Any]] = {}
        self._pinned: Any = _HOME

    def sibling(self, application_name: str) -> Database:
        """Another Database of the same DSN with connections of its own, sharing the routes
        (for another thread)."""
        return Database(self.dsn, application_name=application_name,
                        statement_timeout_ms=self.statement_timeout_ms, routes=self.routes)

    def _connection(self, node: Node | None = None) -> psycopg.Connection[Any]:
        conn = self._conns.get(node)
        if conn is None or conn.closed or conn.broken:
            self._close(node)
            try:
                conn = psycopg.connect(
                    self.dsn if node is None else node.dsn(self.dsn), autocommit=True,
                    connect_timeout=10, application_name=self.application_name,
                    options=f"-c statement_timeout={self.statement_timeout_ms}")
            except psycopg.OperationalError as exc:
                raise DatabaseUnavailable(str(exc).strip()) from exc
            self._conns[node] = conn
        return conn

    def _close(self, node: Node | None) -> None:
        conn = self._conns.pop(node, None)
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def close(self) -> None:
        for node in list(self._conns):
            self._close(node)

    # Where a call goes -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _on(self, node: Node | None) -> Iterator[None]:
        """Sends the calls made inside to ``node`` (None: the DSN given), whatever their
        workspace."""
        saved, self._pinned = self._pinned, node
        try:
            yield
        finally:
            self._pinned = saved

    def _ask(self, node: Node | None, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """Rows of a routing question asked on ``node``."""
        return self._connection(node).execute(query, params).fetchall()

    def node_of(self, workspace_id: Any) -> Node | None:
        """The node to send the workspace's calls to (None: the DSN given), asking where it is
        when the route is unknown or due for a check; a node that cannot be reached is passed
        over for a while, and a question the database cannot answer turns routing off."""
        node, check = self.routes.want(workspace_id)
        if not check:
            return node
        for asked in self.routes.askings(node):
            try:
                rows = self._ask(asked, WHERE, (workspace_id,))
            except DatabaseUnavailable as exc:
                if self.routes.failed(asked, exc, reached=False):
                    continue
                return None
            except psycopg.Error as exc:
                conn = self._conns.get(asked)
                reached = conn is not None and not conn.broken
                if not reached:
                    self._close(asked)
                if self.routes.failed(asked, exc, reached=reached):
                    continue
                return None
            return self.routes.learn(workspace_id, asked, rows[0] if rows else None)
        return None

    def call(self, function: str, *args: Any) -> Any:
        """``select memory.<function>(args...)``: its single value, with our errors mapped. The
        call of a workspace goes to the node holding it (routing)."""
        if not function.replace("_", "").isalnum():
            raise ValueError(f"not an API function name: {function}")
        # dicts go as jsonb, floats as numeric (no implicit float -> numeric cast); lists stay
        # arrays (text[]); wrap a JSON list in Jsonb yourself.
        params = tuple(Jsonb(a) if isinstance(a, dict) else Decimal(str(a))
                       if isinstance(a, float) else a for a in args)
        query = f"select memory.{function}({', '.join(['%s'] * len(params))})"
        if self._pinned is not _HOME:
            node = self._pinned
        elif function in WORKSPACE_CALLS and args:
            node = self.node_of(args[0])
        else:
            node = None
        try:
            conn = self._connection(node)
        except DatabaseUnavailable:
            if node is None or self._pinned is not _HOME:
                raise
            self.routes.unreachable(node)  # nothing was sent: the DSN given takes the call
            node, conn = None, self._connection(None)
        try:
            row = conn.execute(query.encode(), params).fetchone()
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if conn.broken or conn.closed:
                self._close(node)
                if node is not None and args and isinstance(args[0], str):
                    self.routes.forget(args[0])
                raise DatabaseUnavailable(str(exc).strip()) from exc
            raise translate(exc) from exc
        except psycopg.Error as exc:
            raise translate(exc) from exc
        return row[0] if row else None

    # The job functions (memory_worker role) ----------------------------------------------------

    def run_maintenance(self, workspace_id: str | None = None,
                        budget_seconds: float = 30.0) -> dict[str, Any]:
        """Maintenance for one workspace, or for every due workspace one at a time (each its
        own short transaction, so no workspace lock is held across workspaces), until all were
        visited or ``budget_seconds`` have passed. Returns the summed counts, and under
        ``maintained`` the workspaces it visited."""
        if workspace_id is not None:
            counts = self.call("run_maintenance", workspace_id) or {}
            return {**counts, "maintained": [workspace_id]}
        total: dict[str, Any] = {"workspaces": 0}
        maintained: list[str] = []
        deadline = time.monotonic() + budget_seconds
        after: str | None = None
        while time.monotonic() < deadline:
            counts = self.call("maintain_next_workspace", after)
            if not counts:
                break
            after = counts["workspace_id"]
            maintained.append(str(after))
            total["workspaces"] += 1
            for key, value in counts.items():
                if isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
        return {**total, "maintained": maintained}

    def claim_nodes(self) -> list[Node | None]:
        """The nodes to claim on, in this claim's order (None: the DSN given): on a Citus
        cluster every node holding workspaces (``memory.workspace_nodes``, asked again every
        ``ttl`` seconds), each claim starting at the next one; on one server the DSN given."""
        if self.routes.stale_nodes():
            try:
                self.routes.learn_nodes(self._ask(None, NODES))
            except psycopg.Error as exc:
                if no_routing(exc):
                    self.routes.stop(f"memory.workspace_nodes: {exc.sqlstate}")
                else:
                    raise translate(exc) from exc
        return self.routes.claim_order()

    def claim_job(self, worker_id: str) -> dict[str, Any] | None:
        """One job, claimed on each node in turn until one gives a job; its workspace's calls
        then go to the node that gave it. A node that cannot be reached is passed over; when
        none can, :class:`DatabaseUnavailable`."""
        unavailable: DatabaseUnavailable | None = None
        answered = False
        for node in self.claim_nodes():
            with self._on(node):
                try:
                    payload = self.call("claim_job", worker_id)
                except DatabaseUnavailable as exc:
                    if node is None:
                        raise
                    self.routes.unreachable(node)
                    unavailable = exc
                    continue
            answered = True
            if payload is not None:
                self.routes.claimed_on(str(payload.get("workspace_id")), node)
                return payload  # type: ignore[no-any-return]
        if unavailable is not None and not answered:
            raise unavailable
        return None

    def extend_lease(self, workspace_id: str, job_id: int, token: str) -> datetime:
        return self.call("extend_lease", workspace_id, job_id, token)  # type: ignore[no-any-return]

    def start_attempt(self, workspace_id: str, job_id: int, token: str,
                      reserve_usd: Decimal) -> int:
        return int(self.call("start_attempt", workspace_id, job_id, token, reserve_usd))

    def save_checkpoint(self, workspace_id: str, job_id: int, token: str, output: str,
                        usage: dict[str, Any]) -> None:
        """``output`` is the JSON text of the model's reply, sent as it is: the database reads
        it (numbers exactly as written) and validates it."""
        self.call("save_checkpoint", workspace_id, job_id, token,
                  Jsonb(output, dumps=_as_written), usage)

    def commit_job(self, workspace_id: str, job_id: int, token: str) -> dict[str, Any]:
        return self.call("commit_job", workspace_id, job_id, token) or {}

    def fail_job(self, workspace_id: str, job_id: int, token: str, outcome: str, error: str,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """Reports the failed claim; answers the job's new status as the database decided it
        (``{"status": "pending" | "stopped", "why": ...}``)."""
        return self.call("fail_job", workspace_id, job_id, token,  # type: ignore[no-any-return]
                         outcome, error, Jsonb(usage) if usage is not None else None)

    def advance_clock(self, interval: str) -> datetime:
        """Moves the memory clock (``memory_private.advance_clock``; superuser, demo and tests
        only: production never moves it)."""
        conn = self._connection()
        try:
            row = conn.execute("select memory_private.advance_clock(%s::interval)",
                               (interval,)).fetchone()
        except psycopg.Error as exc:
            raise translate(exc) from exc
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    # Recall and control (memory_backend role), used by the demo ------------------------------

    def recall(self, workspace_id: str, request_id: str) -> dict[str, Any]:
        return self.call("recall", workspace_id, request_id)  # type: ignore[no-any-return]

    def query_memories(self, workspace_id: str, request_id: str, tool_call_id: str,
                       args: dict[str, Any]) -> dict[str, Any]:
        return self.call("query_memories", workspace_id, request_id,  # type: ignore[no-any-return]
                         tool_call_id, args)

    def manage_memory(self, workspace_id: str, request_id: str, tool_call_id: str,
                      args: dict[str, Any]) -> dict[str, Any]:
        return self.call("manage_memory", workspace_id, request_id,  # type: ignore[no-any-return]
                         tool_call_id, args)

    # Operator (memory_operator role): views and admin functions ------------------------------
    # Used by ``pimem status`` and ``pimem explain`` (pyworker/status.py). Owned by the
    # operations issue; views are read by name from OPERATOR_VIEWS only, through their functions
    # of the workspace.

    def view_rows(self, view: str, *, workspace_id: str | None = None,
                  where: dict[str, Any] | None = None, order_by: tuple[str, ...] = (),
                  limit: int | None = None, count_records: bool = True
                  ) -> list[dict[str, Any]]:
        """Rows of an operator view as dicts, read through its function of the workspace
        (``memory.<view>(workspace)``, sql/80_operator.sql): one workspace's rows when
        ``workspace_id`` is given (the database reads that workspace only), every workspace's
        when it is None. ``where`` maps another column to a value (equality) or a list (any of);
        ``order_by`` names columns, ``-col`` descending. ``count_records`` False (workspace_status
        only) leaves its validity counts out (NULL), for a caller that reads them per scope."""
        if view not in OPERATOR_VIEWS:
            raise ValueError(f"not an operator view: {view}")
        arguments: list[Any] = [workspace_id]
        if view == "workspace_status":
            arguments.append(count_records)
        elif not count_records:
            raise ValueError("only workspace_status leaves its record counts out")
        query = sql.SQL("select * from {}({})").format(
            sql.Identifier("memory", view), sql.SQL(", ").join(sql.Placeholder() * len(arguments)))
        params: list[Any] = arguments
        conditions = []
        for column, wanted in (where or {}).items():
            if isinstance(wanted, (list, tuple)):
                conditions.append(sql.SQL("{} = any(%s)").format(sql.Identifier(column)))
                params.append(list(wanted))
            else:
                conditions.append(sql.SQL("{} = %s").format(sql.Identifier(column)))
                params.append(wanted)
        if conditions:
            query += sql.SQL(" where ") + sql.SQL(" and ").join(conditions)
        if order_by:
            query += sql.SQL(" order by ") + sql.SQL(", ").join(
                sql.SQL("{} desc nulls last").format(sql.Identifier(c[1:])) if c.startswith("-")
                else sql.SQL("{}").format(sql.Identifier(c)) for c in order_by)
        if limit is not None:
            query += sql.SQL(" limit %s")
            params.append(limit)
        conn = self._connection()
        try:
            with conn.cursor(row_factory=dict_row) as cur:
                return cur.execute(query, params).fetchall()
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if conn.broken or conn.closed:
                self.close()
                raise DatabaseUnavailable(str(exc).strip()) from exc
            raise translate(exc) from exc
        except psycopg.Error as exc:
            raise translate(exc) from exc

    def waiting(self, workspace_id: str | None = None) -> list[dict[str, Any]]:
        """What waits to become a memory and why (``memory.waiting_status``: per workspace and
        reason, the scheduler's own verdict counted in the database), read from that workspace
        alone when one is given. For memory_operator and memory_worker."""
        return self.view_rows("waiting_status", workspace_id=workspace_id)

    def current_role(self) -> str:
        """The role this session acts as (for an error that names it)."""
        conn = self._connection()
        row = conn.execute("select current_user").fetchone()
        return str(row[0]) if row else "?"

    def explain_record(self, workspace_id: str, record_id: int,
                       requester: str | None = None) -> dict[str, Any]:
        return self.call("explain_record", workspace_id, record_id,  # type: ignore[no-any-return]
                         requester)

    def retry_job(self, workspace_id: str, job_id: int) -> dict[str, Any]:
        return self.call("retry_job", workspace_id, job_id)  # type: ignore[no-any-return]

    def set_workspace_paused(self, workspace_id: str, paused: bool) -> dict[str, Any]:
        return self.call("set_workspace_paused", workspace_id,  # type: ignore[no-any-return]
                         paused)


OPERATOR_VIEWS = frozenset({"workspace_status", "scope_status", "record_status", "job_status",
                            "request_memory_charges", "waiting_status"})
