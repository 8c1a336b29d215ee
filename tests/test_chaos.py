"""Chaos: several real worker processes against a real database and the local fake model;
workers are killed with SIGKILL at random points and PostgreSQL is restarted once with
`pg_ctl stop -m immediate`. Afterwards every invariant holds: no job committed twice, no
committed record lost, no job left running past its lease, every charge accounted for, every
scope's index consistent with its valid records.

Profiles: PIMEM_CHAOS_SECONDS (default 8 for CI; the release run uses 300, see
docs/reliability.md) and PIMEM_CHAOS_KILL_EVERY (seconds between kills, "low,high"; default
"0.2,0.8", the release run "2,6"). The CI profile is short and dense: a kill every 0.2-0.8 s,
the database crash at half time, and new conversations in three rounds, so that kills land on
workers starting up, claiming, calling the model and committing, and on the rounds' fresh
snapshots. Progress is awaited, never assumed from time: a kill waits until another worker is
past its start (its log shows a maintenance walk, a claim or no work), and the chaos goes on
past its seconds until a job was committed under it, within a generous deadline, so a loaded
machine makes the test slower, not red. Figures are printed and, with PIMEM_CHAOS_REPORT=path,
written as JSON.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pyworker import schema
from pyworker.lab.servers import find_bindir
from pyworker.testing import FakeModel, default_reply
from tests.conftest import local_cluster
from tests.factory import World

ROOT = Path(__file__).resolve().parent.parent
PRICES = json.dumps({"fake/m": {"input": 3, "output": 15}})


def build_world(conn: psycopg.Connection, workspaces: int, round_no: int) -> int:
    w = World(conn)
    made = 0
    for i in range(workspaces):
        ws = f"ws{i}"
        if round_no == 0:
            w.basic(ws)
        for user in ("alice", "bob"):
            req = f"r{round_no}-{user}"
            w.conversation(ws, req, chat=f"dm-{user}", user=user,
                           user_text=f"round {round_no}: I prefer option {i} and decided to ship",
                           reply="Noted, shipping.")
            made += 1
        req = f"g{round_no}"
        w.conversation(ws, req, chat="grp", user="bob", topic=7,
                       user_text=f"round {round_no}: we agreed to freeze the API",
                       reply="Freeze noted.")
        made += 1
    return made


# Waiting for real progress, never for a fixed time: how long a worker takes to start, or a
# job to finish, depends on the machine and its load (a loaded machine took 2.5 s to start a
# worker, and kills every 0.2-0.8 s then left no worker alive long enough to do anything).
PROGRESS_DEADLINE = 180.0  # seconds; generous, only a broken worker reaches it
# What a worker logs once it is past its start: a maintenance walk, a claim, or no work.
PAST_START = ('"event": "maintenance"', '"event": "job_claimed"', '"event": "no_work"')


class ChaosWorker:
    """A worker process whose log goes to a file, so the test can see it got past its start."""

    def __init__(self, dsn: str, fake: FakeModel, n: int, logs: Path) -> None:
        cmd = [sys.executable, "-m", "pyworker.cli", "worker", "--dsn", dsn, "--model",
               "openai", "--openai-base-url", fake.url, "--prices", PRICES, "--interval",
               "0.3", "--tick-seconds", "20", "--worker-id", f"chaos-{n}", "--log-level",
               "INFO"]
        env = {**os.environ, "PIMEM_OPENAI_API_KEY": "test"}
        self.log = logs / f"chaos-{n}.log"
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                         stderr=err)

    def past_start(self) -> bool:
        text = self.log.read_text(errors="replace")
        return any(mark in text for mark in PAST_START)


def wait_for(what: str, condition: Any, deadline: float) -> None:
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"no progress within {PROGRESS_DEADLINE:.0f} s: {what}")
        time.sleep(0.05)


def succeeded_jobs(dsn: str) -> int | None:
    """Jobs committed so far, or None while the database is coming back."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("select count(*) from memory_private.jobs "
                               "where status = 'succeeded'").fetchone()
    except psycopg.OperationalError:
        return None
    return int(row[0]) if row else 0


