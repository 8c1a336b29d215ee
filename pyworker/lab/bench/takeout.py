"""Take-outs: what each required part of a literal ``query_memories`` search costs, measured by
taking it out.

``pimem bench`` measures the search as it is. This measures copies of it, each with one part
taken out, side by side on the bench's data (run after ``scripts/bench``, which leaves its
database): what the search would cost if that part were free. Two more copies say where the
rest of the call goes (the answer's JSON; the literal walk, against browsing). The take-outs are
not a design and change nothing in the product: the copies live in a scratch schema
(``bench_takeout``), dropped at the end; like the bench's own calls they write what a search
writes (tool-call rows, usage) into the bench's database; and the answers of the copies that
must answer as the search does are checked equal first. docs/benchmarks.md ("What the required
work costs") holds the numbers and the command.

Each call of a round is one workspace's recalled request with a new tool call id; the variants
(and the ``SELECT 1`` floor) are called one after another for the same workspace, in an order
that rotates from workspace to workspace, so that the cold page reads of a workspace fall on
each variant alike. Each variant's p50 is the bench's (nearest rank, beside the floor's), and it
is compared with the whole search by the median of the paired differences (same workspace,
same round), in wall time and in the backend's CPU time (from ``/proc/<pid>/schedstat``, when
the server runs on this machine).

    .venv/bin/python -m pyworker.lab.bench.takeout [--dsn DSN] [--workspaces N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pyworker.lab.bench import data, db

SCHEMA = "bench_takeout"
QUERY = "memory.query_memories(text,text,text,jsonb)"
ANSWER = "memory_private.answer_records(text,bigint[],text,text[],text[])"
RECENT = "memory_private.recent_valid_records(text,bigint,integer,text,text,bigint)"
SEARCH = "memory_private.search_records(text,bigint,integer,text,text)"
RECORDS = "memory_private.query_records(text,bigint,integer,text,text,bigint)"

# The texts each take-out replaces (in the function named), and by what.
USAGE = ("perform memory_private.count_usage(p_workspace_id, v_ids, v_now);", "null;")
PROVENANCE = [("insert into memory_private.tool_calls", "perform 1; /*"),
              ("updated_at = v_now;", "updated_at = v_now; */")]
LINES = [("where p_lines[f.pos] is not null", "where false"),
         ("where p_lines[f.pos] is null and v_folded is not null", "where false")]
JSON = ("return to_jsonb(memory_private.query_answer_row(",
        ("return jsonb_build_object('count', cardinality(v_records)); "
         "return to_jsonb(memory_private.query_answer_row("))
BROWSE = ("v_first := (v_start.previous).tool_call_id is null;",
          "v_first := (v_start.previous).tool_call_id is null; v_query := null;")
VALIDATION = [("and not exists (select 1 from memory_private.record_failures(",
               ("and not exists (select 1 where false and exists (select from "
                "memory_private.record_failures(")),
              ("v_now))\n       order by c.pos", "v_now)))\n       order by c.pos")]


class TakeoutError(Exception):
    """A take-out no longer applies: the text it replaces is not in the function."""


@dataclass
class Variant:
    name: str
    what: str
    same_answer: bool                         # must answer exactly as the whole search does
    query: list[tuple[str, str]] = field(default_factory=list)   # edits of query_memories
    lines: bool = False                       # answer_records without the found lines' order
    validation: bool = False                  # the literal walk without the records' checks


VARIANTS = [
    Variant("whole", "the search as it is", True),
    Variant("no_line_order", "sources in summary order: the lines a search finds not looked "
            "for (issue 13, item 2)", False, lines=True),
    Variant("no_usage", "usage not counted (R7)", True, query=[USAGE]),
    Variant("no_provenance", "the tool call's row not written: no provenance, no citations "
            "(T2, T3, R6)", True, query=PROVENANCE),
    Variant("no_validation", "the records' own checks and grants not asked (V6, T1; the scope's "
            "checks kept)", True, validation=True),
    Variant("none_of_the_four", "all four above taken out at once", False,
            query=[USAGE, *PROVENANCE], lines=True, validation=True),
    # Not rules: where the rest of the call goes.
    Variant("no_json", "the answer's records read and made into rows, but not turned into "
            "JSON, sent or parsed", False, query=[JSON]),
    Variant("browse", "the newest 12 valid records instead of the literal walk (and so no "
            "lines to look for)", False, query=[BROWSE]),
    Variant("whole_again", "the search as it is, a second copy: the noise of the method", True),
]


def one(conn: psycopg.Connection, sql: str, params: Sequence[Any] = ()) -> Any:
    """The first column of the statement's one row."""
    row = conn.execute(sql, params).fetchone()
    assert row is not None, sql
    return row[0]


