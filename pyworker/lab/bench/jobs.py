"""Job machinery throughput: ours vs procrastinate's fetch-and-finish, on the same server.

Ours: the real worker (``pyworker.worker.Worker.tick``) with the ``offline`` model, one process
per worker; a tick is claim_job + start_attempt + the offline model + save_checkpoint +
commit_job. Maintenance (which creates the jobs) runs before the clock starts, as the peer's
jobs are deferred before its clock starts; each worker process connects and does one job (ours
and the peer's alike) before the start signal.

Peer: procrastinate 3.x's own SQL (``procrastinate.sql.queries``: fetch_job, finish_job) from the
same number of processes, on the same server, in a ``bench_peer`` schema. Its task does nothing,
so the peer's figure is its queue machinery alone; ours includes the offline model's work and
the memory writes of a commit (record, sources, charges), and the report shows how much of our
time per job is spent in the database.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self

import psycopg
from psycopg.types.json import Jsonb

from pyworker.db import Database
from pyworker.lab.bench.db import has_function, not_available, summarize

PEER_SCHEMA = "bench_peer"
WORKER_COUNTS = (1, 4)


class NoMaintenanceDatabase(Database):
    """The worker's database module without the maintenance call: the benchmark schedules its
    jobs before the clock starts, so a tick is exactly claim, attempt, checkpoint, commit."""

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self.db_ns = 0
        self.by_function: Counter[str] = Counter()

    def run_maintenance(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def call(self, function: str, *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return super().call(function, *args)
        finally:
            spent = time.perf_counter_ns() - t0
            self.db_ns += spent
            self.by_function[function] += spent


# Jobs to work on ---------------------------------------------------------------------------------

_TURNS = [
    ("Please draft the release notes for version 2.{k}. I prefer bullet points.",
     "Here is a draft with bullet points; the changelog section is still open."),
    ("Correction: the launch moved to Thursday, not Tuesday. Tell the support team.",
     "Noted, the launch is on Thursday. I drafted a message for the support team."),
    ("We decided to keep the old pricing for existing customers until March.",
     "Understood: existing customers keep the old pricing until March."),
]


def prepare_jobs(dsn: str, tag: str, n: int) -> int:
    """n workspaces with three finished conversations each (through the public API) and an
    extraction job each (memory.run_maintenance); returns the number of pending jobs."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        for i in range(n):
            ws = f"bench-job-{tag}-{i:04d}"
            cur.execute("select memory.upsert_workspace(%s, 1, 100::numeric, 0::numeric, 0)",
                        (ws,))
            cur.execute("select memory.upsert_member(%s, 'u1', 'owner', true)", (ws,))
            cur.execute("select memory.upsert_bot(%s, 'b1', 'b1-identity', true)", (ws,))
            cur.execute("select memory.upsert_chat(%s, 'dm-u1', 'private', 'u1', true)", (ws,))
            for k, (user_text, reply) in enumerate(_TURNS):
                rid = f"r{k}"
                cur.execute("select memory.upsert_request(%s, %s, 'b1', 'dm-u1', 0, 'u1', "
                            "'interactive', 'succeeded', 'fake', 'm', 1::numeric)", (ws, rid))
                cur.execute("select memory.upsert_message(%s, %s, %s, 'user', 'u1', %s)",
                            (ws, f"{rid}-u", rid, user_text.format(k=k)))
                cur.execute("select memory.upsert_message(%s, %s, %s, 'assistant', 'b1', %s)",
                            (ws, f"{rid}-a", rid, reply))
            cur.execute("select memory.run_maintenance(%s)", (ws,))
        row = cur.execute("select count(*) from memory_private.jobs where workspace_id like %s "
                          "and status = 'pending'", (f"bench-job-{tag}-%",)).fetchone()
    return int(row[0]) if row else 0


# The largest commit --------------------------------------------------------------------------------

FULL_BATCH_CONVERSATIONS = 100  # x 2 messages of 120 bytes: the batch's 200 messages, 24,000 bytes


def _full_batch_text(i: int, k: int) -> str:
    return f"conversation {k} says code {i}-{k}-zx9 and " + " ".join(
        f"w{k}x{j}" for j in range(13))


