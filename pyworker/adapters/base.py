"""The one small interface every model adapter implements.

``complete`` makes one tool-free call and returns the reply text with its usage, or raises
:class:`ModelFailure` saying truthfully whether the provider may have run (``unknown``) or
certainly produced nothing billable beyond the usage it reports (``failed``), with the failure
code the attempt is recorded with (``memory_private.failure_codes()``, docs/errors.md).

Whatever a provider sends is hostile input: an adapter never lets it escape as another
exception. Usage it cannot read becomes ``None`` (:func:`provider_usage`); a reply whose usage
is not readable is a failure (``reply_unreadable``), charged by the database at the reserve.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, Protocol

from pyworker.payload import ModelRef, Usage, dollars, token_count
from pyworker.prompting import Prompt

Outcome = Literal["failed", "unknown"]


@dataclass(frozen=True)
class Reply:
    text: str
    usage: Usage
    stop_reason: str = "stop"


class ModelFailure(Exception):
    """A call that produced no usable reply.

    ``outcome`` is ``failed`` when the provider certainly answered (with an error, or with a
    reply that was cut off or unreadable) or was certainly never reached, and ``unknown`` when
    it may have run and charged without us seeing the result (an abort, a timeout, a crash
    mid-call). ``code`` is the failure code; ``message`` is for the worker's log only (it may
    quote the provider)."""

    default_code = "provider_error"

    def __init__(self, message: str, *, outcome: Outcome, usage: Usage | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.outcome: Outcome = outcome
        self.usage = usage
        self.code = code or self.default_code


class Cancelled(ModelFailure):
    """The call was aborted because the worker is stopping or lost its lease."""

    default_code = "call_aborted"


class DeadlineExceeded(ModelFailure):
    """The call did not finish before the tick's deadline."""

    default_code = "deadline_exceeded"


def provider_usage(input_tokens: Any, output_tokens: Any, cost_usd: Any) -> Usage:
    """Usage from values a provider reported, each kept only when the database can store it
    (``None`` otherwise: a NaN, negative, fractional or oversized count, a cost that is not a
    dollar amount)."""
    return Usage(input_tokens=token_count(input_tokens), output_tokens=token_count(output_tokens),
                 cost_usd=dollars(cost_usd))


class Adapter(Protocol):
    name: str

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        """The most this call may cost, reserved against the budgets before it is made."""
        ...

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        """One call; ``deadline`` is a ``time.monotonic()`` value."""
        ...

    def close(self) -> None:
        ...


def remaining(deadline: float) -> float:
    return deadline - time.monotonic()


# The budget reserve of a call whose price the worker cannot compute (Pi prices built-in
# models itself): a configured ceiling, PIMEM_RESERVE_USD.
DEFAULT_RESERVE_USD = Decimal("0.05")
