"""Load: ingest and recall never wait on a job's transaction (P16), shown with lock timeouts
while a real commit_job transaction is held open, and measured under concurrent load from many
connections while jobs commit (figures printed; PIMEM_LOAD_REPORT=path writes them as JSON)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.jobs_world import USAGE, advance, checkpoint, claim, maintenance, start


def _committing_job(conn: psycopg.Connection) -> dict[str, Any]:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="I prefer tea")
    advance(conn, "31 minutes")
    maintenance(conn, "ws1")
    job = claim(conn)
    assert job is not None
    start(conn, job)
    checkpoint(conn, job, {"title": "tea", "summary": "alice prefers tea",
                           "source_ids": ["r1-u"]}, USAGE)
    return job


def test_ingest_and_recall_do_not_wait_while_a_commit_holds_the_workspace(
    conn: psycopg.Connection, db_dsn: str
) -> None:
    job = _committing_job(conn)
    holder = psycopg.connect(db_dsn)
    try:
        holder.execute("select memory.commit_job(%s, %s, %s)",
                       (job["workspace_id"], job["job_id"], job["token"]))  # left open
        with psycopg.connect(db_dsn, autocommit=True) as other:
            other.execute("set lock_timeout = '300ms'")
            w = World(other)
            # Every ingest call of the same workspace, scope and request goes through.
            w.request("ws1", "r2", chat="dm-alice", user="alice", status="running")
            w.message("ws1", "r2-u", "r2", "user", "alice", "and coffee too")
            w.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea!")  # an edit
            w.member("ws1", "carol", "member")
            w.grant("ws1", "alice", "repo")
            w.request("ws1", "r2", chat="dm-alice", user="alice")
            recalled = other.execute("select memory.recall('ws1', 'r2')").fetchone()
            assert recalled is not None
            other.execute("select * from memory.resolve_scope('ws1', 'r2')")
        holder.commit()
    finally:
        holder.close()


@pytest.mark.slow  # a load profile
def test_concurrent_ingest_and_recall_while_jobs_commit(db_dsn: str,
                                                        conn: psycopg.Connection) -> None:
    seconds = float(os.environ.get("PIMEM_LOAD_SECONDS", "4"))
    threads_n = int(os.environ.get("PIMEM_LOAD_THREADS", "8"))
    w = World(conn)
    for i in range(4):
        w.basic(f"ws{i}")
        # Idle group topics give the committer a steady supply of jobs in the same workspaces.
        for topic in range(1, 11):
            w.topic(f"ws{i}", "grp", topic)
            w.conversation(f"ws{i}", f"g{topic}", chat="grp", user="bob", topic=topic,
                           user_text=f"we decided to use plan {topic}", reply="Decision noted.")
    advance(conn, "31 minutes")
    stop = threading.Event()
    latencies: dict[str, list[float]] = {"ingest": [], "recall": [], "commit": []}
    errors: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        ws = f"ws{n % 4}"
        user = "alice" if n % 2 else "bob"
        i = 0
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                cw = World(c)
                while not stop.is_set():
                    i += 1
                    req = f"c{n}-{i}"
                    t0 = time.perf_counter()
                    cw.request(ws, req, chat=f"dm-{user}", user=user)
                    cw.message(ws, f"{req}-u", req, "user", user, f"note {i}: I prefer plan {n}")
                    cw.message(ws, f"{req}-a", req, "assistant", "bot1", "ok")
                    t1 = time.perf_counter()
                    c.execute("select memory.recall(%s, %s)", (ws, req))
                    t2 = time.perf_counter()
                    with lock:
                        latencies["ingest"].append((t1 - t0) / 3)
                        latencies["recall"].append(t2 - t1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    def committer() -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                while not stop.is_set():
                    maintenance(c)
                    job = claim(c, "load")
                    if job is None:
                        continue
                    t0 = time.perf_counter()
                    start(c, job, "0.001")
                    if job["phase"] == "extract":
                        ids = [s["id"] for s in job["input"]["sources"]]
                        out: dict[str, Any] = {"title": "plan", "summary": "prefers a plan",
                                               "source_ids": ids}
                    else:
                        ids = [x["id"] for x in job["input"]["candidates"]][:12]
                        out = {"index": "plans", "record_ids": ids}
                    c.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                              (job["workspace_id"], job["job_id"], job["token"], Jsonb(out),
                               Jsonb({"input_tokens": 1, "output_tokens": 1, "cost_usd": 0})))
                    c.execute("select memory.commit_job(%s, %s, %s)",
                              (job["workspace_id"], job["job_id"], job["token"]))
                    with lock:
                        latencies["commit"].append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    pool = [threading.Thread(target=client, args=(n,)) for n in range(threads_n)]
    pool.append(threading.Thread(target=committer))
    for t in pool:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join(timeout=60)
    assert errors == []
    report = {name: {"n": len(v), "p50_ms": round(statistics.median(v) * 1000, 2),
                     "max_ms": round(max(v) * 1000, 2)} for name, v in latencies.items() if v}
    report["threads"] = threads_n
    report["seconds"] = seconds
    print(json.dumps(report))
    if os.environ.get("PIMEM_LOAD_REPORT"):
        Path(os.environ["PIMEM_LOAD_REPORT"]).write_text(json.dumps(report, indent=1))
    assert report["ingest"]["n"] > threads_n and report["commit"]["n"] > 0
