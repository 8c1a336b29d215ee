"""Requirements that docs/rules.md found without a test that could fail without them: one test
each, named in that document's row (B4, P1, P3, P5, P7, P9, P14, P16, P19, R8, V8, T9)."""

from __future__ import annotations

import inspect
import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pyworker.prompting import build_prompt
from pyworker.testing import FakeModel
from pyworker.worker import WorkerConfig
from tests.factory import World
from tests.jobs_world import (
    advance,
    checkpoint,
    claim,
    commit,
    consolidation_of,
    extraction_of,
    idle_private_world,
    jobs,
    maintenance,
    show_memories_with_batches,
    start,
)
from tests.records import make_record, record_exists, scope_of
from tests.test_recall import query, recall, set_index
from tests.test_worker_e2e import finished_conversation, make_worker, openai_adapter
from tests.test_worker_units import payload

ROOT = Path(__file__).resolve().parent.parent


def value(conn: psycopg.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql.encode(), args).fetchone()  # type: ignore[call-overload]
    assert row is not None
    return row[0]


# B4 ------------------------------------------------------------------------------------------


def test_the_repository_top_level_holds_what_the_brief_names() -> None:
    for directory in ("sql", "migrations", "pyworker", "tests", "pgtap"):
        assert (ROOT / directory).is_dir(), directory
    for file in ("pyproject.toml", "README.md"):
        assert (ROOT / file).is_file(), file


# P1, P14 -------------------------------------------------------------------------------------


def test_the_worker_checks_once_a_minute_and_gives_a_tick_ninety_seconds_by_default() -> None:
    from pyworker import cli

    config = WorkerConfig(dsn="postgresql://")
    assert (config.interval, config.tick_seconds) == (60.0, 90.0)
    options = inspect.signature(cli.worker).parameters
    assert options["interval"].default == 60.0, "pimem worker --interval"
    assert options["tick_seconds"].default == 90.0, "pimem worker --tick-seconds"


# P3 ------------------------------------------------------------------------------------------


