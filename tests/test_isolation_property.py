"""Isolation, property-based (V1-V4, C5-C7): random sequences of ingest, extraction commits,
notes, forgets, toggles and membership/grant changes across three workspaces, two bots,
private chats and group topics. After every step every read function is asked from every
request, and any answer that names a record, source or speaker outside that request's scope
fails the run.

Profiles: PIMEM_HYPOTHESIS_PROFILE=ci (default, quick) or =release (long; docs/reliability.md).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.records import make_record
from tests.shared_db import SharedDatabase

settings.register_profile("ci", max_examples=25, stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=False)
settings.register_profile("release", max_examples=300, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("PIMEM_HYPOTHESIS_PROFILE", "ci"))

WORKSPACES = ("w0", "w1", "w2")
BOTS = ("bot1", "bot2")
USERS = ("alice", "bob", "carol")
PLACES = ("dm", "grp/0", "grp/5")


@dataclass
class Model:
    """What the test knows it created, keyed by scope."""

    counters: dict[str, itertools.count] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # ws, request, scope key
    messages: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    speakers: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    records: dict[int, str] = field(default_factory=dict)  # record id -> scope key
    calls: itertools.count = field(default_factory=itertools.count)

    def next_id(self, ws: str) -> int:
        return next(self.counters.setdefault(ws, itertools.count(1)))


def scope_key(ws: str, bot: str, place: str, user: str) -> str:
    if place == "dm":
        return f"{ws}|{bot}|dm-{user}|{user}"
    return f"{ws}|{bot}|grp|{place.split('/')[1]}"


def setup_world(conn: psycopg.Connection) -> None:
    w = World(conn)
    for ws in WORKSPACES:
        w.workspace(ws)
        for i, user in enumerate(USERS):
            w.member(ws, user, "owner" if i == 0 else "member")
            w.private_chat(ws, f"dm-{user}", user)
            w.grant(ws, user, "repo")
        for bot in BOTS:
            w.bot(ws, bot)
        w.group_chat(ws, "grp")
        w.topic(ws, "grp", 5)


def converse(conn: psycopg.Connection, m: Model, ws: str, bot: str, place: str, user: str,
             text: str, repo: bool) -> tuple[str, str]:
    w = World(conn)
    key = scope_key(ws, bot, place, user)
    n = m.next_id(ws)
    request = f"r{n}"  # request ids repeat across workspaces on purpose
    chat, topic = ("dm-" + user, 0) if place == "dm" else ("grp", int(place.split("/")[1]))
    w.request(ws, request, chat=chat, user=user, bot=bot, topic=topic)
    umsg, amsg = f"{key}|m{n}u", f"{key}|m{n}a"
    w.message(ws, umsg, request, "user", user, f"{text} [{key}]",
              repositories=["repo"] if repo else [])
    w.message(ws, amsg, request, "assistant", bot, f"ok [{key}]")
    m.requests.append((ws, request, key))
    m.messages[key] += [umsg, amsg]
    m.speakers[key] |= {user, bot}
    return request, umsg


def check_every_read(conn: psycopg.Connection, m: Model) -> None:
    for ws, request, key in m.requests:
        answers = []
        q = conn.execute("select memory.query_memories(%s, %s, %s, %s)",
                         (ws, request, f"c{next(m.calls)}", Jsonb({}))).fetchone()
        assert q is not None
        answers.append(q[0])
        r = conn.execute("select memory.recall(%s, %s)", (ws, request)).fetchone()
        assert r is not None
        answers.append(r[0])
        for answer in answers:
            for record in answer.get("records") or []:
                rid = int(record["id"])
                assert m.records.get(rid) == key, (
                    f"{ws}/{request} in {key} was shown record {rid} of {m.records.get(rid)}")
                for source in record.get("source_ids", []):
                    assert source.startswith(key + "|"), (
                        f"{ws}/{request} in {key} was shown source {source}")
                for speaker in record.get("speaker_ids", []):
                    assert speaker in m.speakers[key], (
                        f"{ws}/{request} in {key} was shown speaker {speaker}")
            text = json.dumps(answer, ensure_ascii=False)
            for other in m.speakers:
                if other != key:
                    assert f"[{other}]" not in text, f"{key} saw text of {other}"
        cited = conn.execute("select message_id from memory.request_citations(%s, %s)",
                             (ws, request)).fetchall()
        for (message_id,) in cited:
            assert message_id.startswith(key + "|"), f"{key} may cite {message_id}"


ws_st = st.sampled_from(WORKSPACES)
step_st = st.one_of(
    st.tuples(st.just("converse"), ws_st, st.sampled_from(BOTS), st.sampled_from(PLACES),
              st.sampled_from(USERS), st.booleans()),
    st.tuples(st.just("extract"), st.integers(0, 10_000), st.integers(1, 3)),
    st.tuples(st.just("remember"), ws_st, st.sampled_from(BOTS), st.sampled_from(PLACES),
              st.sampled_from(USERS)),
    st.tuples(st.just("forget"), st.integers(0, 10_000), st.integers(0, 10_000)),
    st.tuples(st.just("toggle"), st.integers(0, 10_000), st.booleans()),
    st.tuples(st.just("member"), ws_st, st.sampled_from(USERS), st.booleans()),
    st.tuples(st.just("grant"), ws_st, st.sampled_from(USERS), st.booleans()),
)


def apply_step(conn: psycopg.Connection, m: Model, step: tuple) -> None:  # type: ignore[type-arg]
    kind = step[0]
    if kind == "converse":
        _, ws, bot, place, user, repo = step
        converse(conn, m, ws, bot, place, user, "we decided to ship on friday", repo)
    elif kind == "extract" and m.requests:
        _, pick, size = step
        ws, request, key = m.requests[pick % len(m.requests)]
        sources = m.messages[key][-2 * size:]
        rid = make_record(conn, ws, request, sources, title="decision",
                          summary=f"shipping decided [{key}]")
        m.records[rid] = key
    elif kind == "remember":
        _, ws, bot, place, user = step
        request, umsg = converse(conn, m, ws, bot, place, user, "remember that I like tea", False)
        out = conn.execute("select memory.manage_memory(%s, %s, %s, %s)",
                           (ws, request, "rem", Jsonb({"action": "remember", "sourceId": umsg}))
                           ).fetchone()
        assert out is not None
        if out[0].get("status") == "done" and out[0].get("memory_id"):
            m.records[int(out[0]["memory_id"])] = scope_key(ws, bot, place, user)
    elif kind == "forget" and m.requests and m.records:
        _, pick, rpick = step
        ws, request, key = m.requests[pick % len(m.requests)]
        target = sorted(m.records)[rpick % len(m.records)]
        # The forget needs a direct request in the current human message.
        n = m.next_id(ws)
        bot, chat_part = key.split("|")[1], key.split("|")[2]
        user = key.split("|")[3] if chat_part.startswith("dm-") else "alice"
        place = "dm" if chat_part.startswith("dm-") else f"grp/{key.split('|')[3]}"
        del n
        req2, umsg = converse(conn, m, ws, bot, place, user, "please forget that", False)
        before = conn.execute("select count(*) from memory_private.records where record_id = %s",
                              (target,)).fetchone()
        conn.execute("select memory.manage_memory(%s, %s, %s, %s)",
                     (ws, req2, "fg", Jsonb({"action": "forget", "sourceId": umsg,
                                             "memoryId": target})))
        after = conn.execute("select count(*) from memory_private.records where record_id = %s",
                             (target,)).fetchone()
        if m.records[target] != key:
            assert before == after, f"a forget from {key} deleted record {target} of another scope"
    elif kind == "toggle" and m.requests:
        _, pick, on = step
        ws, request, key = m.requests[pick % len(m.requests)]
        bot, chat_part = key.split("|")[1], key.split("|")[2]
        user = key.split("|")[3] if chat_part.startswith("dm-") else "alice"
        place = "dm" if chat_part.startswith("dm-") else f"grp/{key.split('|')[3]}"
        phrase = "turn on memory" if on else "turn off memory"
        req2, umsg = converse(conn, m, ws, bot, place, user, phrase, False)
        conn.execute("select memory.manage_memory(%s, %s, %s, %s)",
                     (ws, req2, "tg", Jsonb({"action": "enable-memory" if on else "disable-memory",
                                             "sourceId": umsg})))
    elif kind == "member":
        _, ws, user, active = step
        World(conn).member(ws, user, "owner" if user == "alice" else "member", active)
    elif kind == "grant":
        _, ws, user, granted = step
        World(conn).grant(ws, user, "repo", granted)


@pytest.mark.slow  # the hypothesis profile
@given(steps=st.lists(step_st, min_size=3, max_size=25))
def test_no_read_ever_shows_another_scopes_memory(shared_db: SharedDatabase,
                                                  steps: list[tuple]) -> None:  # type: ignore[type-arg]
    # Every example starts from the state of a fresh clone: the worker's shared database,
    # reset after each example as after every test (tests/shared_db.py).
    conn = shared_db.connection()
    try:
        setup_world(conn)
        m = Model()
        for step in steps:
            apply_step(conn, m, step)
            check_every_read(conn, m)
    finally:
        assert shared_db.reset() is None
