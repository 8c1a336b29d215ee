"""Pydantic models at the worker's boundaries: the claim payload and the model replies.

The database validates everything again before it commits (``memory.save_checkpoint`` and
``memory.commit_job``); these models make the worker fail early and say why.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    summary_bytes: int = 4000
    title_bytes: int = 300
    index_bytes: int = 4500
    index_ids: int = 12
    batch_bytes: int = 24000
    candidates: int = 48


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


MAX_TOKENS = 2**31 - 1  # what the database stores (integer)
MAX_COST_USD = Decimal(1_000_000)  # the largest dollar amount the database takes


class Usage(_Model):
    """What one model call used: tokens and dollars (the shape the database stores). ``None``
    is a value the provider did not report readably (NaN, negative, out of range, not a
    number): the database charges an unreadable cost at the attempt's reserve."""

    input_tokens: int | None = Field(default=0, ge=0, le=MAX_TOKENS)
    output_tokens: int | None = Field(default=0, ge=0, le=MAX_TOKENS)
    cost_usd: Decimal | None = Field(default=Decimal(0), ge=0, le=MAX_COST_USD)

    @property
    def known(self) -> bool:
        return None not in (self.input_tokens, self.output_tokens, self.cost_usd)

    def as_json(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cost_usd": None if self.cost_usd is None else float(self.cost_usd)}


UNKNOWN_USAGE = Usage(input_tokens=None, output_tokens=None, cost_usd=None)


def token_count(value: Any) -> int | None:
    """A provider's token count as the database takes it, or None when it is not one (a
    negative, fractional, NaN, oversized or non-numeric value)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_TOKENS:
        return value
    return None


def dollars(value: Any) -> Decimal | None:
    """A provider's dollar amount as the database takes it (0 to 1,000,000), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return None
    try:
        amount = Decimal(str(value))
    except ArithmeticError:
        return None
    if not amount.is_finite() or amount < 0 or amount > MAX_COST_USD:
        return None
    return amount


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
    limits: Limits = Field(default_factory=Limits)
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


class ExtractionOutput(_Model):
    """``{"title", "summary", "source_ids", "reused_ids"}``; all empty is the valid no-op.

    ``source_ids`` are the messages the summary cites, in the order it uses them;
    ``reused_ids`` the memories shown with the batch whose content the summary relies on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    title: str
    summary: str
    source_ids: list[str]
    reused_ids: list[int] = Field(default_factory=list)

    @property
    def is_noop(self) -> bool:
        return not self.title and not self.summary and not self.source_ids

    def check(self, limits: Limits, allowed_ids: set[str],
              existing_ids: set[int] | None = None) -> ExtractionOutput:
        if self.is_noop:
            if self.reused_ids:
                raise ReplyError("an empty (no-op) output reuses no memory")
            return self
        unknown_reused = [i for i in self.reused_ids if i not in (existing_ids or set())]
        if unknown_reused:
            raise ReplyError(f"reused_ids not among the memories shown: {unknown_reused[:5]}")
        if not self.title.strip() or not self.summary.strip() or not self.source_ids:
            raise ReplyError("title, summary and source_ids must be all empty (no-op) "
                             "or all present")
        if utf8_len(self.title) > limits.title_bytes:
            raise ReplyError(f"title is {utf8_len(self.title)} bytes; the limit is "
                             f"{limits.title_bytes}")
        if utf8_len(self.summary) > limits.summary_bytes:
            raise ReplyError(f"summary is {utf8_len(self.summary)} bytes; the limit is "
                             f"{limits.summary_bytes}")
        unknown = [i for i in self.source_ids if i not in allowed_ids]
        if unknown:
            raise ReplyError(f"{len(unknown)} source id(s) are not messages of the batch")
        return self


class ConsolidationOutput(_Model):
    """``{"index", "record_ids"}``: the scope's compact index and the memory ids it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str
    record_ids: list[int]

    def check(self, limits: Limits, allowed_ids: set[int]) -> ConsolidationOutput:
        if utf8_len(self.index) > limits.index_bytes:
            raise ReplyError(f"index is {utf8_len(self.index)} bytes; the limit is "
                             f"{limits.index_bytes}")
        if len(self.record_ids) > limits.index_ids:
            raise ReplyError(f"{len(self.record_ids)} record ids; the limit is "
                             f"{limits.index_ids}")
        if len(set(self.record_ids)) != len(self.record_ids):
            raise ReplyError("record_ids has duplicates")
        unknown = [i for i in self.record_ids if i not in allowed_ids]
        if unknown:
            raise ReplyError(f"{len(unknown)} record id(s) are not among the candidates")
        if not self.index.strip() or not self.record_ids:
            raise ReplyError("the index must not be empty and must name at least one record")
        return self


class ReplyError(ValueError):
    """The model's reply is not a valid output for the job (the attempt failed). ``code`` is
    the failure code the attempt is recorded with; the message names the contract, never what
    the model wrote (it goes to the logs)."""

    def __init__(self, message: str, code: str = "reply_invalid") -> None:
        super().__init__(message)
        self.code = code


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_object(text: str) -> dict[str, Any]:
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    try:
        # NaN/Infinity are not JSON; a number too long for int() (Python refuses more than 4,300
        # digits) raises ValueError, and nesting deeper than the interpreter's stack
        # RecursionError: each is a reply that is not JSON, never a crash of the worker.
        value = json.loads(stripped, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ReplyError(f"the reply is not JSON: {exc.msg} at {exc.pos}",
                         "reply_not_json") from None
    except (ValueError, RecursionError) as exc:
        raise ReplyError(f"the reply is not JSON the worker can read ({type(exc).__name__})",
                         "reply_not_json") from None
    if not isinstance(value, dict):
        raise ReplyError("the reply is JSON but not an object", "reply_not_json")
    return value


def parse_reply(payload: ClaimPayload, text: str) -> ExtractionOutput | ConsolidationOutput:
    """The validated output for a job from the model's reply text; raises :class:`ReplyError`
    for anything else the reply may be (the database validates the output again)."""
    value = _json_object(text)
    try:
        if payload.phase == "extract":
            ex = payload.extract_input()
            ids = {s.id for s in ex.sources}
            existing = {int(e.id) for e in ex.existing if str(e.id).isdigit()}
            return ExtractionOutput.model_validate(value).check(payload.limits, ids, existing)
        cids = {c.id for c in payload.consolidate_input().candidates}
        return ConsolidationOutput.model_validate(value).check(payload.limits, cids)
    except ReplyError:
        raise
    except ValidationError as exc:
        first = exc.errors()[0]
        # The location without the model's own keys: only the contract's names and positions.
        where = ".".join(str(p) if isinstance(p, int) or p in CONTRACT_KEYS else "?"
                         for p in first.get("loc", ()))
        raise ReplyError(f"the reply has the wrong shape at {where or 'top'}: "
                         f"{first.get('type')}") from None
    except (ValueError, RecursionError) as exc:  # e.g. a lone surrogate cannot be UTF-8
        raise ReplyError(f"the reply cannot be checked ({type(exc).__name__})") from None


CONTRACT_KEYS = frozenset({"title", "summary", "source_ids", "index", "record_ids"})
