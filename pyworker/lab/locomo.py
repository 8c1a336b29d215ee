"""LoCoMo conversations, and how ``pimem eval`` feeds them to the memory.

LoCoMo (Maharana et al., ACL 2024) holds long two-person dialogues in sessions; each turn has an
id (``dia_id``, ``D<session>:<turn>``), each session may carry facts a language model wrote about
it (``session_N_observation``: per speaker, ``[fact, dia_id or [dia_id, ...]]``), and ``qa``
lists questions with the turns that answer them (``evidence``) and a category. This module reads
that format (a path; nothing is downloaded) and ingests a conversation through the public API,
session by session, running the real worker after each one. The pieces are functions so other
measurements can reuse them (:func:`prepare`, :func:`ingest_session`, :func:`run_worker`,
:func:`ingest_conversation`)::

    [conv] = locomo.load(Path("../shared/datasets/locomo/conv-26.json"))
    done = locomo.ingest_conversation(Database(dsn), dsn, conv, "group", OfflineAdapter(),
                                      ModelRef(provider="offline", id="heuristic"))
    # done.layout.workspace holds the records; done.per_session the jobs of each session

How a two-person dialogue becomes requests (P2 needs a user and an assistant message in each):

- ``group`` (a linked group chat, topic 1): both people are workspace members talking in a group
  topic where every message is directed at the bot. Each turn is one request by its speaker: the
  turn is the user message, and the bot's reply, which the dataset does not have, is a fixed
  acknowledgement (:data:`ACK`). Records therefore hold both people's statements, attributed.
- ``private`` (a private chat of speaker A): speaker A is the user and speaker B plays the
  assistant. Each exchange (a run of A's turns and the run of B's turns that answers it) is one
  request; B's turns before A's first turn open the first exchange, A's turns after B's last
  turn close the last one.

Message ids are the turn ids, zero-padded so that their order is the conversation's order
(``D1:3`` becomes ``D001:0003``; the batch lists its sources by id). A turn that shares a photo
carries the dataset's caption: ``<text> [shares a photo: <caption>]``. Message times are the
memory clock's, not the dataset's session dates: the clock moves 31 minutes (past the idle
window) after each session; the real months between sessions would let the 30-day pruning of
unused records (T5) remove most records before the questions are asked.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pyworker.adapters.base import Adapter, Reply
from pyworker.db import Database
from pyworker.payload import ModelRef
from pyworker.prompting import Prompt
from pyworker.worker import Worker, WorkerConfig

Variant = Literal["group", "private"]
VARIANTS: tuple[Variant, ...] = ("group", "private")
ACK = "(the bot's reply is not part of the dataset)"
BOT = "eval-bot"
TOPIC = 1
IDLE_MINUTES = 30

_DIA = re.compile(r"D:?(\d+):(\d+)")
_SESSION = re.compile(r"session_(\d+)")


@dataclass(frozen=True)
class Turn:
    dia_id: str          # as the dataset writes it, normalised: D<session>:<turn>
    session: int
    speaker: str
    text: str            # with the photo caption, when the turn shares one

    @property
    def message_id(self) -> str:
        return message_id(self.dia_id)


@dataclass(frozen=True)
class Fact:
    """One ``session_N_observation`` entry: a fact about a speaker and the turns it rests on."""

    speaker: str
    text: str
    dia_ids: tuple[str, ...]


@dataclass(frozen=True)
class Session:
    number: int
    date_time: str
    turns: tuple[Turn, ...]
    facts: tuple[Fact, ...]


@dataclass(frozen=True)
class Question:
    index: int
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]   # normalised dia ids of turns that exist


@dataclass(frozen=True)
class Conversation:
    name: str
    speaker_a: str
    speaker_b: str
    sessions: tuple[Session, ...]
    questions: tuple[Question, ...]
    dropped_evidence: int = 0   # evidence entries that name no turn of the conversation

    @property
    def turns(self) -> list[Turn]:
        return [t for s in self.sessions for t in s.turns]


def dia_ids_in(value: Any) -> list[str]:
    """The turn ids in an evidence value as the dataset writes it: ``"D1:3"``, a list of them,
    ``"D8:6; D9:17"`` or the stray ``"D:11:26"``; anything else yields nothing."""
    items = value if isinstance(value, list) else [value]
    found: list[str] = []
    for item in items:
        for s, t in _DIA.findall(str(item)):
            found.append(f"D{int(s)}:{int(t)}")
    return found


def message_id(dia_id: str) -> str:
    """The message id of a turn: its dia id zero-padded so ids sort in conversation order."""
    s, t = dia_id[1:].split(":")
    return f"D{int(s):03d}:{int(t):04d}"


def load(path: Path) -> list[Conversation]:
    """The conversations of a file in LoCoMo's JSON format: one sample with its keys at the top
    (as in the shared folder), one sample with ``conversation``/``observation``/``qa`` keys, or
    the released list of such samples."""
    raw = json.loads(Path(path).read_text("utf-8"))
    samples = raw if isinstance(raw, list) else [raw]
    stem = Path(path).stem
    return [parse(sample, name=stem if len(samples) == 1 else f"{stem}-{i}")
            for i, sample in enumerate(samples)]


def load_all(paths: Iterable[Path]) -> list[Conversation]:
    """The conversations of the given files; a directory stands for its ``*.json`` files."""
    return [c for p in paths_of(paths) for c in load(p)]


def parse(raw: dict[str, Any], name: str) -> Conversation:
    conv = raw.get("conversation", raw)
    name = str(raw.get("sample_id") or name)
    observations = raw.get("observation", raw)
    sessions: list[Session] = []
    numbers = sorted(int(m.group(1)) for k in conv if (m := _SESSION.fullmatch(k)))
    for n in numbers:
        turns = []
        for item in conv.get(f"session_{n}") or []:
            ids = dia_ids_in(item.get("dia_id"))
            if not ids or not str(item.get("text", "")).strip() and not item.get("blip_caption"):
                continue
            text = str(item.get("text", "")).strip()
            if item.get("blip_caption"):
                text = f"{text} [shares a photo: {item['blip_caption']}]".strip()
            turns.append(Turn(ids[0], n, str(item["speaker"]), text))
        facts = []
        for speaker, entries in (observations.get(f"session_{n}_observation") or {}).items():
            for entry in entries or []:
                if isinstance(entry, list) and len(entry) >= 2:
                    facts.append(Fact(str(speaker), str(entry[0]), tuple(dia_ids_in(entry[1]))))
        if turns:
            sessions.append(Session(n, str(conv.get(f"session_{n}_date_time", "")), tuple(turns),
                                    tuple(facts)))
    known = {t.dia_id for s in sessions for t in s.turns}
    questions = []
    dropped = 0
    for i, q in enumerate(raw.get("qa") or []):
        ids = dia_ids_in(q.get("evidence") or [])
        kept = tuple(dict.fromkeys(d for d in ids if d in known))
        dropped += len(ids) - len(kept)
        answer = q.get("answer", q.get("adversarial_answer", ""))
        questions.append(Question(i, str(q["question"]), str(answer), int(q.get("category", 0)),
                                  kept))
    return Conversation(name, str(conv["speaker_a"]), str(conv["speaker_b"]), tuple(sessions),
                        tuple(questions), dropped)


def paths_of(inputs: Iterable[Path]) -> list[Path]:
    """Files as given; a directory stands for its ``*.json`` files (README and the like are not
    JSON)."""
    found: list[Path] = []
    for p in inputs:
        found.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    return found


# Ingestion ------------------------------------------------------------------------------------


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "speaker"


@dataclass
class Layout:
    """Where one conversation lives in the memory, and who asks the questions."""

    workspace: str
    variant: Variant
    chat: str
    topic: int
    user_a: str
    user_b: str
    model: ModelRef
    asker: str = ""
    requests: int = 0
    messages: int = 0

    def __post_init__(self) -> None:
        self.asker = self.asker or self.user_a

    def speaker_of(self, conv: Conversation, speaker: str) -> str:
        return self.user_a if speaker == conv.speaker_a else self.user_b


def prepare(db: Database, conv: Conversation, variant: Variant, model: ModelRef, *,
            workspace: str | None = None, budget_usd: float = 1000.0) -> Layout:
    """Reports the conversation's workspace, its two members, the bot and the chat through the
    ingest API (removing an earlier copy of the workspace first)."""
    ws = workspace or f"locomo-{slug(conv.name)}-{variant}"
    from pyworker import errors

    try:
        db.call("delete_workspace", ws)
    except errors.NotFound:
        pass
    user_a, user_b = slug(conv.speaker_a), slug(conv.speaker_b)
    if user_a == user_b:
        user_b += "-b"
    db.call("upsert_workspace", ws, 1, budget_usd, 0.0, IDLE_MINUTES)
    db.call("upsert_member", ws, user_a, "owner", True)
    db.call("upsert_member", ws, user_b, "member", True)
    db.call("upsert_bot", ws, BOT, f"eval:{BOT}", True)
    if variant == "group":
        chat = f"group-{slug(conv.name)}"
        db.call("upsert_chat", ws, chat, "group", None, True)
        db.call("upsert_topic", ws, chat, TOPIC, f"{conv.speaker_a} and {conv.speaker_b}")
        topic = TOPIC
    else:
        chat = f"dm-{user_a}"
        db.call("upsert_chat", ws, chat, "private", user_a, True)
        topic = 0
    return Layout(ws, variant, chat, topic, user_a, user_b, model)


def _request(db: Database, layout: Layout, request_id: str, user: str, status: str) -> None:
    db.call("upsert_request", layout.workspace, request_id, BOT, layout.chat, layout.topic, user,
            "interactive", status, layout.model.provider, layout.model.id, 50.0, 0.0)
    layout.requests += status == "running"  # reported running, then succeeded


def _message(db: Database, layout: Layout, mid: str, request_id: str, role: str, speaker: str,
             text: str) -> None:
    db.call("upsert_message", layout.workspace, mid, request_id, role, speaker, text, True)
    layout.messages += 1


def exchanges(conv: Conversation, session: Session) -> list[list[Turn]]:
    """The private variant's requests: runs of A's turns each with the run of B's turns that
    answers it (leading B turns join the first, trailing A turns the last)."""
    groups: list[list[Turn]] = []
    current: list[Turn] = []
    answered = False
    for turn in session.turns:
        is_a = turn.speaker == conv.speaker_a
        if is_a and answered:
            groups.append(current)
            current, answered = [], False
        current.append(turn)
        if not is_a and any(t.speaker == conv.speaker_a for t in current):
            answered = True
    if current:
        if groups and not answered:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def ingest_session(db: Database, layout: Layout, conv: Conversation, session: Session) -> None:
    """Reports one session's requests and messages, each request finished (succeeded)."""
    if layout.variant == "group":
        for turn in session.turns:
            rid = f"r-{turn.message_id}"
            user = layout.speaker_of(conv, turn.speaker)
            _request(db, layout, rid, user, "running")
            _message(db, layout, turn.message_id, rid, "user", user, turn.text)
            _message(db, layout, f"{turn.message_id}/ack", rid, "assistant", BOT, ACK)
            _request(db, layout, rid, user, "succeeded")
        return
    for group in exchanges(conv, session):
        rid = f"r-{group[0].message_id}"
        _request(db, layout, rid, layout.user_a, "running")
        for turn in group:
            if turn.speaker == conv.speaker_a:
                _message(db, layout, turn.message_id, rid, "user", layout.user_a, turn.text)
            else:
                _message(db, layout, turn.message_id, rid, "assistant", BOT, turn.text)
        _request(db, layout, rid, layout.user_a, "succeeded")