def commit_bound(dsn: str, samples: int) -> dict[str, Any]:
    """What the largest extraction commit costs: a batch at both ceilings (200 messages, 24,000
    bytes) and a 4,000-byte summary made of its words, runs and codes (what once made a text
    rule compare everything with everything), citing one message. Times ``memory.commit_job``
    alone, as the worker calls it, in ``samples`` workspaces (one job each, made first)."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        if not has_function(conn, "memory.commit_job(text,bigint,text)"):
            return not_available("the job machinery is not in the schema yet")
        jobs = []
        for i in range(samples + 1):  # the first commit is untimed (the session's first)
            ws = f"bench-commit-{i:04d}"
            cur.execute("select memory.upsert_workspace(%s, 1, 100::numeric, 0::numeric, 0)",
                        (ws,))
            cur.execute("select memory.upsert_member(%s, 'u1', 'owner', true)", (ws,))
            cur.execute("select memory.upsert_bot(%s, 'b1', 'b1-identity', true)", (ws,))
            cur.execute("select memory.upsert_chat(%s, 'dm-u1', 'private', 'u1', true)", (ws,))
            for k in range(FULL_BATCH_CONVERSATIONS):
                rid = f"r{k:03d}"
                cur.execute("select memory.upsert_request(%s, %s, 'b1', 'dm-u1', 0, 'u1', "
                            "'interactive', 'succeeded', 'fake', 'm', 1::numeric)", (ws, rid))
                text = _full_batch_text(i, k)
                cur.execute("select memory.upsert_message(%s, %s, %s, 'user', 'u1', %s)",
                            (ws, f"{rid}-u", rid, text))
                cur.execute("select memory.upsert_message(%s, %s, %s, 'assistant', 'b1', %s)",
                            (ws, f"{rid}-a", rid, text.replace("says", "said")))
            cur.execute("select memory.run_maintenance(%s)", (ws,))
        batch = 0
        while (row := cur.execute("select memory.claim_job('bench-commit')").fetchone()) \
                and row[0] is not None:
            job = row[0]
            sources = job["input"]["sources"]
            batch = max(batch, len(sources))
            words = " ".join(s["text"] for s in sources)
            summary = (words[:3980].rsplit(" ", 1)[0]) + f" [{sources[0]['id']}]"
            cur.execute("select memory.start_attempt(%s, %s, %s, 0.01)",
                        (job["workspace_id"], job["job_id"], job["token"]))
            cur.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                        (job["workspace_id"], job["job_id"], job["token"],
                         Jsonb({"title": words[:290].rsplit(" ", 1)[0], "summary": summary,
                                "source_ids": [sources[0]["id"]]}),
                         Jsonb({"input_tokens": 1, "output_tokens": 1, "cost_usd": 0.0})))
            t0 = time.perf_counter_ns()
            cur.execute("select memory.commit_job(%s, %s, %s)",
                        (job["workspace_id"], job["job_id"], job["token"]))
            jobs.append(time.perf_counter_ns() - t0)
        conn.execute("delete from memory_private.workspaces "
                     "where workspace_id like 'bench-commit-%%'")
    timed = jobs[1:]
    return {"status": "ok", "batch_messages": batch, "commit": summarize(timed),
            "note": ("commit_job of a batch at both ceilings (200 messages, 24,000 bytes) with a "
                     "4,000-byte summary made of its words, citing one message; one job per "
                     "workspace, the first untimed.")}


# Ours --------------------------------------------------------------------------------------------

def ours_process(dsn: str, ready: Any, go: Any, results: Any, *, route: bool = True) -> None:
    """One worker process; ``route=False`` sends every call to the DSN given (on a Citus
    cluster: through the coordinator), else each workspace's calls go to its node."""
    from pyworker.adapters.offline import OfflineAdapter
    from pyworker.worker import Worker, WorkerConfig

    db = NoMaintenanceDatabase(dsn, route=route)
    worker = Worker(WorkerConfig(dsn=dsn, interval=0.1), OfflineAdapter(), db=db)
    db._connection()  # connect before the start signal, as the peer does
    # One job before it too: a session's first job compiles the functions it calls and plans
    # their statements, once for a worker that runs for hours (the quick profile's four
    # workers do four jobs each). The counts start after it.
    worker.tick()
    db.db_ns = 0
    db.by_function.clear()
    ready.release()
    go.wait()
    times: list[int] = []
    statuses: Counter[str] = Counter()
    while True:
        t0 = time.perf_counter_ns()
        result = worker.tick()
        if result.status == "idle":
            break
        times.append(time.perf_counter_ns() - t0)
        statuses[result.status] += 1
    db.close()
    results.put({"times": times, "db_ns": db.db_ns, "statuses": dict(statuses),
                 "by_function": dict(db.by_function)})


# The peer ----------------------------------------------------------------------------------------

def install_peer(dsn: str) -> str | None:
    """procrastinate's schema in its own schema of the bench database; None when procrastinate
    is not installed (it is the 'bench' extra)."""
    try:
        from procrastinate.schema import SchemaManager
    except ImportError:
        return None
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"drop schema if exists {PEER_SCHEMA} cascade")
        conn.execute(f"create schema {PEER_SCHEMA}")
        with conn.transaction():
            conn.execute(f"set local search_path = {PEER_SCHEMA}")
            conn.execute(SchemaManager.get_schema().encode())
        import procrastinate

        return str(procrastinate.__version__)


