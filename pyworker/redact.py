"""Common credential patterns, redacted before a prompt is serialized (P8).

The database redacts the inputs of a claim and the outputs before it stores them; it is the
authority. This is defense in depth on the worker's side, checked against the same shared
test vectors (``pyworker/data/redaction_vectors.json``). No list of patterns finds every
secret: an unusual format or a secret described in words passes through.
"""

from __future__ import annotations

import re

MARK = "[REDACTED]"

# The same ordered table as memory_private.redaction_patterns (sql/30_redaction.sql), translated
# from PostgreSQL AREs (\y is \b; "." crosses newlines there, hence DOTALL; "$" is the end of
# the text, hence \Z). Whole private-key blocks first, then structured forms, then
# `key = value` assignments of secrets. Redacting twice changes nothing.
_SECRET_NAME = (r"[A-Za-z0-9_.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key"
                r"|private[_-]?key)")
_PATTERNS: list[tuple[re.Pattern[str], str]] = [(re.compile(p, f), r) for p, r, f in [
    ((r"-----BEGIN (?:[A-Z0-9]+ )*?PRIVATE KEY(?: BLOCK)?-----.*?"
     r"-----END (?:[A-Z0-9]+ )*?PRIVATE KEY(?: BLOCK)?-----"), MARK, re.DOTALL),
    (r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----.*\Z", MARK, re.DOTALL),
    (r"\b([a-z][a-z0-9+.-]*://[^\s:/@]+:)[^\s@/]+@", rf"\g<1>{MARK}@", re.IGNORECASE),
    (r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}", MARK, 0),
    (r"\bsk-[A-Za-z0-9_-]{16,}", MARK, 0),
    (r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}", MARK, 0),
    (r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}", MARK, 0),
    (r"\bgithub_pat_[A-Za-z0-9_]{20,}", MARK, 0),
    (r"\bglpat-[A-Za-z0-9_-]{20,}", MARK, 0),
    (r"\bxox[abposr]-[A-Za-z0-9-]{10,}", MARK, 0),
    (r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", MARK, 0),
    (r"\bAIza[0-9A-Za-z_-]{35}", MARK, 0),
    (r"\b[0-9]{8,10}:[A-Za-z0-9_-]{35}\b", MARK, 0),
    (r"\b(authorization\"?\s*[:=]\s*\"?(?:(?:bearer|basic|token)\s+)?)[^\s\"',;]+",
     rf"\g<1>{MARK}", re.IGNORECASE),
    (r"\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{16,}", rf"\g<1> {MARK}", re.IGNORECASE),
    (rf"\b({_SECRET_NAME}\"?\s*[:=]\s*)\"[^\"]+\"", rf'\g<1>"{MARK}"', re.IGNORECASE),
    (rf"\b({_SECRET_NAME}\"?\s*[:=]\s*)'[^']+'", rf"\g<1>'{MARK}'", re.IGNORECASE),
    (rf"\b({_SECRET_NAME}\"?\s*[:=]\s*)[^\s\"',;]{{4,}}", rf"\g<1>{MARK}", re.IGNORECASE),
]]


def redact(text: str) -> str:
    """The text with every recognised credential replaced by ``[REDACTED]``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
