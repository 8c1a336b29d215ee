"""Our SQLSTATE codes (class MB) mapped to Python exceptions.

The database raises them; psycopg hands them over as ``psycopg.Error`` with ``sqlstate``.
:func:`translate` turns one into the matching :class:`MemoryError_` subclass.
"""

from __future__ import annotations

import psycopg


class MemoryError_(Exception):
    """An error the memory database raised on purpose, with its code and message."""

    code = "MB000"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class InvalidArgument(MemoryError_):
    code = "MB001"


class NotFound(MemoryError_):
    code = "MB002"


class Conflict(MemoryError_):
    code = "MB003"


class TooLarge(MemoryError_):
    code = "MB004"


class NoScope(MemoryError_):
    code = "MB005"


class JobLost(MemoryError_):
    code = "MB020"


class JobStale(MemoryError_):
    code = "MB021"


class JobConfigChanged(MemoryError_):
    code = "MB022"


class BadModelOutput(MemoryError_):
    code = "MB023"


class BudgetExceeded(MemoryError_):
    code = "MB024"


class JobState(MemoryError_):
    code = "MB025"


BY_CODE: dict[str, type[MemoryError_]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, NotFound, Conflict, TooLarge, NoScope, JobLost, JobStale,
        JobConfigChanged, BadModelOutput, BudgetExceeded, JobState,
    )
}


def translate(exc: psycopg.Error) -> Exception:
    """Our exception for a database error with an MB code; the error itself otherwise."""
    code = exc.sqlstate or ""
    cls = BY_CODE.get(code)
    if cls is None:
        return exc
    diag = exc.diag
    return cls(diag.message_primary or str(exc), hint=diag.message_hint)
