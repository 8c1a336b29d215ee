"""Maintenance that grows with change, and the retention sweep (issues 34 and 40).

Five measurements, each through the public API (``memory.maintain_next_workspace``,
``memory.run_maintenance``, ``memory.upsert_message``) over history written in bulk
(``INSERT ... SELECT`` into the memory_private tables, which notes no change: a workspace so
written is idle until something changes it):

- **A pass beside idle workspaces.** ``changed`` workspaces each get one new message (the
  change), then the worker's walk (``maintain_next_workspace`` until NULL) is timed; first
  beside ``changed`` idle workspaces, then beside ``idle`` of them. The walk must visit the
  changed ones only, and cost the same.
- **A tick beside stopped inputs.** One workspace holds ``stopped`` scopes whose extraction
  input stopped (a stopped job of exactly the scheduler's input), another none; each gets the
  same change (a new message in a live conversation) and its tick (``run_maintenance``) is
  timed.
- **A tick after many new conversations.** ``n`` conversations imported through the API in
  one transaction (1,000 and 10,000, beside each other): the tick that follows (it plans each
  idle end) and, with no idle window, the tick that schedules them. Its ms per conversation
  must not grow with n.
- **A tick after removals beside history.** 50 messages removed in a workspace whose past
  holds 10,000 finished jobs and in one with none: the tick (its scrub) must cost the same.
- **The retention sweep.** ``workspaces`` x ``per_workspace`` messages past their retention are
  swept by walks until none is left: the rate, and the longest single maintenance transaction
  (the longest a workspace's memory lock is held), while another connection ingests
  (``upsert_message`` into the same workspaces), beside the same ingest without the sweep.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import psycopg

from pyworker.lab.bench import db

Section = dict[str, Any]
PREFIX = "bench-mnt"
TARGET_PASS_X = 1.2       # a pass beside 10,000 idle workspaces / beside 100
TARGET_STOPPED_X = 1.2    # a tick with 1,000 stopped inputs / with none ("about 1x")
TARGET_LOCK_MS = 100.0    # the longest maintenance transaction of the sweep
TARGET_MANY_X = 1.5       # a tick's ms per new conversation: the larger size / the smaller
TARGET_SCRUB_X = 1.2      # a tick after 50 removals beside 10,000 past jobs / beside none


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def bulk_workspaces(conn: psycopg.Connection, names: str, first: int, count: int, *,
                    conversations: int, topics: int = 1, expired: bool = False) -> None:
    """``count`` workspaces ``<names>-<first>``.. with a member u1, a bot b1, a linked group
    ``grp`` with ``topics`` topics, and ``conversations`` finished conversations per topic (a
    user message and the reply, 300 bytes each), an hour old; past their retention when
    ``expired``. Written directly: nothing is due."""
    ws = f"format('%s-%s', '{names}', lpad(w::text, 6, '0'))"
    span = f"generate_series({first}, {first + count - 1}) w"
    retain = "now() - interval '1 minute'" if expired else "null"
    with conn.transaction():
        conn.execute(f"""
          insert into memory_private.workspaces
            (workspace_id, config_version, budget_usd, spent_usd, created_at, updated_at)
          select {ws}, 1, 1000, 0, now() - interval '1 day', now() - interval '1 day' from {span}""")
        for table, columns, values in (
                ("members", "workspace_id, user_id, role, active, updated_at",
                 "'u1', 'owner', true, now()"),
                ("bots", "workspace_id, bot_id, identity, active, updated_at",
                 "'b1', 'b1-identity', true, now()"),
                ("chats", "workspace_id, chat_id, kind, private_user_id, linked, updated_at",
                 "'grp', 'group', null, true, now()")):
            conn.execute(f"insert into memory_private.{table} ({columns}) "
                         f"select {ws}, {values} from {span}")
        conn.execute(f"""
          insert into memory_private.topics (workspace_id, chat_id, topic_id)
          select {ws}, 'grp', t from {span}, generate_series(0, {topics - 1}) t""")
        conn.execute(f"""
          insert into memory_private.requests
            (workspace_id, request_id, bot_id, chat_id, topic_id, user_id, kind, status,
             model_provider, model_id, budget_usd, spent_usd, thread_id, created_at, updated_at,
             finished_at)
          select {ws}, format('r-%s-%s', t, c), 'b1', 'grp', t, 'u1', 'interactive',
                 'succeeded', 'fake', 'm', 1, 0, 'th', now() - interval '1 hour',
                 now() - interval '1 hour', now() - interval '1 hour'
            from {span}, generate_series(0, {topics - 1}) t,
                 generate_series(1, {conversations}) c""")
        conn.execute(f"""
          insert into memory_private.messages
            (workspace_id, message_id, request_id, role, speaker_id, body, content_hash,
             directed, retain_until, created_at)
          select q.workspace_id, q.request_id || '-' || r.role, q.request_id, r.role,
                 case when r.role = 'user' then 'u1' else 'b1' end, b.body,
                 memory_private.content_hash(b.body), true, {retain}, now() - interval '1 hour'
            from {span}
            join memory_private.requests q on q.workspace_id = {ws}
           cross join (values ('user'), ('assistant')) r(role)
           cross join lateral (select repeat('The export totals differ from last week. ', 7)
                                      || q.request_id || r.role as body) b""")
    conn.execute("analyze")


def live_message(conn: psycopg.Connection, ws: str, n: int) -> None:
    """The change a measured pass follows: a new message in the workspace's live request."""
    conn.execute("select memory.upsert_request(%s, 'live', 'b1', 'grp', 0, 'u1', 'interactive', "
                 "'running', 'fake', 'm', 1, 0, null)", (ws,))
    conn.execute("select memory.upsert_message(%s, %s, 'live', 'user', 'u1', %s, true, null, "
                 "'{}')", (ws, f"live-{n}", f"a new message, number {n}"))


