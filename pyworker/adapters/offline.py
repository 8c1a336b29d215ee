"""``offline``: a deterministic extractive summarizer with no network and no cost.

It is a heuristic, not a model. Extraction keeps every sentence of the conversation that states
something, whoever said it (each user, and the assistant too: where the assistant side relays
another person, as in the eval's private chat, half of what was said is theirs), and labels each
with what it is, its speaker and its source id:
- by English and Chinese patterns: requests (a user's), corrections, preferences, decisions (an
  assistant's is a proposal), plans and open work (the extraction priorities, P7);
- otherwise as a fact, when the sentence states something: two content words (not stop words,
  not the words of greetings, thanks, praise or agreement, not a name it addresses), or one in a
  sentence of three words or more in the first person, naming someone or something, or with a
  date, time or number ("I got married!", "It was in London."); or two marks of a fact (a
  first-person statement, something done, a name or place, a date, time or number).
Greetings, thanks, reactions ("Wow, that's great!", "Thanks, Mel!"), asides wholly in
parentheses and questions that carry no fact are left out, and so is a sentence an existing
memory already says or its speaker already said earlier in the batch. The summary lists the kept
sentences by priority, then in conversation order, one line per kind and source turn, each
sentence in the speaker's words, at most 600 bytes of a turn (so a long answer does not fill a
record). When they do not all fit the summary limit, what a careful reader would miss most
stays: first every line with its most specific sentence (by the marks of a fact, the P7 kinds
before plain facts; the user's before the assistant's, then the earlier, among equals), then the
lines' other sentences in the same order, so that each statement keeps its gist before any keeps
its detail; what does not fit is left out, and every summary's closing note states this rule.
The title names the speakers and the words the kept sentences are most about. Consolidation
indexes the records of most standing value first (notes, then preferences, corrections,
decisions and plans, then facts), the newest first among equals, each line citing its record as
``[#id]``. It follows the same output contract as a real model, so the whole pipeline (and the
demo) runs without credentials; every summary ends with a note saying it is this heuristic.
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
# A name the sentence addresses: "Hey Mel!", "Yeah Jon, ...", "Wow, Jo, ...", "..., Nate!".
_ADDRESS = re.compile(r"^(?:[A-Za-z]+,? )?[A-Z][\w'’-]*(?=[,!])|, ?[A-Z][\w'’-]*(?=[!.?]*$)")
_ASIDE = re.compile(r"\s*\([^()]*\)[.!?]?\s*")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_CJK_SMALL_TALK = re.compile(
    r"你好|您好|谢谢|多谢|感谢|哈哈|嘿嘿|好的|好吧|再见|拜拜|晚安|早安|早上好|不客气|没关系|没问题|"
    r"太棒了|真棒|加油|是的|对的|当然|[嗯哦啊呀呢吧吗嘛了的]")

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

# Words of small talk (greetings, thanks, praise, agreement, wishes): not content, and not what
# an offline title says a record is about.
PLEASANTRY = frozenset("""
thanks thank appreciate appreciated congrats congratulations welcome cheers bye goodbye luck
wishes wish safe soon chat catch understood noted sharing share awesome cool cute sweet
incredible fantastic wonderful beautiful stunning gorgeous brilliant impressive inspiring
admirable lovely glad proud sorry worries worry yup yep nope haha hahaha lol omg aww awww yay
hug hugs agree agreed indeed true exactly sure pleasure rooting crossed fingers buddy dear hey
hiya
""".split())  # noqa: SIM905 - a word list reads best as prose

LINE_BYTES = 600  # what a line says of its turn at most: a long answer does not fill a record

NOTE = ("(offline heuristic summary: what each speaker stated, the most specific first if not "
        "all fit; not a model's reading)")

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
            return "proposal" if role == "assistant" and kind == "decision" else kind
    return None


def content_words(sentence: str) -> list[str]:
    """The words of a sentence that say what it is about: not stop words, not the words of
    greetings, thanks, praise or agreement, not a name the sentence addresses ("Thanks, Mel!",
    "Yeah Jon, ..."); in Chinese, Japanese or Korean, about one per two characters that are not
    small talk."""
    rest = _ADDRESS.sub(" ", sentence)
    out: list[str] = []
    for word in _WORD.findall(rest):
        if _CJK.search(word):
            chars = _CJK_SMALL_TALK.sub("", "".join(_CJK.findall(word)))
            out.extend(chars[i:i + 2] for i in range(0, len(chars) - 1, 2))
            continue
        key = word.lower().strip("'’-")
        key = key[:-2] if key.endswith(("'s", "’s")) else key
        if len(key) >= 3 and key not in STOP and key not in PLEASANTRY:
            out.append(key)
    return out


def states_something(sentence: str) -> bool:
    """Whether a sentence states something a later conversation may need: two content words
    (one will do in a sentence of three words or more in the first person, or naming someone or
    something, or with a date, time or number: "I got married!", "It was in London."); an aside
    wholly in parentheses ("(laughs)") states nothing, nor does a question unless it also carries
    a fact (a name, a date, something done)."""
    if _ASIDE.fullmatch(sentence):
        return False
    content = len(content_words(sentence))
    if sentence.rstrip().endswith(("?", "？")):
        return content >= 2 and fact_marks(sentence) >= 1
    one_will_do = (_FIRST_PERSON.search(sentence) or _NAME.search(_ADDRESS.sub(" ", sentence))
                   or _TIME.search(sentence))
    return content >= 2 or (content == 1 and bool(one_will_do)
                            and len(_WORD.findall(sentence)) >= 3)


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


def title_for(texts: list[str], speakers: list[str], limit: int,
              skip: frozenset[str] = frozenset()) -> str:
    """What a record of ``texts`` said by (or about) ``speakers`` is about: the speakers and the
    words the texts are most about (never one of ``skip``), or the first text when none stands
    out."""
    who = " and ".join(speakers) if len(speakers) <= 2 else ", ".join(speakers)
    about = keywords(texts, {s.lower() for s in speakers} | skip)
    if not about:
        return _clip(f"{who}: {texts[0]}", limit)
    return _clip(f"{who}: {', '.join(about)}", limit)


@dataclass
class _Said:
    text: str
    score: int       # how much a careful reader would miss it: marks, more for the P7 kinds


@dataclass
class _Line:
    rank: int        # the kind's place in DISPLAY
    kind: str
    source: Source
    said: list[_Said]
    position: int    # conversation order


def _line_text(line: _Line, keep: list[int]) -> str:
    said = " ".join(line.said[i].text for i in sorted(keep))
    return f"- {line.kind}: {line.source.speaker_id}: {said} [{line.source.id}]"


def _fit(lines: list[_Line], budget: int) -> dict[int, list[int]]:
    """Which sentences of which lines fit in ``budget`` bytes, a line saying at most
    LINE_BYTES of its turn. First every line's best sentence, the lines by that sentence's score
    (the user's before the assistant's among equals, then the earlier); then the other sentences
    by score, so that when not all fit each statement keeps its most specific sentence before
    any gets a second, and the least specific go."""
    def best(i: int) -> int:
        return max(range(len(lines[i].said)), key=lambda j: (lines[i].said[j].score, -j))

    def key(i: int, j: int) -> tuple[int, bool, int, int]:
        return (-lines[i].said[j].score, lines[i].source.role != "user", lines[i].position, j)

    chosen: dict[int, list[int]] = {}
    said: dict[int, int] = {}  # line -> the bytes it says
    used = 0
    firsts = sorted(((i, best(i)) for i in range(len(lines))), key=lambda x: key(*x))
    rest = sorted(((i, j) for i in range(len(lines)) for j in range(len(lines[i].said))
                   if j != best(i)), key=lambda x: key(*x))
    for i, j in [*firsts, *rest]:
        size = utf8_len(lines[i].said[j].text)
        if i in chosen:
            cost = size + 1  # joined to its line by a space
            if said[i] + cost > LINE_BYTES:
                continue
        else:
            cost = utf8_len(_line_text(lines[i], [j])) + 1  # a new line and its newline
        if used + cost <= budget:
            chosen.setdefault(i, []).append(j)
            said[i] = said.get(i, -1) + size + 1
            used += cost
    return chosen


def extract(data: ExtractInput, title_bytes: int, summary_bytes: int) -> dict[str, object]:
    order = {k: i for i, k in enumerate(DISPLAY)}
    known = " ".join(e.summary for e in data.existing)
    seen: set[tuple[str, str]] = set()  # (speaker, sentence)
    lines: list[_Line] = []
    for position, src in enumerate(data.sources):
        kept: list[tuple[str, _Said]] = []
        for sentence in _sentences(src.text):
            if sentence in known or (src.speaker_id, sentence) in seen:
                continue  # an existing memory, or the speaker earlier in the batch, said it
            kind = _kind_of(sentence, src.role)
            marks = fact_marks(sentence)
            # Small talk that happens to match a pattern ("See you later!", "Gonna be great!":
            # no content word) is left out; a plan needs one mark of a fact.
            if kind is not None and (marks <= -2 or (kind == "plan" and marks < 1)
                                     or not content_words(sentence)):
                kind = None
            if kind is None and (states_something(sentence) or marks >= 2):
                kind = "fact"
            if kind is not None:
                seen.add((src.speaker_id, sentence))
                bonus = 5 if kind != "fact" else 0
                kept.append((kind, _Said(_clip(sentence, LINE_BYTES), marks + bonus)))
        for kind in dict.fromkeys(k for k, _ in kept):  # one line per kind of the turn
            lines.append(_Line(order[kind], kind, src, [s for k, s in kept if k == kind],
                               position))
    chosen = _fit(lines, summary_bytes - utf8_len(NOTE) - 1)
    if not chosen:
        return {"title": "", "summary": "", "source_ids": [], "reused_ids": []}
    fitting = sorted(chosen, key=lambda i: (lines[i].rank, lines[i].position))
    ids = list(dict.fromkeys(lines[i].source.id for i in fitting))
    speakers = list(dict.fromkeys(lines[i].source.speaker_id for i in fitting))
    texts = [" ".join(lines[i].said[j].text for j in sorted(chosen[i])) for i in fitting]
    title = title_for(texts, speakers, title_bytes, PLEASANTRY)
    summary = "\n".join([*(_line_text(lines[i], chosen[i]) for i in fitting), NOTE])
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
