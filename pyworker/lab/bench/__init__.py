"""``pimem bench``: how fast the memory is where it matters, each figure beside its floor.

One run, one server, the same connections:
1. build W workspaces x 256 records (``bench.data``), growing through the sizes of the profile;
2. at each size: recall for a new request and query_memories over a full scope, each
   interleaved with a ``SELECT 1`` round trip (``bench.db``); then the worst case of
   query_memories, a scope filled with notes made to stall fuzzy search (``bench.hostile``);
3. at the largest size: ingest (``memory.upsert_message``) vs a plain INSERT of the same row,
   and the EXPLAIN of every statement of the hot paths;
4. the job machinery with the offline model, 1 and 4 workers, vs procrastinate's
   fetch-and-finish on the same server (``bench.jobs``);
5. the worker's overhead per model call, Pi RPC vs a direct HTTP call to the same local fake
   server, and the worker's peak RSS (``bench.worker``);
6. maintenance beside idle workspaces and stopped inputs, and the retention sweep with ingest
   beside it (``bench.maintenance``).
Output: ``bench.json``, ``bench.md`` and ``growth.png`` in the output directory. A part whose
code has not landed yet is reported as not available, never estimated.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from pyworker import schema
from pyworker.lab.bench import data, db, hostile, maintenance

Section = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Profile:
    name: str
    sizes: tuple[int, ...]
    recall_samples: int
    query_samples: int
    ingest_samples: int
    jobs: int            # jobs per run of our machinery (each worker count)
    peer_jobs: int       # jobs per run of the peer
    model_calls: int     # calls per adapter for the worker overhead
    floor_samples: int = 1000
    hostile_notes: int = 256   # notes of the worst-case search's scope
    hostile_samples: int = 200
    commit_samples: int = 20   # the largest commit (bench.jobs.commit_bound), one per workspace
    # Maintenance (bench.maintenance): changed and idle workspaces of a pass, passes (and
    # ticks) timed, stopped inputs, and the sweep's workspaces x expired messages each.
    maint_changed: int = 100
    maint_idle: int = 10_000
    maint_passes: int = 7
    maint_stopped: int = 1000
    sweep_workspaces: int = 20
    sweep_messages: int = 5000
    maint_many: tuple[int, ...] = (1000, 10_000)  # new conversations before a tick
    maint_past_jobs: int = 10_000                 # the history beside a removal's tick


PROFILES = {
    "quick": Profile("quick", sizes=(4, 16), recall_samples=150, query_samples=60,
                     ingest_samples=300, jobs=16, peer_jobs=200, model_calls=6,
                     floor_samples=400, hostile_samples=30, maint_changed=10,
                     maint_idle=200, maint_passes=3, maint_stopped=50, sweep_workspaces=4,
                     sweep_messages=500, commit_samples=4, maint_many=(100, 1000),
                     maint_past_jobs=1000),
    "default": Profile("default", sizes=(10, 100, 1000), recall_samples=2000,
                       query_samples=1000, ingest_samples=3000, jobs=200, peer_jobs=2000,
                       model_calls=40, floor_samples=4000),
}

TARGETS = {
    "recall_p50_x_floor": 3.0, "recall_p99_x_floor": 6.0, "recall_flat_p50": 1.3,
    "query_p50_x_floor": 10.0, "ingest_rate_of_floor": 1 / 3, "jobs_x_peer": 1.0,
    "job_db_x_peer": 4.0, "job_db_4_over_1": 1.5,
    "pi_rpc_added_ms": 50.0, "hostile_query_p50_ms": 50.0, "disk_x_raw": 4.0,
    "maintenance_pass_x_idle": maintenance.TARGET_PASS_X,
    "maintenance_tick_x_stopped": maintenance.TARGET_STOPPED_X,
    "sweep_longest_transaction_ms": maintenance.TARGET_LOCK_MS,
    "maintenance_tick_x_conversations": maintenance.TARGET_MANY_X,
    "maintenance_tick_x_past_jobs": maintenance.TARGET_SCRUB_X,
}


# The server and the database ---------------------------------------------------------------------

@dataclass
class Target:
    dsn: str
    description: str
    cleanup: Callable[[], None]
    nodes: dict[str, Path] = field(default_factory=dict)  # a cluster's data directories


def nodes_cpu(nodes: dict[str, Path]) -> dict[str, float | None]:
    from pyworker.lab.servers import server_cpu_seconds

    return {name: server_cpu_seconds(path) for name, path in nodes.items()}


def open_target(dsn: str | None, data_dir: Path, server: str = "embedded") -> Target:
    """The database to measure in. With a DSN: that database (it should be a scratch database:
    the bench writes ~256k records into it, and a ``bench_peer`` schema for procrastinate);
    the canonical schema is applied when missing and earlier bench workspaces are removed.
    Without: the embedded PostgreSQL in ``data_dir`` (``server="embedded"``) or a throwaway
    cluster of the machine's own server binaries (``server="local"``, as the tests use), with a
    fresh ``pimem_bench`` database."""
    cleanup: Callable[[], None] = lambda: None
    nodes: dict[str, Path] = {}
    if dsn is None and server == "citus":
        from pyworker.lab.servers import CitusCluster, citus_available, find_bindir

        bindir = find_bindir()
        reason = citus_available(bindir) if bindir is not None else "no local PostgreSQL"
        if bindir is None or reason:
            raise SystemExit(f"--server citus needs Citus installed: {reason}")
        citus = CitusCluster(bindir).start()
        cleanup = citus.destroy
        dsn = citus.create_database("pimem_bench")
        schema.migrate(dsn)  # built and distributed as an operator's cluster is
        nodes = {"coordinator": citus.coordinator.data,
                 **{f"worker {i + 1}": w.data for i, w in enumerate(citus.workers)}}
        description = (f"a throwaway Citus cluster of {bindir}: a coordinator and "
                       f"{len(citus.workers)} workers on this machine (CitusCluster settings)")
    elif dsn is None and server == "local":
        from pyworker.lab.servers import LocalCluster, find_bindir

        bindir = find_bindir()
        if bindir is None:
            raise SystemExit("no local PostgreSQL binaries (initdb/pg_ctl) for --server local")
        cluster = LocalCluster(bindir).init().start()
        cleanup = cluster.destroy
        nodes = {"server": cluster.data}
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("create database pimem_bench")
        dsn = cluster.dsn("pimem_bench")
        description = f"a throwaway cluster of {bindir} (LocalCluster settings)"
    elif dsn is None:
        from pyworker.lab.servers import embedded_dsn

        admin = embedded_dsn(data_dir)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("drop database if exists pimem_bench with (force)")
            conn.execute("create database pimem_bench")
        dsn = psycopg.conninfo.make_conninfo(admin, dbname="pimem_bench")
        description = f"embedded PostgreSQL in {data_dir}"
    else:
        description = "the database given by --dsn"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("select rolsuper from pg_roles where rolname = current_user").fetchone()
        if not (row and row[0]):
            raise SystemExit("pimem bench needs a superuser connection (it bulk-loads tables)")
        if not conn.execute("select 1 from pg_namespace where nspname = 'memory'").fetchone():
            schema.apply_canonical(conn)
        conn.execute("delete from memory_private.workspaces where workspace_id like 'bench%%'")
    return Target(dsn, description, cleanup, nodes)


def source_facts() -> dict[str, Any]:
    """Which code was measured: the commit, and the schema files that differ from it (the
    schema is applied from the work tree, so uncommitted changes are measured too)."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, check=False, capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout if out.returncode == 0 else ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "sql").splitlines()
             if len(line) > 3]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown",
            "uncommitted_sql": dirty}