class _Borrowed:
    """Lends an adapter to a Worker, which closes its adapter when it stops: the eval keeps one
    adapter (one Pi process) for all sessions and closes it itself."""

    def __init__(self, inner: Adapter) -> None:
        self.inner = inner
        self.name = inner.name

    def reserve_usd(self, model: ModelRef, prompt: Prompt) -> Any:
        return self.inner.reserve_usd(model, prompt)

    def complete(self, model: ModelRef, prompt: Prompt, *, deadline: float,
                 cancel: Any) -> Reply:
        return self.inner.complete(model, prompt, deadline=deadline, cancel=cancel)

    def close(self) -> None:
        pass


@dataclass
class WorkerRun:
    jobs: int
    seconds: float


def run_worker(dsn: str, adapter: Adapter, workspace: str, *,
               tick_seconds: float = 90.0) -> WorkerRun:
    """The real worker (maintenance of this workspace, claim, model call, checkpoint, commit)
    until no job is left; the adapter stays open."""
    began = time.monotonic()
    worker = Worker(WorkerConfig(dsn=dsn, interval=0, tick_seconds=tick_seconds,
                                 workspace_id=workspace),
                    _Borrowed(adapter), db=Database(dsn, application_name="pimem-eval-worker"))
    worker.run(until_idle=True)
    return WorkerRun(worker.jobs_done, time.monotonic() - began)


