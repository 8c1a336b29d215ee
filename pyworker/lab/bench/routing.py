"""``pimem bench --server citus``: calls routed to the workspace's node, beside the same calls
through the coordinator and on one server with the same data (docs/scaling.md, "Routing").

Three ways to send the same calls:
- ``one_server``: a throwaway server of the machine's binaries, the same dataset (W workspaces of
  256 records) built in it;
- ``coordinator``: the cluster, every call to the coordinator, which routes each statement;
- ``routed``: the cluster, each workspace's calls to the node holding it
  (``memory.workspace_node``, a connection per node), as the clients and the worker send them.

Measured: the latency of recall (a new request), a literal search and ingest
(``upsert_message``, one per transaction), each way's samples interleaved with the others' so
that a burst of load from elsewhere hits all three alike; then, one way at a time, a fixed load
(those calls and extraction jobs run by two worker processes) with the CPU seconds each node
spent on it, which gives the cluster's CPU per unit of load and the coordinator's share of it;
and the statements Citus plans for each call (``citus_stat_counters``), with the connections
they cross.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from pyworker.db import Database
from pyworker.lab.bench import data, db
from pyworker.routing import WHERE, Node

Section = dict[str, Any]
MODES = ("one_server", "coordinator", "routed")
TARGET_RECALL_X_ONE_SERVER = 2.0    # a routed recall's p50 within 2x one server's
TARGET_COORDINATOR_SHARE = 0.05     # of the cluster's CPU, routed


class Sender:
    """Connections to send calls by: to the DSN given, or (``route``) to the node holding each
    call's workspace, found once per workspace with ``memory.workspace_node``."""

    def __init__(self, dsn: str, *, route: bool) -> None:
        self.dsn = dsn
        self.route = route
        self.home = psycopg.connect(dsn, autocommit=True)
        self._nodes: dict[Node, psycopg.Connection[Any]] = {}
        self._of: dict[str, psycopg.Connection[Any]] = {}

    def conn(self, workspace_id: str) -> psycopg.Connection[Any]:
        if not self.route:
            return self.home
        found = self._of.get(workspace_id)
        if found is None:
            row = self.home.execute(WHERE, (workspace_id,)).fetchone()
            if row is None or row[0] is None or row[2]:
                found = self.home
            else:
                node = Node(str(row[0]), int(row[1]))
                if node not in self._nodes:
                    self._nodes[node] = psycopg.connect(node.dsn(self.dsn), autocommit=True)
                found = self._nodes[node]
            self._of[workspace_id] = found
        return found

    def call(self, query: str, params: tuple[Any, ...]) -> Any:
        row = self.conn(str(params[0])).execute(query, params, prepare=True).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        for conn in [self.home, *self._nodes.values()]:
            conn.close()


# Statements per call ----------------------------------------------------------------------------