def walk(conn: psycopg.Connection) -> tuple[float, list[dict[str, Any]], list[float]]:
    """The worker's walk: maintain_next_workspace until NULL. Returns its ms, the counts of
    every tick, and each tick's ms (one transaction each)."""
    ticks: list[dict[str, Any]] = []
    each: list[float] = []
    after = None
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        row = conn.execute("select memory.maintain_next_workspace(%s)", (after,)).fetchone()
        each.append(_ms(t1))
        if row is None or row[0] is None:
            return _ms(t0), ticks, each
        ticks.append(row[0])
        after = row[0]["workspace_id"]


def settle(conn: psycopg.Connection) -> None:
    for _ in range(10):
        _, ticks, _ = walk(conn)
        if not ticks:
            return


def _passes(conn: psycopg.Connection, changed: list[str], passes: int, mark: int) -> Section:
    times: list[float] = []
    visited: set[str] = set()
    for p in range(passes):
        for ws in changed:
            live_message(conn, ws, mark + p)
        ms, ticks, _ = walk(conn)
        times.append(ms)
        visited.update(t["workspace_id"] for t in ticks)
        settle(conn)  # what the ticks' own job changes leave due, outside the timing
    return {"passes": passes, "p50_ms": round(statistics.median(times), 2),
            "min_ms": round(min(times), 2), "visited": len(visited)}


def measure_pass(conn: psycopg.Connection, *, changed: int, idle: int, passes: int) -> Section:
    """A pass after ``changed`` workspaces changed, beside ``changed`` then ``idle`` idle ones."""
    names = f"{PREFIX}-p"
    t0 = time.perf_counter()
    bulk_workspaces(conn, names, 0, 2 * changed, conversations=4)
    ids = [f"{names}-{i:06d}" for i in range(changed)]
    for i, ws in enumerate(ids):  # the changed ones: ticked once, so only changes remain
        live_message(conn, ws, -1 - i)
    settle(conn)
    small = _passes(conn, ids, passes, 0)
    bulk_workspaces(conn, names, 2 * changed, idle - changed, conversations=4)
    build = round(time.perf_counter() - t0, 1)
    large = _passes(conn, ids, passes, passes)
    row = conn.execute("select count(*) from memory_private.workspace_memory "
                       "where workspace_id like %s and maintained_at is not null",
                       (f"{names}-%",)).fetchone()
    return {"status": "ok", "changed": changed, "idle_small": changed, "idle_large": idle,
            "small": small, "large": large, "build_seconds": build,
            "ever_maintained": int(row[0]) if row else -1,
            "x": round(large["p50_ms"] / small["p50_ms"], 3) if small["p50_ms"] else None}


