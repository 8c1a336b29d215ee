"""Provenance: a record depends on everything its model call was shown.

Sources (what the output cites, in summary order) and dependencies (the whole batch and what the
memories shown with it rest on) are kept apart; the index depends on every candidate it was
built from; retention and derived answers follow every dependency of every record a request was
shown; after the sweep nothing made from an erased message is left in any table.
tests/test_shown_dependencies.py holds the attacks the rule answers."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from pyworker.adapters.base import Reply
from pyworker.payload import Usage
from pyworker.prompting import Prompt
from pyworker.worker import Worker, WorkerConfig
from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    consolidation_of,
    maintenance,
    start,
)
from tests.records import make_record, scope_of, sweep

SECRET = "zebra-umbrella-42"


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


def recall(conn: psycopg.Connection, ws: str, request: str) -> dict[str, Any]:
    return dict(value(conn, "select memory.recall(%s, %s)", ws, request))


def query(conn: psycopg.Connection, ws: str, request: str, call: str,
          args: dict[str, Any]) -> dict[str, Any]:
    return dict(value(conn, "select memory.query_memories(%s, %s, %s, %s::jsonb)", ws, request,
                      call, psycopg.types.json.Jsonb(args)))


def citations(conn: psycopg.Connection, ws: str, request: str) -> list[str]:
    return [r[0] for r in conn.execute("select message_id from memory.request_citations(%s, %s)",
                                       (ws, request))]


def boundary(conn: psycopg.Connection, ws: str, request: str) -> datetime | None:
    return value(conn, "select memory.answer_retention_boundary(%s, %s)", ws, request)  # type: ignore[no-any-return]


def extract(conn: psycopg.Connection, output: dict[str, Any]) -> dict[str, Any]:
    """Maintenance, claim the extraction, and commit ``output`` (ids checked by the database)."""
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None and job["phase"] == "extract", job
    start(conn, job)
    checkpoint(conn, job, output)
    return commit(conn, job)


def consolidate(conn: psycopg.Connection, record_ids: list[int],
                index: str = "the index") -> dict[str, Any]:
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None and job["phase"] == "consolidate", job
    start(conn, job)
    checkpoint(conn, job, {**consolidation_of(job, index), "record_ids": record_ids})
    return commit(conn, job)


def deps(conn: psycopg.Connection, record_id: int) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(
        "select message_id, via from memory_private.record_dependencies where record_id = %s "
        "order by 1", (record_id,))]


# Extraction: sources and dependencies ------------------------------------------------------


def test_a_source_is_a_cited_dependency_with_a_place_and_nothing_else_has_one(
        conn: psycopg.Connection) -> None:
    """record_sources lists the cited dependencies by their place; the database refuses a cited
    dependency without a place and a place on another dependency."""
    w = World(conn)
    w.basic()
    u, a = w.conversation("ws1", "h1", chat="dm-alice", user="alice")
    rec = make_record(conn, "ws1", "h1", [a, u])
    assert conn.execute("select message_id, position from memory_private.record_sources "
                        "where record_id = %s order by position", (rec,)).fetchall() == [
        (a, 1), (u, 2)]
    for change in ("position = null", "via = 'reused'", "position = 0"):
        with pytest.raises(psycopg.errors.IntegrityError), conn.transaction():
            conn.execute(f"update memory_private.record_dependencies set {change} "
                         "where record_id = %s and message_id = 'h1-u'", (rec,))
    assert deps(conn, rec) == [("h1-a", "cited"), ("h1-u", "cited")]


def test_speakers_and_threads_come_from_the_sources_and_grants_from_everything_shown(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="grp", user="alice", thread="t-1")
    w.message("ws1", "a1", "r1", "user", "alice", "Deploy on Friday.", repositories=["repo-a"])
    w.message("ws1", "a2", "r1", "assistant", "bot1", "ok")
    w.request("ws1", "r2", chat="grp", user="bob", thread="t-2")
    w.message("ws1", "b1", "r2", "user", "bob", "Secret plans in repo-b.",
              repositories=["repo-b"])
    w.message("ws1", "b2", "r2", "assistant", "bot1", "ok")
    advance(conn, "31 minutes")
    result = extract(conn, {"title": "Deploy day", "summary": "Alice: deploy on Friday.",
                            "source_ids": ["a1", "a2"]})
    row = conn.execute("select speaker_ids, thread_ids, repositories from memory_private.records "
                       "where record_id = %s", (result["record_id"],)).fetchone()
    # The record says who said what it cites; but the model saw bob's message, so a reader who
    # may not read repo-b may not read the record, and bob's words may be in it.
    assert row == (["alice"], ["t-1"], ["repo-a", "repo-b"])
    assert deps(conn, result["record_id"]) == [("a1", "cited"), ("a2", "cited"),
                                               ("b1", "shown"), ("b2", "shown")]
    assert (result["dependencies"], result["shown"], result["inherited"]) == (4, 2, 0)
    owners = {r[0] for r in conn.execute(
        "select owner_id from memory_private.record_owners('ws1', array[%s]::bigint[])",
        (result["record_id"],))}
    assert owners == {"alice", "bob"}, "forget's authority counts everyone whose words it saw"


# The index depends on every candidate ------------------------------------------------------


def index_world(conn: psycopg.Connection) -> tuple[World, int, int]:
    """A group topic with two records: ``named`` (the index names it) and ``other`` (a
    candidate the index does not name, drawing on repo-x, which only alice may read)."""
    w = World(conn)
    w.basic(users=("alice", "bob", "carol"))
    w.grant("ws1", "alice", "repo-x")
    w.request("ws1", "r1", chat="grp", user="alice")
    w.message("ws1", "n1", "r1", "user", "alice", "We ship the mobile app on Friday.")
    w.message("ws1", "n2", "r1", "assistant", "bot1", "Noted.")
    advance(conn, "31 minutes")
    named = extract(conn, {"title": "Ship day", "summary": "Ship on Friday.",
                           "source_ids": ["n1", "n2"]})["record_id"]
    consolidate(conn, [named])
    w.request("ws1", "r2", chat="grp", user="alice")
    w.message("ws1", "o1", "r2", "user", "alice", "The repo-x incident is still open.",
              repositories=["repo-x"])
    w.message("ws1", "o2", "r2", "assistant", "bot1", "Noted.")
    advance(conn, "31 minutes")
    other = extract(conn, {"title": "Incident", "summary": "The repo-x incident is open.",
                           "source_ids": ["o1", "o2"]})["record_id"]
    result = consolidate(conn, [named], f"Ship day is Friday [#{named}]")
    assert result["index_candidates"] == 2 and result["index_record_ids"] == [named]
    assert sorted(value(conn, "select candidate_ids from memory_private.scope_indexes")) \
        == sorted([named, other])
    return w, named, other


def test_a_reader_who_may_not_read_a_candidate_gets_the_directory_not_the_index(
        conn: psycopg.Connection) -> None:
    w, named, other = index_world(conn)
    w.request("ws1", "qa", chat="grp", user="alice", status="running")
    w.request("ws1", "qb", chat="grp", user="bob", status="running")
    alice = recall(conn, "ws1", "qa")
    assert alice["mode"] == "index" and alice["index"].startswith("Ship day")
    bob = recall(conn, "ws1", "qb")
    assert bob["mode"] == "directory" and "index" not in bob, \
        "the index text may speak of the repo-x record bob may not read"
    assert [r["id"] for r in bob["records"]] == [named]
    assert other not in [r["id"] for r in bob["records"]]


@pytest.mark.parametrize("change", ["edit", "remove", "expire", "grant", "forget"])
def test_a_change_to_a_candidate_the_index_does_not_name_withdraws_the_frozen_index(
        conn: psycopg.Connection, change: str) -> None:
    w, named, other = index_world(conn)
    w.request("ws1", "qa", chat="grp", user="alice", status="running")
    assert recall(conn, "ws1", "qa")["index"] is not None
    if change == "edit":
        w.message("ws1", "o1", "r2", "user", "alice", "The repo-x incident is closed.",
                  repositories=["repo-x"])
    elif change == "remove":
        w.remove("ws1", "o1")
    elif change == "expire":
        soon = datetime.now(UTC) + timedelta(hours=1)
        w.message("ws1", "o2", "r2", "assistant", "bot1", "Noted.", retain_until=soon)
        advance(conn, "2 hours")
    elif change == "grant":
        w.grant("ws1", "alice", "repo-x", granted=False)
    else:
        w.request("ws1", "f1", chat="grp", user="alice", status="running")
        w.message("ws1", "f1-u", "f1", "user", "alice", "Please forget the incident.")
        out = value(conn, "select memory.manage_memory('ws1', 'f1', 'c1', %s::jsonb)",
                    psycopg.types.json.Jsonb({"action": "forget", "sourceId": "f1-u",
                                              "memoryId": other}))
        assert out["status"] == "done", out
        assert value(conn, "select index_text from memory_private.request_recall "
                           "where request_id = 'qa'") is None, "the frozen text is erased"
    again = recall(conn, "ws1", "qa")
    assert again["mode"] == "index" and again["index"] is None and again["index_withdrawn"]
    assert [r["id"] for r in again["records"]] == [named], "the named record is still fine"


# Forget within its authority ---------------------------------------------------------------


def test_forget_tombstones_what_the_selected_record_was_made_from_and_only_that(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    msgs = {}
    for key, text in (("a", "I like tea"), ("b", "I like jazz"), ("c", "I like cats")):
        msgs[key], _ = w.conversation("ws1", f"h{key}", chat="dm-alice", user="alice",
                                      user_text=text)
    base = make_record(conn, "ws1", "ha", [msgs["a"]])
    # ``reuser`` cites b and declared it reused ``base`` (so it depends on a too).
    reuser = make_record(conn, "ws1", "hb", [msgs["b"]], reused=[msgs["a"]])
    cats = make_record(conn, "ws1", "hc", [msgs["c"], msgs["b"]])
    w.request("ws1", "f", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "f-u", "f", "user", "alice", "forget what you know about jazz")
    out = value(conn, "select memory.manage_memory('ws1', 'f', 'c1', %s::jsonb)",
                psycopg.types.json.Jsonb({"action": "forget", "sourceId": "f-u",
                                          "memoryId": reuser}))
    assert out["status"] == "done"
    assert sorted(out["forgotten_ids"]) == sorted([base, reuser, cats]), \
        "every record sharing a dependency with the selected one"
    assert out["forgotten_by_person"] == {"alice": 3}
    tombstoned = sorted(r[0] for r in conn.execute("select message_id from memory_private.tombstones"))
    assert tombstoned == sorted([msgs["a"], msgs["b"]]), \
        "the selected record's dependencies; cats' other message may be extracted again"


def test_a_participant_is_refused_with_nothing_changed_when_a_neighbour_holds_another_persons_words(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    a, _ = w.conversation("ws1", "ga", chat="grp", user="bob", user_text="bob's plan")
    # The bot's answer in alice's request is alice's conversation.
    w.request("ws1", "gb", chat="grp", user="alice")
    w.message("ws1", "gb-a", "gb", "assistant", "bot1", "alice's answer")
    own = make_record(conn, "ws1", "ga", [a])
    shared = make_record(conn, "ws1", "gb", ["gb-a", a])
    w.request("ws1", "f", chat="grp", user="bob", status="running")
    w.message("ws1", "f-u", "f", "user", "bob", "please forget my plan")
    before = value(conn, "select count(*) from memory_private.records")
    out = value(conn, "select memory.manage_memory('ws1', 'f', 'c1', %s::jsonb)",
                psycopg.types.json.Jsonb({"action": "forget", "sourceId": "f-u",
                                          "memoryId": own}))
    assert (out["status"], out["code"]) == ("refused", "not_allowed")
    assert "owner or admin" in out["reason"] and "1 related" in out["reason"]
    assert value(conn, "select count(*) from memory_private.records") == before
    assert value(conn, "select count(*) from memory_private.tombstones") == 0
    assert shared


# Retention follows provenance --------------------------------------------------------------


def test_the_answer_boundary_follows_every_dependency_of_the_records_shown(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "h", chat="dm-alice", user="alice")
    base = datetime(2031, 1, 1, tzinfo=UTC)
    ids = []
    for i in range(25):  # the 25th source is the one retained the shortest
        mid = f"h-{i:02d}"
        w.message("ws1", mid, "h", "user", "alice", f"fact {i}",
                  retain_until=base + timedelta(days=60 - i))
        ids.append(mid)
    w.request("ws1", "old", chat="dm-alice", user="alice")
    w.message("ws1", "old-u", "old", "user", "alice", "an old fact",
              retain_until=base - timedelta(days=5))
    wide = make_record(conn, "ws1", "h", ids)
    reusing = make_record(conn, "ws1", "h", ["h-00"], reused=["old-u"])

    w.request("ws1", "q1", chat="dm-alice", user="alice", status="running")
    shown = query(conn, "ws1", "q1", "c1", {"id": wide})["records"][0]
    assert shown["source_ids"] == ids[:20] and shown["sources_overflow"] == 5
    assert citations(conn, "ws1", "q1") == ids[:20], "citations are the sources shown"
    assert boundary(conn, "ws1", "q1") == base + timedelta(days=36), "not only the 20 shown"

    w.request("ws1", "q2", chat="dm-alice", user="alice", status="running")
    query(conn, "ws1", "q2", "c1", {"id": reusing})
    assert citations(conn, "ws1", "q2") == ["h-00"]
    assert boundary(conn, "ws1", "q2") == base - timedelta(days=5), "the reused dependency counts"

    w.request("ws1", "q3", chat="dm-alice", user="alice", status="running")
    assert recall(conn, "ws1", "q3")["mode"] == "directory"
    assert boundary(conn, "ws1", "q3") == base - timedelta(days=5), "what recall showed counts"


def test_an_answer_is_erased_when_a_record_behind_its_index_loses_a_dependency(
        conn: psycopg.Connection) -> None:
    w, _named, _other = index_world(conn)
    w.request("ws1", "qa", chat="grp", user="alice", status="running")
    assert recall(conn, "ws1", "qa")["mode"] == "index"
    w.message("ws1", "qa-a", "qa", "assistant", "bot1", "Answer drawing on the index.")
    w.request("ws1", "qn", chat="grp", user="alice", status="running")
    w.message("ws1", "qn-a", "qn", "assistant", "bot1", "Answer drawing on nothing.")
    w.remove("ws1", "o1")  # a dependency of the candidate the index does not name
    counts = sweep(conn, "ws1")
    assert counts["answers_erased"] == 1
    assert conn.execute("select message_id, body, removal_reason from memory_private.messages "
                        "where message_id in ('qa-a', 'qn-a') order by 1").fetchall() == [
        ("qa-a", None, "derived_from_removed"), ("qn-a", "Answer drawing on nothing.", None)]


def test_a_record_losing_a_dependency_is_purged_even_while_recall_is_off(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, _ = w.conversation("ws1", "h", chat="dm-alice", user="alice", user_text="a fact")
    record = make_record(conn, "ws1", "h", [u])
    conn.execute("update memory_private.scopes set recall_enabled = false")
    w.remove("ws1", u)
    assert sweep(conn, "ws1")["records_invalidated"] == 1
    assert value(conn, "select count(*) from memory_private.records where record_id = %s",
                 record) == 0


def test_citations_lost_to_a_bot_change_do_not_come_back_when_the_records_are_purged(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, a = w.conversation("ws1", "h", chat="dm-alice", user="alice", user_text="a fact")
    make_record(conn, "ws1", "h", [u, a])
    w.request("ws1", "q", chat="dm-alice", user="alice", status="running")
    query(conn, "ws1", "q", "c1", {})
    assert citations(conn, "ws1", "q") == sorted([u, a])
    w.bot("ws1", "bot1", identity="a-new-identity")
    assert citations(conn, "ws1", "q") == []
    assert sweep(conn, "ws1")["records_invalidated"] == 1
    assert citations(conn, "ws1", "q") == [], "a purged record authorizes nothing"


def rows_holding(conn: psycopg.Connection, needle: str) -> dict[str, int]:
    """How many rows of each memory_private table hold ``needle`` anywhere (any column)."""
    found = {}
    tables = [r[0] for r in conn.execute(
        "select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace "
        "where n.nspname = 'memory_private' and c.relkind = 'r' order by 1")]
    for table in tables:
        n = value(conn, f"select count(*) from memory_private.{table} t "
                        "where strpos(t::text, %s) > 0", needle)
        if n:
            found[table] = n
    return found


def secret_world(conn: psycopg.Connection) -> World:
    """alice told the bot a secret in r1 (retained one day); it became a record and the index;
    request q1 recalled the index, queried the record and answered with the secret."""
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    soon = datetime.now(UTC) + timedelta(days=1)
    w.message("ws1", "r1-u", "r1", "user", "alice", f"My locker code is {SECRET}.",
              retain_until=soon)
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted.")
    advance(conn, "31 minutes")
    record = extract(conn, {"title": f"Locker code {SECRET}",
                            "summary": f"Alice's locker code is {SECRET}.",
                            "source_ids": ["r1-u", "r1-a"]})["record_id"]
    consolidate(conn, [record], f"[#{record}] locker code {SECRET}")
    w.request("ws1", "q1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "q1-u", "q1", "user", "alice", "What is my locker code?")
    assert SECRET in recall(conn, "ws1", "q1")["index"]
    assert query(conn, "ws1", "q1", "c1", {"query": "locker"})["count"] == 1
    w.message("ws1", "q1-a", "q1", "assistant", "bot1", f"It is {SECRET}.")
    return w


def test_after_the_sweep_nothing_made_from_an_expired_message_is_left_anywhere(
        conn: psycopg.Connection) -> None:
    secret_world(conn)
    digest = value(conn, "select content_hash from memory_private.messages "
                         "where message_id = 'r1-u'")
    assert set(rows_holding(conn, SECRET)) >= {"messages", "records", "scope_indexes",
                                              "request_recall"}
    assert set(rows_holding(conn, digest)) >= {"messages", "record_dependencies", "jobs",
                                              "extracted_sources"}
    advance(conn, "2 days")
    counts = sweep(conn, "ws1")
    assert counts["messages_expired"] == 1 and counts["answers_erased"] == 1
    assert rows_holding(conn, SECRET) == {}
    assert rows_holding(conn, digest) == {}
    assert boundary(conn, "ws1", "q1") is not None, "the provenance (ids only) is kept"
    assert value(conn, "select count(*) from memory_private.tombstones "
                       "where message_id = 'r1-u'") == 0


def test_a_checkpoint_made_from_a_removed_message_is_scrubbed_and_never_committed(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    w.message("ws1", "r1-u", "r1", "user", "alice", f"My locker code is {SECRET}.")
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "Noted.")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    checkpoint(conn, job, {"title": "Locker", "summary": f"The code is {SECRET}.",
                           "source_ids": ["r1-u"]})
    digest = value(conn, "select content_hash from memory_private.messages "
                         "where message_id = 'r1-u'")
    w.remove("ws1", "r1-u")
    sweep(conn, "ws1")
    assert rows_holding(conn, SECRET) == {} and rows_holding(conn, digest) == {}
    with pytest.raises(psycopg.Error) as err:
        commit(conn, job)
    assert err.value.sqlstate == "MB021"
    assert value(conn, "select count(*) from memory_private.records") == 0


def test_a_checkpoint_of_an_input_that_changed_during_the_call_is_refused(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer coffee")  # edited meanwhile
    with pytest.raises(psycopg.Error) as err:
        checkpoint(conn, job, {"title": "Tea", "summary": "Alice prefers tea.",
                               "source_ids": ["r1-u"]})
    assert err.value.sqlstate == "MB021"
    assert value(conn, "select checkpoint is null from memory_private.jobs "
                       "where job_id = %s", job["job_id"])


class EditsDuringTheCall:
    """An adapter whose call edits a source of the batch (another backend write) and then
    answers validly: what a real model call racing an edit looks like to the worker."""

    name = "edits-during-the-call"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def reserve_usd(self, model: Any, prompt: Prompt) -> Decimal:
        return Decimal("0.01")

    def complete(self, model: Any, prompt: Prompt, *, deadline: float,
                 cancel: threading.Event) -> Reply:
        with psycopg.connect(self.dsn, autocommit=True) as other:
            World(other).message("ws1", "r1-u", "r1", "user", "alice", "I prefer coffee")
        return Reply(text='{"title": "Tea", "summary": "Alice prefers tea.", '
                          '"source_ids": ["r1-u"]}',
                     usage=Usage(input_tokens=10, output_tokens=5, cost_usd=Decimal("0.002")))

    def close(self) -> None:
        pass


def test_the_worker_reports_an_input_changed_during_the_call_as_failed_and_goes_on(
        conn: psycopg.Connection, db_dsn: str) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    worker = Worker(WorkerConfig(dsn=db_dsn, workspace_id="ws1"), EditsDuringTheCall(db_dsn))
    result = worker.tick()
    assert (result.status, result.detail) == ("failed", "input_changed")
    attempt = conn.execute("select outcome, cost_usd, error from memory_private.job_attempts"
                           ).fetchone()
    assert attempt == ("failed", Decimal("0.002000"), "input_changed"), \
        "closed, with its usage charged"
    assert value(conn, "select count(*) from memory_private.records") == 0
    assert scope_of(conn, "ws1", "r1")


@pytest.mark.parametrize("how", ["forget", "prune"])
def test_an_answers_provenance_outlives_the_records_it_was_shown(
        conn: psycopg.Connection, how: str) -> None:
    w = World(conn)
    w.basic()
    soon = datetime(2031, 1, 1, tzinfo=UTC)
    w.request("ws1", "h", chat="dm-alice", user="alice")
    w.message("ws1", "h-u", "h", "user", "alice", "I prefer tea", retain_until=soon)
    w.message("ws1", "h-a", "h", "assistant", "bot1", "Noted.")
    record = make_record(conn, "ws1", "h", ["h-a"], reused=["h-u"])
    for req in ("q1", "q2"):
        w.request("ws1", req, chat="dm-alice", user="alice", status="running")
        w.message("ws1", f"{req}-a", req, "assistant", "bot1", "You prefer tea.")
    assert recall(conn, "ws1", "q1")["mode"] == "directory"
    assert query(conn, "ws1", "q2", "c1", {"id": record})["count"] == 1
    if how == "forget":
        conn.execute("select memory_private.forget_records('ws1', %s, %s, array[%s]::bigint[])",
                     (scope_of(conn, "ws1", "h"), record, record))
    else:
        conn.execute("select memory_private.delete_records('ws1', array[%s]::bigint[])",
                     (record,))
    assert value(conn, "select count(*) from memory_private.records") == 0
    assert boundary(conn, "ws1", "q1") == soon and boundary(conn, "ws1", "q2") == soon
    assert citations(conn, "ws1", "q2") == [], "a record gone authorizes nothing"
    w.remove("ws1", "h-u")
    assert sweep(conn, "ws1")["answers_erased"] == 2


@pytest.mark.parametrize("change", ["none", "recall_disabled", "bot_inactive", "bot_replaced",
                                    "group_unlinked", "membership", "source_removed",
                                    "source_expired", "source_edited", "forgotten",
                                    "grant_revoked"])
def test_index_holds_exactly_when_every_candidate_is_valid_for_the_reader(
        conn: psycopg.Connection, change: str) -> None:
    w, named, other = index_world(conn)
    scope = scope_of(conn, "ws1", "r1")
    if change == "recall_disabled":
        conn.execute("update memory_private.scopes set recall_enabled = false")
    elif change == "bot_inactive":
        w.bot("ws1", "bot1", active=False)
    elif change == "bot_replaced":
        w.bot("ws1", "bot1", identity="a-new-identity")
    elif change == "group_unlinked":
        w.group_chat("ws1", "grp", linked=False)
    elif change == "membership":
        w.member("ws1", "alice", "owner", active=False)
    elif change == "source_removed":
        w.remove("ws1", "o2")
    elif change == "source_expired":
        w.message("ws1", "o2", "r2", "assistant", "bot1", "Noted.",
                  retain_until=datetime.now(UTC) + timedelta(hours=1))
        advance(conn, "2 hours")
    elif change == "source_edited":
        w.message("ws1", "n1", "r1", "user", "alice", "We ship on Monday.")
    elif change == "forgotten":
        conn.execute("insert into memory_private.tombstones values ('ws1', %s, 'o1', "
                     "memory_private.clock_now())", (scope,))
    elif change == "grant_revoked":
        w.grant("ws1", "alice", "repo-x", granted=False)
    for reader in (None, "alice", "bob", "carol", "dave"):
        valid = {r[0] for r in conn.execute(
            "select record_id from memory_private.invalid_records('ws1', %s, %s, %s) "
            "where reason is null", (scope, [named, other], reader))}
        holds = value(conn, "select memory_private.index_holds('ws1', %s, %s)", scope, reader)
        assert holds == (valid == {named, other}), (change, reader)
