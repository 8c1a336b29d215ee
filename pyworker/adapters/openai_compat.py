"""``openai``: one direct OpenAI-compatible chat-completions call (httpx), for hosts without Node.

No ``tools`` are sent. Usage comes from the provider's ``usage`` and is priced from a configured
table (dollars per million tokens, keyed ``provider/model`` or ``model``); a model without a
price is refused before any call, because its charge could not be recorded truthfully.

The response is hostile input: a body that is not JSON, nested deeper than the interpreter's
stack, with numbers too long to convert, without a reply, or with usage that is not valid
numbers is a failed call (``reply_unreadable``), never an exception of another kind.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

from pyworker.adapters.base import (
    Cancelled,
    DeadlineExceeded,
    ModelFailure,
    Reply,
    provider_usage,
    remaining,
)
from pyworker.payload import UNKNOWN_USAGE, ModelRef, Usage, token_count, utf8_len
from pyworker.prompting import Prompt

MAX_OUTPUT_TOKENS = 4096
MAX_INT_DIGITS = 18  # a longer integer in a response is no count we could store


def _bounded_int(digits: str) -> int | None:
    return int(digits) if len(digits.lstrip("-")) <= MAX_INT_DIGITS else None


def _no_constant(name: str) -> None:
    return None  # NaN / Infinity: not a number a usage or id can be


def read_body(raw: bytes) -> Any:
    """A response body as JSON, or raises ValueError: never RecursionError, never the
    interpreter's refusal of a 5,000-digit integer."""
    try:
        return json.loads(raw, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("the body is nested too deep") from None


@dataclass(frozen=True)
class Price:
    input: Decimal  # dollars per million input tokens
    output: Decimal  # dollars per million output tokens


def load_prices(source: str | Path | None) -> dict[str, Price]:
    """A price table from JSON text or a file: ``{"openai/gpt-4o-mini": {"input": 0.15,
    "output": 0.6}, ...}`` (PIMEM_PRICES)."""
    if not source:
        return {}
    text = Path(source).read_text() if Path(str(source)).is_file() else str(source)
    raw: dict[str, dict[str, Any]] = json.loads(text)
    return {k: Price(Decimal(str(v["input"])), Decimal(str(v["output"]))) for k, v in raw.items()}


@dataclass
class OpenAIAdapter:
    base_url: str = field(default_factory=lambda: os.environ.get(
        "PIMEM_OPENAI_BASE_URL", "https://api.openai.com/v1"))
    api_key: str | None = field(default_factory=lambda: os.environ.get(
        "PIMEM_OPENAI_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    prices: dict[str, Price] = field(default_factory=lambda: load_prices(
        os.environ.get("PIMEM_PRICES")))
    name: str = "openai"
    # One HTTP client for every call of the adapter (its connection pool and TLS context are
    # built once: building them took about 45 ms per call); closed by close(). Connections are
    # kept alive. A server that writes headers and body apart without TCP_NODELAY (the tests'
    # fake server) makes each kept-alive call wait for the client's delayed ACK, about 40 ms.
    _client: httpx.Client | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=httpx.Timeout(10.0))
            return self._client

    def price(self, model: ModelRef) -> Price:
        found = self.prices.get(model.qualified) or self.prices.get(model.id)
        if found is None:
            raise ModelFailure(f"no price for {model.qualified} in the configured table "
                               "(PIMEM_PRICES); not calling an unpriced model", outcome="failed",
                               code="not_priced")
        return found

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        p = self.price(model)
        in_tokens = (utf8_len(prompt.system) + utf8_len(prompt.user)) // 3 + 1
        dollars = (p.input * in_tokens + p.output * MAX_OUTPUT_TOKENS) / Decimal(1_000_000)
        return dollars.quantize(Decimal("0.000001"))

    def _cost(self, model: ModelRef, usage: Any) -> Usage:
        """The call's usage priced from the table; unknown (None) where the provider's counts
        are missing or not counts."""
        if not isinstance(usage, dict):
            return UNKNOWN_USAGE
        p = self.price(model)
        tin = token_count(usage.get("prompt_tokens"))
        tout = token_count(usage.get("completion_tokens"))
        if tin is None or tout is None:
            return provider_usage(tin, tout, None)
        try:
            cost = ((p.input * Decimal(str(tin)) + p.output * Decimal(str(tout)))
                    / Decimal(1_000_000)).quantize(Decimal("0.00000001"))
        except ArithmeticError:  # counts so large the price has no exact dollar amount
            return provider_usage(tin, tout, None)
        return provider_usage(tin, tout, cost)

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        if cancel.is_set():
            raise Cancelled("stopped before the call", outcome="failed")
        self.price(model)
        body = {"model": model.id, "temperature": 0, "max_tokens": MAX_OUTPUT_TOKENS,
                "stream": False,
                "messages": [{"role": "system", "content": prompt.system},
                             {"role": "user", "content": prompt.user}]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        result: dict[str, Any] = {}
        timeout = httpx.Timeout(10.0, read=max(1.0, remaining(deadline) + 1))
        client = self._http()

        def run() -> None:
            try:
                result["response"] = client.post(
                    self.base_url.rstrip("/") + "/chat/completions", json=body,
                    headers=headers, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - handed to the caller below
                result["error"] = exc

        # The request runs in a thread so a signal or the deadline can abandon it at once.
        thread = threading.Thread(target=run, daemon=True, name="openai-call")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and (cancel.is_set() or remaining(deadline) <= 0):
                cls = Cancelled if cancel.is_set() else DeadlineExceeded
                why = "stopped during the call" if cancel.is_set() else "past the tick deadline"
                raise cls(f"call abandoned: {why}", outcome="unknown")
        if "error" in result:
            exc = result["error"]
            # Never connected: nothing ran. Anything later: the provider may have run.
            reached = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
            raise ModelFailure(f"HTTP call failed: {type(exc).__name__}",
                               outcome="unknown" if reached else "failed",
                               code="reply_unreadable" if reached else "provider_unreachable")
        response: httpx.Response = result["response"]
        if response.status_code >= 400:
            raise ModelFailure(f"provider answered HTTP {response.status_code}",
                               outcome="failed", code="provider_error")
        # A complete answer came back: the call ran. Whatever is unreadable in it makes the
        # attempt failed (replayable), with the usage that could be read (an unreadable cost is
        # charged at the reserve).
        try:
            data = read_body(response.content)
        except ValueError as exc:
            raise ModelFailure(f"unreadable provider response: {exc}", outcome="failed",
                               usage=UNKNOWN_USAGE, code="reply_unreadable") from None
        if not isinstance(data, dict):
            raise ModelFailure("unreadable provider response: not an object", outcome="failed",
                               usage=UNKNOWN_USAGE, code="reply_unreadable")
        usage = self._cost(model, data.get("usage"))
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        message = choice.get("message") if isinstance(choice, dict) else None
        text = message.get("content") if isinstance(message, dict) else None
        if text is None and isinstance(message, dict):
            text = ""  # a reply with no text (e.g. only tool calls): not JSON, handled later
        if not isinstance(text, str):
            raise ModelFailure("unreadable provider response: no reply text", outcome="failed",
                               usage=usage, code="reply_unreadable")
        if not usage.known:
            raise ModelFailure("the provider's usage is missing or not valid numbers; the "
                               "charge is the reserve", outcome="failed", usage=usage,
                               code="reply_unreadable")
        assert isinstance(choice, dict)
        if choice.get("finish_reason") == "length":
            raise ModelFailure("the reply was cut off at the output limit", outcome="failed",
                               usage=usage, code="reply_cut_off")
        return Reply(text=text, usage=usage, stop_reason=str(choice.get("finish_reason"))[:40])

    def close(self) -> None:
        # A call abandoned mid-flight (deadline, stop) fails in its thread once the client is
        # closed; its outcome was already reported as unknown.
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