def machine_facts() -> dict[str, Any]:
    """What else was running: the load average and the other test runs at this moment."""
    try:
        ps = subprocess.run(["ps", "-eo", "args"], check=False, capture_output=True, text=True, timeout=5)
        pytest_procs = sum(1 for line in ps.stdout.splitlines()
                           if "pytest" in line and "bench" not in line)
    except (OSError, subprocess.SubprocessError):
        pytest_procs = -1
    return {"load_average": [round(x, 2) for x in os.getloadavg()],
            "pytest_processes": pytest_procs, "cpus": os.cpu_count(),
            "at": datetime.now(UTC).isoformat(timespec="seconds")}


# The run -----------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(profile: Profile, *, dsn: str | None, out_dir: Path,
        data_dir: Path | None = None, server: str = "embedded") -> Section:
    started = time.monotonic()
    if data_dir is None:
        from pyworker.lab.servers import state_dir

        data_dir = state_dir() / "bench-pg"
    target = open_target(dsn, data_dir, server)
    command = "pimem bench" + (" --quick" if profile.name == "quick" else "")
    if profile.sizes != PROFILES[profile.name].sizes:
        command += " --sizes " + ",".join(str(w) for w in profile.sizes)
    command += " --dsn <scratch database>" if dsn else (
        f" --server {server}" if server in ("local", "citus") else "")
    result: Section = {"profile": asdict(profile), "targets": TARGETS, "command": command,
                       "source": source_facts(),
                       "server": {"where": target.description},
                       "machine": {"platform": platform.platform(), "start": machine_facts()}}
    cpu_before = nodes_cpu(target.nodes)
    on_citus = schema.citus_cluster(target.dsn) is not None
    try:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            result["server"].update(db.server_facts(conn))
            result["floor"] = db.measure_floor(conn, profile.floor_samples)
            result["dataset"] = {"records_per_workspace": data.RECORDS_PER_WORKSPACE,
                                 "sizes": list(profile.sizes), "build_seconds": {}}
            result["recall"], result["query"] = {}, {}
            have = 0
            now = datetime.now(UTC)
            for width in profile.sizes:
                t0 = time.monotonic()
                log(f"dataset: growing to {width} workspaces")
                data.grow(conn, have, width, now=now)
                have = width
                result["dataset"]["build_seconds"][str(width)] = round(time.monotonic() - t0, 1)
                log(f"recall at W={width}")
                recall = db.measure_recall(conn, width, profile.recall_samples)
                pairs = [tuple(p) for p in recall.pop("requests", [])]
                log(f"query_memories at W={width}")
                query = db.measure_query(conn, pairs, profile.query_samples,
                                         {"query": data.SEARCH_TERM}, f"qs{width}")
                browse = db.measure_query(conn, pairs, max(20, profile.query_samples // 4), {},
                                          f"qb{width}")
                question = db.measure_query(conn, pairs, max(20, profile.query_samples // 4),
                                            {"query": data.QUESTION}, f"qq{width}")
                if query.get("status") == "ok":
                    query["browse"] = {"floor": browse["floor"], "query": browse["query"],
                                       "reads": browse.get("reads")}
                    query["question"] = {"floor": question["floor"], "query": question["query"],
                                         "args": question["args"], "reads": question.get("reads")}
                result["recall"][str(width)] = recall
                result["query"][str(width)] = query
            log(f"query_memories worst case ({profile.hostile_notes} hostile notes)")
            result["hostile_query"] = hostile.measure(conn, profile.hostile_samples,
                                                      profile.hostile_notes)
            log(f"query_memories worst case ({profile.hostile_notes} notes holding every word)")
            result["every_word_query"] = hostile.measure_every_word(
                conn, profile.hostile_samples, profile.hostile_notes)
            result["dataset"]["consistency"] = data.check_consistency(conn)
            log(f"disk per message at W={have}")
            result["disk"] = (db.not_available("a cluster's tables are its shards") if on_citus
                              else db.measure_disk(conn))
            log(f"ingest at W={have}")
            result["ingest"] = db.measure_ingest(conn, have, profile.ingest_samples)
            log("EXPLAIN of the hot paths")
            if run_jobs_available(target.dsn):
                from pyworker.lab.bench import jobs as bench_jobs

                bench_jobs.prepare_jobs(target.dsn, "explain", 1)  # a job for claim_job's plan
            if not on_citus:
                result["explain"] = db.explain_hot_paths(conn, have)
            else:  # auto_explain of a call on the coordinator shows no worker's plan
                result["explain"] = db.not_available(
                    "the plans are one server's: on Citus each statement is planned on the "
                    "node holding the workspace")
            conn.execute("delete from memory_private.workspaces "
                         "where workspace_id like 'bench-job-explain-%%'")
            # Last: it leaves every scope due for consolidation.
            log(f"recall while consolidation is pending at W={have}")
            result["recall_directory"] = db.measure_recall_directory(
                conn, have, max(200, profile.recall_samples // 4))
        log(f"maintenance: {profile.maint_changed} changed beside {profile.maint_idle} idle "
            f"workspaces, {profile.maint_stopped} stopped inputs, a sweep of "
            f"{profile.sweep_workspaces * profile.sweep_messages} expired messages")
        result["maintenance"] = guarded(lambda: maintenance.measure(
            target.dsn, changed=profile.maint_changed, idle=profile.maint_idle,
            passes=profile.maint_passes, stopped=profile.maint_stopped,
            sweep_workspaces=profile.sweep_workspaces,
            sweep_per_workspace=profile.sweep_messages,
            ingest_samples=max(100, profile.ingest_samples // 3),
            many=profile.maint_many, past_jobs=profile.maint_past_jobs))
        log("job machinery")
        result["jobs"] = guarded(lambda: run_jobs(profile, target.dsn, target.nodes))
        log("the largest commit")
        result["commit_bound"] = guarded(lambda: run_commit_bound(profile, target.dsn))
        log("worker overhead and memory")
        both = guarded(lambda: dict(zip(("worker_overhead", "memory"),
                                        run_worker(profile, target.dsn), strict=True)))
        result["worker_overhead"] = both.get("worker_overhead", both)
        result["memory"] = both.get("memory", both)
        if target.nodes:  # where a cluster's CPU went over the whole run
            after = nodes_cpu(target.nodes)
            result["cluster_cpu_seconds"] = {
                name: round(after[name] - start, 1)  # type: ignore[operator]
                for name, start in cpu_before.items()
                if start is not None and after.get(name) is not None}
        if on_citus and len(target.nodes) > 1:  # a cluster the bench started: its CPU is known
            from pyworker.lab.bench import routing

            log("routing: calls routed to the workspace's node, through the coordinator, and "
                "on one server")
            result["routing"] = guarded(lambda: routing.measure(
                target.dsn, target.nodes, have, samples=max(60, profile.recall_samples // 2),
                jobs=profile.jobs, log=log))
    finally:
        target.cleanup()
    result["growth"] = growth(result)
    result["verdict"] = verdict(result)
    result["machine"]["end"] = machine_facts()
    result["seconds"] = round(time.monotonic() - started, 1)
    write_outputs(result, out_dir)
    return result


def run_scale(sizes: str | None, *, dsn: str | None, out_dir: Path,
              data_dir: Path | None = None, server: str = "embedded") -> Section:
    """``pimem bench --scale`` (``bench.scale``): the hot paths at 10,000 workspaces beside the
    same at 1,000, in one run on one server."""
    from pyworker.lab.bench import scale

    started = time.monotonic()
    profile = scale.profile_for(sizes)
    if data_dir is None:
        from pyworker.lab.servers import state_dir

        data_dir = state_dir() / "bench-pg"
    if server == "citus":
        raise SystemExit("--scale runs on one server (embedded, local or --dsn)")
    target = open_target(dsn, data_dir, server)
    command = "pimem bench --scale" + (f" --sizes {sizes}" if sizes else "") + (
        " --dsn <scratch database>" if dsn else (" --server local" if server == "local" else ""))
    result: Section = {"profile": {"name": "scale", **asdict(profile)},
                       "targets": scale.TARGETS, "command": command, "source": source_facts(),
                       "server": {"where": target.description},
                       "machine": {"platform": platform.platform(), "start": machine_facts()}}
    try:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            result["server"].update(db.server_facts(conn))
            result["scale"] = scale.run(conn, target.dsn, profile, log)
    finally:
        target.cleanup()
    result["verdict"] = scale.verdict(result["scale"])
    result["machine"]["end"] = machine_facts()
    result["seconds"] = round(time.monotonic() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    return result


def guarded(part: Callable[[], Section]) -> Section:
    """A part that fails is reported as an error with its reason; the other parts still run."""
    try:
        return part()
    except Exception as exc:  # noqa: BLE001 - reported in the output, never hidden
        log(f"failed: {type(exc).__name__}: {exc}")
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}


def run_jobs(profile: Profile, dsn: str, nodes: dict[str, Path] | None = None) -> Section:
    try:
        from pyworker.lab.bench import jobs as bench_jobs
    except ImportError as exc:
        return db.not_available(f"job benchmark cannot load: {exc}")
    return bench_jobs.measure(dsn, jobs=profile.jobs, peer_jobs=profile.peer_jobs, nodes=nodes)


def run_commit_bound(profile: Profile, dsn: str) -> Section:
    from pyworker.lab.bench import jobs as bench_jobs

    return bench_jobs.commit_bound(dsn, profile.commit_samples)


def run_worker(profile: Profile, dsn: str) -> tuple[Section, Section]:
    try:
        from pyworker.lab.bench import worker as bench_worker
    except ImportError as exc:
        reason = f"worker benchmark cannot load: {exc}"
        return db.not_available(reason), db.not_available(reason)
    def job_dsn(adapter: str) -> str | None:
        """The DSN with jobs ready for a memory run of this adapter, or None without the job
        machinery (the run then makes adapter calls only)."""
        if run_jobs_available(dsn):
            from pyworker.lab.bench import jobs as bench_jobs

            if bench_jobs.prepare_jobs(dsn, f"rss-{adapter}", profile.model_calls):
                return dsn
        return None

    return bench_worker.measure(dsn, calls=profile.model_calls, job_dsn=job_dsn)


def run_jobs_available(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return all(db.has_function(conn, s) for s in ("memory.claim_job(text)",
                                                       "memory.run_maintenance(text)"))


# Derived figures ---------------------------------------------------------------------------------

def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def growth(result: Section) -> Section:
    """Recall and query p50/p99 (and their floors) at each W."""
    rows = []
    for width, rec in result.get("recall", {}).items():
        q = result.get("query", {}).get(width, {})
        row: dict[str, Any] = {"workspaces": int(width)}
        if rec.get("status") == "ok":
            row.update(recall_p50_ms=rec["recall"]["p50_ms"], recall_p99_ms=rec["recall"]["p99_ms"],
                       recall_floor_p50_ms=rec["floor"]["p50_ms"],
                       recall_floor_p99_ms=rec["floor"]["p99_ms"])
        if q.get("status") == "ok":
            row.update(query_p50_ms=q["query"]["p50_ms"], query_p99_ms=q["query"]["p99_ms"],
                       query_floor_p50_ms=q["floor"]["p50_ms"])
        rows.append(row)
    return {"status": "ok" if rows else "not_available", "rows": rows}


def verdict(result: Section) -> list[dict[str, Any]]:
    """Every target with its measured value; a part not available yet says so."""
    out: list[dict[str, Any]] = []
    recall = result.get("recall", {})
    widths = sorted(int(w) for w in recall)
    if widths and all(recall[str(w)].get("status") == "ok" for w in widths):
        big, small = recall[str(widths[-1])], recall[str(widths[0])]
        out.append(db.target(f"recall p50 / floor p50 at W={widths[-1]}",
                             _ratio(big["recall"]["p50_ms"], big["floor"]["p50_ms"]),
                             TARGETS["recall_p50_x_floor"]))
        p99 = db.target(f"recall p99 / floor p99 at W={widths[-1]}",
                        _ratio(big["recall"]["p99_ms"], big["floor"]["p99_ms"]),
                        TARGETS["recall_p99_x_floor"])
        # A floor's p99 is where a shared machine's noise lands; show the stricter reading too.
        p99["vs_floor_p50"] = round(_ratio(big["recall"]["p99_ms"], big["floor"]["p50_ms"]), 3)
        out.append(p99)
        flat = db.target(f"recall p50 at W={widths[-1]} / at W={widths[0]}",
                         _ratio(big["recall"]["p50_ms"], small["recall"]["p50_ms"]),
                         TARGETS["recall_flat_p50"])
        # For reading a noisy run: the same ratio with each p50 divided by its own floor first.
        flat["floor_normalised"] = round(_ratio(big["recall"]["p50_ms"] / big["floor"]["p50_ms"],
                                                small["recall"]["p50_ms"] / small["floor"]["p50_ms"]),
                                         3)
        out.append(flat)
    else:
        out.append({"name": "recall", "met": None, "note": "not available yet"})
    query = result.get("query", {})
    qwidths = sorted(int(w) for w in query)
    if qwidths and query[str(qwidths[-1])].get("status") == "ok":
        q = query[str(qwidths[-1])]
        out.append(db.target(f"query_memories search p50 / floor p50 at W={qwidths[-1]}",
                             _ratio(q["query"]["p50_ms"], q["floor"]["p50_ms"]),
                             TARGETS["query_p50_x_floor"]))
    else:
        out.append({"name": "query_memories", "met": None, "note": "not available yet"})
    worst = result.get("hostile_query", {})
    if worst.get("status") == "ok":
        out.append(db.target(f"query_memories worst case p50 ms ({worst['scope_records']} "
                             "hostile notes, 32 fuzzy words)", worst["query"]["p50_ms"],
                             TARGETS["hostile_query_p50_ms"]))
    else:
        out.append({"name": "query_memories worst case", "met": None,
                    "note": worst.get("reason", "not available yet")})
    every = result.get("every_word_query", {})
    if every.get("status") == "ok":
        out.append(db.target(f"query_memories worst case p50 ms ({every['scope_records']} notes "
                             f"holding every word of a {every['query_words']}-word question)",
                             every["query"]["p50_ms"], TARGETS["hostile_query_p50_ms"]))
    else:
        out.append({"name": "query_memories worst case, every word", "met": None,
                    "note": every.get("reason", "not available yet")})
    wide = result.get("explain", {}).get("wide_reads")
    if wide:
        nodes = sum(len(v) for v in wide["nodes"].values())
        out.append(db.target(f"hot-path plan nodes reading > {wide['limit_rows']} rows of a "
                             "tenant table (whole-table reads)", nodes, 0))
    disk = result.get("disk", {})
    if disk.get("status") == "ok" and disk.get("message_x_raw") is not None:
        out.append(db.target("bytes on disk per message (table, TOAST, indexes) / its raw text",
                             disk["message_x_raw"], TARGETS["disk_x_raw"]))
    ingest = result.get("ingest", {})
    if ingest.get("status") == "ok":
        pc = ingest["per_commit"]
        out.append(db.target("ingest rate / plain INSERT rate (one call per transaction)",
                             _ratio(pc["upsert_message"]["per_second"], pc["floor"]["per_second"]),
                             round(TARGETS["ingest_rate_of_floor"], 3), at_least=True))
    jobs = result.get("jobs", {})
    if jobs.get("status") == "ok":
        for workers in ("1", "4"):
            ours = jobs["ours"].get(workers, {})
            peer = jobs["peer"].get(workers, {})
            if ours.get("jobs_per_second") and peer.get("jobs_per_second"):
                out.append(db.target(f"jobs/s ours / procrastinate, {workers} worker(s)",
                                     _ratio(ours["jobs_per_second"], peer["jobs_per_second"]),
                                     TARGETS["jobs_x_peer"], at_least=True))
            else:
                out.append({"name": f"jobs/s ours / procrastinate, {workers} worker(s)",
                            "met": None, "note": peer.get("reason") or ours.get("reason")
                            or "no jobs were measured"})
        out += job_db_targets(jobs)
    else:
        out.append({"name": "job machinery", "met": None,
                    "note": jobs.get("reason", "not available yet")})
    out += maintenance.verdict(result.get("maintenance", {}))
    if result.get("routing", {}).get("status") == "ok":
        from pyworker.lab.bench import routing

        out += routing.verdict(result["routing"])
    over = result.get("worker_overhead", {})
    if over.get("status") == "ok" and over.get("pi_added_ms") is not None:
        out.append(db.target("Pi RPC added ms per call vs a bare HTTP call (p50)",
                             over["pi_added_ms"], TARGETS["pi_rpc_added_ms"]))
    else:
        out.append({"name": "worker overhead", "met": None,
                    "note": over.get("reason", "not available yet")})
    return out


# Figures shown beside a target's measured value, for reading it.
EXTRAS = ("vs_floor_p50", "floor_normalised", "procrastinate_4_over_1",
          "server_cpu_per_job_4_over_1", "lock_wait_share_4_workers")


def job_db_targets(jobs: Section) -> list[dict[str, Any]]:
    """Issue 34's two targets for the database time of a job (claim, attempt, checkpoint,
    commit): at most 4x the peer's fetch and finish with one worker, and with four workers at
    most 1.5x the one-worker figure, shown beside the peer's own four-to-one ratio, the ratio
    of the servers' CPU per job and the share of time spent waiting on locks with four."""
    out: list[dict[str, Any]] = []

    def db_ms(system: str, workers: str) -> float | None:
        value = jobs.get(system, {}).get(workers, {}).get("db_ms_per_job")
        return float(value) if value else None

    ours1, ours4, peer1, peer4 = (db_ms("ours", "1"), db_ms("ours", "4"), db_ms("peer", "1"),
                                  db_ms("peer", "4"))
    name = "database ms per job, ours / procrastinate, 1 worker"
    if ours1 and peer1:
        out.append(db.target(name, _ratio(ours1, peer1), TARGETS["job_db_x_peer"]))
    else:
        out.append({"name": name, "met": None, "note": "not measured (procrastinate missing?)"})
    name = "database ms per job, 4 workers / 1 worker (ours)"
    if ours1 and ours4:
        row = db.target(name, _ratio(ours4, ours1), TARGETS["job_db_4_over_1"])
        if peer1 and peer4:
            row["procrastinate_4_over_1"] = round(_ratio(peer4, peer1), 3)
        four, one = jobs["ours"]["4"], jobs["ours"]["1"]
        if four.get("server_cpu_ms_per_job") and one.get("server_cpu_ms_per_job"):
            row["server_cpu_per_job_4_over_1"] = round(
                _ratio(four["server_cpu_ms_per_job"], one["server_cpu_ms_per_job"]), 3)
        share = four.get("activity", {}).get("lock_wait_share")
        if share is not None:
            row["lock_wait_share_4_workers"] = share
        out.append(row)
    else:
        out.append({"name": name, "met": None, "note": "not measured"})
    return out


# Output ------------------------------------------------------------------------------------------

def write_outputs(result: Section, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    explain = result.get("explain", {})
    if explain.get("status") == "ok":
        lines = []
        for name, plans in explain["plans"].items():
            lines.append(f"==== {name} ({len(plans)} statements) ====")
            lines.extend(plans)
        (out_dir / "explain.txt").write_text("\n\n".join(lines) + "\n")
    try:
        plot(result, out_dir / "growth.png")
        result["growth"]["plot"] = str(out_dir / "growth.png")
    except ImportError as exc:
        result["growth"]["plot"] = f"not drawn: {exc} (install the 'bench' extra)"
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


def written(result: Section, out_dir: Path) -> list[str]:
    """The files write_outputs wrote for ``result`` (no plot without matplotlib, no plans when
    the explain part did not run)."""
    names = ["bench.json", "bench.md"]
    if result.get("explain", {}).get("status") == "ok":
        names.append("explain.txt")
    if result.get("growth", {}).get("plot") == str(out_dir / "growth.png"):
        names.append("growth.png")
    return names


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if x < 10 else f"{x:.1f}"
    return str(x)


def _share(x: float | None) -> str:
    return "" if x is None else f"{x:.1%}"


def header(result: Section) -> list[str]:
    """The report's title, what was run where, and the targets' table."""
    srv = result.get("server", {})
    m = result.get("machine", {})
    lines = [f"# pimem bench ({result['profile']['name']})", "",
             (f"Command: `{result['command']}`; {result.get('seconds', '?')} s; "
              f"PostgreSQL {srv.get('server_version', '?')} ({srv.get('where', '?')}; "
              f"fsync={srv.get('fsync')}, synchronous_commit={srv.get('synchronous_commit')}, "
              f"jit={srv.get('jit')})."),
             (f"Code: commit {result.get('source', {}).get('commit')}; schema files changed "
              f"since: {', '.join(result.get('source', {}).get('uncommitted_sql') or []) or 'none'}."),
             (f"Machine: {m.get('start', {}).get('cpus')} CPUs; load average at start "
              f"{m.get('start', {}).get('load_average')}, at end "
              f"{m.get('end', {}).get('load_average')}; pytest processes running at start/end: "
              f"{m.get('start', {}).get('pytest_processes')}/"
              f"{m.get('end', {}).get('pytest_processes')}."), "",
             "## Targets", "", "| target | measured | limit | met |", "| --- | --- | --- | --- |"]
    for v in result.get("verdict", []):
        if v.get("met") is None:
            lines.append(f"| {v['name']} | {v.get('note')} | | n/a |")
        else:
            extra = "".join(f" ({k.replace('_', ' ')}: "
                            f"{_share(x) if k.endswith('_share_4_workers') else _fmt(x)})"
                            for k, x in v.items() if k in EXTRAS)
            lines.append(f"| {v['name']} | {_fmt(v['value'])}{extra} | {v['op']} "
                         f"{_fmt(v['limit'])} | {'yes' if v['met'] else '**no**'} |")
    return lines


def markdown(result: Section) -> str:
    if "scale" in result:
        from pyworker.lab.bench import scale

        return "\n".join(header(result) + scale.markdown(result["scale"])) + "\n"
    lines = header(result)
    cpu = result.get("cluster_cpu_seconds")
    if cpu:
        total = sum(cpu.values()) or 1
        lines += ["", "## Where the server's CPU went (the whole run)", "",
                  "| node | CPU seconds | share |", "| --- | --- | --- |"]
        lines += [f"| {name} | {sec} | {sec / total:.0%} |" for name, sec in cpu.items()]
    lines += ["", "## Latency beside the floor (ms)", "",
              ("| figure | W | n | p50 | p99 | floor p50 | floor p99 | p50 ratio | p99 ratio | "
               "pages read a call | read ms a call |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def row(name: str, width: Any, s: Section, f: Section, reads: Section | None = None) -> None:
        io = (f"{_fmt(reads['pages'])} | {_fmt(reads['read_ms'])}" if reads else " | ")
        lines.append(f"| {name} | {width} | {s['n']} | {_fmt(s['p50_ms'])} | "
                     f"{_fmt(s['p99_ms'])} | {_fmt(f['p50_ms'])} | {_fmt(f['p99_ms'])} | "
                     f"{_fmt(_ratio(s['p50_ms'], f['p50_ms']))} | "
                     f"{_fmt(_ratio(s['p99_ms'], f['p99_ms']))} | {io} |")

    for width, rec in result.get("recall", {}).items():
        if rec.get("status") == "ok":
            row(f"recall ({', '.join(f'{k}: {v}' for k, v in rec['modes'].items())})", width,
                rec["recall"], rec["floor"], rec.get("reads"))
        else:
            lines.append(f"| recall | {width} | {rec.get('reason')} | | | | | | | | |")
    rd = result.get("recall_directory", {})
    if rd.get("status") == "ok":
        row(f"recall, consolidation pending ({', '.join(f'{k}: {v}' for k, v in rd['modes'].items())})",
            rd["workspaces"], rd["recall"], rd["floor"], rd.get("reads"))
    for width, q in result.get("query", {}).items():
        if q.get("status") == "ok":
            row(f"query_memories search '{q['args'].get('query')}'", width, q["query"], q["floor"],
                q.get("reads"))
            if "browse" in q:
                row("query_memories browse", width, q["browse"]["query"], q["browse"]["floor"],
                    q["browse"].get("reads"))
            if "question" in q:
                row(f"query_memories search '{q['question']['args']['query']}' (ranked words)",
                    width, q["question"]["query"], q["question"]["floor"],
                    q["question"].get("reads"))
        else:
            lines.append(f"| query_memories | {width} | {q.get('reason')} | | | | | | | | |")
    worst = result.get("hostile_query", {})
    if worst.get("status") == "ok":
        row(f"query_memories worst case: 32 fuzzy words over {worst['scope_records']} hostile "
            f"notes (target p50 <= {_fmt(worst['target_ms'])} ms)", 1, worst["query"],
            worst["floor"], worst.get("reads"))
    every = result.get("every_word_query", {})
    if every.get("status") == "ok":
        row(f"query_memories worst case: a {every['query_words']}-word question over "
            f"{every['scope_records']} notes holding every word on every line (target p50 <= "
            f"{_fmt(every['target_ms'])} ms)", 1, every["query"], every["floor"],
            every.get("reads"))
    ing = result.get("ingest", {})
    if ing.get("status") == "ok":
        row("upsert_message vs plain INSERT, 1 per transaction", ing["workspaces"],
            ing["per_commit"]["upsert_message"], ing["per_commit"]["floor"])
        b = ing["batched"]
        row(f"upsert_message vs plain INSERT, {b['calls_per_transaction']} per transaction",
            ing["workspaces"], b["upsert_message"], b["floor"])
    lines += ["", ("Pages read a call: pages a call found outside PostgreSQL's shared buffers "
                   "(mean over its samples and warm-up; pg_stat_get_backend_io, PostgreSQL 18 and "
                   "a superuser, else blank), and the milliseconds it waited for them "
                   "(track_io_timing): the part of a figure that is the machine's storage and "
                   "page cache, not the work.")]
    disk = result.get("disk", {})
    if disk.get("status") == "ok":
        lines += ["", "## Disk", "",
                  (f"{disk['messages']} messages of {disk['raw_bytes_per_message']} bytes of text "
                   f"on average. The messages table with its TOAST and indexes: "
                   f"{disk['message_bytes_per_message']} bytes a message "
                   f"({disk['message_x_raw']}x the text); every table of the schema with its "
                   f"TOAST and indexes (records, searches, jobs, ...): "
                   f"{disk['all_bytes_per_message']} bytes a message ({disk['all_x_raw']}x)."),
                  "", "| table | heap | TOAST | indexes |", "| --- | --- | --- | --- |"]
        lines += [f"| {t['table']} | {t['heap']} | {t['toast']} | {t['indexes']} |"
                  for t in disk["tables"][:10]]
        lines += ["", "| index (largest ten) | table | bytes |", "| --- | --- | --- |"]
        lines += [f"| {i['index']} | {i['table']} | {i['bytes']} |" for i in disk["indexes"][:10]]
    lines += maintenance.markdown(result.get("maintenance", {}))
    lines += ["", "## Job machinery", ""]
    jobs = result.get("jobs", {})
    if jobs.get("status") == "ok":
        lines += [("| system | workers | jobs | seconds | jobs/s | per job p50 ms | p99 ms | "
                  "in the database, ms per job | server CPU ms per job | lock waits |"),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for system in ("ours", "peer"):
            for workers, r in jobs[system].items():
                if r.get("status", "ok") != "ok":
                    lines.append(f"| {system} | {workers} | {r.get('reason')} | | | | | | | |")
                    continue
                split = ", ".join(f"{k} {_fmt(v)}"
                                  for k, v in r.get("db_ms_per_job_by_function", {}).items())
                events = ", ".join(f"{k} {v}" for k, v in
                                   r.get("activity", {}).get("lock_events", {}).items())
                lines.append(f"| {r.get('label', system)} | {workers} | {r['jobs']} | "
                             f"{_fmt(r['seconds'])} | {_fmt(r['jobs_per_second'])} | "
                             f"{_fmt(r['per_job']['p50_ms'])} | {_fmt(r['per_job']['p99_ms'])} | "
                             f"{_fmt(r['db_ms_per_job'])}{f' ({split})' if split else ''} | "
                             f"{_fmt(r.get('server_cpu_ms_per_job') or '')} | "
                             f"{_share(r.get('activity', {}).get('lock_wait_share'))}"
                             f"{f' ({events})' if events else ''} |")
        for note in jobs.get("notes", []):
            lines.append(f"\n{note}")
    else:
        lines.append(f"{'Failed' if jobs.get('status') == 'error' else 'Not available'}: "
                     f"{jobs.get('reason')}")
    bound = result.get("commit_bound", {})
    if bound.get("status") == "ok":
        c = bound["commit"]
        lines += ["", (f"The largest commit ({bound['batch_messages']} messages shown, a "
                       f"4,000-byte summary made of them): commit_job p50 {_fmt(c['p50_ms'])} ms, "
                       f"p99 {_fmt(c['p99_ms'])} ms over {c['n']}. {bound['note']}")]
    lines += ["", "## Worker overhead per model call and memory", ""]
    over = result.get("worker_overhead", {})
    if over.get("status") == "ok":
        lines += ["| adapter | calls | p50 ms | p99 ms |", "| --- | --- | --- | --- |"]
        for name, s in over["adapters"].items():
            if s.get("status", "ok") == "ok":
                lines.append(f"| {name} | {s['n']} | {_fmt(s['p50_ms'])} | {_fmt(s['p99_ms'])} |")
            else:
                lines.append(f"| {name} | {s.get('reason')} | | |")
        for note in over.get("notes", []):
            lines.append(f"\n{note}")
    else:
        lines.append(f"Worker overhead not available: {over.get('reason')}")
    mem = result.get("memory", {})
    if mem.get("status") == "ok":
        lines += ["", "| process | peak RSS MiB |", "| --- | --- |"]
        for name, mib in mem["peak_rss_mib"].items():
            lines.append(f"| {name} | {_fmt(mib)} |")
    else:
        lines.append(f"\nMemory not available: {mem.get('reason')}")
    explain = result.get("explain", {})
    if explain.get("status") == "ok":
        lines += ["", (f"## Where one call spends its time (auto_explain, W={explain['workspaces']};"
                  " full plans in explain.txt)"), ""]
        for name, rows in explain.get("top_statements", {}).items():
            lines += [f"**{name}**", "", "| ms | calls | statement |", "| --- | --- | --- |"]
            for r in rows:
                text = r["statement"].replace("|", "\\|")
                lines.append(f"| {_fmt(r['ms'])} | {r['calls']} | `{text}` |")
            lines.append("")
        wide = explain.get("wide_reads", {})
        found = [(name, n) for name, nodes in wide.get("nodes", {}).items() for n in nodes]
        lines.append(f"Plan nodes reading more than {wide.get('limit_rows')} rows of a tenant "
                     f"table: {len(found)}"
                     + "".join(f"\n- {name}: {n['node']} on {n['table']}, {n['rows']:.0f} rows"
                               for name, n in found))
    if result.get("routing", {}).get("status") == "ok":
        from pyworker.lab.bench import routing

        lines += routing.markdown(result["routing"])
    ds = result.get("dataset", {})
    lines += ["", "## Dataset", "",
              (f"{ds.get('records_per_workspace')} records per workspace; sizes "
               f"{ds.get('sizes')}; build seconds {ds.get('build_seconds')}; consistency "
               f"{ds.get('consistency')}."), ""]
    return "\n".join(lines) + "\n"


def plot(result: Section, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("growth", {}).get("rows", [])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["workspaces"] for r in rows]
    for key, label, style in (("recall_p50_ms", "recall p50", "o-"),
                              ("recall_p99_ms", "recall p99", "o--"),
                              ("query_p50_ms", "query_memories search p50", "s-"),
                              ("query_p99_ms", "query_memories search p99", "s--"),
                              ("recall_floor_p50_ms", "SELECT 1 floor p50", "k:")):
        pts = [(r["workspaces"], r[key]) for r in rows if key in r]
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    for num, den, label, style in (("recall_p50_ms", "recall_floor_p50_ms", "recall p50", "o-"),
                                   ("recall_p99_ms", "recall_floor_p99_ms", "recall p99", "o--"),
                                   ("query_p50_ms", "query_floor_p50_ms", "query p50", "s-")):
        pts = [(r["workspaces"], r[num] / r[den]) for r in rows if num in r and r.get(den)]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    for y, label in ((TARGETS["recall_p50_x_floor"], "recall p50 target"),
                     (TARGETS["recall_p99_x_floor"], "recall p99 target"),
                     (TARGETS["query_p50_x_floor"], "query p50 target")):
        ax2.axhline(y, color="grey", linewidth=0.8, linestyle=":")
        ax2.annotate(label, (xs[0] if xs else 1, y), fontsize=7, color="grey",
                     xytext=(2, 2), textcoords="offset points")
    for ax, title, ylabel in ((ax1, "Latency by workspace count", "ms"),
                              (ax2, "Ratio to the SELECT 1 floor", "x floor")):
        ax.set_xscale("log")
        ax.set_xlabel("workspaces (x 256 records)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"pimem bench ({result['profile']['name']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_for(quick: bool, sizes: str | None) -> Profile:
    profile = PROFILES["quick" if quick else "default"]
    if sizes:
        profile = replace(profile, sizes=tuple(int(s) for s in sizes.split(",") if s.strip()))
    return profile