def measure_stopped(conn: psycopg.Connection, *, stopped: int, ticks: int) -> Section:
    """A tick after one change, in a workspace with ``stopped`` stopped inputs and in one
    without."""
    names = f"{PREFIX}-s"
    t0 = time.perf_counter()
    bulk_workspaces(conn, names, 0, 1, conversations=1, topics=stopped + 1)
    bulk_workspaces(conn, names, 1, 1, conversations=1)
    with_ws, none_ws = f"{names}-000000", f"{names}-000001"
    for ws in (with_ws, none_ws):  # the history's first tick derives every scope
        conn.execute("insert into memory_private.maintenance_due (workspace_id, due_at) "
                     "values (%s, now())", (ws,))
        conn.execute("select memory.run_maintenance(%s)", (ws,))  # an extraction per scope
    # Every input of the first but topic 0 stops (three failed calls, say): blocked.
    conn.execute("update memory_private.jobs set status = 'stopped', finished_at = now(), "
                 "last_error = 'bench: a stopped input' "
                 "where workspace_id = %s and status = 'pending' and scope_id <> "
                 "(select scope_id from memory_private.scopes where workspace_id = %s "
                 "and chat_id = 'grp' and topic_id = 0)", (with_ws, with_ws))
    row = conn.execute("select count(*) from memory_private.jobs where workspace_id = %s "
                       "and status = 'stopped'", (with_ws,)).fetchone()
    build = round(time.perf_counter() - t0, 1)
    times: dict[str, list[float]] = {"none": [], "stopped": []}
    for n in range(-1, ticks):  # the two interleaved, after one tick each untimed
        for name, ws in (("none", none_ws), ("stopped", with_ws)):
            live_message(conn, ws, n)
            t1 = time.perf_counter()
            conn.execute("select memory.run_maintenance(%s)", (ws,))
            if n >= 0:
                times[name].append(_ms(t1))
    out = {name: {"ticks": ticks, "p50_ms": round(statistics.median(ts), 2),
                  "min_ms": round(min(ts), 2)} for name, ts in times.items()}
    return {"status": "ok", "stopped_inputs": int(row[0]) if row else -1, **out,
            "build_seconds": build,
            "x": round(out["stopped"]["p50_ms"] / out["none"]["p50_ms"], 3)
            if out["none"]["p50_ms"] else None}


def _fresh_workspace(conn: psycopg.Connection, ws: str, idle_minutes: int, topics: int) -> None:
    """A workspace through the public API: a member, a bot and a linked group of ``topics``
    topics, ticked once (so only what follows is due)."""
    conn.execute("select memory.upsert_workspace(%s, 1, 1000, 0, %s)", (ws, idle_minutes))
    conn.execute("select memory.upsert_member(%s, 'u1', 'owner', true)", (ws,))
    conn.execute("select memory.upsert_bot(%s, 'b1', 'b1-identity', true)", (ws,))
    conn.execute("select memory.upsert_chat(%s, 'grp', 'group', null, true)", (ws,))
    conn.execute("select memory.upsert_topic(%s, 'grp', t, null) "
                 "from generate_series(1, %s) t", (ws, topics - 1))
    conn.execute("select memory.run_maintenance(%s)", (ws,))


def _import(conn: psycopg.Connection, ws: str, n: int, topics: int) -> float:
    """``n`` finished conversations (a request, a user message, the reply) reported through
    the public API in one transaction, spread over the topics; its seconds."""
    t0 = time.perf_counter()
    with conn.transaction():
        conn.execute(
            """select memory.upsert_request(%(ws)s, 'c' || i, 'b1', 'grp', i %% %(topics)s,
                                            'u1', 'interactive', 'succeeded', 'fake', 'm', 1, 0,
                                            null),
                      memory.upsert_message(%(ws)s, 'c' || i || '-u', 'c' || i, 'user', 'u1',
                                            'what was decided about the export, number ' || i,
                                            true, null, '{}'),
                      memory.upsert_message(%(ws)s, 'c' || i || '-a', 'c' || i, 'assistant',
                                            'b1', 'the export totals are weekly now, ' || i,
                                            true, null, '{}')
                 from generate_series(1, %(n)s) i""", {"ws": ws, "n": n, "topics": topics})
    return time.perf_counter() - t0