class Counters:
    """Citus's counters of every node of the cluster (``citus_stat_counters``): the statements
    Citus planned (single- and multi-shard executions) and the connections they used to other
    nodes. Counts only the connections opened after :meth:`on`."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            nodes = [Node(str(h), int(p)) for h, p in conn.execute(
                "select nodename, nodeport from pg_dist_node "
                "where noderole = 'primary' and isactive order by groupid")]
        self.conns = [psycopg.connect(n.dsn(dsn), autocommit=True) for n in nodes]

    def on(self, enabled: bool) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            database = conn.execute("select current_database()").fetchone()[0]  # type: ignore[index]
            action = "set citus.enable_stat_counters = on" if enabled else \
                "reset citus.enable_stat_counters"
            conn.execute(psycopg.sql.SQL("alter database {} " + action).format(
                psycopg.sql.Identifier(database)))

    def take(self) -> tuple[int, int]:
        """(statements, connections) since the last take, on all nodes together."""
        statements = connections = 0
        for conn in self.conns:
            row = conn.execute("""
                select query_execution_single_shard + query_execution_multi_shard,
                       connection_establishment_succeeded + connection_reused
                  from citus_stat_counters where name = current_database()""").fetchone()
            conn.execute("select citus_stat_counters_reset()")
            if row is not None:
                statements += int(row[0])
                connections += int(row[1])
        return statements, connections

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def count_statements(dsn: str, width: int, log: Callable[[str], None]) -> Section:
    """The statements Citus plans for one call of each kind, and the connections to other
    nodes they take, through the coordinator and routed (averaged over a few calls of each)."""
    counters = Counters(dsn)
    counters.on(True)
    calls = 4
    out: Section = {"status": "ok", "calls_each": calls, "through": {}}
    try:
        for mode in ("coordinator", "routed"):
            log(f"statements per call, {mode}")
            out["through"][mode] = _count_one_way(dsn, mode, width, counters, calls)
    finally:
        counters.on(False)
        counters.close()
    return out


def _count_one_way(dsn: str, mode: str, width: int, counters: Counters,
                   calls: int) -> Section:
    from pyworker.adapters.offline import OfflineAdapter
    from pyworker.lab.bench import jobs as bench_jobs
    from pyworker.worker import Worker, WorkerConfig

    route = mode == "routed"
    tag = f"st{mode[0]}{time.time_ns() % 10**8}"  # new requests and messages each run
    sender = Sender(dsn, route=route)
    pairs = db.new_requests(sender.home, width, calls, tag)
    rows = db.ingest_rows(width, calls, tag)
    for ws, _ in pairs:
        sender.conn(ws)  # the connections opened (and the routes found) before counting
    search = f'{{"query": "{data.SEARCH_TERM}"}}'
    kinds: list[tuple[str, Callable[[int], tuple[str, tuple[Any, ...]]]]] = [
        ("recall (new request)", lambda i: ("select memory.recall(%s, %s)", pairs[i])),
        ("recall (again)", lambda i: ("select memory.recall(%s, %s)", pairs[i])),
        ("query_memories: literal search", lambda i: (
            "select memory.query_memories(%s, %s, %s, %s::jsonb)",
            (*pairs[i], f"{tag}-s{i}", search))),
        ("query_memories: browse", lambda i: (
            "select memory.query_memories(%s, %s, %s, '{}'::jsonb)",
            (*pairs[i], f"{tag}-b{i}"))),
        ("upsert_message", lambda i: (db.UPSERT_SQL, rows[i])),
    ]
    figures: Section = {}
    for name, make in kinds:
        counters.take()
        for i in range(calls):
            sender.call(*make(i))
        statements, connections = counters.take()
        figures[name] = {"statements": round(statements / calls, 1),
                         "connections": round(connections / calls, 1)}
    sender.close()
    # A job's calls, one job after another, as the worker makes them.
    bench_jobs.prepare_jobs(dsn, tag, calls)
    counting = _CountingDatabase(dsn, counters, route=route)
    worker = Worker(WorkerConfig(dsn=dsn, interval=0, maintenance=False,
                                 worker_id=f"bench-statements-{mode}"),
                    OfflineAdapter(), db=counting)
    done = 0
    while done < calls and worker.tick().status != "idle":
        done += 1
    worker.adapter.close()
    counting.close()
    for name, (statements, connections) in counting.counts.items():
        figures[f"job: {name}"] = {"statements": round(statements / max(done, 1), 1),
                                   "connections": round(connections / max(done, 1), 1)}
    return figures


class _CountingDatabase(Database):
    """The worker's database, with Citus's counters read around each call (per function)."""

    def __init__(self, dsn: str, counters: Counters, *, route: bool) -> None:
        super().__init__(dsn, route=route)
        self._counters = counters
        self.counts: dict[str, tuple[int, int]] = {}

    def run_maintenance(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def call(self, function: str, *args: Any) -> Any:
        self._counters.take()
        try:
            return super().call(function, *args)
        finally:
            statements, connections = self._counters.take()
            before = self.counts.get(function, (0, 0))
            self.counts[function] = (before[0] + statements, before[1] + connections)


# Latency, interleaved ----------------------------------------------------------------------------

def interleaved_modes(senders: dict[str, Sender], make: Callable[[str, int], tuple[str, tuple[Any, ...]]],
                      n: int, *, warmup: int = db.WARMUP) -> dict[str, Any]:
    """``make(mode, i)``'s call sent by each mode's sender in turn, n times after a warm-up;
    the p50/p99 of each."""
    samples: dict[str, list[int]] = {mode: [] for mode in senders}
    clock = time.perf_counter_ns
    for i in range(-warmup, n):
        for mode, sender in senders.items():
            query, params = make(mode, i)
            t0 = clock()
            sender.call(query, params)
            if i >= 0:
                samples[mode].append(clock() - t0)
    return {mode: db.summarize(ns) for mode, ns in samples.items()}


# The whole section -------------------------------------------------------------------------------

def cpu_of(nodes: dict[str, Path]) -> dict[str, float]:
    from pyworker.lab.servers import server_cpu_seconds

    spent = {name: server_cpu_seconds(path) for name, path in nodes.items()}
    return {name: value for name, value in spent.items() if value is not None}


def measure(cluster_dsn: str, cluster_nodes: dict[str, Path], width: int, *, samples: int,
            jobs: int, log: Callable[[str], None]) -> Section:
    """The routing section: one server beside the cluster, through the coordinator and
    routed."""
    from pyworker import schema
    from pyworker.lab.bench import jobs as bench_jobs
    from pyworker.lab.servers import LocalCluster, find_bindir

    bindir = find_bindir()
    if bindir is None:
        return db.not_available("no local PostgreSQL binaries for the one-server side")
    log(f"routing: one server beside the cluster, {width} workspaces built in it")
    local = LocalCluster(bindir).init().start()
    try:
        with psycopg.connect(local.dsn(), autocommit=True) as conn:
            conn.execute("create database pimem_bench")
        local_dsn = local.dsn("pimem_bench")
        with psycopg.connect(local_dsn, autocommit=True) as conn:
            schema.apply_canonical(conn)
            data.grow(conn, 0, width, now=datetime.now(UTC))
        dsns = {"one_server": local_dsn, "coordinator": cluster_dsn, "routed": cluster_dsn}
        nodes = {"one_server": {"server": local.data}, "coordinator": cluster_nodes,
                 "routed": cluster_nodes}
        senders = {mode: Sender(dsn, route=mode == "routed") for mode, dsn in dsns.items()}
        result: Section = {"status": "ok", "workspaces": width, "samples": samples,
                           "latency": {}, "load": {}}
        try:
            log("routing: latency, the three ways interleaved")
            pairs = {mode: db.new_requests(senders[mode].home, width, samples + db.WARMUP,
                                           f"rt{mode[0]}") for mode in MODES}
            result["latency"]["recall (new request)"] = interleaved_modes(
                senders, lambda mode, i: ("select memory.recall(%s, %s)",
                                          pairs[mode][i % len(pairs[mode])]), samples)
            search = f'{{"query": "{data.SEARCH_TERM}"}}'
            result["latency"]["query_memories: literal search"] = interleaved_modes(
                senders, lambda mode, i: ("select memory.query_memories(%s, %s, %s, %s::jsonb)",
                                          (*pairs[mode][i % len(pairs[mode])], f"rt{i}",
                                           search)), samples)
            rows = {mode: db.ingest_rows(width, samples + db.WARMUP, f"rt{mode[0]}")
                    for mode in MODES}
            result["latency"]["upsert_message"] = interleaved_modes(
                senders, lambda mode, i: (db.UPSERT_SQL, rows[mode][i + db.WARMUP]), samples)
            for sender in senders.values():
                sender.close()
            result["latency"]["floor"] = {mode: _floor(dsn) for mode, dsn in dsns.items()}
            for mode in MODES:
                log(f"routing: a fixed load, {mode}, with each node's CPU")
                result["load"][mode] = _load(mode, dsns[mode], nodes[mode], width, samples,
                                             jobs, bench_jobs)
        finally:
            for sender in senders.values():
                try:
                    sender.close()
                except psycopg.Error:
                    pass
        result["statements"] = count_statements(cluster_dsn, width, log)
    finally:
        local.destroy()
    result["summary"] = summary(result)
    return result


def _floor(dsn: str, n: int = 200) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        floor = db.floor_of(conn)
        a, b = db.interleaved(floor, floor, n // 2)
    return db.summarize(a + b)


def _load(mode: str, dsn: str, nodes: dict[str, Path], width: int, calls: int, jobs: int,
          bench_jobs: Any) -> Section:
    """A fixed load sent one way: ``calls`` each of recall (new requests), a literal search and
    ingest from one client, then ``jobs`` extraction jobs by two worker processes; the CPU each
    node spent on each part."""
    sender = Sender(dsn, route=mode == "routed")
    pairs = db.new_requests(sender.home, width, calls, f"ld{mode[0]}")
    rows = db.ingest_rows(width, calls, f"ld{mode[0]}")
    for ws, _ in pairs:
        sender.conn(ws)
    search = f'{{"query": "{data.SEARCH_TERM}"}}'
    before = cpu_of(nodes)
    t0 = time.perf_counter()
    for i, pair in enumerate(pairs):
        sender.call("select memory.recall(%s, %s)", pair)
        sender.call("select memory.query_memories(%s, %s, %s, %s::jsonb)",
                    (*pair, f"ld{i}", search))
        sender.call(db.UPSERT_SQL, rows[i])
    seconds = time.perf_counter() - t0
    sender.close()
    time.sleep(0.5)  # the backends' CPU is counted once they are reaped
    after = cpu_of(nodes)
    calls_cpu = {name: round(after[name] - before[name], 2) for name in before if name in after}
    made = bench_jobs.prepare_jobs(dsn, f"ld{mode[0]}", jobs + 2)  # one each to warm up
    run = bench_jobs.run_processes(functools.partial(bench_jobs.ours_process,
                                                     route=mode == "routed"), dsn, 2, nodes,
                                   sample=False)
    jobs_cpu = run["cpu_seconds_by_node"]  # from the start signal to the last job
    return {"calls": {"each": calls, "seconds": round(seconds, 2),
                      "calls_per_second": round(3 * calls / seconds, 1) if seconds else None,
                      "cpu_seconds": calls_cpu},
            "jobs": {"prepared": made, "done": run["jobs"], "workers": 2,
                     "jobs_per_second": run["jobs_per_second"], "cpu_seconds": jobs_cpu}}


def summary(result: Section) -> Section:
    """The figures the issue asks for: each call's p50 routed and through the coordinator over
    one server's, jobs per second, the cluster's CPU per load over one server's, and the
    coordinator's share of the cluster's CPU, routed."""
    out: Section = {"p50_x_one_server": {}, "jobs_per_second": {}, "cpu_x_one_server": {},
                    "coordinator_share": {}}
    for name, figures in result.get("latency", {}).items():
        if name == "floor":
            continue
        one = figures["one_server"]["p50_ms"]
        out["p50_x_one_server"][name] = {mode: round(figures[mode]["p50_ms"] / one, 2)
                                         for mode in ("coordinator", "routed")}
    load = result.get("load", {})
    for mode, part in load.items():
        out["jobs_per_second"][mode] = part["jobs"]["jobs_per_second"]
    one_total = {kind: sum(load["one_server"][kind]["cpu_seconds"].values())
                 for kind in ("calls", "jobs")} if "one_server" in load else {}
    for mode in ("coordinator", "routed"):
        if mode not in load:
            continue
        shares = {}
        for kind in ("calls", "jobs"):
            cpu = load[mode][kind]["cpu_seconds"]
            total = sum(cpu.values())
            shares[kind] = round(cpu.get("coordinator", 0.0) / total, 3) if total else None
            if one_total.get(kind):
                out["cpu_x_one_server"].setdefault(mode, {})[kind] = round(
                    total / one_total[kind], 2)
        out["coordinator_share"][mode] = shares
    return out


def verdict(result: Section) -> list[dict[str, Any]]:
    """The routing targets with their measured values."""
    s = result.get("summary", {})
    out = []
    recall = s.get("p50_x_one_server", {}).get("recall (new request)", {}).get("routed")
    if recall is not None:
        out.append(db.target("routed recall p50 / one server's p50", recall,
                             TARGET_RECALL_X_ONE_SERVER))
    for kind in ("calls", "jobs"):
        share = s.get("coordinator_share", {}).get("routed", {}).get(kind)
        if share is not None:
            out.append(db.target(f"coordinator's share of the cluster's CPU, routed {kind}",
                                 share, TARGET_COORDINATOR_SHARE))
    return out


def markdown(result: Section) -> list[str]:
    """The section of bench.md."""
    modes = ("one_server", "coordinator", "routed")
    lines = ["", ("## Routed, through the coordinator, on one server (ms, W="
             f"{result['workspaces']}, {result['samples']} samples each, interleaved)"), "",
             ("| call | one server p50 | coordinator p50 | routed p50 | one server p99 | "
             "coordinator p99 | routed p99 |"), "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, figures in result["latency"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{figures[m]['p50_ms']:.3f}" for m in modes) + " | " + " | ".join(
            f"{figures[m]['p99_ms']:.3f}" for m in modes) + " |")
    s = result.get("summary", {})
    lines += ["", "p50 over one server's: " + "; ".join(
        f"{name}: coordinator {r['coordinator']}x, routed {r['routed']}x"
        for name, r in s.get("p50_x_one_server", {}).items()) + "."]
    lines += ["", ("A fixed load each way (CPU seconds of each node): "
              f"{next(iter(result['load'].values()))['calls']['each']} calls each of recall, "
              "a literal search and ingest from one client; then extraction jobs by two worker "
              "processes."), "",
              "| way | node | calls: CPU s | jobs: CPU s | jobs/s |", "| --- | --- | --- | --- | --- |"]
    for mode, part in result["load"].items():
        for node in part["calls"]["cpu_seconds"]:
            lines.append(f"| {mode} | {node} | {part['calls']['cpu_seconds'][node]} | "
                         f"{part['jobs']['cpu_seconds'].get(node, '')} | "
                         f"{part['jobs']['jobs_per_second']} |")
    lines += ["", "Cluster CPU over one server's for the same load: " + "; ".join(
        f"{mode}: calls {v.get('calls')}x, jobs {v.get('jobs')}x"
        for mode, v in s.get("cpu_x_one_server", {}).items()) + ". The coordinator's share of "
        "the cluster's CPU: " + "; ".join(
        f"{mode}: calls {v.get('calls'):.1%}, jobs {v.get('jobs'):.1%}"
        for mode, v in s.get("coordinator_share", {}).items()
        if v.get("calls") is not None and v.get("jobs") is not None) + "."]
    st = result.get("statements", {})
    if st.get("status") == "ok":
        lines += ["", ("Statements Citus plans per call (citus_stat_counters: single- and "
                  "multi-shard executions on every node), and the connections to another node "
                  f"they take (mean of {st['calls_each']} calls):"), "",
                  ("| call | statements, coordinator | connections, coordinator | "
                  "statements, routed | connections, routed |"),
                  "| --- | --- | --- | --- | --- |"]
        through = st["through"]
        for name in through.get("routed", {}):
            c, r = through["coordinator"].get(name, {}), through["routed"][name]
            lines.append(f"| {name} | {c.get('statements', '')} | {c.get('connections', '')} "
                         f"| {r['statements']} | {r['connections']} |")
    return lines