def check_invariants(conn: psycopg.Connection) -> dict[str, Any]:
    q = lambda sql: conn.execute(sql).fetchall()
    violations: list[str] = []
    twice = q("""select result->>'record_id', count(*) from memory_private.jobs
                  where status = 'succeeded' and result->>'record_id' is not null
                  group by 1 having count(*) > 1""")
    violations += [f"record {r} committed by {n} jobs" for r, n in twice]
    lost = q("""select j.job_id from memory_private.jobs j
                 where j.status = 'succeeded' and j.result->>'record_id' is not null
                   and not exists (select 1 from memory_private.records r
                                    where r.workspace_id = j.workspace_id
                                      and r.record_id = (j.result->>'record_id')::bigint)""")
    violations += [f"job {j} committed a record that is gone" for (j,) in lost]
    extra = q("""select count(*) from memory_private.records r where r.kind = 'extracted'
                   and not exists (select 1 from memory_private.jobs j
                                    where j.workspace_id = r.workspace_id
                                      and (j.result->>'record_id')::bigint = r.record_id)""")
    if extra[0][0]:
        violations.append(f"{extra[0][0]} extracted records without a committing job")
    stuck = q("""select job_id from memory_private.jobs where status = 'running'
                  and lease_expires_at <= memory_private.clock_now()""")
    violations += [f"job {j} running past its lease" for (j,) in stuck]
    uncharged = q("""select a.job_id, a.attempt_no from memory_private.job_attempts a
                      where a.outcome in ('ok', 'unknown')
                        and not exists (select 1 from memory_private.request_charges c
                                         where c.workspace_id = a.workspace_id
                                           and c.job_id = a.job_id
                                           and c.attempt_no = a.attempt_no)""")
    violations += [f"attempt {j}/{n} has no charge" for j, n in uncharged]
    totals = q("""select a.job_id, a.attempt_no, a.cost_usd, c.cost_usd
                    from memory_private.job_attempts a
                    join memory_private.request_charges c
                      on c.workspace_id = a.workspace_id and c.job_id = a.job_id
                     and c.attempt_no = a.attempt_no
                   where c.cost_usd is distinct from a.cost_usd or a.cost_usd > a.reserved_usd""")
    violations += [f"attempt {j}/{n} cost {a} but was charged {b} (or over its reserve)"
                   for j, n, a, b in totals]
    ws_totals = q("""select w.workspace_id from memory_private.workspace_memory w
                      where w.memory_spent_usd <> (select coalesce(sum(c.cost_usd), 0)
                                                     from memory_private.request_charges c
                                                    where c.workspace_id = w.workspace_id)""")
    violations += [f"workspace {w} spend differs from its charges" for (w,) in ws_totals]
    bad_index = q("""select s.scope_id, i.id from memory_private.scopes s
                       join memory_private.scope_indexes x using (workspace_id, scope_id)
                       cross join unnest(x.record_ids) i(id)
                      where s.consolidation_due_at is null
                        and not exists (select 1 from memory_private.records r
                                         where r.workspace_id = s.workspace_id
                                           and r.scope_id = s.scope_id and r.record_id = i.id
                                           and memory_private.record_invalid_reason(r, null)
                                               is null)""")
    violations += [f"scope {s} index names invalid record {i}" for s, i in bad_index]
    figures = dict(q("""select status, count(*) from memory_private.jobs group by 1"""))
    attempts = dict(q("""select outcome, count(*) from memory_private.job_attempts group by 1"""))
    return {"violations": violations, "jobs": figures, "attempts": attempts}


