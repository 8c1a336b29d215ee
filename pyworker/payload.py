"""Pydantic models at the worker's boundaries: the claim payload it reads and the usage it reports,
and the reading of a model's reply as one JSON object.

The worker decides no rule: the database validates the output (``memory.save_checkpoint``, MB023)
and the usage (MB001) and is the only verdict. What stays here is transport: reading what the
database sends, and telling a reply that is one JSON object from one that is not.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Phase = Literal["extract", "consolidate"]


class _Model(BaseModel):
    # The database may add keys in later versions; the worker ignores what it does not use.
    model_config = ConfigDict(extra="ignore", frozen=True)


class Scope(_Model):
    scope_id: int
    kind: Literal["private", "shared"]
    bot_id: str
    chat_id: str
    user_id: str | None = None
    topic_id: int | None = None


class ModelRef(_Model):
    provider: str
    id: str

    @property
    def qualified(self) -> str:
        return f"{self.provider}/{self.id}"


class Budget(_Model):
    # Exact decimal strings in the payload ("0.420000"); a JSON number is accepted too.
    request_left_usd: Decimal
    workspace_left_usd: Decimal


class Limits(_Model):
    """The limits of model work as the claim states them (``memory_private.job_limits()``): the
    prompt tells the model these numbers; the database enforces them."""

    summary_bytes: int
    title_bytes: int
    index_bytes: int
    index_ids: int
    batch_bytes: int
    candidates: int


class Source(_Model):
    id: str
    role: Literal["user", "assistant"]
    speaker_id: str
    thread_id: str | None = None
    created_at: str | None = None
    text: str


class Existing(_Model):
    id: int | str
    title: str
    summary: str


class ExtractInput(_Model):
    sources: list[Source]
    existing: list[Existing] = Field(default_factory=list)


class Candidate(_Model):
    id: int
    kind: str = "extracted"
    title: str
    summary: str
    speaker_ids: list[str] = Field(default_factory=list)
    created_at: str | None = None


class ConsolidateInput(_Model):
    candidates: list[Candidate]


class Usage(_Model):
    """What one model call used: tokens and dollars, as the provider reported them. ``None`` is a
    value that is not a number (missing, NaN, text): the database charges an unreadable cost at
    the attempt's reserve. Whether a number is one it can store (a count from 0 to 2^31-1, a cost
    from 0 to 1,000,000) is the database's to say: it refuses the usage with MB001, and the
    worker then reports the attempt with its usage unknown."""

    input_tokens: int | float | None = 0
    output_tokens: int | float | None = 0
    cost_usd: Decimal | None = Decimal(0)

    @property
    def known(self) -> bool:
        return None not in (self.input_tokens, self.output_tokens, self.cost_usd)

    def as_json(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cost_usd": None if self.cost_usd is None else float(self.cost_usd)}


UNKNOWN_USAGE = Usage(input_tokens=None, output_tokens=None, cost_usd=None)


def token_count(value: Any) -> int | float | None:
    """A provider's token count as a JSON number (an integral float as an int), or None when it
    is not a finite number. Its range is the database's to check."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return None
    if isinstance(value, int):
        return value
    number = float(value)
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() else number


def dollars(value: Any) -> Decimal | None:
    """A provider's dollar amount as a Decimal, or None when it is not a finite number. Its range
    is the database's to check."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return None
    try:
        amount = Decimal(str(value))
    except ArithmeticError:
        return None
    return amount if amount.is_finite() else None


class Checkpoint(_Model):
    output: dict[str, Any]
    usage: dict[str, Any] | None = None


class ClaimPayload(_Model):
    """One claimed job, as ``memory.claim_job`` returns it."""

    job_id: int
    workspace_id: str
    token: str
    phase: Phase
    attempt: int | None = None
    lease_expires_at: str | None = None
    scope: Scope
    origin_request_id: str | None = None
    model: ModelRef
    budget: Budget
    limits: Limits
    input: dict[str, Any]
    checkpoint: Checkpoint | None = None

    def extract_input(self) -> ExtractInput:
        return ExtractInput.model_validate(self.input)

    def consolidate_input(self) -> ConsolidateInput:
        return ConsolidateInput.model_validate(self.input)

    def log_fields(self) -> dict[str, Any]:
        return {"workspace_id": self.workspace_id, "job_id": self.job_id, "phase": self.phase,
                "request_id": self.origin_request_id, "scope_id": self.scope.scope_id}


# Model replies ------------------------------------------------------------------------------


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


class ReplyError(ValueError):
    """The model's reply is not one JSON object (the attempt failed with ``reply_not_json``). The
    message names what was wrong, never what the model wrote (it goes to the logs)."""

    code = "reply_not_json"


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unread(text: str) -> None:
    return None  # numbers are read by the database, exactly as written


def reply_object(text: str) -> str:
    """The JSON text of the one object the model's reply is (a Markdown code fence around it
    removed), to hand to ``memory.save_checkpoint`` as it is: the database reads it, numbers
    and all, and decides whether it is a valid output. Raises :class:`ReplyError` for a reply
    that is not one JSON object."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    try:
        stripped.encode("utf-8")
    except UnicodeEncodeError:
        raise ReplyError("the reply is not valid Unicode text (a lone surrogate)") from None
    try:
        # Only the syntax is read here: numbers are not converted (a 5,000-digit integer or 1e999
        # is JSON the database can read), NaN/Infinity are not JSON, and nesting deeper than the
        # interpreter's stack (RecursionError) is a reply the worker cannot read, never a crash.
        value = json.loads(stripped, parse_constant=_no_constant, parse_int=_unread,
                           parse_float=_unread)
    except json.JSONDecodeError as exc:
        raise ReplyError(f"the reply is not JSON: {exc.msg} at {exc.pos}") from None
    except (ValueError, RecursionError) as exc:
        raise ReplyError(f"the reply is not JSON the worker can read ({type(exc).__name__})"
                         ) from None
    if not isinstance(value, dict):
        raise ReplyError("the reply is JSON but not an object")
    return stripped
