"""``replay``: answers each extraction with facts a dataset supplies for the batch's sources.

For ``pimem eval``: LoCoMo ships, per session, facts a language model wrote about each speaker,
each with the turn it came from (``session_N_observation``). Replaying them as the extraction
output lets the rest of the pipeline (validation, commit, consolidation, recall, search) be
measured on records written by a model, offline and free. Each summary line is one fact citing
the batch's message ids it rests on; the title names the speakers and what the facts are about
(the offline summarizer's title rule). Consolidation is the offline adapter's. Labelled: the
note at the end of each summary says where the text came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pyworker.adapters import offline
from pyworker.adapters.offline import OfflineAdapter
from pyworker.payload import ExtractInput, Limits, utf8_len

NOTE = "(replayed: facts the evaluation dataset supplies for these sources)"


class FactLike(Protocol):
    @property
    def speaker(self) -> str: ...

    @property
    def text(self) -> str: ...


def extract(data: ExtractInput, facts: Mapping[str, Sequence[FactLike]], title_bytes: int,
            summary_bytes: int) -> dict[str, object]:
    batch = [s.id for s in data.sources]
    known = " ".join(e.summary for e in data.existing)
    # Each fact once, in the order of the first source it rests on, citing every batch source
    # it rests on.
    cited: dict[int, tuple[FactLike, list[str]]] = {}
    for sid in batch:
        for fact in facts.get(sid, ()):
            entry = cited.setdefault(id(fact), (fact, []))
            if sid not in entry[1]:
                entry[1].append(sid)
    lines: list[str] = []
    ids: list[str] = []
    texts: list[str] = []
    speakers: list[str] = []
    budget = summary_bytes - utf8_len(NOTE) - 1
    for fact, sids in cited.values():
        if fact.text in known:
            continue
        line = f"- {fact.text} [{', '.join(sids)}]"
        if utf8_len("\n".join([*lines, line])) > budget:
            continue
        lines.append(line)
        texts.append(fact.text)
        speakers.append(fact.speaker)
        ids.extend(s for s in sids if s not in ids)
    if not lines:
        return {"title": "", "summary": "", "source_ids": [], "reused_ids": []}
    title = offline.title_for(texts, list(dict.fromkeys(speakers)), title_bytes)
    return {"title": title, "summary": "\n".join([*lines, NOTE]), "source_ids": ids,
            "reused_ids": []}


class ReplayAdapter(OfflineAdapter):
    """Extraction from ``facts`` (message id -> the facts resting on it); consolidation by the
    offline rule. No network, no cost."""

    name = "replay"

    def __init__(self, facts: Mapping[str, Sequence[FactLike]]) -> None:
        self.facts = facts

    def extract(self, data: ExtractInput, limits: Limits) -> dict[str, object]:
        return extract(data, self.facts, limits.title_bytes, limits.summary_bytes)
