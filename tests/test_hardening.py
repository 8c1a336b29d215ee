"""Issue 14's database findings, each shown against the database itself: charges within the
reserve and coded errors (items 1-3), claims counted per unchanged input and only when they
can reach the provider (4-6), idle windows per conversation (7), a message re-reported as not
directed (8), replays from current state (10), and the backend's writes never waiting on a job
or on maintenance (12, 13). The recogniser's phrasings (9) are in tests/data/
manage_phrasings.json; hostile replies against the worker in tests/test_hostile_replies.py;
privileges (14) in pgtap/00_schema_shape.sql and pgtap/01_roles.sql."""

from __future__ import annotations

import io
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from rich.console import Console

from pyworker.status import render_explain, render_status
from tests.factory import World
from tests.jobs_world import (
    USAGE,
    advance,
    checkpoint,
    claim,
    commit,
    extraction_of,
    fail,
    idle_private_world,
    job_row,
    jobs,
    maintenance,
    start,
)
from tests.test_recall import manage, recall


def claimed(conn: psycopg.Connection) -> dict[str, Any]:
    job = claim(conn)
    assert job is not None
    return job


def sqlstate(call: Any) -> str | None:
    try:
        call()
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def attempts(conn: psycopg.Connection, job_id: int) -> list[tuple[Any, ...]]:
    return conn.execute("select attempt_no, outcome, error, reserved_usd, reported_cost_usd, "
                        "cost_usd from memory_private.job_attempts where job_id = %s "
                        "order by attempt_no", (job_id,)).fetchall()


def spent(conn: psycopg.Connection) -> tuple[Decimal, Decimal]:
    row = conn.execute("select memory_private.request_memory_spent('ws1', 'r1'), "
                       "(select memory_spent_usd from memory_private.workspace_memory "
                       "where workspace_id = 'ws1')").fetchone()
    assert row is not None
    return row[0], row[1]


# 1. Charges stay within the reserve ---------------------------------------------------------


def test_a_cost_reported_over_the_reserve_is_charged_the_reserve_and_kept_as_reported(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job, reserve="0.05")
    checkpoint(conn, job, extraction_of(job),
               usage={"input_tokens": 2_000_000_000, "output_tokens": 1, "cost_usd": 6000})
    assert attempts(conn, job["job_id"]) == [
        (1, "ok", None, Decimal("0.05"), Decimal(6000), Decimal("0.05"))]
    assert spent(conn) == (Decimal("0.05"), Decimal("0.05"))
    # The constraint holds it whatever writes the row.
    assert sqlstate(lambda: conn.execute(
        "update memory_private.job_attempts set cost_usd = reserved_usd + 1")) == "23514"


@pytest.mark.parametrize(("usage", "charged"), [
    (None, Decimal(0)),  # the provider answered with no usage (an error status)
    ({"input_tokens": None, "output_tokens": None, "cost_usd": None}, Decimal("0.05")),
    ({"input_tokens": 100, "output_tokens": None, "cost_usd": 0.002}, Decimal("0.002")),
])
def test_a_failed_attempt_is_charged_what_can_be_known_within_its_reserve(
        conn: psycopg.Connection, usage: Any, charged: Decimal) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job, reserve="0.05")
    fail(conn, job, "failed", "reply_unreadable", usage=usage)
    [(_, outcome, error, _, _, cost)] = attempts(conn, job["job_id"])
    assert (outcome, error, cost) == ("failed", "reply_unreadable", charged)
    assert spent(conn) == (charged, charged)


@pytest.mark.parametrize("usage", [
    {"input_tokens": -5, "output_tokens": 1, "cost_usd": 0},
    {"input_tokens": 1, "output_tokens": 1, "cost_usd": 2_000_000},
    {"input_tokens": 1.5, "output_tokens": None, "cost_usd": None},
    {"input_tokens": None, "output_tokens": None},
    {"input_tokens": "1", "output_tokens": None, "cost_usd": None},
])
def test_usage_a_worker_could_not_sanitize_is_refused_with_mb001_and_changes_nothing(
        conn: psycopg.Connection, usage: Any) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    assert sqlstate(lambda: fail(conn, job, "failed", "reply_unreadable", usage=usage)) == "MB001"
    assert [a[1] for a in attempts(conn, job["job_id"])] == ["open"]