def defer_peer_jobs(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True, options=f"-c search_path={PEER_SCHEMA}") as conn:
        for lo in range(0, n, 500):
            count = min(500, n - lo)
            conn.execute(
                "select procrastinate_defer_jobs_v1(array(select row('bench', 'bench.noop', 0, "
                "null, null, jsonb_build_object('i', i), null)::procrastinate_job_to_defer_v1 "
                "from generate_series(1, %s) i))", (count,))


def _peer_process(dsn: str, ready: Any, go: Any, results: Any) -> None:
    from procrastinate.sql import queries

    conn = psycopg.connect(dsn, autocommit=True, options=f"-c search_path={PEER_SCHEMA}")
    row = conn.execute(queries["register_worker"]).fetchone()
    worker_id = row[0] if row else None
    job = conn.execute(queries["fetch_job"], {"queues": ["bench"],
                                              "worker_id": worker_id}).fetchone()
    if job is not None and job[0] is not None:  # one job before the start signal, as ours
        conn.execute(queries["finish_job"], {"job_id": job[0], "status": "succeeded",
                                             "delete_job": False})
    ready.release()
    go.wait()
    times: list[int] = []
    while True:
        t0 = time.perf_counter_ns()
        job = conn.execute(queries["fetch_job"], {"queues": ["bench"],
                                                  "worker_id": worker_id}).fetchone()
        if job is None or job[0] is None:
            break
        conn.execute(queries["finish_job"], {"job_id": job[0], "status": "succeeded",
                                             "delete_job": False})
        times.append(time.perf_counter_ns() - t0)
    conn.execute(queries["unregister_worker"], {"worker_id": worker_id})
    conn.close()
    results.put({"times": times, "db_ns": sum(times), "statuses": {"succeeded": len(times)},
                 "by_function": {}})


# What the server did meanwhile --------------------------------------------------------------------

class ActivitySampler:
    """Samples, every few milliseconds, what the database's client backends that are inside a
    statement are doing: running (or waiting for a CPU: the server cannot tell the two apart),
    or waiting on a lock (Lock: a row, a transaction, a relation; LWLock: a page, the lock
    table), on I/O, or on something else. With more worker processes than CPUs, time inside
    a call grows by the wait for a CPU, which is not lock waiting: the share of samples spent
    waiting on locks says which of the two a slowdown is."""

    def __init__(self, dsn: str, interval: float = 0.005) -> None:
        self.dsn = dsn
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self.lock_events: Counter[str] = Counter()  # which lock: 'LWLock:WALWrite', ...
        self.cpu_seconds: float | None = None  # what its own backend spent (a local server)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("select pg_backend_pid()").fetchone()
            pid = int(row[0]) if row else 0
            try:
                self._sample(conn)
            finally:
                self.cpu_seconds = process_cpu_seconds(pid)

    def _sample(self, conn: psycopg.Connection[Any]) -> None:
        while not self._stop.is_set():
            for kind, event in conn.execute(
                    "select coalesce(wait_event_type, 'running'), wait_event "
                    "from pg_stat_activity "
                    "where datname = current_database() and pid <> pg_backend_pid() "
                    "and backend_type = 'client backend' and state = 'active'"):
                self.counts[kind if kind in ("running", "Lock", "LWLock", "IO")
                            else "other"] += 1
                if kind in ("Lock", "LWLock"):
                    self.lock_events[f"{kind}:{event}"] += 1
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        total = sum(self.counts.values())
        waiting = self.counts["Lock"] + self.counts["LWLock"]
        return {"samples": dict(self.counts),
                "lock_wait_share": round(waiting / total, 4) if total else None,
                "lock_events": dict(self.lock_events.most_common(4))}


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU seconds a process of this machine has used (user and system), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(nodes: dict[str, Path] | None) -> float | None:
    """The CPU seconds the servers (a cluster's nodes) have used so far; None when unknown."""
    if not nodes:
        return None
    from pyworker.lab.servers import server_cpu_seconds

    spent = [server_cpu_seconds(path) for path in nodes.values()]
    return None if any(x is None for x in spent) else sum(x for x in spent if x is not None)


# Running N processes against one queue -----------------------------------------------------------