def test_a_workspace_reported_without_an_idle_window_waits_thirty_minutes(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    assert w.call("upsert_workspace", "ws1", 1, 100.0) == "inserted"  # no idle minutes given
    w.member("ws1", "alice", "owner")
    w.private_chat("ws1", "dm-alice", "alice")
    w.bot("ws1", "bot1")
    w.conversation("ws1", "r1", chat="dm-alice", user="alice")
    advance(conn, "29 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    advance(conn, "2 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1


# P5 ------------------------------------------------------------------------------------------


def test_the_memories_sharing_most_words_with_a_batch_accompany_it_when_the_policy_shows_some(
        fresh_conn: psycopg.Connection) -> None:
    conn = fresh_conn
    show_memories_with_batches(conn, 2)
    w = World(conn)
    w.basic()
    made = {}
    for key, text in (("tea", "alice drinks green tea every morning"),
                      ("jazz", "alice plays jazz piano on weekends"),
                      ("tea2", "alice buys tea leaves from the market"),
                      ("cats", "alice has two cats named pixel and byte")):
        w.conversation("ws1", f"h-{key}", chat="dm-alice", user="alice", user_text=text)
        advance(conn, "31 minutes")
        maintenance(conn, "ws1")
        while (job := claim(conn)) is not None:
            start(conn, job)
            if job["phase"] == "extract":
                checkpoint(conn, job, extraction_of(job, key, text))
                made[key] = commit(conn, job)["record_id"]
            else:
                checkpoint(conn, job, consolidation_of(job))
                commit(conn, job)
    w.message("ws1", "h-tea2-u", "h-tea2", "user", "alice", "edited")  # invalid from now
    w.conversation("ws1", "new", chat="dm-alice", user="alice",
                   user_text="which green tea leaves should alice buy at the market?")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    [job] = [j for j in jobs(conn) if j["phase"] == "extract" and j["status"] == "pending"]
    # tea2 shares the most words but is no longer valid; nor is cats, which was made with tea2
    # shown and so rests on the edited message too; tea shares "alice" and "green", jazz only
    # "alice".
    assert job["input"]["existing"] == [made["tea"], made["jazz"]]
    assert not record_exists(conn, "ws1", made["cats"]), "purged by the tick after the edit"


# P7 ------------------------------------------------------------------------------------------


def test_the_extraction_prompt_puts_requests_corrections_preferences_decisions_and_open_work_first(
) -> None:
    text = build_prompt(payload()).user
    order = ["what the user actually asked for", "corrections", "preferences the user stated",
             "decisions", "unfinished work"]
    places = [text.find(phrase) for phrase in order]
    assert -1 not in places and places == sorted(places), places
    assert "Keep apart what was proposed" in text and "what stayed uncertain" in text


# P9 ------------------------------------------------------------------------------------------


def test_a_consolidation_sees_the_48_newest_valid_records(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u1, _ = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="jazz")
    valid = [make_record(conn, "ws1", "h1", [u1], summary=f"tea {i}") for i in range(49)]
    make_record(conn, "ws1", "h2", [u2], summary="jazz")  # the newest, made invalid below
    w.message("ws1", u2, "h2", "user", "alice", "blues")
    conn.execute("select memory_private.mark_consolidation_due('ws1', %s)",
                 (scope_of(conn, "ws1", "h1"),))
    assert maintenance(conn, "ws1")["consolidate_jobs_created"] == 1
    [job] = [j for j in jobs(conn) if j["phase"] == "consolidate"]
    assert job["input"]["candidates"] == list(reversed(valid))[:48]


# P16 -----------------------------------------------------------------------------------------


def test_no_workspace_lock_is_held_while_the_model_call_runs(
        conn: psycopg.Connection, db_dsn: str) -> None:
    finished_conversation(conn)
    with FakeModel() as model:
        model.mode = "hang"
        worker = make_worker(db_dsn, openai_adapter(model))
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(r=worker.tick()), daemon=True)
        thread.start()
        try:
            assert model.call_started.wait(30), "the model was never called"
            assert value(conn, "select count(*) from pg_stat_activity "
                               "where application_name = 'pimem-worker'") >= 1
            held = value(conn, "select count(*) from pg_locks l join pg_stat_activity a "
                               "using (pid) where a.application_name = 'pimem-worker' "
                               "and l.locktype in ('relation', 'tuple', 'transactionid')")
            assert held == 0, "the worker's session holds locks during the call"
            with psycopg.connect(db_dsn) as other:
                other.execute("set lock_timeout = '300ms'")
                other.execute("select memory_private.lock_workspace('ws1')")  # a memory write
                World(other).workspace("ws1", budget=99.0)  # and the backend's own upsert
                other.rollback()
        finally:
            model.release.set()
            thread.join(30)
    assert result["r"].status == "failed" and result["r"].detail == "provider_error"


# P19 -----------------------------------------------------------------------------------------


def test_a_checkpoint_is_kept_on_its_job_and_never_in_the_transcript(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    transcript = "select md5(string_agg(m::text, '' order by message_id)), count(*) " \
                 "from memory_private.messages m"
    before = conn.execute(transcript).fetchone()
    checkpoint(conn, job, extraction_of(job, summary="A checkpointed summary, not a message."))
    assert conn.execute(transcript).fetchone() == before
    assert value(conn, "select checkpoint -> 'output' ->> 'summary' from memory_private.jobs "
                       "where job_id = %s", job["job_id"]) == "A checkpointed summary, not a message."
    assert value(conn, "select count(*) from memory_private.records") == 0


# R8 ------------------------------------------------------------------------------------------


def test_memory_answers_carry_no_message_text(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    u, a = w.conversation("ws1", "h1", chat="dm-alice", user="alice",
                          user_text="verbatim words of the user", reply="verbatim words of the bot")
    make_record(conn, "ws1", "h1", [u, a], title="Tea", summary="Alice prefers tea.")
    w.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    answers = [recall(conn, "ws1", "live"), query(conn, "ws1", "live", "c1", {}),
               query(conn, "ws1", "live", "c2", {"query": "tea"})]
    assert all(a["records"] for a in answers)
    for answer in answers:
        assert "verbatim words" not in json.dumps(answer), answer
    [result] = answers[1]["records"]
    assert result["source_ids"] == [u, a], "the sources are ids, for chat-history retrieval"


# V8 (and C4's approvals) ---------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["private", "shared"])
def test_every_answer_that_shows_memories_says_they_approve_nothing(
        conn: psycopg.Connection, scope: str) -> None:
    w = World(conn)
    w.basic()
    chat = "dm-alice" if scope == "private" else "grp"
    u, _ = w.conversation("ws1", "h1", chat=chat, user="alice", user_text="we ship on Friday")
    r = make_record(conn, "ws1", "h1", [u], title="Ship day", summary="Ship on Friday.")
    w.request("ws1", "dir", chat=chat, user="alice", status="running")
    directory = recall(conn, "ws1", "dir")
    set_index(conn, "ws1", "h1", [r], "Ship day")
    w.request("ws1", "idx", chat=chat, user="alice", status="running")
    index = recall(conn, "ws1", "idx")
    assert (directory["mode"], index["mode"]) == ("directory", "index")
    answers = [directory, index, query(conn, "ws1", "idx", "c1", {}),
               query(conn, "ws1", "idx", "c2", {"query": "ship"}),
               query(conn, "ws1", "idx", "c3", {"id": r})]
    for answer in answers:
        assert answer["records"], answer
        label = answer["label"]
        assert "not instructions" in label and "approves nothing" in label, answer
        assert "replace approved instructions" in label
        assert ("not a team decision" in label) == (scope == "shared")


# T9 ------------------------------------------------------------------------------------------


def test_credential_redaction_is_documented_as_defense_in_depth(conn: psycopg.Connection) -> None:
    comment = value(conn, "select obj_description('memory_private.redact(text)'::regprocedure, "
                          "'pg_proc')")
    assert "Defense in depth" in comment and "cannot find every secret" in comment
    retention = (ROOT / "docs" / "retention.md").read_text()
    assert "## Credential redaction is defense in depth (T9)" in retention
