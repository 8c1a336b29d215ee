"""Worker metrics (pyworker/metrics.py): a worker runs against a test database with the metrics
port open, the endpoint is scraped, and the counters say what the worker did. Also: the JSON logs
of every job event carry the workspace, job and request ids."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyworker import metrics
from pyworker.testing import FakeModel
from tests.test_worker_e2e import CALL_COST, finished_conversation, make_worker, openai_adapter

ROOT = Path(__file__).resolve().parent.parent
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


@pytest.fixture(scope="module")
def port() -> int:
    """The in-process endpoint (one per test process: the registry is process-wide, so the
    tests compare scrapes before and after)."""
    return metrics.serve(0)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as f:
        yield f


def test_a_worker_run_counts_claims_commits_latency_tokens_and_dollars(
        conn: psycopg.Connection, db_dsn: str, fake: FakeModel, port: int) -> None:
    fake.reset()
    finished_conversation(conn)
    before = scrape(port)
    worker = make_worker(db_dsn, openai_adapter(fake))
    assert worker.run(until_idle=True) == 0
    after = scrape(port)
    for phase in ("extract", "consolidate"):
        assert delta(before, after, "pimem_jobs_claimed_total", phase=phase) == 1
        assert delta(before, after, "pimem_jobs_committed_total", phase=phase) == 1
        assert delta(before, after, "pimem_model_call_seconds_count",
                     adapter="openai", phase=phase, result="ok") == 1
        # what the fake reports per call: 1,200 input and 300 output tokens, $0.0081
        assert delta(before, after, "pimem_model_tokens_total",
                     adapter="openai", phase=phase, kind="input") == 1200
        assert delta(before, after, "pimem_model_tokens_total",
                     adapter="openai", phase=phase, kind="output") == 300
        assert delta(before, after, "pimem_model_cost_usd_total",
                     adapter="openai", phase=phase) == pytest.approx(float(CALL_COST))
    assert delta(before, after, "pimem_jobs_failed_total", phase="extract",
                 outcome="failed") == 0
    # the database's ledger agrees with the counters
    row = conn.execute("select sum(cost_usd) from memory_private.request_charges").fetchone()
    assert row is not None and row[0] == 2 * CALL_COST


def test_failed_and_unknown_calls_are_counted_and_an_unknown_one_as_stopped(
        conn: psycopg.Connection, db_dsn: str, fake: FakeModel, port: int) -> None:
    fake.reset("error")
    finished_conversation(conn)
    before = scrape(port)
    assert make_worker(db_dsn, openai_adapter(fake)).tick().status == "failed"
    conn.execute("select memory_private.advance_clock('61 minutes')")
    fake.reset("hang")
    result = make_worker(db_dsn, openai_adapter(fake), tick_seconds=3, commit_margin=1).tick()
    assert result.status == "unknown"
    after = scrape(port)
    assert delta(before, after, "pimem_jobs_claimed_total", phase="extract") == 2
    assert delta(before, after, "pimem_jobs_failed_total", phase="extract", outcome="failed") == 1
    assert delta(before, after, "pimem_jobs_failed_total", phase="extract",
                 outcome="unknown") == 1
    assert delta(before, after, "pimem_jobs_stopped_total", phase="extract",
                 why="unknown_outcome") == 1
    assert delta(before, after, "pimem_jobs_committed_total", phase="extract") == 0
    assert delta(before, after, "pimem_model_call_seconds_count", adapter="openai",
                 phase="extract", result="unknown") == 1
    row = conn.execute("select status from memory_private.jobs").fetchone()
    assert row is not None and row[0] == "stopped"  # what the counter claimed


def test_an_invalid_reply_counts_its_tokens_and_dollars_once(
        conn: psycopg.Connection, db_dsn: str, fake: FakeModel, port: int) -> None:
    fake.reset("malformed")  # a reply with usage, then refused by the worker
    finished_conversation(conn)
    before = scrape(port)
    assert make_worker(db_dsn, openai_adapter(fake)).tick().status == "failed"
    after = scrape(port)
    assert delta(before, after, "pimem_model_tokens_total", adapter="openai", phase="extract",
                 kind="input") == 1200
    assert delta(before, after, "pimem_model_cost_usd_total", adapter="openai",
                 phase="extract") == pytest.approx(float(CALL_COST))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_pimem_worker_serves_metrics_on_its_port_and_logs_ids_with_every_job_event(
        conn: psycopg.Connection, db_dsn: str, tmp_path: Path) -> None:
    finished_conversation(conn)
    port = free_port()
    log = tmp_path / "worker.log"
    env = {**os.environ, "PIMEM_METRICS_PORT": str(port)}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pyworker.cli", "worker", "--dsn", db_dsn, "--model",
             "offline", "--interval", "0.2", "--worker-id", "metrics-test"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        samples: Samples = {}
        while time.monotonic() < deadline:
            try:
                samples = scrape(port)
            except httpx.TransportError:
                samples = {}
            if sample(samples, "pimem_jobs_committed_total", phase="consolidate") >= 1:
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)  # waiting for another process, not for the memory clock
        assert sample(samples, "pimem_jobs_claimed_total", phase="extract") == 1
        assert sample(samples, "pimem_jobs_committed_total", phase="extract") == 1
        assert sample(samples, "pimem_jobs_committed_total", phase="consolidate") == 1
        assert sample(samples, "pimem_model_call_seconds_count", adapter="offline",
                      phase="extract", result="ok") == 1
        assert sample(samples, "pimem_jobs_failed_total", phase="extract", outcome="failed") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    serving = [e for e in events if e["event"] == "metrics_serving"]
    assert serving and serving[0]["port"] == port
    job_events = [e for e in events if e["event"] in {
        "job_claimed", "model_call", "model_reply", "checkpoint_saved", "job_committed"}]
    assert len(job_events) == 10  # five events for each of the two jobs
    for e in job_events:
        assert e["workspace_id"] == "ws1" and e["request_id"] == "r1", e
        assert isinstance(e["job_id"], int) and e["worker_id"] == "metrics-test", e
    assert Decimal(0) == Decimal(str(sample(samples, "pimem_model_cost_usd_total",
                                            adapter="offline", phase="extract")))
