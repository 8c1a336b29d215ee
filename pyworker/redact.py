"""Common credential patterns, redacted before a prompt is serialized (P8).

The database redacts the inputs of a claim and the outputs before it stores them; it is the
authority. This is defense in depth on the worker's side, checked against the same shared
test vectors (``pyworker/data/redaction_vectors.json``). No list of patterns finds every
secret: an unusual format or a secret described in words passes through.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MARK = "[REDACTED]"

# Order matters: whole blocks first, then structured forms, then bare tokens.
_PATTERNS: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    # PEM private keys, whole block.
    (re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----",
                re.DOTALL), MARK),
    # user:password@ in URLs: keep the user and host.
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/@]+:)[^\s@/]+(@)"),
     lambda m: m.group(1) + MARK + m.group(2)),
    # Authorization headers.
    (re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{8,}"),
     lambda m: m.group(1) + " " + MARK),
    # JSON web tokens.
    (re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"), MARK),
    # Vendor keys with recognisable prefixes.
    (re.compile(r"\bsk-(?:ant-|proj-|live-|test-)?[A-Za-z0-9_-]{16,}"), MARK),
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"), MARK),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), MARK),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MARK),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), MARK),
    (re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}"), MARK),
    (re.compile(r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"), MARK),
    # Telegram bot tokens: 123456789:AA...
    (re.compile(r"\b\d{8,10}:[A-Za-z0-9_-]{35}\b"), MARK),
    # key = value assignments of secrets (password, api_key, secret, token ...).
    (re.compile(r"(?i)\b((?:password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token"
                r"|client[_-]?secret|private[_-]?key)\s*[:=]\s*)(['\"]?)[^\s'\",;]{4,}\2"),
     lambda m: m.group(1) + m.group(2) + MARK + m.group(2)),
]


def redact(text: str) -> str:
    """The text with every recognised credential replaced by ``[REDACTED]``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