def edited(source: str, edits: Sequence[tuple[str, str]], what: str) -> str:
    for old, new in edits:
        if old not in source:
            raise TakeoutError(f"{what}: {old.splitlines()[0]!r} is not in the function")
        source = source.replace(old, new)
    return source


def copy_function(conn: psycopg.Connection, signature: str, name: str,
                  edits: Sequence[tuple[str, str]]) -> None:
    """Creates bench_takeout.<name>: the function's definition with the edits made."""
    source = one(conn, "select pg_get_functiondef(%s::regprocedure)", (signature,))
    original = signature.split("(", 1)[0]
    source = edited(source, [(f"FUNCTION {original}(", f"FUNCTION {SCHEMA}.{name}(")], signature)
    conn.execute(edited(source, edits, f"{name} ({signature})"))


def install(conn: psycopg.Connection, variants: Sequence[Variant]) -> dict[str, str]:
    """The copies of each variant; returns the name of each variant's query_memories."""
    conn.execute(f"drop schema if exists {SCHEMA} cascade")
    conn.execute(f"create schema {SCHEMA}")
    copy_function(conn, ANSWER, "answer_no_lines", LINES)
    copy_function(conn, RECENT, "recent_unchecked", VALIDATION)
    copy_function(conn, SEARCH, "search_unchecked", [(
        "memory_private.recent_valid_records(", f"{SCHEMA}.recent_unchecked(")])
    copy_function(conn, RECORDS, "records_unchecked", [(
        "memory_private.search_records(", f"{SCHEMA}.search_unchecked(")])
    names = {}
    for v in variants:
        edits = list(v.query)
        if v.lines:
            edits.append(("memory_private.answer_records(", f"{SCHEMA}.answer_no_lines("))
        if v.validation:
            edits.append(("memory_private.query_records(", f"{SCHEMA}.records_unchecked("))
        copy_function(conn, QUERY, f"query_{v.name}", edits)
        names[v.name] = f"{SCHEMA}.query_{v.name}"
    return names


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what a second call changes by itself (the replay flag, the last use
    the call before it counted)."""
    answer = dict(answer)
    answer.pop("replayed", None)
    if isinstance(answer.get("records"), list):
        answer["records"] = [{k: v for k, v in r.items() if k != "last_used_at"}
                             for r in answer["records"]]
    return answer


def backend_cpu(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return None


def p50(samples_ns: Sequence[int]) -> float | None:
    """The bench's p50 (nearest rank, pyworker.lab.bench.db.percentile), in ms."""
    return round(db.percentile(sorted(samples_ns), 50), 4) if samples_ns else None


def median_ms(differences_ns: Sequence[int]) -> float | None:
    """The median of paired differences, in ms."""
    return round(statistics.median(differences_ns) / 1e6, 4) if differences_ns else None


