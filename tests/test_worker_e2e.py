"""The worker against a real database and the fake model server (the ``openai`` adapter, in
process): the whole pipeline, and each failure ending as the rules say with nothing
half-written. Crash tests with real processes are in test_worker_crash.py, the real Pi CLI in
test_pi_adapter.py. The helpers here are shared by those modules."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from pyworker.adapters.base import Adapter
from pyworker.adapters.openai_compat import OpenAIAdapter, load_prices
from pyworker.db import DatabaseUnavailable
from pyworker.testing import FakeModel
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World

PRICES = '{"fake/m": {"input": 3, "output": 15}}'
# 1,200 input tokens at $3/M + 300 output tokens at $15/M: what the fake reports per call.
CALL_COST = Decimal("0.0081")


# Shared helpers ----------------------------------------------------------------------------


def finished_conversation(conn: psycopg.Connection, *, budget: float = 1.0) -> World:
    """A private chat with one finished conversation (a preference, a correction, an open
    item), then the clock moved past the idle window."""
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", budget=budget)
    w.message("ws1", "r1-u1", "r1", "user", "alice",
              "Please plan the Berlin trip. I prefer short answers.")
    w.message("ws1", "r1-a1", "r1", "assistant", "bot1", "Sure. When do you fly?")
    w.message("ws1", "r1-u2", "r1", "user", "alice",
              "Actually the flight is on the 14th. I still need to book the hotel.")
    w.message("ws1", "r1-a2", "r1", "assistant", "bot1", "Noted: the 14th; hotel still open.")
    idle(conn)
    return w


def idle(conn: psycopg.Connection, minutes: int = 31) -> None:
    conn.execute("select memory_private.advance_clock(make_interval(mins => %s))", (minutes,))


def rows(conn: psycopg.Connection, sql: str, *args: Any) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(sql.encode(), args).fetchall()  # type: ignore[call-overload, no-any-return]


def jobs(conn: psycopg.Connection) -> list[dict[str, Any]]:
    return rows(conn, "select job_id, phase, status, claims, last_error, next_attempt_at, "
                      "checkpoint is not null as has_checkpoint from memory_private.jobs "
                      "order by job_id")


def attempts(conn: psycopg.Connection) -> list[dict[str, Any]]:
    return rows(conn, "select job_id, attempt_no, outcome, reserved_usd, cost_usd, error "
                      "from memory_private.job_attempts order by job_id, attempt_no")


def records(conn: psycopg.Connection) -> list[dict[str, Any]]:
    return rows(conn, "select record_id, scope_id, title, summary, speaker_ids "
                      "from memory_private.records order by record_id")


def charges(conn: psycopg.Connection, request: str = "r1") -> list[dict[str, Any]]:
    return rows(conn, "select kind, outcome, cost_usd, input_tokens, output_tokens "
                      "from memory_private.request_charges where request_id = %s "
                      "order by charge_id", request)


def memory_spent(conn: psycopg.Connection, request: str = "r1") -> Decimal:
    row = conn.execute("select memory_private.request_memory_spent('ws1', %s)",
                       (request,)).fetchone()
    assert row is not None
    return Decimal(row[0])


def make_worker(dsn: str, adapter: Adapter, **config: Any) -> Worker:
    return Worker(WorkerConfig(dsn=dsn, interval=0.1, worker_id="test-worker", **config), adapter)


def openai_adapter(fake: FakeModel) -> OpenAIAdapter:
    return OpenAIAdapter(base_url=fake.url, api_key="fake-key", prices=load_prices(PRICES))


# Fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as f:
        yield f


@pytest.fixture
def model(fake: FakeModel) -> FakeModel:
    fake.reset()
    return fake


# The pipeline ------------------------------------------------------------------------------


def test_finished_conversation_becomes_a_record_then_an_index(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    worker = make_worker(db_dsn, openai_adapter(model))
    first = worker.tick()
    assert (first.status, first.phase) == ("committed", "extract")
    [rec] = records(conn)
    assert rec["speaker_ids"] == ["alice"] and rec["title"].startswith("Fake memory: Please plan")
    second = worker.tick()
    assert (second.status, second.phase) == ("committed", "consolidate")
    scope = rows(conn, "select index_text, record_ids from memory_private.scope_indexes")[0]
    assert scope["record_ids"] == [rec["record_id"]]
    assert worker.tick().status == "idle"
    assert [c["kind"] for c in charges(conn)] == ["memory_extract", "memory_consolidate"]
    assert all(c["cost_usd"] == CALL_COST and c["outcome"] == "ok" for c in charges(conn))
    assert memory_spent(conn) == 2 * CALL_COST
    assert model.calls == 2 and model.violations == []
    assert all("tools" not in r for r in model.requests)


def test_run_until_idle_handles_every_job_and_survives_a_killed_connection(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    worker = make_worker(db_dsn, openai_adapter(model))
    assert worker.tick().status == "committed"
    conn.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                 "where application_name = 'pimem-worker' and pid <> pg_backend_pid()")
    with pytest.raises(DatabaseUnavailable):
        worker.tick()
    assert worker.run(until_idle=True) == 0  # reconnects, consolidates, stops when idle
    assert [j["status"] for j in jobs(conn)] == ["succeeded", "succeeded"]


# Failures ----------------------------------------------------------------------------------


def assert_nothing_written(conn: psycopg.Connection) -> None:
    assert records(conn) == []
    assert rows(conn, "select 1 from memory_private.extracted_sources") == []
    assert all(not j["has_checkpoint"] for j in jobs(conn))


def test_provider_error_fails_backs_off_an_hour_then_succeeds(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "error"
    worker = make_worker(db_dsn, openai_adapter(model))
    result = worker.tick()
    assert result.status == "failed" and result.detail == "provider_error"
    assert_nothing_written(conn)
    [job] = jobs(conn)
    assert (job["status"], job["claims"]) == ("pending", 1)
    assert [a["outcome"] for a in attempts(conn)] == ["failed"]
    model.mode = "ok"
    assert worker.tick().status == "idle"  # backing off
    idle(conn, 59)
    assert worker.tick().status == "idle"
    idle(conn, 2)
    assert worker.tick().status == "committed"
    assert model.calls == 2


def test_malformed_reply_fails_with_its_usage_charged(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "malformed"
    result = make_worker(db_dsn, openai_adapter(model)).tick()
    assert result.status == "failed" and result.detail == "reply_not_json"
    assert_nothing_written(conn)
    assert [(c["outcome"], c["cost_usd"]) for c in charges(conn)] == [("failed", CALL_COST)]
    assert jobs(conn)[0]["status"] == "pending"


def test_oversize_reply_fails_before_anything_is_stored(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "oversize"  # 2,100 characters but 4,200 UTF-8 bytes
    result = make_worker(db_dsn, openai_adapter(model)).tick()
    assert result.status == "failed" and result.detail == "output_refused"
    assert_nothing_written(conn)
    assert [a["outcome"] for a in attempts(conn)] == ["failed"]


def test_call_past_the_tick_deadline_is_unknown_and_never_replayed(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "hang"
    worker = make_worker(db_dsn, openai_adapter(model), tick_seconds=3, commit_margin=1)
    began = time.monotonic()
    result = worker.tick()
    assert result.status == "unknown" and result.detail == "deadline_exceeded"
    assert time.monotonic() - began < 4
    model.release.set()
    assert_nothing_written(conn)
    [job] = jobs(conn)
    assert job["status"] == "stopped"
    [att] = attempts(conn)
    assert att["outcome"] == "unknown" and att["cost_usd"] == att["reserved_usd"] > 0
    idle(conn, 180)
    model.reset()
    assert worker.tick().status == "idle"
    assert model.calls == 0


def test_budget_that_cannot_hold_the_reserve_makes_no_call(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn, budget=0.001)
    result = make_worker(db_dsn, openai_adapter(model)).tick()
    assert result.status == "failed" and result.detail.startswith("budget")
    assert model.calls == 0
    assert_nothing_written(conn)
    assert attempts(conn) == [] and charges(conn) == []


def test_stop_during_the_call_reports_unknown_at_once(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "hang"
    worker = make_worker(db_dsn, openai_adapter(model))

    def stop_when_called() -> None:
        model.call_started.wait(10)
        worker.request_stop()

    threading.Thread(target=stop_when_called, daemon=True).start()
    began = time.monotonic()
    assert worker.run() == 0
    assert time.monotonic() - began < 5
    model.release.set()
    assert jobs(conn)[0]["status"] == "stopped"
    assert [a["outcome"] for a in attempts(conn)] == ["unknown"]


def test_lease_is_extended_during_the_call_and_a_lost_lease_aborts_it(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    finished_conversation(conn)
    model.mode = "hang"
    worker = make_worker(db_dsn, openai_adapter(model), lease_every=0.2)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(r=worker.tick()), daemon=True)
    thread.start()
    assert model.call_started.wait(10)
    first = rows(conn, "select lease_expires_at from memory_private.jobs")[0]["lease_expires_at"]
    # Real heartbeats (every 0.2 s here), so this waits for real time, up to 5 s.
    until = time.monotonic() + 5
    while time.monotonic() < until:
        later = rows(conn, "select lease_expires_at from memory_private.jobs")[0][
            "lease_expires_at"]
        if later > first:
            break
        time.sleep(0.05)
    assert later > first, "the lease was not extended during the call"
    # Another party decides the lease is gone: the clock passes it and maintenance reclaims it.
    conn.execute("select memory_private.advance_clock(interval '3 minutes'), "
                 "memory.run_maintenance()")
    thread.join(5)
    assert not thread.is_alive(), "the call was not aborted after the lease was lost"
    assert result["r"].status == "unknown" and result["r"].detail == "lease_lost"
    model.release.set()
    assert jobs(conn)[0]["status"] == "stopped"
    assert [a["outcome"] for a in attempts(conn)] == ["unknown"]
    assert_nothing_written(conn)
