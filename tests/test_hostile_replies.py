"""The worker against hostile provider replies (pyworker/testing.py, HOSTILE): a model's text
built to break it (JSON nested 100,000 levels deep, 5,000-digit integers, NUL characters, lone
surrogates, escape sequences, token-shaped ids), usage that is not numbers (negative, NaN,
oversized, missing), and bodies that are no response at all. Whatever comes back, the attempt
is closed with what can be known of its usage and a failure code, charged at most its reserve,
no model text reaches storage, and the loop goes on.

The ``openai`` adapter runs in process here (fast on two cores); tests/test_pi_adapter.py runs a
sample of the same replies through the real Pi CLI.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from pyworker.adapters.base import Adapter, Reply
from pyworker.db import Database
from pyworker.payload import ModelRef, Usage
from pyworker.prompting import Prompt
from pyworker.testing import HOSTILE, FakeModel
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World
from tests.test_worker_e2e import CALL_COST, openai_adapter, rows

HOSTILE_REPLIES = int(os.environ.get("PIMEM_HOSTILE_REPLIES", "1000"))

# What each reply must become for an extraction (outcome, failure code, what is charged):
# "reported" is the provider's reported cost (the fake reports $0.0081), "reserve" the
# attempt's reserve (the cost could not be read, or the outcome is unknown), "zero" nothing
# (the provider answered with an error and no usage), "other" a smaller reported cost.
EXPECTED: dict[str, tuple[str, str | None, str]] = {
    "deep_nesting": ("failed", "reply_not_json", "reported"),
    "huge_integer": ("failed", "output_refused", "reported"),
    "big_id": ("failed", "output_refused", "reported"),
    "nul_title": ("failed", "output_refused", "reported"),
    "lone_surrogate": ("failed", "output_refused", "reported"),
    "float_ids": ("failed", "output_refused", "reported"),
    "wrong_types": ("failed", "output_refused", "reported"),
    "token_ids": ("failed", "output_refused", "reported"),
    "escape_sequences": ("ok", None, "reported"),
    "oversize": ("failed", "output_refused", "reported"),
    "huge_content": ("failed", "reply_not_json", "reported"),
    "not_object": ("failed", "reply_not_json", "reported"),
    "nan_literal": ("failed", "reply_not_json", "reported"),
    "infinity_id": ("failed", "output_refused", "reported"),
    "empty": ("failed", "reply_not_json", "reported"),
    "extra_key_escape": ("failed", "output_refused", "reported"),
    "double_encoded": ("failed", "reply_not_json", "reported"),
    "usage_negative": ("failed", "reply_unreadable", "reserve"),
    "usage_nan": ("failed", "reply_unreadable", "reserve"),
    "usage_huge": ("failed", "reply_unreadable", "reserve"),
    "usage_float": ("failed", "reply_unreadable", "reserve"),
    "usage_string": ("failed", "reply_unreadable", "reserve"),
    "usage_overflow": ("failed", "reply_unreadable", "reserve"),
    "usage_missing": ("failed", "reply_unreadable", "reserve"),
    "usage_over_reserve": ("ok", None, "reserve"),
    "body_not_json": ("failed", "reply_unreadable", "reserve"),
    "body_deep": ("failed", "reply_unreadable", "reserve"),
    "body_no_choices": ("failed", "reply_unreadable", "other"),
    "body_choices_not_list": ("failed", "reply_unreadable", "reserve"),
    "body_content_object": ("failed", "reply_unreadable", "reported"),
    "tool_calls_only": ("failed", "reply_not_json", "reported"),
    "huge_int_elsewhere": ("ok", None, "reported"),
    "status_500_html": ("failed", "provider_error", "zero"),
    "status_429": ("failed", "provider_error", "zero"),
    "finish_length": ("failed", "reply_cut_off", "reported"),
    "truncated": ("unknown", "reply_unreadable", "reserve"),
}
# Strings of the hostile replies that must never reach a stored error or an operator view.
MARKERS = ("sk-live", "ghp_", "\x1b", "pwned", "NaN", "Bad gateway", "slow down", "9999999999")
# Log events that mean the worker met something it did not handle as a hostile reply.
UNHANDLED = {"tick_error", "worker_error", "database_error", "fail_not_recorded",
             "claim_unreadable", "maintenance_failed"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as f:
        yield f


@pytest.fixture
def model(fake: FakeModel) -> FakeModel:
    fake.reset()
    fake.hostile_served.clear()
    return fake


def failure_codes(conn: psycopg.Connection) -> set[str]:
    return {r[0] for r in conn.execute("select code from memory_private.failure_codes()")}


def conversation(w: World, ws: str, n: int) -> None:
    """A finished conversation in a private chat of its own (its own scope, its own job)."""
    w.private_chat(ws, f"dm-{n}", "alice")
    w.request(ws, f"r{n}", chat=f"dm-{n}", user="alice")
    w.message(ws, f"r{n}-u", f"r{n}", "user", "alice",
              f"Please remember preference {n}: I prefer tea. We decided to ship on Friday.")
    w.message(ws, f"r{n}-a", f"r{n}", "assistant", "bot1", "Noted: tea, and Friday.")


def world(conn: psycopg.Connection, ws: str) -> World:
    w = World(conn)
    w.workspace(ws, budget=1000.0)
    w.member(ws, "alice", "owner")
    w.bot(ws, "bot1")
    return w


def assert_no_model_text_stored(conn: psycopg.Connection) -> None:
    codes = failure_codes(conn)
    stored = rows(conn, "select error from memory_private.job_attempts where error is not null")
    assert {r["error"] for r in stored} <= codes, "an attempt's error is a failure code"
    texts = [r["t"] for r in rows(
        conn, "select last_error as t from memory_private.jobs where last_error is not null "
              "union all select last_attempt_error from memory.job_status "
              "where last_attempt_error is not null")]
    for text in texts:
        assert not any(m in text for m in MARKERS), text


def assert_every_attempt_closed_within_its_reserve(conn: psycopg.Connection) -> None:
    assert rows(conn, "select 1 from memory_private.job_attempts where outcome = 'open'") == []
    assert rows(conn, "select 1 from memory_private.jobs where status = 'running'") == []
    over = rows(conn, "select job_id from memory_private.job_attempts "
                      "where cost_usd > reserved_usd")
    assert over == []
    unmatched = rows(conn, """select a.job_id from memory_private.job_attempts a
                               left join memory_private.request_charges c
                                 on c.workspace_id = a.workspace_id and c.job_id = a.job_id
                                and c.attempt_no = a.attempt_no
                              where c.cost_usd is distinct from a.cost_usd""")
    assert unmatched == [], "every closed attempt is charged exactly its cost"
    spend = rows(conn, """select w.workspace_id from memory_private.workspace_memory w
                           where w.memory_spent_usd <> (select coalesce(sum(c.cost_usd), 0)
                                                          from memory_private.request_charges c
                                                         where c.workspace_id = w.workspace_id)""")
    assert spend == []


def test_each_hostile_reply_closes_its_attempt_with_its_code_within_the_reserve(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel,
        caplog: pytest.LogCaptureFixture) -> None:
    assert set(EXPECTED) == set(HOSTILE), "every hostile reply has its expectation"
    caplog.set_level(logging.INFO, logger="pimem")
    for n, _ in enumerate(HOSTILE):  # one workspace, one conversation, one job per reply
        conversation(world(conn, f"h{n:02d}"), f"h{n:02d}", n)
    conn.execute("select memory_private.advance_clock('31 minutes')")
    conn.execute("select memory.run_maintenance()")
    # Maintenance made the jobs; without more of it, and with the clock still, the worker
    # claims each once (a failed one backs off an hour), in an order of the server's (on a
    # Citus cluster, node by node), and the model answers the next hostile reply in turn.
    worker = Worker(WorkerConfig(dsn=db_dsn, interval=0.01, worker_id="hostile",
                                 maintenance=False), openai_adapter(model))
    model.mode = "hostile"
    try:
        for name in HOSTILE:
            result = worker.tick()
            assert result.phase == "extract", name
            assert model.hostile_served[name] == 1, name
            [att] = rows(conn, """select a.outcome, a.error, a.cost_usd, a.reserved_usd,
                                         a.reported_cost_usd
                                    from memory_private.job_attempts a
                                   where a.job_id = %s""", result.job_id)
            outcome, code, charge = EXPECTED[name]
            assert (att["outcome"], att["error"]) == (outcome, code), name
            expected_cost = {"reported": CALL_COST, "reserve": att["reserved_usd"],
                             "zero": Decimal(0)}.get(charge)
            if expected_cost is not None:
                assert att["cost_usd"] == expected_cost, name
            assert Decimal(0) <= att["cost_usd"] <= att["reserved_usd"], name
            if name == "usage_over_reserve":
                assert att["reported_cost_usd"] > att["reserved_usd"], "the report is kept"
            assert result.status == ("committed" if outcome == "ok" else outcome), name
    finally:
        worker.adapter.close()
        worker.db.close()
    assert model.violations == []
    assert dict(model.hostile_served) == dict.fromkeys(HOSTILE, 1)
    assert_every_attempt_closed_within_its_reserve(conn)
    assert_no_model_text_stored(conn)
    assert not {r.getMessage() for r in caplog.records} & UNHANDLED
    # The valid reply with escape sequences in its title is stored as model text may be; the
    # operator's views never show it (they carry no titles).
    [record] = rows(conn, "select title from memory_private.records where title like %s",
                    "%pwned%")
    assert "\x1b" in record["title"]


def test_an_invalid_reply_stores_no_model_text_in_job_status(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    """The review's case: token-shaped strings in source_ids used to reach jobs.last_error,
    job_attempts.error and memory.job_status."""
    w = world(conn, "ws1")
    conversation(w, "ws1", 1)
    conn.execute("select memory_private.advance_clock('31 minutes')")
    model.mode = "hostile:token_ids"
    worker = Worker(WorkerConfig(dsn=db_dsn, interval=0.01, worker_id="w"),
                    openai_adapter(model))
    try:
        assert worker.tick().detail == "output_refused"
    finally:
        worker.adapter.close()
        worker.db.close()
    [job] = rows(conn, "select last_error, last_attempt_error from memory.job_status")
    assert job == {"last_error": "output_refused", "last_attempt_error": "output_refused"}


class Feeding(Worker):
    """The real worker loop; its maintenance also plays the world around it: it moves the
    clock past every backoff and idle window, removes the conversations whose input stopped,
    and adds fresh conversations when few jobs are left, in a new workspace every 48 (so
    maintenance, which runs for the current workspace, stays the size of a small tenant)."""

    def __init__(self, *args: Any, conn: psycopg.Connection, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = conn
        self.world = World(conn)
        self.made = 0
        self.workspaces = 0

    def maintain(self) -> dict[str, Any]:
        conn = self.conn
        conn.execute("select memory_private.advance_clock('61 minutes')")
        for ws, message_id in conn.execute(
                """select j.workspace_id, s.id from memory_private.jobs j
                     cross join jsonb_to_recordset(j.input -> 'sources') s(id text, hash text)
                     join memory_private.messages m
                       on m.workspace_id = j.workspace_id and m.message_id = s.id
                    where j.status = 'stopped' and m.body is not null""").fetchall():
            self.world.remove(ws, message_id)
        open_jobs = conn.execute("select count(*) from memory_private.jobs where status in "
                                 "('pending', 'running')").fetchone()
        if open_jobs is not None and open_jobs[0] < 4:
            if self.made % 48 == 0:
                self.workspaces += 1
                self.config.workspace_id = f"ws{self.workspaces}"
                world(conn, self.config.workspace_id)
            for _ in range(8):
                self.made += 1
                conversation(self.world, self.config.workspace_id or "", self.made)
        return super().maintain()


@pytest.mark.slow  # a thousand worker ticks
def test_the_worker_loop_survives_a_thousand_hostile_replies(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pimem")
    model.mode = "hostile"  # every call answers the next hostile reply in turn
    worker = Feeding(WorkerConfig(dsn=db_dsn, interval=0.01, worker_id="hostile-run"),
                     openai_adapter(model), conn=conn)
    runs = 0
    while sum(model.hostile_served.values()) < HOSTILE_REPLIES:
        left = HOSTILE_REPLIES - sum(model.hostile_served.values())
        before = worker.jobs_done
        assert worker.run(max_jobs=before + left) == 0
        assert worker.jobs_done == before + left, "the loop ended only at its job count"
        runs += 1
        assert runs < 5
    served = sum(model.hostile_served.values())
    assert served >= HOSTILE_REPLIES and set(model.hostile_served) == set(HOSTILE)
    attempts = rows(conn, "select count(*) as n from memory_private.job_attempts")[0]["n"]
    assert attempts == model.calls == served, "every reply was one attempt, and each is closed"
    assert_every_attempt_closed_within_its_reserve(conn)
    assert_no_model_text_stored(conn)
    assert not {r.getMessage() for r in caplog.records} & UNHANDLED
    outcomes = {r["outcome"] for r in rows(conn, "select distinct outcome "
                                                 "from memory_private.job_attempts")}
    assert outcomes == {"ok", "failed", "unknown"}
    print(f"{served} hostile replies, {attempts} attempts, {worker.made} conversations in "
          f"{worker.workspaces} workspaces")


# Errors from the worker's own side of a tick --------------------------------------------------


class Exploding:
    """An adapter whose call fails with an error no adapter should raise."""

    name = "exploding"

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        return Decimal("0.01")

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        raise RuntimeError("a bug in an adapter")

    def close(self) -> None:
        pass


class Replying:
    """An adapter that returns one fixed reply with the given usage."""

    name = "replying"

    def __init__(self, text: str, usage: Usage) -> None:
        self.text, self.usage = text, usage

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        return Decimal("0.01")

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        return Reply(text=self.text, usage=self.usage)

    def close(self) -> None:
        pass


def one_job_worker(conn: psycopg.Connection, dsn: str, adapter: Adapter,
                   db: Database | None = None) -> Worker:
    w = world(conn, "ws1")
    conversation(w, "ws1", 1)
    conn.execute("select memory_private.advance_clock('31 minutes')")
    return Worker(WorkerConfig(dsn=dsn, interval=0.01, worker_id="w"), adapter, db=db)


def test_an_unexpected_adapter_error_closes_the_attempt_and_the_loop_goes_on(
        conn: psycopg.Connection, db_dsn: str) -> None:
    worker = one_job_worker(conn, db_dsn, Exploding())
    result = worker.tick()
    assert (result.status, result.detail) == ("failed", "worker_error")
    [att] = rows(conn, "select outcome, error, cost_usd from memory_private.job_attempts")
    # The call may have reached the provider: its cost is not known, so the reserve is charged.
    assert att == {"outcome": "failed", "error": "worker_error", "cost_usd": Decimal("0.01")}
    assert worker.tick().status == "idle"  # backing off; nothing left open
    worker.db.close()


def assert_closed_at_the_reserve_with_usage_unknown(conn: psycopg.Connection, code: str) -> None:
    [att] = rows(conn, "select outcome, error, cost_usd, reserved_usd, input_tokens "
                       "from memory_private.job_attempts")
    assert (att["outcome"], att["error"], att["input_tokens"]) == ("failed", code, None)
    assert att["cost_usd"] == att["reserved_usd"] == Decimal("0.01")


def test_a_failed_reply_whose_usage_the_database_refuses_is_still_closed_at_the_reserve(
        conn: psycopg.Connection, db_dsn: str) -> None:
    """The provider's usage goes to the database as reported; when fail_job refuses it with
    MB001, the worker reports the attempt again with its usage unknown."""
    bad = Usage(input_tokens=-5, output_tokens=1, cost_usd=Decimal("0.001"))
    worker = one_job_worker(conn, db_dsn, Replying("not json", bad))
    assert worker.tick().detail == "reply_not_json"
    assert_closed_at_the_reserve_with_usage_unknown(conn, "reply_not_json")
    worker.db.close()


@pytest.mark.parametrize("usage", [
    Usage(input_tokens=-5, output_tokens=1, cost_usd=Decimal("0.001")),
    Usage(input_tokens=2**31, output_tokens=1, cost_usd=Decimal("0.001")),
    Usage(input_tokens=12.5, output_tokens=1, cost_usd=Decimal("0.001")),
    Usage(input_tokens=1, output_tokens=1, cost_usd=Decimal("1000000.01"))],
    ids=["negative", "past_integer", "fractional", "cost_past_a_million"])
def test_a_valid_reply_whose_usage_the_database_refuses_is_unreadable_at_the_reserve(
        conn: psycopg.Connection, db_dsn: str, usage: Usage,
        caplog: pytest.LogCaptureFixture) -> None:
    """The worker hands the provider's numbers on; the database's MB001 at the checkpoint is the
    verdict on them, and nothing of the output is stored."""
    caplog.set_level(logging.INFO, logger="pimem")
    valid = '{"title": "Tea", "summary": "alice prefers tea.", "source_ids": ["r1-u"]}'
    worker = one_job_worker(conn, db_dsn, Replying(valid, usage))
    assert worker.tick().detail == "reply_unreadable"
    assert_closed_at_the_reserve_with_usage_unknown(conn, "reply_unreadable")
    assert rows(conn, "select checkpoint from memory_private.jobs") == [{"checkpoint": None}]
    assert rows(conn, "select 1 from memory_private.records") == []
    assert "usage_refused" in {r.getMessage() for r in caplog.records}
    worker.db.close()


class FailingDatabase(Database):
    """A database whose named call fails once with an error that is not one of ours."""

    def __init__(self, dsn: str, failing: str) -> None:
        super().__init__(dsn)
        self.failing = failing

    def call(self, function: str, *args: Any) -> Any:
        if function == self.failing:
            self.failing = ""
            raise psycopg.errors.SerializationFailure("injected")
        return super().call(function, *args)


def test_a_database_error_at_the_checkpoint_closes_the_attempt_with_its_usage(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    worker = one_job_worker(conn, db_dsn, openai_adapter(model),
                            FailingDatabase(db_dsn, "save_checkpoint"))
    assert worker.tick().detail == "database_error"
    [att] = rows(conn, "select outcome, error, cost_usd from memory_private.job_attempts")
    assert att == {"outcome": "failed", "error": "database_error", "cost_usd": CALL_COST}
    worker.db.close()


def test_a_database_error_at_the_commit_keeps_the_checkpoint_for_the_next_claim(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel) -> None:
    worker = one_job_worker(conn, db_dsn, openai_adapter(model),
                            FailingDatabase(db_dsn, "commit_job"))
    assert worker.tick().detail == "database_error"
    [job] = rows(conn, "select status, checkpoint is not null as kept from memory_private.jobs")
    assert job == {"status": "pending", "kept": True}
    conn.execute("select memory_private.advance_clock('61 minutes')")
    assert worker.tick().status == "committed"
    assert model.calls == 1, "committed from the checkpoint without another model call"
    worker.db.close()


def test_the_run_loop_survives_an_error_of_any_tick(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel,
        caplog: pytest.LogCaptureFixture) -> None:
    worker = one_job_worker(conn, db_dsn, openai_adapter(model),
                            FailingDatabase(db_dsn, "claim_job"))
    caplog.set_level(logging.INFO, logger="pimem")
    assert worker.run(max_jobs=1) == 0
    assert "tick_error" in {r.getMessage() for r in caplog.records}
    assert rows(conn, "select status from memory_private.jobs") == [{"status": "succeeded"}]


# The real Pi CLI ---------------------------------------------------------------------------
# Pi reads the stream itself: a body or usage it cannot parse is its provider error, it fills in
# zeros for usage the provider left out (the adapter reads that as unknown), and a reply that
# asks for a tool would make it call the model again and again (the adapter stops it: unknown,
# since the next call may have begun). Everything else ends as with the openai adapter.
PI_EXPECTED: dict[str, tuple[str, str | None]] = {
    **{name: (outcome, code) for name, (outcome, code, _) in EXPECTED.items()},
    "usage_nan": ("failed", "provider_error"),
    "usage_string": ("ok", None),
    "body_not_json": ("failed", "provider_error"),
    "body_deep": ("failed", "provider_error"),
    "body_no_choices": ("failed", "provider_error"),
    "body_choices_not_list": ("failed", "provider_error"),
    "body_content_object": ("failed", "reply_not_json"),
    "tool_calls_only": ("unknown", "reply_invalid"),
    "truncated": ("failed", "provider_error"),
}
PI_SAMPLE = list(HOSTILE)


@pytest.mark.slow  # a Pi process per reply
@pytest.mark.pi
def test_hostile_replies_through_the_real_pi_cli_close_every_attempt_within_its_reserve(
        conn: psycopg.Connection, db_dsn: str, model: FakeModel,
        caplog: pytest.LogCaptureFixture) -> None:
    from pyworker.adapters.pi import PiAdapter, pi_unavailable_reason
    from tests.test_pi_adapter import fake_models

    reason = pi_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Pi: {reason}")
    caplog.set_level(logging.INFO, logger="pimem")
    for n, _ in enumerate(PI_SAMPLE):
        conversation(world(conn, f"h{n:02d}"), f"h{n:02d}", n)
    conn.execute("select memory_private.advance_clock('31 minutes')")
    conn.execute("select memory.run_maintenance()")
    pi = PiAdapter(models=fake_models(model.url), env={"FAKE_API_KEY": "fake-key"})
    worker = Worker(WorkerConfig(dsn=db_dsn, interval=0.01, worker_id="hostile-pi",
                                 maintenance=False), pi)
    try:
        for n, name in enumerate(PI_SAMPLE):
            model.mode = f"hostile:{name}"
            result = worker.tick()
            [att] = rows(conn, "select outcome, error, cost_usd, reserved_usd "
                               "from memory_private.job_attempts where workspace_id = %s",
                         f"h{n:02d}")
            if name == "tool_calls_only":
                # Whether Pi began its next model call before the abort landed is a race the
                # machine's load decides: either answer is truthful (unknown at the reserve,
                # or failed with the reply's usage).
                assert (att["outcome"], att["error"]) in {("unknown", "reply_invalid"),
                                                          ("failed", "reply_invalid")}, name
            else:
                assert (att["outcome"], att["error"]) == PI_EXPECTED[name], name
            assert result.status == ("committed" if att["outcome"] == "ok"
                                     else att["outcome"]), name
            assert att["cost_usd"] <= att["reserved_usd"], name
    finally:
        pi.close()
        worker.db.close()
    assert model.violations == []
    assert len(PI_SAMPLE) <= model.calls <= len(PI_SAMPLE) + 1, \
        "one model call per reply (the tool call's next one at most begun): Pi never looped"
    assert_every_attempt_closed_within_its_reserve(conn)
    assert_no_model_text_stored(conn)
    assert not {r.getMessage() for r in caplog.records} & UNHANDLED
