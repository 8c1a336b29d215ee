"""``offline``: a deterministic extractive summarizer with no network and no cost.

It is a heuristic, not a model: it picks sentences that look like requests, corrections,
preferences, decisions and open items by English and Chinese patterns, labels each with its
speaker and source id, and trims to the byte limits. It follows the same output contract as a
real model, so the whole pipeline (and the demo) runs without credentials.
"""

from __future__ import annotations

import json
import re
import threading
from decimal import Decimal

from pyworker.adapters.base import Cancelled, Reply
from pyworker.payload import (
    ConsolidateInput,
    ExtractInput,
    Limits,
    ModelRef,
    Source,
    Usage,
    utf8_len,
)
from pyworker.prompting import Prompt

# Kinds by precedence (a sentence takes the first that matches); DISPLAY orders the summary
# by the extraction priorities (P7).
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("correction", re.compile(
        r"(?i)\b(actually|correction|i meant|not .{1,40} but|no,? (?:it|that)'?s|instead of|"
        r"scratch that|to correct|wrong)\b|不对|更正|其实|应该是|改成|我说错了|纠正")),
    ("preference", re.compile(
        r"(?i)\b(i (?:prefer|like|love|hate|want .{0,20}always)|please always|always use|never use|"
        r"don'?t (?:ever )?(?:use|send|call)|call me|my preference|i'?d rather)\b|"
        r"我(?:更)?喜欢|偏好|请(?:一直|总是|始终)|以后(?:都|请)|不要再|习惯用")),
    ("decision", re.compile(
        r"(?i)\b(we(?:'ve| have)? decided|decided|let'?s go with|we'?ll (?:use|go)|agreed|"
        r"final(?:ly)? (?:choice|answer)|we chose|going with)\b|决定|就用|确定(?:了|用)|定了|"
        r"同意")),
    ("open item", re.compile(
        r"(?i)\b(todo|to-do|still need|not (?:yet|done)|later|next (?:step|time|week)|"
        r"remind me|follow up|pending|tomorrow|unfinished|will (?:finish|continue)|open question)\b|"
        r"还没|待办|下次|明天|稍后|回头|没做完|未完成|接下来")),
    ("request", re.compile(
        r"(?i)^(please|can you|could you|would you|help me|i need|i want|write|make|create|"
        r"find|show|explain|summari[sz]e|translate|draft)\b|\?\s*$|^请|帮我|能不能|可以.{0,10}吗|"
        r"[？]\s*$")),
]

# A sentence ends at . ! ? followed by a blank (so "2.1" stays whole), at 。！？, or a line end.
_SPLIT = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])|\n+")
DISPLAY = ["request", "correction", "preference", "decision", "open item", "proposal"]

NOTE = "(offline heuristic summary: sentences picked by patterns, not a model's reading)"


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SPLIT.split(text) if s.strip()]


def _clip(text: str, limit: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[: max(0, limit - 3)].decode("utf-8", "ignore").rstrip() + "..."


def _kind_of(sentence: str, role: str) -> str | None:
    for kind, pattern in KINDS:
        if kind == "request" and role != "user":
            continue
        if pattern.search(sentence):
            # An assistant's "we decided" is a proposal until a user confirms it.
            if role == "assistant" and kind != "decision":
                return None  # the assistant restating the user adds nothing
            if role == "assistant" and kind == "decision":
                return "proposal"
            return kind
    return None


def title_for(texts: list[str], speakers: list[str], limit: int) -> str:
    """A title for a record made of ``texts`` said by (or about) ``speakers``."""
    return _clip(f"{', '.join(speakers)}: {texts[0]}", limit)


def extract(data: ExtractInput, title_bytes: int, summary_bytes: int) -> dict[str, object]:
    picked: list[tuple[int, str, Source, str]] = []
    order = {k: i for i, k in enumerate(DISPLAY)}
    known = " ".join(e.summary for e in data.existing)
    for src in data.sources:
        for sentence in _sentences(src.text):
            kind = _kind_of(sentence, src.role)
            if kind and sentence not in known:
                picked.append((order[kind], kind, src, sentence))
    if not picked:
        return {"title": "", "summary": "", "source_ids": []}
    picked.sort(key=lambda p: p[0])  # stable: keeps conversation order within a kind
    lines: list[str] = []
    ids: list[str] = []
    budget = summary_bytes - utf8_len(NOTE) - 1
    for _, kind, src, sentence in picked:
        line = f"- {kind}: {src.speaker_id}: {_clip(sentence, 400)} [{src.id}]"
        if utf8_len("\n".join([*lines, line])) > budget:
            continue
        lines.append(line)
        if src.id not in ids:
            ids.append(src.id)
    first = next((p for p in picked if p[1] == "decision"),
                 next((p for p in picked if p[1] == "request"), picked[0]))
    title = _clip(f"{first[2].speaker_id}: {first[3]}", title_bytes)
    return {"title": title, "summary": "\n".join([*lines, NOTE]), "source_ids": ids}


def consolidate(data: ConsolidateInput, index_bytes: int, index_ids: int) -> dict[str, object]:
    newest = sorted(data.candidates, key=lambda c: (c.created_at or "", c.id), reverse=True)
    lines: list[str] = []
    ids: list[int] = []
    for cand in newest:
        if len(ids) >= index_ids:
            break
        who = ", ".join(cand.speaker_ids) or "unknown speaker"
        line = f"[#{cand.id}] {_clip(cand.title, 200)} ({cand.kind}; {who})"
        if utf8_len("\n".join([*lines, line])) > index_bytes:
            break
        lines.append(line)
        ids.append(cand.id)
    return {"index": "\n".join(lines), "record_ids": ids}


class OfflineAdapter:
    name = "offline"

    def extract(self, data: ExtractInput, limits: Limits) -> dict[str, object]:
        return extract(data, limits.title_bytes, limits.summary_bytes)

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Decimal:
        return Decimal(0)

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        if cancel.is_set():
            raise Cancelled("stopped before the call", outcome="failed")
        lim = prompt.limits
        if isinstance(prompt.data, ExtractInput):
            out = self.extract(prompt.data, lim)
        else:
            out = consolidate(prompt.data, lim.index_bytes, lim.index_ids)
        text = json.dumps(out, ensure_ascii=False)
        return Reply(text=text, usage=Usage(input_tokens=0, output_tokens=0,
                                            cost_usd=Decimal(0)))

    def close(self) -> None:
        pass