def test_an_ok_attempt_needs_every_usage_value(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    assert sqlstate(lambda: checkpoint(conn, job, extraction_of(job), usage={
        "input_tokens": 1, "output_tokens": 1, "cost_usd": None})) == "MB001"


# 2. Errors are codes, never text ------------------------------------------------------------


@pytest.mark.parametrize("error", [
    "invalid reply: source_ids not in the batch: ['sk-live-0123456789abcdef']",
    "\x1b[31mred\x1b[0m", "", "reply_invalid ", "REPLY_INVALID",
])
def test_fail_job_takes_a_failure_code_not_text(conn: psycopg.Connection, error: str) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    assert sqlstate(lambda: fail(conn, job, "failed", error)) == "MB001"
    assert job_row(conn, job["job_id"])["status"] == "running"
    assert [a[1] for a in attempts(conn, job["job_id"])] == ["open"]


def test_bad_output_errors_name_the_contract_never_what_the_model_wrote(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    secret_key = "sk-live-0123456789abcdef\x1b[31m"
    for output in ({**extraction_of(job), secret_key: 1},
                   {**extraction_of(job), "source_ids": [secret_key]}):
        with pytest.raises(psycopg.Error) as err:
            checkpoint(conn, job, output)
        assert err.value.sqlstate == "MB023"
        assert "sk-live" not in str(err.value) and "\x1b" not in str(err.value)


HOSTILE_TEXT = "\x1b]0;pwned\x07\x1b[2J[bold red]styled[/bold red]\u202eevil"


def printed(render: Any, data: Any) -> str:
    out = io.StringIO()
    render(data, Console(file=out, width=400, color_system=None))
    return out.getvalue()


def test_pimem_status_and_explain_print_no_control_characters_or_markup_from_the_database(
) -> None:
    job = {"workspace_id": HOSTILE_TEXT, "job_id": 1, "phase": "extract", "status": "stopped",
           "age": None, "claims": 3, "next_attempt_at": None, "last_attempt_no": 1,
           "last_attempt_outcome": "failed", "last_error": HOSTILE_TEXT,
           "retry_refusal": HOSTILE_TEXT, "stale_reason": None}
    text = printed(render_status, {"workspaces": [], "scopes": [], "jobs": [job],
                                   "charges": []})
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "[bold red]styled[/bold red]" in text, "markup from the database is shown literally"
    explain = {"workspace_id": HOSTILE_TEXT, "record_id": 1, "requester": None, "valid": False,
               "invalid_reason": HOSTILE_TEXT,
               "scope": {"scope_id": 1, "kind": "private", "bot_id": HOSTILE_TEXT,
                         "chat_id": "c", "user_id": "u", "topic_id": None,
                         "recall_enabled": True},
               "record": {"kind": "note", "created_at": "t", "origin_request_id": HOSTILE_TEXT,
                          "usage_count": 0, "in_index": False},
               "checks": [{"check": "x", "ok": False, "reason": "r", "detail": HOSTILE_TEXT}],
               "sources": [HOSTILE_TEXT],
               "dependencies": [{"message_id": HOSTILE_TEXT, "via": HOSTILE_TEXT, "role": "user",
                                 "speaker_id": "u", "state": HOSTILE_TEXT,
                                 "recorded_hash": None, "current_hash": None,
                                 "retain_until": None, "removed_at": None,
                                 "tombstoned": False}]}
    text = printed(render_explain, explain)
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text



def test_the_demo_and_the_command_errors_print_model_and_database_text_literally() -> None:
    from typer.testing import CliRunner

    from pyworker.cli import app
    from pyworker.lab.demo import show_recall, show_records

    record = {"id": 1, "title": HOSTILE_TEXT, "summary": "a line [m1]\n" + HOSTILE_TEXT,
              "speaker_ids": [HOSTILE_TEXT], "source_ids": ["m1", HOSTILE_TEXT]}
    for text in (printed(lambda d, c: show_records(c, "[/oops]", d), {"records": [record]}),
                 printed(lambda d, c: show_recall(c, "[/oops]", d),
                         {"label": HOSTILE_TEXT, "mode": "index", "index": HOSTILE_TEXT,
                          "records": [record]})):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
        assert "[bold red]styled[/bold red]" in text and "[/oops]" in text
    assert "[m1]" in printed(lambda d, c: show_records(c, "t", d), {"records": [record]}), \
        "a line's citation is shown, not taken for markup"
    # An error text with markup-like brackets (here from a connection string) is printed
    # literally, not parsed (a closing tag nobody opened used to end the command in a
    # MarkupError).
    result = CliRunner().invoke(app, ["migrate", "--dsn", "host=[/x] port=notaport"])
    assert result.exit_code == 1 and "MarkupError" not in repr(result.exception)


# 3. Malformed values a worker can send get MB codes -------------------------------------------


def test_the_claim_payload_budget_is_exact_decimal_strings_and_the_worker_reads_them_exactly(
        conn: psycopg.Connection) -> None:
    from pyworker.payload import ClaimPayload

    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", budget=0.3, spent=0.1)
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like tea")
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "noted")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    raw = claimed(conn)
    assert raw["budget"]["request_left_usd"] == "0.200000"  # a string, not a float 0.2
    budget = ClaimPayload.model_validate(raw).budget
    assert budget.request_left_usd == Decimal("0.2") and budget.workspace_left_usd == 100


@pytest.mark.parametrize("call", [
    "select memory.extend_lease('ws1', %s, %s)",
    "select memory.start_attempt('ws1', %s, %s, 0.01)",
    "select memory.save_checkpoint('ws1', %s, %s, '{}', '{}')",
    "select memory.commit_job('ws1', %s, %s)",
    "select memory.fail_job('ws1', %s, %s, 'failed', 'provider_error')",
])
@pytest.mark.parametrize("token", ["not-a-token", "", "00000000-0000-0000-0000-00000000000g",
                                   "{00000000-0000-0000-0000-000000000000}", None])
def test_a_malformed_token_is_mb001_not_a_cast_error(
        conn: psycopg.Connection, call: str, token: str | None) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert sqlstate(lambda: conn.execute(call, (job["job_id"], token))) == "MB001"


def test_a_float_record_id_is_bad_model_output_not_a_cast_error(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    run = maintenance(conn, "ws1")
    assert run["extract_jobs_created"] == 1
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    commit(conn, job)
    maintenance(conn, "ws1")
    job = claimed(conn)
    assert job["phase"] == "consolidate"
    start(conn, job)
    rid = job["input"]["candidates"][0]["id"]
    for ids in ([float(rid)], [rid, 1e300], [f"{rid}"]):
        output = {"index": "x", "record_ids": ids}
        assert sqlstate(lambda o=output: checkpoint(conn, job, o)) == "MB023", ids


# 4-6. Claims: per unchanged input, only those that can reach the provider --------------------


def third_claim(conn: psycopg.Connection) -> dict[str, Any]:
    """Maintenance, two claims whose model calls failed, and the third claim of the input."""
    maintenance(conn, "ws1")
    for _ in range(2):
        job = claimed(conn)
        start(conn, job)
        fail(conn, job)
        advance(conn, "61 minutes")
    return claimed(conn)


def test_a_checkpoint_saved_on_the_third_claim_is_committed_after_the_worker_dies(
        conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    job = third_claim(conn)
    assert start(conn, job) == 3
    checkpoint(conn, job, extraction_of(job))
    advance(conn, "3 minutes")  # the worker died before its commit
    maintenance(conn, "ws1")
    row = job_row(conn, job["job_id"])
    assert (row["status"], row["claims"], row["checkpoint"] is not None) == ("pending", 3, True)
    again = claimed(conn)
    assert again["job_id"] == job["job_id"] and again["checkpoint"] is not None
    assert again["attempt"] is None, "no model call: the claim only commits"
    assert commit(conn, again)["status"] == "committed"
    assert len(attempts(conn, job["job_id"])) == 3


def test_a_failure_reported_after_a_checkpoint_keeps_it(conn: psycopg.Connection) -> None:
    idle_private_world(conn)
    job = third_claim(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    fail(conn, job, "failed", "database_error")  # e.g. the commit failed unexpectedly
    row = job_row(conn, job["job_id"])
    assert (row["status"], row["checkpoint"] is not None) == ("pending", True)
    advance(conn, "61 minutes")
    assert commit(conn, claimed(conn))["status"] == "committed"


def test_at_most_three_model_calls_per_input_across_a_transient_supersede(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    for i in range(2):
        job = claimed(conn)
        start(conn, job)
        fail(conn, job)
        if i == 0:
            advance(conn, "61 minutes")
    # The bot is deactivated and reactivated: the pending job is superseded, and the same input
    # is scheduled again.
    w.bot("ws1", "bot1", active=False)
    assert maintenance(conn, "ws1")["jobs_superseded_stale"] == 1
    w.bot("ws1", "bot1", active=True)
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 1
    old, new = jobs(conn)
    assert (old["status"], new["status"], new["input_hash"]) == (
        "superseded", "pending", old["input_hash"])
    assert new["claims"] == 2, "the input's calls carry over"
    assert new["next_attempt_at"] == old["next_attempt_at"], "and so does its backoff"
    assert claim(conn) is None, "still backing off"
    advance(conn, "61 minutes")
    job = claimed(conn)
    assert job["attempt"] == 3 and start(conn, job) == 3
    fail(conn, job)
    assert job_row(conn, new["job_id"])["status"] == "stopped"
    # Once more off and on: the input stays blocked.
    w.bot("ws1", "bot1", active=False)
    maintenance(conn, "ws1")
    w.bot("ws1", "bot1", active=True)
    assert maintenance(conn, "ws1")["replays_blocked"] == 1
    advance(conn, "1 day")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0
    total = conn.execute("select count(*) from memory_private.job_attempts").fetchone()
    assert total == (3,)


def test_a_job_superseded_after_its_third_call_blocks_its_input(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    job = third_claim(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    # Recall turned off before the commit: the checkpoint is stale, the job superseded.
    w.request("ws1", "r9", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "r9-u", "r9", "user", "alice", "turn off memory")
    assert manage(conn, "ws1", "r9", "c1", {"action": "disable-memory",
                                            "sourceId": "r9-u"})["status"] == "done"
    assert sqlstate(lambda: commit(conn, job)) == "MB021"
    maintenance(conn, "ws1")
    assert job_row(conn, job["job_id"])["status"] == "superseded"
    w.message("ws1", "r9-u2", "r9", "user", "alice", "turn memory back on")
    manage(conn, "ws1", "r9", "c2", {"action": "enable-memory", "sourceId": "r9-u2"})
    assert maintenance(conn, "ws1")["replays_blocked"] == 1, "three calls were made"


def test_budget_refusals_before_any_call_use_no_claim(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "r1", chat="dm-alice", user="alice", budget=0.01)
    w.message("ws1", "r1-u", "r1", "user", "alice", "remember that I like tea")
    w.message("ws1", "r1-a", "r1", "assistant", "bot1", "noted")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    for _ in range(4):
        job = claimed(conn)
        assert sqlstate(lambda job=job: start(conn, job, reserve="0.05")) == "MB024"
        fail(conn, job, "failed", "budget_exceeded")
        assert job_row(conn, job["job_id"])["status"] == "pending"
        advance(conn, "61 minutes")
    assert job_row(conn, job["job_id"])["claims"] == 0
    w.request("ws1", "r1", chat="dm-alice", user="alice", budget=1.0)
    job = claimed(conn)
    assert job["attempt"] == 1 and start(conn, job, reserve="0.05") == 1


def test_a_claim_that_dies_before_its_call_uses_a_claim(conn: psycopg.Connection) -> None:
    # Issue 31 reversed the rule of this test: a worker that dies holding a job, even before its
    # model call, may have died on the job's content; that claim counts, so such a job stops
    # after three instead of coming back for ever (tests/test_claims_lost.py).
    idle_private_world(conn)
    maintenance(conn, "ws1")
    for _ in range(2):
        claimed(conn)
        advance(conn, "3 minutes")  # the worker died before start_attempt
        maintenance(conn, "ws1")
    job = claimed(conn)
    assert (job["attempt"], start(conn, job)) == (3, 3)


# The commit of a claim that maintenance ended says why -----------------------------------------


def test_a_commit_after_maintenance_superseded_the_job_answers_mb021(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer coffee after all")
    assert maintenance(conn, "ws1")["jobs_superseded_stale"] == 1
    assert sqlstate(lambda: commit(conn, job)) == "MB021"


def test_a_commit_after_maintenance_stopped_the_job_for_a_new_config_answers_mb022(
        conn: psycopg.Connection) -> None:
    w = idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    checkpoint(conn, job, extraction_of(job))
    w.workspace("ws1", config_version=2)
    assert maintenance(conn, "ws1")["jobs_stopped_config_changed"] == 1
    assert sqlstate(lambda: commit(conn, job)) == "MB022"


# 7. The idle window is per conversation -------------------------------------------------------


def test_a_busy_group_topic_does_not_hold_back_a_finished_conversation(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "g1", chat="grp", user="alice", user_text="we decided on Friday")
    for i in range(2, 6):  # bob keeps talking in the same topic, every ten minutes
        advance(conn, "10 minutes")
        w.conversation("ws1", f"g{i}", chat="grp", user="bob", user_text=f"point {i}")
        maintenance(conn, "ws1")
    extract = [j for j in jobs(conn) if j["phase"] == "extract" and j["status"] == "pending"]
    assert [sorted(s["id"] for s in j["input"]["sources"]) for j in extract] == [
        ["g1-a", "g1-u", "g2-a", "g2-u"]], "only the conversations idle for 30 minutes"


def test_an_edit_restarts_only_its_own_conversations_window(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="tea")
    w.conversation("ws1", "r2", chat="dm-alice", user="alice", user_text="coffee")
    advance(conn, "29 minutes")
    w.message("ws1", "r2-u", "r2", "user", "alice", "coffee, black")  # an edit of r2
    advance(conn, "2 minutes")
    maintenance(conn, "ws1")
    [job] = jobs(conn)
    assert sorted(s["id"] for s in job["input"]["sources"]) == ["r1-a", "r1-u"]


# 8. A message re-reported as not directed -----------------------------------------------------


def test_a_group_message_re_reported_as_not_directed_loses_its_stored_copy(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "g1", chat="grp", user="alice")
    assert w.message("ws1", "g1-u", "g1", "user", "alice", "ship on Friday") == "inserted"
    w.message("ws1", "g1-a", "g1", "assistant", "bot1", "noted")
    assert w.message("ws1", "g1-u", "g1", "user", "alice", "ship on Friday",
                     directed=False) == "updated"
    row = conn.execute("select body, content_hash, removed_at is not null, removal_reason "
                       "from memory_private.messages where message_id = 'g1-u'").fetchone()
    assert row == (None, None, True, "removed"), "erased exactly as remove_message would"
    assert w.message("ws1", "g1-u", "g1", "user", "alice", "ship on Friday",
                     directed=False) == "unchanged"
    assert w.message("ws1", "g9-u", "g1", "user", "alice", "chatter", directed=False) == "ignored"
    with pytest.raises(psycopg.Error) as err:
        w.message("ws1", "g1-u", "g1", "user", "bob", "moved", directed=False)
    assert err.value.sqlstate == "MB003"
    advance(conn, "31 minutes")
    assert maintenance(conn, "ws1")["extract_jobs_created"] == 0, "nothing left to extract"


# 9. The recogniser reads a bounded head of the message ---------------------------------------


def classify(conn: psycopg.Connection, text: str) -> str | None:
    row = conn.execute("select memory_private.classify_request(%s)", (text,)).fetchone()
    assert row is not None
    return row[0]


def test_the_recogniser_reads_the_opening_of_a_message_not_all_of_it(
        conn: psycopg.Connection) -> None:
    """A request opens the message (after a short preamble): the recogniser reads the first 300
    characters and the last few, so a 64,000-byte message of polite words costs what a short
    one does under the workspace lock (docs/benchmarks.md has the figures) instead of one
    regexp_replace over the whole text per word."""
    assert classify(conn, "please " * 5 + "remember that the deploy is on Friday") == "remember"
    assert classify(conn, "please " * 9000 + "remember that the deploy is on Friday") is None
    assert classify(conn, "请" * 21000 + "记住我喜欢茶") is None
    long_content = "remember that " + "tea and coffee " * 4000
    assert classify(conn, long_content) == "remember"
    assert classify(conn, long_content + "?") is None, "the end of the message is read too"


# 10. Replays answer from current state ----------------------------------------------------------


def test_a_replayed_toggle_says_when_its_state_no_longer_holds(conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "t1", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "t1-u", "t1", "user", "alice", "Turn off memory")
    off = {"action": "disable-memory", "sourceId": "t1-u"}
    assert manage(conn, "ws1", "t1", "c1", off)["code"] == "disabled"
    replay = manage(conn, "ws1", "t1", "c1", off)
    assert (replay["code"], replay["holds"], replay["replayed"]) == ("disabled", True, True)
    w.request("ws1", "t2", chat="dm-alice", user="alice", status="running")
    w.message("ws1", "t2-u", "t2", "user", "alice", "Turn on memory")
    assert manage(conn, "ws1", "t2", "c1", {"action": "enable-memory",
                                            "sourceId": "t2-u"})["code"] == "enabled"
    later = manage(conn, "ws1", "t1", "c1", off)
    assert (later["status"], later["code"], later["holds"]) == ("done", "no_longer_holds", False)
    assert "on again" in later["reason"]
    assert recall(conn, "ws1", "t2")["mode"] != "disabled", "the replay changed nothing"


# 12, 13. The backend's own writes never wait on memory work -------------------------------------


def test_ingest_of_the_charged_request_and_workspace_does_not_wait_on_a_checkpoint(
        conn: psycopg.Connection, db_dsn: str) -> None:
    idle_private_world(conn)
    maintenance(conn, "ws1")
    job = claimed(conn)
    start(conn, job)
    holder = psycopg.connect(db_dsn)
    try:
        holder.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                       (job["workspace_id"], job["job_id"], job["token"],
                        Jsonb(extraction_of(job)), Jsonb(USAGE)))  # left open: it charged r1
        with psycopg.connect(db_dsn, autocommit=True) as other:
            other.execute("set lock_timeout = '300ms'")
            ow = World(other)
            ow.workspace("ws1", budget=99.0)
            ow.request("ws1", "r1", chat="dm-alice", user="alice", budget=2.0, spent=0.5)
            ow.message("ws1", "r1-u", "r1", "user", "alice", "please remember: tea, always")
        holder.commit()
    finally:
        holder.close()


def test_run_maintenance_of_every_workspace_blocks_neither_recall_nor_upsert_workspace(
        conn: psycopg.Connection, db_dsn: str) -> None:
    w = World(conn)
    for ws in ("ws1", "ws2"):
        w.basic(ws)
        w.conversation(ws, "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    holder = psycopg.connect(db_dsn)
    try:
        counts = holder.execute("select memory.run_maintenance()").fetchone()  # left open
        assert counts is not None and counts[0]["extract_jobs_created"] == 2
        with psycopg.connect(db_dsn, autocommit=True) as other:
            other.execute("set lock_timeout = '300ms'")
            ow = World(other)
            for ws in ("ws1", "ws2"):
                assert other.execute("select memory.recall(%s, 'r1')",
                                     (ws,)).fetchone() is not None
                ow.workspace(ws, budget=50.0)
                ow.request(ws, "r5", chat="dm-bob", user="bob", status="running")
                assert other.execute("select memory.recall(%s, 'r5')",
                                     (ws,)).fetchone() is not None
        holder.commit()
    finally:
        holder.close()
