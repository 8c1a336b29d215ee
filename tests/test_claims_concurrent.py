"""Concurrent claims from 8 real connections (P1, P16): no job is claimed twice and a workspace
never has two running jobs, while workers claim, work and commit at the same time."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import USAGE, advance, maintenance

WORKERS = 8
WORKSPACES = ("wa", "wb", "wc")
USERS = ("u1", "u2", "u3", "u4")


def build(conn: psycopg.Connection) -> int:
    w = World(conn)
    for ws in WORKSPACES:
        w.basic(ws, users=USERS)
        for user in USERS:
            w.conversation(ws, f"{ws}-{user}", chat=f"dm-{user}", user=user)
    advance(conn, "31 minutes")
    counts = maintenance(conn)
    return int(counts["extract_jobs_created"])


def test_eight_connections_never_claim_a_job_twice_or_run_two_in_a_workspace(
        conn: psycopg.Connection, db_dsn: str) -> None:
    total = build(conn)
    assert total == len(WORKSPACES) * len(USERS)

    lock = threading.Lock()
    held: dict[str, str] = {}          # workspace -> worker currently holding a job in it
    claimed: list[int] = []
    problems: list[str] = []
    first_round: list[dict[str, Any] | None] = []
    barrier = threading.Barrier(WORKERS)

    def worker(name: str) -> None:
        with psycopg.connect(db_dsn, autocommit=True) as c:
            barrier.wait()
            idle_rounds = 0
            first = True
            while idle_rounds < 30:
                row = c.execute("select memory.claim_job(%s)", (name,)).fetchone()
                job = row[0] if row else None
                if first:
                    with lock:
                        first_round.append(job)
                    first = False
                if job is None:
                    idle_rounds += 1
                    continue
                idle_rounds = 0
                ws = job["workspace_id"]
                with lock:
                    claimed.append(job["job_id"])
                    if ws in held:
                        problems.append(f"{name} and {held[ws]} both hold a job in {ws}")
                    held[ws] = name
                args = (ws, job["job_id"], job["token"])
                c.execute("select memory.start_attempt(%s, %s, %s, 0.01)", args)
                output = {"title": "t", "summary": "s",
                          "source_ids": [s["id"] for s in job["input"]["sources"]]}
                c.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                          (*args, Jsonb(output), Jsonb(USAGE)))
                # Release our mark before the commit: until the commit, the database still
                # refuses every other claim in this workspace, so a second holder is a bug.
                with lock:
                    held.pop(ws, None)
                c.execute("select memory.commit_job(%s, %s, %s)", args)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)

    assert problems == []
    first_jobs = [j for j in first_round if j is not None]
    assert 1 <= len(first_jobs) <= len(WORKSPACES)
    assert len({j["workspace_id"] for j in first_jobs}) == len(first_jobs), \
        "simultaneous first claims landed in distinct workspaces"
    dupes = [job for job, n in Counter(claimed).items() if n > 1]
    assert dupes == [], "no job is claimed twice"
    assert sorted(claimed) == sorted(
        r[0] for r in conn.execute("select job_id from memory_private.jobs").fetchall())
    statuses = conn.execute("select status, count(*) from memory_private.jobs group by 1"
                            ).fetchall()
    assert statuses == [("succeeded", total)]
    attempts = conn.execute("select max(attempt_no) from memory_private.job_attempts").fetchone()
    assert attempts == (1,), "every job was claimed exactly once"


def test_simultaneous_claims_in_one_workspace_yield_exactly_one_running_job(
        conn: psycopg.Connection, db_dsn: str) -> None:
    w = World(conn)
    w.basic("solo", users=USERS)
    for user in USERS:
        w.conversation("solo", f"r-{user}", chat=f"dm-{user}", user=user)
    advance(conn, "31 minutes")
    assert maintenance(conn)["extract_jobs_created"] == len(USERS)
    barrier = threading.Barrier(WORKERS)
    results: list[Any] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with psycopg.connect(db_dsn, autocommit=True) as c:
            barrier.wait()
            row = c.execute("select memory.claim_job(%s)", (name,)).fetchone()
            with lock:
                results.append(row[0] if row else None)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len([r for r in results if r is not None]) == 1
    running = conn.execute("select count(*) from memory_private.jobs where status = 'running'"
                           ).fetchone()
    assert running == (1,)
