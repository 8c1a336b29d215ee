"""The one small interface every model adapter implements.

``complete`` makes one tool-free call and returns the reply text with its usage, or raises
:class:`ModelFailure` saying truthfully whether the provider may have run (``unknown``) or
certainly produced nothing billable beyond the usage it reports (``failed``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal, Protocol

from pyworker.payload import ModelRef, Usage
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
    reply that was cut off) or was certainly never reached, and ``unknown`` when it may have run
    and charged without us seeing the result (an abort, a timeout, a crash mid-call)."""

    def __init__(self, message: str, *, outcome: Outcome, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.outcome: Outcome = outcome
        self.usage = usage


class Cancelled(ModelFailure):
    """The call was aborted because the worker is stopping or lost its lease."""


class DeadlineExceeded(ModelFailure):
    """The call did not finish before the tick's deadline."""


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