def run(dsn: str, *, workspaces: int = 300, rounds: int = 4,
        query: str = data.SEARCH_TERM, variants: Sequence[Variant] = VARIANTS,
        log: Any = print) -> dict[str, Any]:
    """Measures every variant; returns the report (and leaves nothing behind)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pairs = conn.execute(
            "select distinct on (q.workspace_id) q.workspace_id, q.request_id "
            "from memory_private.requests q "
            "where q.workspace_id like 'bench-%%' and q.request_id like 'rc%%' "
            "and q.kind = 'interactive' order by q.workspace_id, q.request_id limit %s",
            (workspaces,)).fetchall()
        if not pairs:
            raise TakeoutError("no recalled bench requests here: run pimem bench first")
        body = json.dumps({"query": query})
        if not any(v.name == "whole" for v in variants):
            raise TakeoutError("the variants must include 'whole', the search as it is")
        try:
            names = install(conn, variants)
            stamp = f"takeout-{int(time.time() * 1000)}"
            same = {}
            ws, rid = pairs[0]
            answers = {name: comparable(one(conn, f"select {fn}(%s, %s, %s, %s::jsonb)",
                                            (ws, rid, f"{stamp}-check-{name}", body)))
                       for name, fn in names.items()}
            for v in variants:
                same[v.name] = answers[v.name] == answers["whole"]
                if v.same_answer and not same[v.name]:
                    raise TakeoutError(f"{v.name} answers otherwise than the whole search")
            pid = one(conn, "select pg_backend_pid()")
            keys = ["floor", *names]
            samples: dict[str, list[tuple[int, int | None]]] = {k: [] for k in keys}
            for rnd in range(rounds + 1):               # round 0 warms up
                for i, (ws, rid) in enumerate(pairs):
                    for k in keys[i % len(keys):] + keys[:i % len(keys)]:
                        c0, t0 = backend_cpu(pid), time.perf_counter_ns()
                        if k == "floor":
                            conn.execute(db.FLOOR_SQL, prepare=True).fetchone()
                        else:
                            conn.execute(f"select {names[k]}(%s, %s, %s, %s::jsonb)",
                                         (ws, rid, f"{stamp}-{rnd}-{k}-{i}", body),
                                         prepare=True).fetchone()
                        t1, c1 = time.perf_counter_ns(), backend_cpu(pid)
                        if rnd:
                            cpu = c1 - c0 if c0 is not None and c1 is not None else None
                            samples[k].append((t1 - t0, cpu))
                log(f"round {rnd}/{rounds} done" + (" (warm-up)" if rnd == 0 else ""))
        finally:
            conn.execute(f"drop schema if exists {SCHEMA} cascade")
    floor = p50([w for w, _ in samples["floor"]]) or float("nan")
    whole = samples["whole"]
    report: dict[str, Any] = {"query": query, "workspaces": len(pairs), "rounds": rounds,
                              "floor_p50_ms": floor, "variants": []}
    for v in variants:
        s = samples[v.name]
        cpus = [c for _, c in s if c is not None]
        pairs_cpu = [(b[1], x[1]) for b, x in zip(whole, s, strict=True)
                     if b[1] is not None and x[1] is not None]
        wall = p50([w for w, _ in s]) or float("nan")
        report["variants"].append({
            "name": v.name, "what": v.what, "same_answer": same[v.name],
            "wall_p50_ms": wall, "cpu_p50_ms": p50(cpus),
            "saved_wall_ms": median_ms([b[0] - x[0] for b, x in zip(whole, s, strict=True)]),
            "saved_cpu_ms": median_ms([b - x for b, x in pairs_cpu]),
            "ratio_to_floor": round(wall / floor, 1)})
    return report


def table(report: dict[str, Any]) -> str:
    lines = [(f"query {report['query']!r}, {report['workspaces']} workspaces, "
              f"{report['rounds']} rounds; SELECT 1 floor p50 {report['floor_p50_ms']} ms"),
             "",
             ("| variant | wall p50 ms | CPU p50 ms | saved wall ms | saved CPU ms | x floor | "
              "same answer |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in report["variants"]:
        lines.append(f"| {v['name']} | {v['wall_p50_ms']} | {v['cpu_p50_ms']} | "
                     f"{v['saved_wall_ms']} | {v['saved_cpu_ms']} | {v['ratio_to_floor']} | "
                     f"{'yes' if v['same_answer'] else 'no'} |")
    return "\n".join(lines)


def bench_database() -> str:
    """The pimem_bench database of the embedded PostgreSQL that ``pimem bench`` leaves in the
    state directory (started, or reused if it runs)."""
    from pyworker.lab.servers import embedded_dsn, state_dir

    admin = embedded_dsn(state_dir() / "bench-pg")
    return psycopg.conninfo.make_conninfo(admin, dbname="pimem_bench")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="the database the bench ran in (default: its pimem_bench "
                        "database in the embedded PostgreSQL the bench left, started if need be)")
    parser.add_argument("--workspaces", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    dsn = args.dsn or bench_database()
    try:
        report = run(dsn, workspaces=args.workspaces, rounds=args.rounds,
                     log=lambda m: print(m, file=sys.stderr))
    except TakeoutError as e:
        print(f"takeout: {e}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
