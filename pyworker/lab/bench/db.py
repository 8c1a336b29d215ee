"""The database figures of ``pimem bench``, each measured beside its floor.

Every figure is sampled *interleaved* with its floor on the same connection (floor, subject,
floor, subject, ...), so a burst of load from elsewhere on a shared machine hits both alike and
the ratio holds. Statements are prepared (``prepare=True``) and connections are autocommit, as a
bot backend would run them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from pyworker.lab.bench import data

Section = dict[str, Any]
FLOOR_SQL = "select 1"


# Statistics -------------------------------------------------------------------------------------

def percentile(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanosecond samples, in milliseconds."""
    if not sorted_ns:
        return float("nan")
    rank = max(1, min(len(sorted_ns), int(-(-q * len(sorted_ns) // 100))))
    return sorted_ns[rank - 1] / 1e6


def summarize(samples_ns: Sequence[int]) -> dict[str, float | int]:
    s = sorted(samples_ns)
    total = sum(s)
    return {"n": len(s), "p50_ms": round(percentile(s, 50), 4),
            "p90_ms": round(percentile(s, 90), 4), "p99_ms": round(percentile(s, 99), 4),
            "mean_ms": round(total / len(s) / 1e6, 4) if s else float("nan"),
            "max_ms": round(s[-1] / 1e6, 4) if s else float("nan"),
            "per_second": round(len(s) / (total / 1e9), 1) if total else float("nan")}


WARMUP = 20  # calls of each before the timed ones


def interleaved(floor: Callable[[int], None], subject: Callable[[int], None], n: int, *,
                warmup: int = WARMUP) -> tuple[list[int], list[int]]:
    """Runs floor(i) and subject(i) alternately n times (after a warm-up); returns their
    durations in nanoseconds."""
    for i in range(warmup):
        floor(-1 - i)
        subject(-1 - i)
    floor_ns: list[int] = []
    subject_ns: list[int] = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        floor(i)
        t1 = clock()
        subject(i)
        t2 = clock()
        floor_ns.append(t1 - t0)
        subject_ns.append(t2 - t1)
    return floor_ns, subject_ns


def target(name: str, value: float, limit: float, *, at_least: bool = False) -> dict[str, Any]:
    met = value >= limit if at_least else value <= limit
    return {"name": name, "value": round(value, 3), "limit": limit,
            "op": ">=" if at_least else "<=", "met": bool(met)}


def not_available(reason: str) -> Section:
    return {"status": "not_available", "reason": reason}


def has_function(conn: psycopg.Connection, signature: str) -> bool:
    row = conn.execute("select to_regprocedure(%s) is not null", (signature,)).fetchone()
    return bool(row and row[0])


def server_facts(conn: psycopg.Connection) -> dict[str, str]:
    names = ("server_version", "fsync", "synchronous_commit", "shared_buffers", "jit",
             "max_connections", "work_mem")
    facts = {}
    for name in names:
        row = conn.execute("select current_setting(%s)", (name,)).fetchone()
        facts[name] = str(row[0]) if row else "?"
    return facts


# Page reads -------------------------------------------------------------------------------------

BACKEND_IO = "pg_stat_get_backend_io(integer)"


def start_reads(conn: psycopg.Connection) -> tuple[int, float] | None:
    """This connection's page reads so far (pages that were not in shared buffers, and the
    milliseconds it waited for them), to set beside a figure: the part of a latency that is the
    machine's storage rather than the work. Needs PostgreSQL 18's per-backend I/O statistics
    and a superuser (``track_io_timing`` is set on for the rest of the session); None
    otherwise."""
    row = conn.execute("select current_setting('is_superuser') = 'on'").fetchone()
    if not (row and row[0]) or not has_function(conn, BACKEND_IO):
        return None
    conn.execute("set track_io_timing = on")
    return _reads(conn)


def _reads(conn: psycopg.Connection) -> tuple[int, float]:
    conn.execute("select pg_stat_force_next_flush()")  # flushed when the session goes idle
    # bytes, not reads: PostgreSQL 18 reads neighbouring pages in one operation
    row = conn.execute("select coalesce(sum(read_bytes), 0)::bigint "
                       "/ current_setting('block_size')::bigint, "
                       "coalesce(sum(read_time), 0)::float8 "
                       "from pg_stat_get_backend_io(pg_backend_pid()) "
                       "where object = 'relation'").fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


def reads_per_call(conn: psycopg.Connection, start: tuple[int, float] | None,
                   calls: int) -> Section | None:
    """Pages read and milliseconds spent reading them per call since ``start`` (means over
    ``calls`` calls; the floor's ``SELECT 1`` reads none)."""
    if start is None or calls <= 0:
        return None
    pages, ms = _reads(conn)
    return {"pages": round((pages - start[0]) / calls, 2),
            "read_ms": round((ms - start[1]) / calls, 4)}


# The floor --------------------------------------------------------------------------------------

def floor_of(conn: psycopg.Connection) -> Callable[[int], None]:
    def run(_i: int) -> None:
        conn.execute(FLOOR_SQL, prepare=True).fetchone()
    return run


def measure_floor(conn: psycopg.Connection, n: int) -> Section:
    """The bare round trip alone, for reference (each figure also carries its own)."""
    floor = floor_of(conn)
    a, b = interleaved(floor, floor, n // 2)
    return {"status": "ok", "sql": FLOOR_SQL, "round_trip": summarize(a + b)}


# Recall and query_memories ----------------------------------------------------------------------

RECALL_SIGNATURE = "memory.recall(text,text)"
QUERY_SIGNATURE = "memory.query_memories(text,text,text,jsonb)"


def new_requests(conn: psycopg.Connection, width: int, n: int, tag: str) -> list[tuple[str, str]]:
    """n new running interactive requests spread over the first ``width`` workspaces (through
    the public API); returns (workspace, request) pairs."""
    pairs = []
    rows = []
    for i in range(n):
        index = (i * 7919) % width          # a stride, so neighbours hit different workspaces
        ws = data.workspace_id(index)
        rid = f"{tag}-{i:05d}"
        user = data.user_of(index, i)
        rows.append((ws, rid, "b1", data.chat_of(index), 0, user, "interactive", "running",
                     "fake", "m", 1, 0, None))
        pairs.append((ws, rid))
    with conn.cursor() as cur:
        cur.executemany("select memory.upsert_request(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
                        "%s::numeric, %s::numeric, %s)", rows)
    return pairs


def measure_recall(conn: psycopg.Connection, width: int, n: int, tag: str = "rc") -> Section:
    """memory.recall for a request that has not recalled yet, vs the SELECT 1 floor."""
    if not has_function(conn, RECALL_SIGNATURE):
        return not_available("memory.recall (sql/50_recall.sql) is not in the schema yet")
    pairs = new_requests(conn, width, n + WARMUP, f"{tag}{width}")
    modes: dict[str, int] = {}

    def recall(i: int) -> None:
        ws, rid = pairs[i if i >= 0 else n - 1 - i]
        row = conn.execute("select memory.recall(%s, %s)", (ws, rid), prepare=True).fetchone()
        assert row is not None
        if i >= 0:
            mode = str(row[0].get("mode"))
            modes[mode] = modes.get(mode, 0) + 1

    reads = start_reads(conn)
    floor_ns, subject_ns = interleaved(floor_of(conn), recall, n, warmup=WARMUP)
    return {"status": "ok", "workspaces": width, "modes": modes,
            "floor": summarize(floor_ns), "recall": summarize(subject_ns),
            "reads": reads_per_call(conn, reads, n + WARMUP), "requests": pairs[:n]}


def measure_recall_directory(conn: psycopg.Connection, width: int, n: int) -> Section:
    """memory.recall while every scope's consolidation is pending: the directory of up to eight
    valid records instead of the index (R2). Marks all bench scopes due first (it stays so)."""
    if not has_function(conn, RECALL_SIGNATURE):
        return not_available("memory.recall (sql/50_recall.sql) is not in the schema yet")
    conn.execute("update memory_private.scopes s set consolidation_due_at = i.built_at "
                 "from memory_private.scope_indexes i "
                 "where i.workspace_id = s.workspace_id and i.scope_id = s.scope_id "
                 "and s.workspace_id like 'bench-%%' and s.consolidation_due_at is null")
    section = measure_recall(conn, width, n, tag="rd")  # new requests: none has recalled yet
    section.pop("requests", None)
    return section


def measure_query(conn: psycopg.Connection, pairs: Sequence[tuple[str, str]], n: int,
                  args: dict[str, Any], label: str) -> Section:
    """memory.query_memories over a full 256-record scope, vs the SELECT 1 floor. Each sample is
    a new tool call of a request that has recalled."""
    if not has_function(conn, QUERY_SIGNATURE):
        return not_available("memory.query_memories (sql/50_recall.sql) is not in the schema yet")
    if not pairs:
        return not_available("no recalled requests to query from")
    body = json.dumps(args)
    counts: list[int] = []

    def query(i: int) -> None:
        ws, rid = pairs[abs(i) % len(pairs)]
        call = f"{label}-{i}"
        row = conn.execute("select memory.query_memories(%s, %s, %s, %s::jsonb)",
                           (ws, rid, call, body), prepare=True).fetchone()
        assert row is not None
        if i >= 0:
            counts.append(int(row[0].get("count", 0)))

    reads = start_reads(conn)
    floor_ns, subject_ns = interleaved(floor_of(conn), query, n, warmup=WARMUP)
    return {"status": "ok", "args": args, "scope_records": data.RECORDS_PER_WORKSPACE,
            "results_mean": round(sum(counts) / len(counts), 2) if counts else 0,
            "floor": summarize(floor_ns), "query": summarize(subject_ns),
            "reads": reads_per_call(conn, reads, n + WARMUP)}


# Ingest -----------------------------------------------------------------------------------------

FLOOR_TABLE = "bench_floor.plain_messages"
UPSERT_SQL = ("select memory.upsert_message(%s, %s, %s, %s, %s, %s, %s, %s::timestamptz, "
              "%s::text[])")
PLAIN_SQL = (f"insert into {FLOOR_TABLE} (workspace_id, message_id, request_id, role, "
             "speaker_id, body, content_hash, directed, retain_until, repositories, created_at) "
             "values (%s, %s, %s, %s, %s, %s, %s, %s, %s::timestamptz, %s::text[], now())")


def prepare_floor_table(conn: psycopg.Connection) -> None:
    """An unindexed table with the message columns (no key, no checks, no foreign keys)."""
    conn.execute("create schema if not exists bench_floor")
    conn.execute(f"drop table if exists {FLOOR_TABLE}")
    conn.execute(f"create table {FLOOR_TABLE} (like memory_private.messages including defaults)")


def ingest_rows(width: int, n: int, tag: str,
                conversations: int = data.CONVERSATIONS_PER_WORKSPACE) -> list[tuple[Any, ...]]:
    """New user messages for existing conversations (requests ``r000`` .. of each workspace),
    200-400 bytes of chat text each."""
    import random

    rng = random.Random(11)
    rows: list[tuple[Any, ...]] = []
    for i in range(n):
        index = (i * 7919) % width
        k = (i * 31) % conversations
        text = data.chat_text(rng, data._USER_LINES, 200, 400)
        rows.append((data.workspace_id(index), f"{tag}-{i:06d}", f"r{k:03d}", "user",
                     data.user_of(index, k), text, True, None, []))
    return rows


def measure_ingest(conn: psycopg.Connection, width: int, n: int, batch: int = 50,
                   conversations: int = data.CONVERSATIONS_PER_WORKSPACE) -> Section:
    """memory.upsert_message (validation, hashing, foreign keys, indexes) vs a plain INSERT of
    the same row into an unindexed table: one call per transaction, and ``batch`` calls per
    transaction (which takes the commit out of both)."""
    prepare_floor_table(conn)
    rows = ingest_rows(width, 2 * n + 4 * 20 + 2 * batch * 4, f"ing{width}", conversations)
    upserts = iter(rows)
    floors = iter(rows)

    def upsert(_i: int) -> None:
        row = conn.execute(UPSERT_SQL, next(upserts), prepare=True).fetchone()
        assert row is not None and row[0] == "inserted", row

    def plain(_i: int) -> None:
        r = next(floors)
        conn.execute(PLAIN_SQL, (*r[:6], data.content_hash(str(r[5])), *r[6:]), prepare=True)

    floor_ns, subject_ns = interleaved(plain, upsert, n)
    per_commit = {"floor": summarize(floor_ns), "upsert_message": summarize(subject_ns)}

    def in_batch(step: Callable[[int], None]) -> Callable[[int], None]:
        def run(i: int) -> None:
            with conn.transaction():
                for _ in range(batch):
                    step(i)
        return run

    rounds = max(4, n // batch)
    floor_b, subject_b = interleaved(in_batch(plain), in_batch(upsert), rounds, warmup=2)
    batched = {"calls_per_transaction": batch,
               "floor": summarize([t // batch for t in floor_b]),
               "upsert_message": summarize([t // batch for t in subject_b])}
    return {"status": "ok", "workspaces": width, "per_commit": per_commit, "batched": batched}


# EXPLAIN of the hot paths -----------------------------------------------------------------------

def explain_hot_paths(conn: psycopg.Connection, width: int) -> Section:
    """The plan of every statement the hot paths run, through auto_explain (nested statements,
    ANALYZE, buffers), captured as notices on this connection."""
    plans: dict[str, list[str]] = {}
    current: list[str] = []

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "duration:" in diag.message_primary:
            current.append(diag.message_primary)

    try:
        conn.execute("load 'auto_explain'")
    except psycopg.Error as exc:
        return not_available(f"auto_explain cannot be loaded: {exc}")
    settings = {"auto_explain.log_min_duration": "0", "auto_explain.log_analyze": "on",
                "auto_explain.log_buffers": "on", "auto_explain.log_timing": "on",
                "auto_explain.log_nested_statements": "on", "auto_explain.log_level": "notice",
                "client_min_messages": "notice"}
    conn.add_notice_handler(on_notice)
    try:
        pairs = new_requests(conn, width, 2, f"ex{width}")
        calls: list[tuple[str, str, tuple[Any, ...]]] = []
        if has_function(conn, RECALL_SIGNATURE):
            calls.append(("recall", "select memory.recall(%s, %s)", pairs[0]))
            calls.append(("recall (second workspace kind)", "select memory.recall(%s, %s)",
                          pairs[1]))
        if has_function(conn, QUERY_SIGNATURE):
            search = json.dumps({"query": data.SEARCH_TERM})
            calls.append(("query_memories search",
                          "select memory.query_memories(%s, %s, %s, %s::jsonb)",
                          (*pairs[0], "ex-1", search)))
            calls.append(("query_memories search (ranked words)",
                          "select memory.query_memories(%s, %s, %s, %s::jsonb)",
                          (*pairs[1], "ex-2", json.dumps({"query": data.QUESTION}))))
            calls.append(("query_memories browse",
                          "select memory.query_memories(%s, %s, %s, %s::jsonb)",
                          (*pairs[0], "ex-3", "{}")))
        calls.append(("upsert_message", UPSERT_SQL, ingest_rows(width, 1, "ex-ing")[0]))
        if has_function(conn, "memory.claim_job(text)"):
            # Rolled back below: the claim is explained, the job stays pending.
            calls.append(("claim_job (rolled back)", "select memory.claim_job(%s)",
                          ("bench-explain",)))
        for name, sql, args in calls:
            for key, value in settings.items():
                conn.execute("select set_config(%s, %s, false)", (key, value))
            current.clear()
            with conn.transaction(force_rollback=name.endswith("(rolled back)")):
                conn.execute(sql, args)
            conn.execute("select set_config('auto_explain.log_min_duration', '-1', false)")
            plans[name] = [p for p in current if "select set_config" not in p]
    finally:
        conn.remove_notice_handler(on_notice)
        conn.execute("reset client_min_messages")
        conn.execute("select set_config('auto_explain.log_min_duration', '-1', false)")
    # claim_job is left out: it is the job machinery's path, which picks among every workspace's
    # jobs by design (FOR UPDATE SKIP LOCKED over the queue), not an interactive read.
    limit = data.RECORDS_PER_WORKSPACE * 2  # two full scopes
    return {"status": "ok", "workspaces": width, "plans": plans,
            "top_statements": {name: top_statements(p) for name, p in plans.items()},
            "wide_reads": {"limit_rows": limit,
                           "nodes": {name: wide_reads(p, limit) for name, p in plans.items()
                                     if not name.startswith("claim_job")}}}


# The tables that grow with the workspaces. A hot path reads a few of their rows by key, or one
# scope's rows through its index; a plan node that reads more rows than two full scopes is a
# whole-table read (a planner's choice that costs W times more at W workspaces: the hashed
# subplan over every summary line of 2026-12-01, docs/benchmarks.md).
TENANT_TABLES = frozenset({
    "records", "record_texts", "record_documents", "scope_words", "record_dependencies", "record_usage", "messages", "requests", "tool_calls", "scopes",
    "tombstones", "index_dependencies", "request_recall", "members", "bots", "chats", "topics",
    "repository_grants"})
_NODE = re.compile(r"(Seq Scan|Index Scan|Index Only Scan|Bitmap Heap Scan|Tid Scan)"
                   r"(?: Backward)?(?: using \S+)? on (?:\w+\.)?(\w+)")
_ACTUAL = re.compile(r"actual (?:time=[\d.]+\.\.[\d.]+ )?rows=([\d.]+) loops=(\d+)")
_REMOVED = re.compile(r"Rows Removed by (?:Filter|Index Recheck|Join Filter): (\d+)")


def wide_reads(plans: Sequence[str], limit: int) -> list[dict[str, Any]]:
    """The scan nodes of the given auto_explain plans (ANALYZE) that read more than ``limit``
    rows of a tenant table (rows returned and removed by a filter, over all loops)."""
    found: list[dict[str, Any]] = []
    for plan in plans:
        node: dict[str, Any] | None = None
        for line in plan.splitlines() + ["->"]:
            m = _NODE.search(line)
            if m or "->" in line:
                if node and node["table"] in TENANT_TABLES and node["rows"] > limit:
                    found.append(node)
                node = None
            if m:
                a = _ACTUAL.search(line)
                rows, loops = (float(a.group(1)), int(a.group(2))) if a else (0.0, 1)
                node = {"node": m.group(1), "table": m.group(2), "rows": rows * loops,
                        "loops": loops}
            elif node is not None:
                r = _REMOVED.search(line)
                if r:
                    node["rows"] += int(r.group(1)) * node["loops"]
    return found


def top_statements(plans: Sequence[str], n: int = 8) -> list[dict[str, Any]]:
    """The statements that took longest in one call (auto_explain's duration, under ANALYZE,
    so inflated alike), grouped by their text; the call itself comes first."""
    totals: dict[str, list[float]] = {}
    for plan in plans:
        d = re.search(r"duration: ([\d.]+) ms", plan)
        q = re.search(r"Query Text: (.*?)\n(?:Query Parameters|[A-Z][a-zA-Z ]+  \(cost)", plan,
                      re.DOTALL)
        text = " ".join((q.group(1) if q else "?").split())[:160]
        totals.setdefault(text, []).append(float(d.group(1)) if d else 0.0)
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"statement": k, "calls": len(v), "ms": round(sum(v), 3)} for k, v in ranked]


# What the searches derive from the records (sql/48_search.sql, record_texts): their index.
SEARCH_TABLES = frozenset({"record_documents", "scope_words", "record_texts"})


def measure_disk(conn: psycopg.Connection) -> Section:
    """Bytes on disk per message against its raw text (issue 34): the messages table with its
    TOAST and indexes, and every table of the schema likewise (records, searches, jobs, ...),
    each over the number of messages; and what each index costs. Sizes as PostgreSQL reports
    them (pg_relation_size of each fork), right after the bench's data was built."""
    messages, raw = conn.execute(
        "select count(*), coalesce(sum(octet_length(body)), 0) from memory_private.messages"
    ).fetchone() or (0, 0)
    if not messages:
        return not_available("no messages in the dataset")
    tables = [dict(zip(("table", "heap", "toast", "indexes"), r, strict=True)) for r in
              conn.execute("""
        select c.relname::text, pg_relation_size(c.oid),
               coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0),
               pg_indexes_size(c.oid)
          from pg_class c
         where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
         order by pg_total_relation_size(c.oid) desc""").fetchall()]
    indexes = [dict(zip(("index", "table", "bytes"), r, strict=True)) for r in conn.execute("""
        select i.relname::text, t.relname::text, pg_relation_size(i.oid)
          from pg_index x
          join pg_class i on i.oid = x.indexrelid
          join pg_class t on t.oid = x.indrelid
         where t.relnamespace = 'memory_private'::regnamespace
         order by 3 desc""").fetchall()]
    own = next(t for t in tables if t["table"] == "messages")
    search = sum(t["heap"] + t["toast"] + t["indexes"] for t in tables
                 if t["table"] in SEARCH_TABLES)
    records = conn.execute("select count(*) from memory_private.records").fetchone()
    own_bytes = own["heap"] + own["toast"] + own["indexes"]
    all_bytes = sum(t["heap"] + t["toast"] + t["indexes"] for t in tables)
    return {"status": "ok", "messages": messages, "raw_bytes_per_message": round(raw / messages, 1),
            "message_bytes_per_message": round(own_bytes / messages, 1),
            "message_x_raw": round(own_bytes / raw, 3) if raw else None,
            "all_bytes_per_message": round(all_bytes / messages, 1),
            "all_x_raw": round(all_bytes / raw, 3) if raw else None,
            "search_bytes_per_record": round(search / records[0], 1)
            if records and records[0] else None,
            "tables": tables, "indexes": indexes}

