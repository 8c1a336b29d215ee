"""``offline``: a deterministic extractive summarizer with no network and no cost.

It is a heuristic, not a model. Extraction keeps the sentences of the conversation that carry
something to remember and labels each with what it is, its speaker and its source id:
- by English and Chinese patterns: requests, corrections, preferences, decisions, plans and open
  work (the extraction priorities, P7);
- by the marks of a fact: a first-person statement ("I adopted ...", "my sister ..."), a name or
  a place (a capitalised word inside the sentence), a date, a time or a number, a plan; a
  sentence needs two such marks, so greetings, thanks and reactions ("Wow, that's great!") and
  questions that state nothing are left out.
The summary lists them by priority, then in conversation order, one line per kind and source
turn; when they do not fit, the lines with the fewest marks go first. The title names the speakers and
the words the kept sentences are most about. Consolidation indexes the records of most standing
value first (notes, then preferences, corrections, decisions and plans, then facts), the newest
first among equals, each line citing its record as ``[#id]``. It follows the same output
contract as a real model, so the whole pipeline (and the demo) runs without credentials; every
summary ends with a note saying it is this heuristic.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal

from pyworker.adapters.base import Cancelled, Reply
from pyworker.payload import (
    Candidate,
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
        r"(?i)\b(i (?:really )?(?:prefer|like|love|enjoy|hate|can'?t stand|want .{0,20}always)|"
        r"please always|always use|never use|don'?t (?:ever )?(?:use|send|call)|call me|"
        r"my (?:preference|favou?rite)|i'?d rather)\b|"
        r"我(?:更)?喜欢|偏好|请(?:一直|总是|始终)|以后(?:都|请)|不要再|习惯用")),
    ("decision", re.compile(
        r"(?i)\b(we(?:'ve| have)? decided|i(?:'ve| have)? decided|decided|let'?s go with|"
        r"we'?ll (?:use|go)|agreed|final(?:ly)? (?:choice|answer)|we chose|going with)\b|"
        r"决定|就用|确定(?:了|用)|定了|同意")),
    ("open item", re.compile(
        r"(?i)\b(todo|to-do|still need|not (?:yet|done)|later|next (?:step|time|week)|"
        r"remind me|follow up|pending|tomorrow|unfinished|will (?:finish|continue)|open question)\b|"
        r"还没|待办|下次|明天|稍后|回头|没做完|未完成|接下来")),
    ("plan", re.compile(
        r"(?i)\b(i'?m (?:going|planning|hoping|thinking of|about) to|i(?:'ll| will)|"
        r"i (?:plan|want|hope|intend|aim) to|we(?:'re| are) (?:going|planning) to|"
        r"we(?:'ll| will)|my plan|gonna)\b|打算|计划|准备|想要")),
    ("request", re.compile(
        r"(?i)^(please|can you|could you|would you|help me|i need|write|make|create|"
        r"find|show|explain|summari[sz]e|translate|draft)\b|^请|帮我|能不能|可以.{0,10}吗")),
]
DISPLAY = ["request", "correction", "preference", "decision", "open item", "plan", "fact",
           "proposal"]

# The marks of a fact.
_FIRST_PERSON = re.compile(r"(?i)\b(i|i'm|i've|i'd|i'll|my|me|mine|we|we're|we've|our|us)\b|我")
_NAME = re.compile(r"(?<=[\w,;:] )[A-Z][\w'’-]*[a-z][\w'’-]*(?: [A-Z][\w'’-]*[a-z][\w'’-]*)*")
_TIME = re.compile(
    r"(?i)\b(\d+|one|two|three|four|five|six|seven|eight|nine|ten|twenty|hundred|"
    r"jan(?:uary)?|feb(?:ruary)?|march|april|june|july|aug(?:ust)?|sept?(?:ember)?|"
    r"oct(?:ober)?|nov(?:ember)?|dec(?:ember)?|monday|tuesday|wednesday|thursday|friday|"
    r"saturday|sunday|weekend|yesterday|today|tonight|tomorrow|ago|"
    r"(?:last|next|this|every) (?:week|month|year|summer|winter|spring|fall|autumn|night|time)|"
    r"(?:a|one|two|few|couple of) (?:days|weeks|months|years))\b|\d|年|月|日|周|星期|昨天|今天|明天")
_DONE = re.compile(
    r"(?i)\b(?:i|we)(?: just| recently| finally| also| even)? (?:\w+ed|went|got|made|took|bought|"
    r"saw|met|ran|began|won|lost|found|had|did|gave|left|moved|became|built|wrote|read|sold|"
    r"kept|told|brought|came|spent|drew|sang|swam|flew|drove|grew|chose|joined|am|have|was)\b")
_SMALL_TALK = re.compile(
    r"(?i)^(?:hey|hi|hello|wow|whoa|oh|aw+|omg|yay|thanks?|thank you|congrat\w*|awesome|great|"
    r"cool|nice|sounds|glad|good|lol|haha|yeah|yes|no|sure|ok|okay|bye|see you|take care|"
    r"same|totally|definitely|absolutely|amazing|that'?s|it'?s so|you'?re|you have|you got)\b")
_WORD = re.compile(r"[^\W\d_][\w'’-]*")

# Words that say little about what a record is about (the title's keywords skip them).
STOP = frozenset("""
a about above after again against all also always am an and any anything are around as at be
because been before being below between both but by can can't cannot could couldn't did didn't
do does doesn't doing don't down during each else even ever every few for from further get gets
getting go goes going gone got gotta had hadn't has hasn't have haven't having he he'd he'll he's
her here here's hers herself him himself his how how's i i'd i'll i'm i've if in into is isn't it
it's its itself just let's like lot lots made make makes many me might more most much must my
myself need never no nor not now of off often oh ok okay on once one only or other ought our ours
ourselves out over own really right said same say says she she'd she'll she's should shouldn't
so some something still such sure than that that's the their theirs them themselves then there
there's these they they'd they'll they're they've thing things think this those though through
to too under until up us very was wasn't way we we'd we'll we're we've well were weren't what
what's when when's where where's which while who who's whom why why's will with won't would
wouldn't yeah yes yet you you'd you'll you're you've your yours yourself yourselves
actually amazing awesome cool definitely feel feels felt glad good great hey hi hello keep know
love lovely maybe nice pretty sounds thanks thank totally wow wanna want glad new time times day
days year years week weeks lately today yesterday tomorrow please sorry gonna able absolutely
again along already another anyone anything back bad best better big bit came come comes coming
crazy different doing done easy else enjoy enough everyone everything exciting excited fun gave
give gives giving guess happen happened happy hard help helped helps hope hopefully inspired
inspiring kind last least let little look looked looking looks lot mean means meant much next
nothing okay part people place proud put reminds see seeing seems seen since someone sometimes
special stay stuff super take taking tell thing tough tried true try trying used wanted wonderful
yourself told talk talking together work working life world
""".split())  # noqa: SIM905 - a word list reads best as prose

NOTE = ("(offline heuristic summary: sentences picked by patterns and the marks of a fact, "
        "not a model's reading)")

# A sentence ends at . ! ? followed by a blank (so "2.1" stays whole), at 。！？, or a line end.
_SPLIT = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])|\n+")


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


def fact_marks(sentence: str) -> int:
    """How much a sentence looks like a fact worth keeping: one point each for a first-person
    statement, something done, a name or place, a date, time or number; less for a question,
    small talk or a fragment."""
    words = len(_WORD.findall(sentence)) or len(sentence) // 3  # CJK: about 3 bytes a word
    marks = (bool(_FIRST_PERSON.search(sentence)) + bool(_DONE.search(sentence))
             + min(len(_NAME.findall(sentence)), 2) + bool(_TIME.search(sentence)))
    if sentence.rstrip().endswith(("?", "？")):
        marks -= 2
    if _SMALL_TALK.search(sentence) and words < 10:
        marks -= 1
    if words < 5:
        marks -= 1
    return marks


@dataclass
class _Line:
    rank: int        # the kind's place in DISPLAY
    kind: str
    source: Source
    sentences: list[str]
    marks: int
    position: int    # conversation order


def keywords(texts: list[str], skip: set[str], n: int = 4) -> list[str]:
    """The words the texts are most about: names and places (capitalised inside a sentence,
    "Door Dash") count double, then frequent words that are not stop words; never the speakers'
    own names; longer first among equals, then the first seen."""
    counts: Counter[str] = Counter()
    first: dict[str, int] = {}
    shown: dict[str, str] = {}
    for text in texts:
        for sentence in _sentences(text):
            names = [m.strip("'’-") for m in _NAME.findall(sentence)]
            rest = _NAME.sub(" ", sentence)
            terms = [(name, 2) for name in names] + [(w, 1) for w in _WORD.findall(rest)]
            for term, weight in terms:
                key = term.lower().strip("'’-")
                if (len(key) < 3 or key in STOP or key in skip
                        or key.endswith(("'s", "’s"))):
                    continue
                counts[key] += weight
                first.setdefault(key, len(first))
                shown.setdefault(key, term if weight == 2 else key)
    ranked = sorted(counts, key=lambda k: (-counts[k], -len(k), first[k]))
    return [shown[k] for k in ranked[:n]]


def title_for(texts: list[str], speakers: list[str], limit: int) -> str:
    """What a record of ``texts`` said by (or about) ``speakers`` is about: the speakers and the
    words the texts are most about, or the first text when none stands out."""
    who = " and ".join(speakers) if len(speakers) <= 2 else ", ".join(speakers)
    about = keywords(texts, {s.lower() for s in speakers})
    if not about:
        return _clip(f"{who}: {texts[0]}", limit)
    return _clip(f"{who}: {', '.join(about)}", limit)


def extract(data: ExtractInput, title_bytes: int, summary_bytes: int) -> dict[str, object]:
    order = {k: i for i, k in enumerate(DISPLAY)}
    known = " ".join(e.summary for e in data.existing)
    lines: list[_Line] = []
    for position, src in enumerate(data.sources):
        kept: list[tuple[str, str, int]] = []
        for sentence in _sentences(src.text):
            if sentence in known:
                continue
            kind = _kind_of(sentence, src.role)
            marks = fact_marks(sentence)
            # Small talk that happens to match a pattern ("See you later!", "Gonna be great!")
            # is left out; a plan needs one mark of a fact.
            if kind is not None and (marks <= -2 or (kind == "plan" and marks < 1)):
                kind = None
            if kind is None and marks >= 2 and src.role == "user":
                kind = "fact"
            if kind is not None:
                kept.append((kind, sentence, marks))
        for kind in dict.fromkeys(k for k, _, _ in kept):  # one line per kind of the turn
            same = [(s, m) for k, s, m in kept if k == kind]
            lines.append(_Line(order[kind], kind, src, [s for s, _ in same],
                               sum(m for _, m in same) + (5 if kind != "fact" else 0),
                               position))
    if not lines:
        return {"title": "", "summary": "", "source_ids": [], "reused_ids": []}
    budget = summary_bytes - utf8_len(NOTE) - 1

    def text(line: _Line) -> str:
        said = _clip(" ".join(line.sentences), 600)
        return f"- {line.kind}: {line.source.speaker_id}: {said} [{line.source.id}]"

    # Over the budget: the lines with the fewest marks go first (later ones among equals).
    chosen = sorted(lines, key=lambda x: (-x.marks, x.position))
    used = 0
    fitting: list[_Line] = []
    for line in chosen:
        size = utf8_len(text(line)) + 1
        if used + size <= budget:
            fitting.append(line)
            used += size
    fitting.sort(key=lambda x: (x.rank, x.position))
    ids = list(dict.fromkeys(x.source.id for x in fitting))
    speakers = list(dict.fromkeys(x.source.speaker_id for x in fitting))
    title = title_for([" ".join(x.sentences) for x in fitting], speakers, title_bytes)
    summary = "\n".join([*(text(x) for x in fitting), NOTE])
    # It never builds on an existing memory (what they already say is left out), so it
    # truthfully declares no reuse.
    return {"title": title, "summary": summary, "source_ids": ids, "reused_ids": []}


_LABEL = re.compile(r"^- (request|correction|preference|decision|open item|plan|fact|proposal):",
                    re.MULTILINE)
STANDING = {"note": 6, "preference": 3, "correction": 3, "decision": 3, "open item": 2,
            "plan": 2, "request": 1, "fact": 1, "proposal": 1}


def standing(cand: Candidate) -> float:
    """How much lasting value a record holds: an explicit note most; then each preference,
    correction and decision it holds, each plan and open item, each other fact (by the offline
    labels, or by the patterns when a model wrote the summary)."""
    if cand.kind == "note":
        return STANDING["note"]
    labels = _LABEL.findall(cand.summary)
    if not labels:
        labels = [k for line in _sentences(cand.summary)
                  if (k := _kind_of(line, "user") or ("fact" if fact_marks(line) >= 2 else ""))]
    return sum(STANDING.get(k, 0) for k in labels)


def consolidate(data: ConsolidateInput, index_bytes: int, index_ids: int) -> dict[str, object]:
    ranked = sorted(data.candidates,
                    key=lambda c: (standing(c), c.created_at or "", c.id), reverse=True)
    lines: list[str] = []
    ids: list[int] = []
    per_line = max(80, index_bytes // max(1, min(index_ids, len(ranked))) - 1)
    for cand in ranked:
        if len(ids) >= index_ids:
            break
        who = ", ".join(cand.speaker_ids) or "unknown speaker"
        line = _clip(f"[#{cand.id}] {cand.title} ({cand.kind}; {who})", per_line)
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