def run_processes(target: Any, dsn: str, workers: int,
                  nodes: dict[str, Path] | None = None, *, sample: bool = True
                  ) -> dict[str, Any]:
    """``workers`` processes of ``target`` against one queue, started together once each is
    connected; the jobs they did, how fast, and (``nodes``) the CPU each server spent from the
    start to the end. ``sample``: what the busy backends of ``dsn`` wait on, sampled by a
    backend of its own (off when each node's CPU must be the workers' alone)."""
    ctx = mp.get_context("fork")  # no connection or thread is open in this process here
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(dsn, ready, go, results)) for _ in range(workers)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise RuntimeError("a benchmark worker did not start")
    cpu_before = cpu_seconds(nodes)
    by_node_before = _by_node(nodes)
    activity = ActivitySampler(dsn)
    with activity if sample else contextlib.nullcontext(activity):
        t0 = time.perf_counter()
        go.set()
        parts: list[dict[str, Any]] = []
        while len(parts) < len(procs):
            try:
                parts.append(results.get(timeout=1))
            except queue.Empty:
                crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if crashed:
                    raise RuntimeError(f"a benchmark worker exited with {crashed[0]}") from None
        seconds = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    cpu_ms = None
    by_node: dict[str, float] = {}
    if cpu_before is not None:
        time.sleep(0.5)  # the workers' backends exit and are reaped: their CPU is counted then
        after = cpu_seconds(nodes)
        by_node = {name: round(spent - by_node_before[name], 2)
                   for name, spent in _by_node(nodes).items() if name in by_node_before}
        if after is not None:  # the sampler's own backend does not count
            cpu_ms = (after - cpu_before - (activity.cpu_seconds or 0.0)) * 1000
    times = [t for part in parts for t in part["times"]]
    statuses: Counter[str] = Counter()
    for part in parts:
        statuses.update(part["statuses"])
    jobs = len(times)
    db_ms = sum(part["db_ns"] for part in parts) / 1e6
    by_function: Counter[str] = Counter()
    for part in parts:
        by_function.update(part["by_function"])
    return {"status": "ok", "workers": workers, "jobs": jobs, "seconds": round(seconds, 3),
            "jobs_per_second": round(jobs / seconds, 1) if seconds else 0.0,
            "per_job": summarize(times) if times else {},
            "db_ms_per_job": round(db_ms / jobs, 3) if jobs else None,
            "db_ms_per_job_by_function": {name: round(ns / 1e6 / jobs, 3)
                                          for name, ns in by_function.most_common()} if jobs
            else {},
            # The servers' CPU per job over the run (a cluster's nodes together): unlike the
            # time inside the calls, it does not grow with the wait for a CPU.
            "server_cpu_ms_per_job": round(cpu_ms / jobs, 3) if jobs and cpu_ms is not None
            else None,
            "cpu_seconds_by_node": by_node,
            "activity": activity.summary() if sample else {},
            "outcomes": dict(statuses)}


def _by_node(nodes: dict[str, Path] | None) -> dict[str, float]:
    from pyworker.lab.servers import server_cpu_seconds

    spent = {name: server_cpu_seconds(path) for name, path in (nodes or {}).items()}
    return {name: value for name, value in spent.items() if value is not None}


def measure(dsn: str, *, jobs: int, peer_jobs: int,
            nodes: dict[str, Path] | None = None) -> dict[str, Any]:
    """Ours and the peer with 1 and 4 worker processes; ``nodes`` (the servers' data
    directories, when the bench started them) adds the servers' CPU per job."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        missing = [s for s in ("memory.claim_job(text)", "memory.commit_job(text,bigint,text)",
                               "memory.run_maintenance(text)") if not has_function(conn, s)]
    if missing:
        return not_available(f"the job machinery is not in the schema yet: {', '.join(missing)}")
    ours: dict[str, Any] = {}
    peer: dict[str, Any] = {}
    notes = []
    for workers in WORKER_COUNTS:
        made = prepare_jobs(dsn, f"w{workers}", jobs + workers)  # one each before the clock
        r = run_processes(ours_process, dsn, workers, nodes)
        r["label"] = "pimem (offline model)"
        r["jobs_prepared"] = made
        ours[str(workers)] = r
    version = install_peer(dsn)
    if version is None:
        for workers in WORKER_COUNTS:
            peer[str(workers)] = not_available(
                "procrastinate is not installed (pip install -e '.[bench]' or scripts/bench)")
    else:
        for workers in WORKER_COUNTS:
            defer_peer_jobs(dsn, peer_jobs + workers)
            r = run_processes(_peer_process, dsn, workers, nodes)
            r["label"] = f"procrastinate {version} (no-op task)"
            peer[str(workers)] = r
    notes.append("Ours per job: claim_job, start_attempt, the offline model, save_checkpoint, "
                 "commit_job (which writes the record, its sources and the charge); "
                 "db_ms_per_job is the time inside those calls. The peer's no-op task makes its "
                 "figure pure queue machinery (fetch_job + finish_job). With more worker "
                 "processes than CPUs the time inside a call includes the wait for a CPU: "
                 "the servers' CPU per job and the share of the busy backends' samples spent "
                 "waiting on a lock (pg_stat_activity) tell that from lock contention; the lock "
                 "waits are named, with their samples (LWLock:WALWrite: a commit waiting for the "
                 "WAL flush of another).")
    return {"status": "ok", "ours": ours, "peer": peer, "notes": notes}