@dataclass
class Ingested:
    layout: Layout
    sessions: int = 0
    jobs: int = 0
    ingest_seconds: float = 0.0
    worker_seconds: float = 0.0
    per_session: list[dict[str, Any]] = field(default_factory=list)


def ingest_conversation(db: Database, dsn: str, conv: Conversation, variant: Variant,
                        adapter: Adapter, model: ModelRef, *,
                        on_session: Callable[[Session], None] | None = None,
                        workspace: str | None = None) -> Ingested:
    """The whole conversation, session by session: report the session, move the memory clock
    past the idle window, run the worker until it is idle. Needs a superuser connection (the
    clock)."""
    layout = prepare(db, conv, variant, model, workspace=workspace)
    out = Ingested(layout)
    for session in conv.sessions:
        began = time.monotonic()
        ingest_session(db, layout, conv, session)
        out.ingest_seconds += time.monotonic() - began
        db.advance_clock(f"{IDLE_MINUTES + 1} minutes")
        run = run_worker(dsn, adapter, layout.workspace)
        out.sessions += 1
        out.jobs += run.jobs
        out.worker_seconds += run.seconds
        out.per_session.append({"session": session.number, "turns": len(session.turns),
                                "jobs": run.jobs, "worker_seconds": round(run.seconds, 3)})
        if on_session is not None:
            on_session(session)
    return out


def facts_by_message(conv: Conversation) -> dict[str, list[Fact]]:
    """The dataset's session facts keyed by the message id of each turn of their session they
    rest on, for the replay adapter (a fact resting on several turns is listed under each).
    Message ids repeat across conversations: one replay adapter serves one conversation."""
    out: dict[str, list[Fact]] = {}
    for session in conv.sessions:
        for fact in session.facts:
            # Under the turns of its own session: a fact of session 2 that also names a turn of
            # session 1 is not known while session 1 is extracted.
            own = [d for d in fact.dia_ids if d.startswith(f"D{session.number}:")]
            for d in own or fact.dia_ids:
                out.setdefault(message_id(d), []).append(fact)
    return out
