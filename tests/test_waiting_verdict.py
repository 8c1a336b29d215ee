"""What may be extracted has one home (issue 40, part 1): the scheduling verdict
(memory_private.extraction_verdict) gives every conversation not yet extracted the first reason
it waits, in the order of memory_private.waiting_reasons, or none. The scheduler takes those
without one; memory.waiting_status counts them by reason. On a world where every reason holds
for some conversation, waiting_status is exactly the verdict, and a tick that derives every
scope then does what each reason says: a job (or a skipped record) for each conversation
without one, nothing for any other, and an idle end planned for each in its idle window (the
twin of tests/test_validity_set.py for the validity rule)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tests.factory import World
from tests.jobs_world import advance, fail, start

SCOPE = ("select s.scope_id from memory_private.scopes s join memory_private.requests r "
         "on r.workspace_id = s.workspace_id and r.bot_id = s.bot_id and r.chat_id = s.chat_id "
         "and (s.kind = 'private' or s.topic_id = r.topic_id) "
         "where r.workspace_id = %s and r.request_id = %s")


def reasons(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(
        "select reason from memory_private.waiting_reasons order by rank").fetchall()]


def claim_in(conn: psycopg.Connection, ws: str) -> dict[str, Any]:
    row = conn.execute("select memory_private.claim_workspace_job(%s, 'w1')", (ws,)).fetchone()
    assert row is not None and row[0] is not None, ws
    return dict(row[0])


def conversation(w: World, ws: str, request: str, *, chat: str = "dm-alice",
                 user: str = "alice", bot: str = "bot1", status: str = "succeeded",
                 user_text: str | None = "I prefer tea", reply: str | None = "Noted.") -> None:
    w.request(ws, request, chat=chat, user=user, bot=bot, status=status)
    if user_text is not None:
        w.message(ws, f"{request}-u", request, "user", user, user_text)
    if reply is not None:
        w.message(ws, f"{request}-a", request, "assistant", bot, reply)


def tick(conn: psycopg.Connection, ws: str) -> None:
    conn.execute("select memory.run_maintenance(%s)", (ws,))


def world(conn: psycopg.Connection) -> None:
    """A workspace per job state (one running job per workspace), and the rest beside."""
    w = World(conn)
    for ws in ("gates", "jobs-budget", "jobs-priced", "jobs-backoff", "jobs-due", "jobs-run",
               "jobs-stop", "batch"):
        w.basic(ws)
    # The gates and the conversations' own reasons, in one workspace.
    w.bot("gates", "bot2")
    conversation(w, "gates", "g-off", chat="grp", user="bob")          # recall off (shared)
    conversation(w, "gates", "g-bot", bot="bot2")                        # bot inactive
    conversation(w, "gates", "g-run", status="running")                  # not finished
    conversation(w, "gates", "g-fail", status="failed")                  # failed
    conversation(w, "gates", "g-nouser", chat="dm-bob", user="bob", user_text=None)
    conversation(w, "gates", "g-noreply", chat="dm-bob", user="bob", reply=None)
    # Each job state, in a workspace of its own.
    for ws in ("jobs-budget", "jobs-priced", "jobs-backoff", "jobs-due", "jobs-run",
               "jobs-stop"):
        conversation(w, ws, "j1")
    # A batch full with the newest conversation: the older one waits for the next.
    big = "x" * 13000
    conversation(w, "batch", "b-old", user_text=big)
    advance(conn, "1 minute")
    conversation(w, "batch", "b-new", user_text=big)
    advance(conn, "31 minutes")
    for ws in ("gates", "jobs-budget", "jobs-priced", "jobs-backoff", "jobs-due", "jobs-run",
               "jobs-stop", "batch"):
        tick(conn, ws)
    w.bot("gates", "bot2", active=False)
    conn.execute("update memory_private.scopes set recall_enabled = false "
                 "where workspace_id = 'gates' and kind = 'shared'")
    for ws, outcome, code in (("jobs-budget", "failed", "budget_exceeded"),
                              ("jobs-priced", "failed", "not_priced"),
                              ("jobs-backoff", "failed", "provider_error"),
                              ("jobs-stop", "unknown", "call_aborted")):
        job = claim_in(conn, ws)
        if code not in ("budget_exceeded", "not_priced"):
            start(conn, job)
        fail(conn, job, outcome, code)
    tick(conn, "jobs-stop")
    # Beside a job that keeps its snapshot: a conversation it does not hold (next batch).
    conversation(w, "jobs-due", "j2", chat="dm-alice")
    # A paused workspace, one whose conversation qualifies now (no tick yet), and one in its
    # idle window.
    w.basic("paused")
    conversation(w, "paused", "p1")
    w.call("set_workspace_paused", "paused", True)
    w.basic("ready")
    w.workspace("ready", idle_minutes=0)
    conversation(w, "ready", "a1")
    conversation(w, "ready", "a-big", chat="dm-bob", user="bob", user_text="y" * 30000)
    w.basic("idle")
    conversation(w, "idle", "i1")
    advance(conn, "1 minute")
    job = claim_in(conn, "jobs-run")  # running now, its lease current
    start(conn, job)


def verdict(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "select w.workspace_id, v.* from memory_private.workspaces w "
            "cross join lateral memory_private.extraction_verdict(w.workspace_id, "
            "  array(select s.scope_id from memory_private.scopes s "
            "         where s.workspace_id = w.workspace_id), memory_private.clock_now()) v "
            "order by 1, v.scope_id, v.request_id").fetchall()


def holding_jobs(conn: psycopg.Connection, ws: str, scope: int, sources: Any) -> set[int]:
    return {r[0] for r in conn.execute(
        "select job_id from memory_private.jobs where workspace_id = %s and scope_id = %s "
        "and phase = 'extract' and status in ('pending', 'running') "
        "and input -> 'sources' @> %s::jsonb", (ws, scope, psycopg.types.json.Jsonb(sources)))}


def skipped(conn: psycopg.Connection, ws: str, ids: list[str]) -> int:
    row = conn.execute("select count(*) from memory_private.extracted_sources "
                       "where workspace_id = %s and message_id = any(%s) "
                       "and outcome = 'skipped'", (ws, ids)).fetchone()
    assert row is not None
    return int(row[0])


def test_waiting_status_is_the_verdict_and_the_scheduler_does_what_it_says(
        conn: psycopg.Connection) -> None:
    world(conn)
    before = verdict(conn)
    found = Counter(r["reason"] or "awaiting_maintenance" for r in before)
    assert set(found) == set(reasons(conn)), "every reason holds for some conversation"

    # memory.waiting_status is the verdict, counted.
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("select * from memory.waiting_status").fetchall()
    counted: Counter[str] = Counter()
    for row in rows:
        counted[row["reason"]] += row["conversations"]
        mine = [r for r in before if r["workspace_id"] == row["workspace_id"]
                and (r["reason"] or "awaiting_maintenance") == row["reason"]]
        assert row["conversations"] == len(mine)
        assert row["messages"] == sum(r["messages"] for r in mine)
        assert row["next_change_at"] == min((r["next_change_at"] for r in mine
                                             if r["next_change_at"]), default=None)
    assert counted == found
    order = [r["reason"] for r in rows if r["workspace_id"] == "gates"]
    assert order == [x for x in reasons(conn) if x in order], "in the order of the reasons"

    # What the scheduler then does: a tick deriving every scope of every workspace.
    state = {(r["workspace_id"], r["request_id"]):
             holding_jobs(conn, r["workspace_id"], r["scope_id"], r["sources"]) for r in before}
    for ws in {r["workspace_id"] for r in before}:
        conn.execute("select memory_private.note_change(%s, 'updated')", (ws,))
        tick(conn, ws)
    for r in before:
        ws, reason = r["workspace_id"], r["reason"]
        ids = [s["id"] for s in r["sources"]]
        held = holding_jobs(conn, ws, r["scope_id"], r["sources"])
        new = held - state[(ws, r["request_id"])]
        where = (ws, r["request_id"], reason)
        if reason is None and r["skip"]:
            assert skipped(conn, ws, ids) == len(ids), where
        elif reason is None:
            assert new, f"{where}: a job holds it now"
        else:
            assert not new and skipped(conn, ws, ids) == 0, f"{where}: nothing was done"
        if reason == "idle_window":
            due = conn.execute(
                "select due_at from memory_private.maintenance_due where workspace_id = %s "
                "and request_id = %s and foreseen", (ws, r["request_id"])).fetchall()
            assert due == [(r["next_change_at"],)], f"{where}: its idle end is planned"
    # and the verdict after it: nothing waits for maintenance any more
    assert not [r for r in verdict(conn) if r["reason"] is None]
