"""Where each workspace's calls go: the node holding the workspace, on a Citus cluster.

Given the coordinator's DSN, the clients (:mod:`pyworker.client`) and the worker
(:mod:`pyworker.db`) ask the database where a workspace is (``memory.workspace_node``, from
Citus's metadata: docs/scaling.md, "Routing") and send its calls to that node, over a
connection (or a pool) per node with the same user, database and settings. A call made there
runs every statement on that node; a call made anywhere else is answered the same, through
more nodes. So a route that went stale (an operator moved the workspace's shards) costs time,
never an answer: a route is trusted for ``ttl`` seconds, then asked again on its own node, which
says whether it still holds the workspace and where it is otherwise.

On one server ``memory.workspace_node`` answers that the server holds every workspace: the first
answer turns routing off, and every call goes to the DSN given, as before. So does a database
whose schema has no ``memory.workspace_node`` yet, or a role that may not call it.

:class:`Routes` is the map, shared by threads (the worker's lease heartbeat uses its job's
route); the clients do the asking, each with its own kind of connection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pyworker.logs import event

ROUTE_TTL = 30.0  # seconds a route is trusted before it is checked on its node
WHERE = "select host, port, here from memory.workspace_node(%s)"
NODES = "select host, port, here from memory.workspace_nodes()"


@dataclass(frozen=True)
class Node:
    """A node of the cluster, as Citus's metadata names it (``pg_dist_node``)."""

    host: str
    port: int

    def dsn(self, home: str) -> str:
        """The DSN of this node: ``home`` (the coordinator's) with its host and port."""
        info = psycopg.conninfo.conninfo_to_dict(home)
        info.pop("hostaddr", None)
        info.update(host=self.host, port=str(self.port))
        return psycopg.conninfo.make_conninfo("", **{k: v for k, v in info.items() if v is not None})

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


Answer = tuple[Any, Any, Any]  # a row of memory.workspace_node / workspace_nodes: host, port, here


def no_routing(exc: psycopg.Error) -> bool:
    """Whether an error of asking means there is nothing to route with: a schema without
    ``memory.workspace_node`` (an older release) or a role that may not call it."""
    return exc.sqlstate in ("42883", "42501", "3F000")


class Routes:
    """The map of workspaces to nodes (None: the DSN given), each route with the time it was
    learnt; the nodes that hold workspaces, for the worker's claims; the nodes that could not be
    reached lately. Thread-safe."""

    def __init__(self, ttl: float = ROUTE_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self.routing: bool | None = None  # None until the first answer; False: nothing to route
        self._routes: dict[str, tuple[Node | None, float]] = {}
        self._nodes: tuple[list[Node | None], float] | None = None
        self._down: dict[Node, float] = {}
        self._turn = 0
        self._lock = threading.Lock()

    # A workspace's node ---------------------------------------------------------------------

    def want(self, workspace_id: Any) -> tuple[Node | None, bool]:
        """The node to send the workspace's calls to (None: the DSN given), and whether to ask
        first, there, where the workspace is: it has no route yet, or one older than ``ttl``."""
        if self.routing is False or not isinstance(workspace_id, str):
            return None, False
        with self._lock:
            known = self._routes.get(workspace_id)
            if known is None:
                return None, True
            node, learnt = known
            if node is not None and self._is_down(node):
                return None, True
            return node, self.clock() - learnt >= self.ttl

    def learn(self, workspace_id: str, asked: Node | None, answer: Answer | None) -> Node | None:
        """Records where ``memory.workspace_node`` asked on ``asked`` (None: the DSN given) says
        the workspace is, and answers the node to send its calls to."""
        if answer is None:
            return None
        host, port, here = answer
        if asked is None and here and host is None:
            self.stop("one server: it holds every workspace")
            return None
        self.routing = True
        if here:
            node = asked
        elif host is None:
            node = None  # no node can take its calls directly: the DSN given routes them
        else:
            node = Node(str(host), int(port))
        with self._lock:
            if node is not None and self._is_down(node):
                node = None
            before = self._routes.get(workspace_id)
            self._routes[workspace_id] = (node, self.clock())
        if before is not None and before[0] != node:
            event("route_changed", logging.INFO, workspace_id=workspace_id,
                  before=str(before[0] or "home"), now=str(node or "home"))
        return node

    @staticmethod
    def askings(node: Node | None) -> list[Node | None]:
        """Where to ask where a workspace is: on its node, then (that node unreachable) on the
        DSN given; with no route, on the DSN given."""
        return [node, None] if node is not None else [None]

    def failed(self, asked: Node | None, exc: Exception, *, reached: bool) -> bool:
        """Takes an error of asking on ``asked`` (``reached``: the node answered, with an
        error); answers whether to ask on the next place. Else the call goes to the DSN given,
        which answers it, or says what is wrong (an invalid workspace id, a lost database)."""
        if not reached:
            if asked is None:
                return False
            self.unreachable(asked)
            return True
        if isinstance(exc, psycopg.Error) and no_routing(exc):
            self.stop(f"memory.workspace_node: {exc.sqlstate}")
        return False

    def claimed_on(self, workspace_id: str, node: Node | None) -> None:
        """A job of the workspace was claimed on ``node`` (which picks among the workspaces it
        holds): that is its route."""
        if node is not None:
            with self._lock:
                self._routes[workspace_id] = (node, self.clock())

    def forget(self, workspace_id: str) -> None:
        with self._lock:
            self._routes.pop(workspace_id, None)

    def unreachable(self, node: Node) -> None:
        """``node`` could not be reached: its workspaces go to the DSN given for ``ttl``
        seconds (which reaches them through Citus, or fails as the node does)."""
        event("node_unreachable", logging.WARNING, node=str(node), retry_in=self.ttl)
        with self._lock:
            self._down[node] = self.clock() + self.ttl
            self._nodes = None

    def stop(self, why: str) -> None:
        """Nothing to route: every call goes to the DSN given."""
        if self.routing is not False:
            event("routing_off", logging.DEBUG, why=why)
        self.routing = False

    def _is_down(self, node: Node) -> bool:
        until = self._down.get(node)
        if until is None:
            return False
        if self.clock() >= until:
            del self._down[node]
            return False
        return True

    # The nodes, for claims -------------------------------------------------------------------

    def stale_nodes(self) -> bool:
        """Whether the list of nodes holding workspaces must be asked for (again)."""
        if self.routing is False:
            return False
        with self._lock:
            return self._nodes is None or self.clock() - self._nodes[1] >= self.ttl

    def learn_nodes(self, rows: Sequence[Answer]) -> None:
        """Records ``memory.workspace_nodes`` asked on the DSN given."""
        nodes: list[Node | None] = []
        for host, port, here in rows:
            if host is None and here:
                self.stop("one server: it holds every workspace")
                nodes = [None]
                break
            node = None if here else Node(str(host), int(port))
            if node not in nodes:
                nodes.append(node)
        if nodes and self.routing is not False:
            self.routing = True
        with self._lock:
            self._nodes = (nodes or [None], self.clock())

    def claim_order(self) -> list[Node | None]:
        """The nodes to claim on, each in turn from the next one, so that workers spread their
        claims (and their jobs' calls) over the nodes; the ones down lately last."""
        with self._lock:
            nodes = list(self._nodes[0]) if self._nodes and self.routing else [None]
            start = self._turn % len(nodes)
            self._turn += 1
            order = nodes[start:] + nodes[:start]
            return [n for n in order if n is None or not self._is_down(n)] + [
                n for n in order if n is not None and self._is_down(n)]