def measure_many(conn: psycopg.Connection, *, sizes: tuple[int, ...]) -> Section:
    """A tick after ``n`` new conversations, for each size: the tick that follows their import
    (it plans each one's idle end) and, in a workspace with no idle window, the tick that
    schedules them (the verdict of every conversation, the batches). Linear in n: the ms per
    conversation stays the same from the smaller size to the larger."""
    names = f"{PREFIX}-n"
    out: dict[str, Any] = {}
    for n in sizes:
        topics = max(1, n // 100)
        row: dict[str, Any] = {"conversations": n, "scopes": topics}
        for what, idle in (("after_import", 30), ("scheduling", 0)):
            ws = f"{names}-{what}-{n}"
            _fresh_workspace(conn, ws, idle, topics)
            seconds = _import(conn, ws, n, topics)
            t0 = time.perf_counter()
            got = conn.execute("select memory.run_maintenance(%s)", (ws,)).fetchone()
            ms = _ms(t0)
            counts = got[0] if got else {}
            row[what] = {"tick_ms": round(ms, 1), "us_per_conversation": round(1000 * ms / n, 1),
                         "import_s": round(seconds, 2),
                         "extract_jobs_created": counts.get("extract_jobs_created", 0),
                         "statistics_refreshed": counts.get("statistics_refreshed", 0)}
            if what == "after_import":
                due = conn.execute("select count(*) from memory_private.maintenance_due "
                                   "where workspace_id = %s and foreseen", (ws,)).fetchone()
                row[what]["foreseen_rows"] = int(due[0]) if due else -1
            conn.execute("delete from memory_private.workspaces where workspace_id = %s", (ws,))
        out[str(n)] = row
    small, large = out[str(sizes[0])], out[str(sizes[-1])]
    x = {what: round(large[what]["us_per_conversation"] / small[what]["us_per_conversation"], 3)
         if small[what]["us_per_conversation"] else None
         for what in ("after_import", "scheduling")}
    return {"status": "ok", "sizes": list(sizes), "by_size": out, "x": x}


def measure_scrub(conn: psycopg.Connection, *, past_jobs: int, removals: int,
                  ticks: int) -> Section:
    """The tick after ``removals`` messages are removed, in a workspace whose history holds
    ``past_jobs`` finished jobs (naming other messages of it) and in one with none: erasing
    reads what names the removed messages, not the workspace's history."""
    names = f"{PREFIX}-r"
    history, bare = f"{names}-history", f"{names}-bare"
    removed = removals * (ticks + 1)  # conversations c1.. lose their user message, in turn
    others = 100                      # the conversations the past jobs name
    t0 = time.perf_counter()
    for ws in (history, bare):
        _fresh_workspace(conn, ws, 30, 1)
        _import(conn, ws, removed + others, 1)
        conn.execute("select memory.run_maintenance(%s)", (ws,))
    # The history: finished jobs of the past, each naming the messages of five conversations.
    conn.execute(
        """insert into memory_private.jobs
             (workspace_id, scope_id, phase, status, input, input_hash, origin_request_id,
              model_provider, model_id, config_version, claims, next_attempt_at, created_at,
              updated_at, finished_at)
           select %(ws)s, s.scope_id, 'extract', 'succeeded',
                  jsonb_build_object(
                    'bot_identity', 'b1-identity', 'existing', '[]'::jsonb,
                    'sources', (select jsonb_agg(jsonb_build_object('id', m.message_id,
                                                                    'hash', m.content_hash))
                                  from generate_series(0, 4) k
                                  join memory_private.messages m
                                    on m.workspace_id = %(ws)s
                                   and m.request_id = 'c' || (%(removed)s + 1
                                                              + (j * 5 + k) %% %(others)s))),
                  md5(j::text), 'c1', 'fake', 'm', 1, 1, now(), now(), now(), now()
             from generate_series(1, %(jobs)s) j
             join memory_private.scopes s on s.workspace_id = %(ws)s""",
        {"ws": history, "jobs": past_jobs, "removed": removed, "others": others})
    conn.execute("analyze memory_private.jobs")
    build = round(time.perf_counter() - t0, 1)
    times: dict[str, list[float]] = {"bare": [], "history": []}
    for t in range(ticks + 1):  # the first of each untimed
        for name, ws in (("bare", bare), ("history", history)):
            for i in range(removals):
                conn.execute("select memory.remove_message(%s, %s)",
                             (ws, f"c{1 + t * removals + i}-u"))
            t1 = time.perf_counter()
            got = conn.execute("select memory.run_maintenance(%s)", (ws,)).fetchone()
            if t:
                times[name].append(_ms(t1))
            if got is None or got[0].get("messages_scrubbed") != removals:
                raise RuntimeError(f"the tick did not scrub the {removals} removals: {got}")
    for ws in (history, bare):
        conn.execute("delete from memory_private.workspaces where workspace_id = %s", (ws,))
    out = {name: {"ticks": ticks, "p50_ms": round(statistics.median(ts), 2)}
           for name, ts in times.items()}
    return {"status": "ok", "past_jobs": past_jobs, "removals": removals, **out,
            "build_seconds": build,
            "x": round(out["history"]["p50_ms"] / out["bare"]["p50_ms"], 3)
            if out["bare"]["p50_ms"] else None}


INGEST_EVERY = 0.002  # a call every 2 ms at most: a busy backend, not a flood


def _ingest(dsn: str, workspaces: list[str], stop: threading.Event, limit: int,
            tag: str) -> list[float]:
    """upsert_message calls, one a transaction, round robin over ``workspaces``, one per
    INGEST_EVERY at most, until ``stop`` or ``limit`` calls; their ms."""
    out: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for ws in workspaces:
            conn.execute("select memory.upsert_request(%s, %s, 'b1', 'grp', 0, 'u1', "
                         "'interactive', 'running', 'fake', 'm', 1, 0, null)", (ws, tag))
        n = 0
        while not stop.is_set() and n < limit:
            ws = workspaces[n % len(workspaces)]
            t0 = time.perf_counter()
            conn.execute("select memory.upsert_message(%s, %s, %s, 'user', 'u1', %s, true, "
                         "null, '{}')", (ws, f"{tag}-{n}", tag, f"ingest while sweeping {n}"))
            out.append(_ms(t0))
            n += 1
            time.sleep(max(0.0, INGEST_EVERY - (time.perf_counter() - t0)))
    return out


def _latency(samples: list[float]) -> Section:
    s = sorted(samples)
    if not s:
        return {"n": 0}
    return {"n": len(s), "p50_ms": round(s[len(s) // 2], 3),
            "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3)}


def measure_sweep(conn: psycopg.Connection, dsn: str, *, workspaces: int,
                  per_workspace: int, ingest_samples: int) -> Section:
    names = f"{PREFIX}-x"
    t0 = time.perf_counter()
    bulk_workspaces(conn, names, 0, workspaces, conversations=per_workspace // 2, expired=True)
    ids = [f"{names}-{i:06d}" for i in range(workspaces)]
    # The retention end their last tick foresaw.
    conn.execute("insert into memory_private.maintenance_due (workspace_id, due_at, foreseen) "
                 "select workspace_id, now(), true from memory_private.workspaces "
                 "where workspace_id like %s "
                 "on conflict (workspace_id) where foreseen and request_id is null "
                 "do update set due_at = excluded.due_at", (f"{names}-%",))
    conn.execute("analyze memory_private.messages")
    build = round(time.perf_counter() - t0, 1)
    quiet = _ingest(dsn, ids, threading.Event(), ingest_samples, "quiet")
    stop = threading.Event()
    during: list[float] = []
    thread = threading.Thread(target=lambda: during.extend(
        _ingest(dsn, ids, stop, 10**9, "busy")))
    thread.start()
    erased, walks, longest, ticks = 0, 0, 0.0, 0
    t1 = time.perf_counter()
    try:
        while True:
            _, done, each = walk(conn)
            walks += 1
            ticks += len(done)
            longest = max([longest, *each])
            erased += sum(int(t.get("messages_expired", 0)) for t in done)
            if not any(t.get("sweep_backlog") for t in done):
                break
    finally:
        seconds = time.perf_counter() - t1
        stop.set()
        thread.join()
    row = conn.execute("select count(*) from memory_private.messages where workspace_id like %s "
                       "and body is not null and retain_until <= now()",
                       (f"{names}-%",)).fetchone()
    return {"status": "ok", "workspaces": workspaces, "expired": workspaces * per_workspace,
            "erased": erased, "left": int(row[0]) if row else -1, "walks": walks,
            "ticks": ticks, "seconds": round(seconds, 2),
            "messages_per_second": round(erased / seconds) if seconds else None,
            "longest_transaction_ms": round(longest, 1), "build_seconds": build,
            "ingest_without_sweep": _latency(quiet), "ingest_during_sweep": _latency(during)}


def measure(dsn: str, *, changed: int, idle: int, passes: int, stopped: int,
            sweep_workspaces: int, sweep_per_workspace: int, ingest_samples: int,
            many: tuple[int, ...] = (1000, 10_000), past_jobs: int = 10_000) -> Section:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not any(db.has_function(conn, f"memory_private.due_workspaces({arguments})")
                   for arguments in ("text,integer,timestamptz", "text,integer")):
            return db.not_available("maintenance does not follow change in this schema yet")
        conn.execute("delete from memory_private.workspaces where workspace_id like %s",
                     (f"{PREFIX}-%",))
        # The other sections' workspaces are written directly or measured through ingest;
        # what they left due is not this section's change.
        conn.execute("delete from memory_private.maintenance_due")
        try:
            return {"status": "ok",
                    "pass": measure_pass(conn, changed=changed, idle=idle, passes=passes),
                    "stopped": measure_stopped(conn, stopped=stopped, ticks=passes),
                    "many": measure_many(conn, sizes=many),
                    "scrub": measure_scrub(conn, past_jobs=past_jobs, removals=50,
                                           ticks=passes),
                    "sweep": measure_sweep(conn, dsn, workspaces=sweep_workspaces,
                                           per_workspace=sweep_per_workspace,
                                           ingest_samples=ingest_samples)}
        finally:
            conn.execute("delete from memory_private.workspaces where workspace_id like %s",
                         (f"{PREFIX}-%",))


def verdict(section: Section) -> list[dict[str, Any]]:
    if section.get("status") != "ok":
        return [{"name": "maintenance that grows with change", "met": None,
                 "note": section.get("reason", "not available yet")}]
    p, s, w = section["pass"], section["stopped"], section["sweep"]
    n, r = section["many"], section["scrub"]
    small, large = n["sizes"][0], n["sizes"][-1]
    return [
        db.target(f"maintenance pass after {p['changed']} changes: beside {p['idle_large']} idle "
                  f"workspaces / beside {p['idle_small']}", p["x"], TARGET_PASS_X),
        db.target(f"tick after {large} new conversations, per conversation / after {small}",
                  n["x"]["after_import"], TARGET_MANY_X),
        db.target(f"tick scheduling {large} conversations, per conversation / {small}",
                  n["x"]["scheduling"], TARGET_MANY_X),
        db.target(f"tick after {r['removals']} removals: beside {r['past_jobs']} past jobs / "
                  "beside none", r["x"], TARGET_SCRUB_X),
        db.target(f"maintenance tick after one change: {s['stopped_inputs']} stopped inputs / "
                  "none", s["x"], TARGET_STOPPED_X),
        db.target(f"retention sweep of {w['expired']} expired messages: longest maintenance "
                  "transaction ms", w["longest_transaction_ms"], TARGET_LOCK_MS),
    ]


def markdown(section: Section) -> list[str]:
    lines = ["", "## Maintenance and the retention sweep", ""]
    if section.get("status") != "ok":
        return [*lines, f"Not available: {section.get('reason')}"]
    p, s, w = section["pass"], section["stopped"], section["sweep"]
    lines += [
        (f"A pass (the worker's walk) after one new message in each of {p['changed']} "
         f"workspaces: {p['small']['p50_ms']} ms beside {p['idle_small']} idle workspaces, "
         f"{p['large']['p50_ms']} ms beside {p['idle_large']} ({p['x']}x; median of "
         f"{p['large']['passes']} passes; workspaces visited {p['large']['visited']}; idle "
         f"workspaces ever maintained: {p['ever_maintained'] - p['changed']})."),
        "",
        (f"A tick after one new message: {s['none']['p50_ms']} ms with no stopped input, "
         f"{s['stopped']['p50_ms']} ms with {s['stopped_inputs']} ({s['x']}x)."),
        "",
        "A tick after n new conversations (imported through the API in one transaction):",
        "",
        ("| n | scopes | tick after the import ms | µs each | foreseen rows | scheduling tick "
         "ms | µs each | jobs |"),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {k} | {v['scopes']} | {v['after_import']['tick_ms']} | "
          f"{v['after_import']['us_per_conversation']} | {v['after_import']['foreseen_rows']} | "
          f"{v['scheduling']['tick_ms']} | {v['scheduling']['us_per_conversation']} | "
          f"{v['scheduling']['extract_jobs_created']} |"
          for k, v in section["many"]["by_size"].items()),
        "",
        (f"A tick after {section['scrub']['removals']} removals: "
         f"{section['scrub']['bare']['p50_ms']} ms in a workspace with no past job, "
         f"{section['scrub']['history']['p50_ms']} ms beside {section['scrub']['past_jobs']} "
         f"({section['scrub']['x']}x)."),
        "",
        (f"The sweep of {w['expired']} expired messages in {w['workspaces']} workspaces: "
         f"{w['seconds']} s, {w['messages_per_second']} messages/s, {w['ticks']} ticks in "
         f"{w['walks']} walks, longest maintenance transaction {w['longest_transaction_ms']} ms, "
         f"{w['left']} left. Ingest (upsert_message, one per transaction, into the same "
         f"workspaces from another connection): p50 {w['ingest_without_sweep'].get('p50_ms')} / "
         f"p99 {w['ingest_without_sweep'].get('p99_ms')} ms without the sweep, p50 "
         f"{w['ingest_during_sweep'].get('p50_ms')} / p99 "
         f"{w['ingest_during_sweep'].get('p99_ms')} ms during it "
         f"({w['ingest_during_sweep'].get('n')} calls)."),
        "",
        (f"Build seconds (bulk history): pass {p['build_seconds']}, stopped inputs "
         f"{s['build_seconds']}, sweep {w['build_seconds']}."),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    """The section alone: ``python -m pyworker.lab.bench.maintenance [--quick] [--dsn DSN]``,
    in a throwaway cluster of the machine's PostgreSQL binaries without --dsn."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the quick profile's sizes")
    parser.add_argument("--dsn", help="a scratch database (superuser), else a throwaway cluster")
    args = parser.parse_args(argv)
    from pyworker import schema
    from pyworker.lab.bench import PROFILES

    p = PROFILES["quick" if args.quick else "default"]
    cleanup = None
    dsn = args.dsn
    if dsn is None:
        from pyworker.lab.servers import LocalCluster, find_bindir

        bindir = find_bindir()
        if bindir is None:
            raise SystemExit("no local PostgreSQL binaries: pass --dsn")
        cluster = LocalCluster(bindir).init().start()
        cleanup = cluster.destroy
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("create database pimem_bench")
        dsn = cluster.dsn("pimem_bench")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            if not conn.execute("select 1 from pg_namespace where nspname = 'memory'").fetchone():
                schema.apply_canonical(conn)
        section = measure(dsn, changed=p.maint_changed, idle=p.maint_idle,
                          passes=p.maint_passes, stopped=p.maint_stopped,
                          sweep_workspaces=p.sweep_workspaces,
                          sweep_per_workspace=p.sweep_messages,
                          ingest_samples=max(100, p.ingest_samples // 3),
                          many=p.maint_many, past_jobs=p.maint_past_jobs)
    finally:
        if cleanup is not None:
            cleanup()
    print(json.dumps(section, indent=2))
    print("\n".join(markdown(section)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
