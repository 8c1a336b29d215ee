"""The ``pi`` adapter: the real Pi CLI in RPC mode against the fake model server.

One Pi process serves every test of this module (Pi takes about a second to start). The tests
skip, saying why, only when Node 22 / Pi are not installed; scripts/bootstrap installs them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from pyworker.adapters.base import Cancelled, DeadlineExceeded, ModelFailure
from pyworker.adapters.pi import PiAdapter, pi_unavailable_reason
from pyworker.prompting import build_prompt
from pyworker.testing import FakeModel
from tests.test_worker_units import payload

REASON = pi_unavailable_reason()
pytestmark = [pytest.mark.pi, pytest.mark.skipif(REASON is not None, reason=f"Pi: {REASON}")]

PRICES = {"input": 3, "output": 15, "cacheRead": 0.3, "cacheWrite": 3.75}


def fake_models(url: str) -> dict[str, Any]:
    return {"providers": {"fake": {
        "baseUrl": url, "api": "openai-completions", "apiKey": "$FAKE_API_KEY",
        "models": [{"id": "m", "contextWindow": 32000, "maxTokens": 2048, "cost": PRICES}]}}}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeModel]:
    with FakeModel() as f:
        yield f


@pytest.fixture(scope="module")
def pi(fake: FakeModel) -> Iterator[PiAdapter]:
    adapter = PiAdapter(models=fake_models(fake.url), env={"FAKE_API_KEY": "fake-key"})
    yield adapter
    adapter.close()


@pytest.fixture(autouse=True)
def fresh(fake: FakeModel) -> None:
    fake.reset()


def call(pi: PiAdapter, *, seconds: float = 30, cancel: threading.Event | None = None) -> Any:
    p = payload()
    return pi.complete(p.model, build_prompt(p), deadline=time.monotonic() + seconds,
                       cancel=cancel or threading.Event())


def test_pi_call_returns_the_reply_with_pis_own_cost_and_offers_no_tools(
        pi: PiAdapter, fake: FakeModel) -> None:
    reply = call(pi)
    assert reply.text.startswith('{"title": "Fake memory: Please draft the release notes.')
    # Pi prices the usage itself: 1,200 input tokens at $3/M + 300 output tokens at $15/M.
    assert reply.usage.input_tokens == 1200 and reply.usage.output_tokens == 300
    assert reply.usage.cost_usd == Decimal("0.0081")
    assert fake.calls == 1 and fake.violations == []
    sent = fake.requests[0]
    assert "tools" not in sent and sent["model"] == "m" and sent["stream"] is True
    system = sent["messages"][0]["content"]
    assert system.startswith("You are the background memory writer")
    assert "My token is [REDACTED]." in str(sent)  # the claim's input, as the database gave it
    # A second call starts a fresh session: one system and one user message, no history.
    call(pi)
    assert len(fake.requests[1]["messages"]) == 2
    assert pi.starts == 1


def test_pi_reserve_uses_the_models_prices(pi: PiAdapter) -> None:
    p = payload()
    reserve = pi.reserve_usd(p.model, build_prompt(p))
    # 2,048 output tokens at $15/M is $0.03072; the prompt adds a little.
    assert Decimal("0.0307") < reserve < Decimal("0.05")


def test_provider_error_fails_once_without_pis_retries(pi: PiAdapter, fake: FakeModel) -> None:
    fake.mode = "error"
    with pytest.raises(ModelFailure) as info:
        call(pi)
    assert info.value.outcome == "failed"
    assert "500" in info.value.message or "error" in info.value.message
    assert fake.calls == 1  # settings.json turned Pi's own retries off
    fake.mode = "ok"
    assert call(pi).usage.output_tokens == 300  # the same process goes on


def test_hanging_provider_is_aborted_at_the_deadline_as_unknown(
        pi: PiAdapter, fake: FakeModel) -> None:
    fake.mode = "hang"
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        call(pi, seconds=1.5)
    assert info.value.outcome == "unknown"  # the provider had the request
    assert time.monotonic() - began < 5
    fake.release.set()
    fake.reset()
    assert call(pi).text  # Pi (restarted if it had to be) answers again


def test_cancel_aborts_the_call_in_flight(pi: PiAdapter, fake: FakeModel) -> None:
    fake.mode = "hang"
    fake.call_started.clear()
    cancel = threading.Event()

    def cancel_when_called() -> None:
        fake.call_started.wait(10)
        cancel.set()

    threading.Thread(target=cancel_when_called, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(Cancelled) as info:
        call(pi, cancel=cancel)
    assert info.value.outcome == "unknown"
    assert time.monotonic() - began < 10, "the abort must not wait for the hanging provider"
    fake.release.set()


def test_cut_off_reply_is_a_failure_with_its_usage(pi: PiAdapter, fake: FakeModel) -> None:
    fake.mode = "length"
    with pytest.raises(ModelFailure) as info:
        call(pi)
    assert info.value.outcome == "failed" and info.value.usage is not None
    assert info.value.usage.cost_usd == Decimal("0.0081")


def test_one_rpc_process_serves_every_call(pi: PiAdapter, fake: FakeModel) -> None:
    """The process is started once and reused (its per-call cost is measured by pimem bench,
    not asserted here)."""
    call(pi)
    assert pi._proc is not None
    pid = pi._proc.pid
    for _ in range(3):
        call(pi)
    assert pi._proc is not None and pi._proc.pid == pid and pi._proc.poll() is None


# End to end: the worker with the real Pi CLI and a real database ---------------------------


class Recording:
    """Wraps the module's Pi adapter and keeps every reply, to compare Pi's reported cost."""

    def __init__(self, inner: PiAdapter) -> None:
        self.inner = inner
        self.name = "pi"
        self.replies: list[Any] = []

    def reserve_usd(self, model: Any, prompt: Any) -> Decimal:
        return self.inner.reserve_usd(model, prompt)

    def complete(self, model: Any, prompt: Any, *, deadline: float,
                 cancel: threading.Event) -> Any:
        reply = self.inner.complete(model, prompt, deadline=deadline, cancel=cancel)
        self.replies.append(reply)
        return reply

    def close(self) -> None:  # the module fixture closes the process
        pass


def test_pi_end_to_end_record_then_index_charged_at_pis_cost(
        conn: Any, db_dsn: str, pi: PiAdapter, fake: FakeModel) -> None:
    from tests.test_worker_e2e import (
        charges,
        finished_conversation,
        make_worker,
        memory_spent,
        records,
        rows,
    )

    finished_conversation(conn)
    recording = Recording(pi)
    worker = make_worker(db_dsn, recording)
    assert worker.run(until_idle=True) == 0
    [rec] = records(conn)
    assert rec["title"].startswith("Fake memory: Please plan the Berlin trip")
    scope = rows(conn, "select index_text, record_ids from memory_private.scope_indexes")[0]
    assert scope["record_ids"] == [rec["record_id"]]
    assert f"[#{rec['record_id']}]" in scope["index_text"]
    # The charge recorded on the request is exactly what Pi reported, call by call.
    pi_costs = [r.usage.cost_usd for r in recording.replies]
    assert len(pi_costs) == 2 and all(c > 0 for c in pi_costs)
    assert [c["cost_usd"] for c in charges(conn)] == pi_costs
    assert [c["kind"] for c in charges(conn)] == ["memory_extract", "memory_consolidate"]
    assert memory_spent(conn) == sum(pi_costs)
    # What Pi sent: no tools, our system prompt, the redacted batch.
    assert fake.calls == 2 and fake.violations == []
    assert all("tools" not in r and "tool_choice" not in r for r in fake.requests)
    assert "TASK: extract" in str(fake.requests[0]) and "TASK: consolidate" in str(fake.requests[1])
