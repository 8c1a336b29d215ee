"""Crash tests with real worker processes (``pimem worker``) and the fake model server.

The worker runs the real Pi CLI when it is installed (scripts/bootstrap installs it), else the
``openai`` adapter, so these tests run everywhere. The fake server counts the model calls.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pyworker.adapters.pi import pi_unavailable_reason
from pyworker.testing import FakeModel
from tests.test_pi_adapter import fake_models
from tests.test_worker_e2e import (
    PRICES,
    attempts,
    charges,
    finished_conversation,
    idle,
    jobs,
    records,
)

PIMEM = [sys.executable, "-m", "pyworker.cli"]
# The same command line, with a commit that stalls after the checkpoint (the fault is injected
# here, on the test side: tests/stalled_commit_worker.py).
STALLED_COMMIT = [sys.executable, "-m", "tests.stalled_commit_worker"]
ROOT = Path(__file__).resolve().parent.parent
ADAPTER = os.environ.get("PIMEM_TEST_WORKER_ADAPTER") or (
    "pi" if pi_unavailable_reason() is None else "openai")


class WorkerProcess:
    """``pimem worker`` in a subprocess, its JSON log lines read into a queue."""

    def __init__(self, dsn: str, fake: FakeModel, tmp: Path, *, once: bool = False,
                 stall_commit: bool = False) -> None:
        models = tmp / "models.json"
        models.write_text(json.dumps(fake_models(fake.url)))
        cmd = [*(STALLED_COMMIT if stall_commit else PIMEM), "worker", "--dsn", dsn, "--model", ADAPTER, "--interval", "0.2",
               "--pi-models", str(models), "--openai-base-url", fake.url, "--prices", PRICES]
        if once:
            cmd.append("--once")
        full_env = {**os.environ, "FAKE_API_KEY": "fake-key", "PIMEM_OPENAI_API_KEY": "fake-key"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     env=full_env, cwd=ROOT)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                rec = {"event": "stderr", "text": raw.decode(errors="replace")}
            self.log.append(rec)
            self.lines.put(rec)

    def wait_for(self, event: str, timeout: float = 30) -> dict[str, Any]:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            try:
                rec = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if rec.get("event") == event:
                return rec
        raise AssertionError(f"no {event!r} in the worker log: {self.log[-10:]}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as f:
        yield f


@pytest.fixture
def model(fake: FakeModel) -> Iterator[FakeModel]:
    fake.reset()
    yield fake
    fake.release.set()


@pytest.fixture
def spawn(db_dsn: str, model: FakeModel, tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(**kw: Any) -> WorkerProcess:
        w = WorkerProcess(db_dsn, model, tmp_path, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def maintenance(conn: psycopg.Connection) -> Any:
    return conn.execute("select memory.run_maintenance()").fetchone()[0]  # type: ignore[index]


def test_kill_9_during_the_model_call_leaves_unknown_and_no_replay(
        conn: psycopg.Connection, model: FakeModel, spawn: Any) -> None:
    finished_conversation(conn)
    model.mode = "hang"
    worker = spawn()
    assert model.call_started.wait(30), f"no model call: {worker.log[-5:]}"
    worker.kill9()
    [job] = jobs(conn)
    assert job["status"] == "running"
    assert [a["outcome"] for a in attempts(conn)] == ["open"]
    idle(conn, 3)  # the two-minute lease expires
    maintenance(conn)
    [job] = jobs(conn)
    assert job["status"] == "stopped"
    [att] = attempts(conn)
    assert att["outcome"] == "unknown" and att["cost_usd"] == att["reserved_usd"]
    assert [c["outcome"] for c in charges(conn)] == ["unknown"]
    # A new worker finds nothing to replay, even hours later.
    model.release.set()
    model.reset()
    idle(conn, 180)
    again = spawn(once=True)
    assert again.proc.wait(60) == 0
    assert model.calls == 0 and records(conn) == []


def test_kill_9_after_the_checkpoint_resumes_without_a_second_model_call(
        conn: psycopg.Connection, model: FakeModel, spawn: Any) -> None:
    finished_conversation(conn)
    first = spawn(stall_commit=True)
    first.wait_for("commit_stalled")
    first.kill9()
    [job] = jobs(conn)
    assert job["has_checkpoint"] and job["status"] == "running" and records(conn) == []
    assert model.calls == 1
    idle(conn, 3)
    second = spawn(once=True)
    second.wait_for("job_committed")
    assert second.proc.wait(60) == 0
    assert model.calls == 2  # the resumed extraction made none; the consolidation made one
    extraction = next(r for r in second.log if r.get("event") == "job_claimed")
    assert extraction["resumed"] is True and extraction["phase"] == "extract"
    assert [r["phase"] for r in second.log if r.get("event") == "model_call"] == ["consolidate"]
    assert len(records(conn)) == 1
    assert [c["kind"] for c in charges(conn)] == ["memory_extract", "memory_consolidate"]


def test_sigterm_during_the_call_exits_within_5_seconds_reporting_unknown(
        conn: psycopg.Connection, model: FakeModel, spawn: Any) -> None:
    finished_conversation(conn)
    model.mode = "hang"
    worker = spawn()
    assert model.call_started.wait(30), f"no model call: {worker.log[-5:]}"
    began = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(5) == 0
    took = time.monotonic() - began
    assert took < 5
    events = [r.get("event") for r in worker.log]
    assert "stop_requested" in events and "worker_stopped" in events
    [job] = jobs(conn)
    assert job["status"] == "stopped"  # reported at once, no lease expiry needed
    assert [a["outcome"] for a in attempts(conn)] == ["unknown"]
    print(f"SIGTERM to exit: {took:.2f} s ({ADAPTER} adapter)")