@pytest.mark.slow  # PIMEM_CHAOS_SECONDS of chaos
def test_workers_killed_and_a_database_crash_break_no_invariant(tmp_path: Path) -> None:
    """A kill happens only while another worker is past its start (so the pool is never all
    starting up), and the chaos goes on past PIMEM_CHAOS_SECONDS until the workers committed
    a job under it: progress is awaited, with a generous deadline, not assumed from time."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no local PostgreSQL binaries")
    seconds = float(os.environ.get("PIMEM_CHAOS_SECONDS", "8"))
    low, high = (float(x) for x in os.environ.get("PIMEM_CHAOS_KILL_EVERY", "0.2,0.8").split(","))
    rng = random.Random(int(os.environ.get("PIMEM_CHAOS_SEED", "7")))
    cluster = local_cluster(bindir).init().start()
    workers: list[ChaosWorker] = []
    fake = FakeModel().start()

    def slow_reply(body: dict[str, Any]) -> str:
        time.sleep(rng.uniform(0.0, 0.5))
        return default_reply(body)

    fake.responder = slow_reply
    kills = restarts = rounds = conversations = 0
    committed_under_chaos = 0
    try:
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            schema.apply_canonical(conn)
            conversations += build_world(conn, 3, 0)
            conn.execute("select memory_private.advance_clock('31 minutes')")
        workers = [ChaosWorker(dsn, fake, n, tmp_path) for n in range(3)]
        started = time.monotonic()
        progress_deadline = started + seconds + PROGRESS_DEADLINE
        restarted = False
        next_round = started + seconds / 4
        while time.monotonic() - started < seconds or committed_under_chaos == 0:
            time.sleep(rng.uniform(low, high))
            victim = rng.randrange(len(workers))
            wait_for("no worker got past its start (a maintenance walk, a claim)",
                     lambda spared=victim: any(w.past_start() for i, w in enumerate(workers)
                                               if i != spared), progress_deadline)
            workers[victim].proc.send_signal(signal.SIGKILL)
            workers[victim].proc.wait()
            kills += 1
            workers[victim] = ChaosWorker(dsn, fake, 100 + kills, tmp_path)
            if not restarted and time.monotonic() - started > seconds / 2:
                cluster.stop("immediate")
                time.sleep(0.5)
                cluster.start()
                restarted = True
                restarts += 1
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    # Leases of killed workers expire; new conversations make new snapshots.
                    conn.execute("select memory_private.advance_clock('3 minutes')")
                    if time.monotonic() > next_round:
                        rounds += 1
                        conversations += build_world(conn, 3, rounds)
                        conn.execute("select memory_private.advance_clock('31 minutes')")
                        next_round = time.monotonic() + seconds / 4
            except psycopg.OperationalError:
                pass  # the database is coming back; the next loop tries again
            committed_under_chaos = succeeded_jobs(dsn) or committed_under_chaos
            if time.monotonic() > progress_deadline:
                pytest.fail(f"no job committed under chaos within {PROGRESS_DEADLINE:.0f} s "
                            f"past the {seconds:.0f} s of chaos ({kills} kills)")
        for w in workers:
            w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.proc.wait(timeout=30)
        # Drain: expire what the kills left, let one clean worker finish the rest.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("select memory_private.advance_clock('3 minutes')")
        fake.responder = default_reply
        drain = ChaosWorker(dsn, fake, 999, tmp_path)
        deadline = time.monotonic() + PROGRESS_DEADLINE
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                time.sleep(0.2)
                open_jobs = conn.execute(
                    "select count(*) from memory_private.jobs "
                    "where status in ('pending', 'running')").fetchone()
                if open_jobs == (0,):
                    break
                conn.execute("select memory_private.advance_clock('3 minutes')")
        drain.proc.send_signal(signal.SIGTERM)
        drain.proc.wait(timeout=30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            report = check_invariants(conn)
        report.update({"seconds": round(time.monotonic() - started, 1), "kills": kills,
                       "database_restarts": restarts, "conversations": conversations,
                       "model_calls": fake.calls, "committed_under_chaos": committed_under_chaos})
        print(json.dumps(report, indent=1))
        if os.environ.get("PIMEM_CHAOS_REPORT"):
            Path(os.environ["PIMEM_CHAOS_REPORT"]).write_text(json.dumps(report, indent=1))
        assert report["violations"] == []
        assert restarts == 1 and kills >= 3 and rounds >= 2
        assert committed_under_chaos > 0, "the workers got work done meanwhile"
        assert fake.violations == []
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        fake.stop()
        cluster.destroy()
