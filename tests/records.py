"""Test helpers that place records directly (as the pipeline would), for tests of what reads
and sweeps do with them. Production records are written only by commit_job and manage_memory."""

from __future__ import annotations

import psycopg

from pyworker.lab.bench.data import DEPENDENCY_COPIES_DIFFERING, RECORDS_WITHOUT_USAGE


def scope_of(conn: psycopg.Connection, ws: str, request: str) -> int:
    row = conn.execute("select scope_id from memory.resolve_scope(%s, %s)", (ws, request)).fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def make_record(conn: psycopg.Connection, ws: str, request: str, sources: list[str], *,
                title: str = "a memory", summary: str = "something worth keeping",
                kind: str = "extracted", speakers: list[str] | None = None,
                reused: list[str] | None = None) -> int:
    """A record in the scope of ``request`` citing ``sources`` (in that order) at their current
    hashes, as a consolidated pipeline would leave it; ``reused`` are further dependencies (the
    messages of memories it declared it reused). Speakers default to the user messages'
    speakers among all of them."""
    deps = list(dict.fromkeys([*sources, *(reused or [])]))
    scope = scope_of(conn, ws, request)
    row = conn.execute(
        """
        insert into memory_private.records
          (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
           bot_identity, origin_request_id, created_at)
        select %(ws)s, %(scope)s, %(kind)s, %(title)s, %(summary)s,
               coalesce(%(speakers)s::text[],
                        (select array_agg(distinct m.speaker_id order by m.speaker_id)
                           from memory_private.messages m
                          where m.workspace_id = %(ws)s and m.message_id = any(%(src)s)
                            and m.role = 'user'), '{}'),
               coalesce((select array_agg(distinct q.thread_id) from memory_private.messages m
                          join memory_private.requests q using (workspace_id, request_id)
                          where m.workspace_id = %(ws)s and m.message_id = any(%(src)s)), '{}'),
               coalesce((select array_agg(distinct repo) from memory_private.messages m,
                                 unnest(m.repositories) repo
                          where m.workspace_id = %(ws)s and m.message_id = any(%(src)s)), '{}'),
               b.identity, %(req)s, memory_private.clock_now()
          from memory_private.scopes s
          join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
         where s.workspace_id = %(ws)s and s.scope_id = %(scope)s
        returning record_id
        """,
        {"ws": ws, "scope": scope, "kind": kind, "title": title, "summary": summary,
         "src": deps, "req": request, "speakers": speakers},
    ).fetchone()
    assert row is not None
    record_id = int(row[0])
    # The sources are the cited dependencies, numbered in the order given.
    inserted = conn.execute(
        """insert into memory_private.record_dependencies (workspace_id, record_id, message_id,
                                                           content_hash, via, position)
           select m.workspace_id, %s, m.message_id, m.content_hash,
                  case when s.n is not null then 'cited' else 'inherited' end, s.n
             from memory_private.messages m
             left join unnest(%s::text[]) with ordinality as s(id, n) on s.id = m.message_id
            where m.workspace_id = %s and m.message_id = any(%s)
              and m.content_hash is not null""",
        (record_id, list(dict.fromkeys(sources)), ws, deps)).rowcount
    assert inserted == len(deps), "every source must be a retained message"
    # Each record a moment after the previous one, so "newest first" is well defined.
    conn.execute("select memory_private.advance_clock('1 second')")
    return record_id



scope_id = scope_of


def record_copy(conn: psycopg.Connection, ws: str, record_id: int
                ) -> tuple[list[str], list[str], list[str]]:
    """A record's own copy of what it rests on: dependency ids, their hashes, its sources."""
    row = conn.execute("select dependency_ids, dependency_hashes, source_ids "
                       "from memory_private.records where workspace_id = %s and record_id = %s",
                       (ws, record_id)).fetchone()
    assert row is not None
    return list(row[0]), list(row[1]), list(row[2])


def copies_differing(conn: psycopg.Connection) -> int:
    """How many records' copies of their dependencies differ from record_dependencies (ids and
    hashes in bytewise id order, sources in their order): always 0."""
    row = conn.execute(DEPENDENCY_COPIES_DIFFERING).fetchone()
    assert row is not None
    return int(row[0])


def usage_rows_missing(conn: psycopg.Connection) -> int:
    """How many records have no usage row (memory_private.record_usage): always 0."""
    row = conn.execute(RECORDS_WITHOUT_USAGE).fetchone()
    assert row is not None
    return int(row[0])


def invalid_reason(conn: psycopg.Connection, ws: str, record_id: int,
                   requester: str | None = None) -> str | None:
    # The rule by the record's ids (a whole row read on a Citus shard is of the shard's type).
    scope = conn.execute("select scope_id from memory_private.records "
                         "where workspace_id = %s and record_id = %s", (ws, record_id)).fetchone()
    assert scope is not None, f"record {record_id} does not exist"
    row = conn.execute(
        "select reason from memory_private.invalid_records(%s, %s, array[%s]::bigint[], %s)",
        (ws, scope[0], record_id, requester)).fetchone()
    assert row is not None
    return row[0]


def record_exists(conn: psycopg.Connection, ws: str, record_id: int) -> bool:
    row = conn.execute("select count(*) from memory_private.records where workspace_id = %s "
                       "and record_id = %s", (ws, record_id)).fetchone()
    return bool(row and row[0])


def sweep(conn: psycopg.Connection, ws: str) -> dict[str, int]:
    row = conn.execute("select memory_private.sweep_retention(%s)", (ws,)).fetchone()
    assert row is not None
    return dict(row[0])


def advance(conn: psycopg.Connection, interval: str) -> None:
    conn.execute("select memory_private.advance_clock(%s::interval)", (interval,))


def set_index(conn: psycopg.Connection, ws: str, request: str, record_ids: list[int],
              text: str = "INDEX: tea and planning", *, due: bool = False,
              candidates: list[int] | None = None) -> None:
    """A consolidated index for the scope of ``request``, as write_index leaves it
    (memory_private.install_index): naming ``record_ids``, built from ``candidates`` (by default
    just the records it names) under the bot's current identity."""
    scope = scope_of(conn, ws, request)
    conn.execute(
        """select memory_private.install_index(%s, %s, %s, %s, %s,
                  (select b.identity from memory_private.scopes s
                     join memory_private.bots b using (workspace_id, bot_id)
                    where s.workspace_id = %s and s.scope_id = %s))""",
        (ws, scope, text, record_ids, candidates if candidates is not None else record_ids,
         ws, scope))
    conn.execute(("update memory_private.scopes set consolidation_due_at = "
                  + ("memory_private.clock_now()" if due else "null")
                  + " where workspace_id = %s and scope_id = %s"), (ws, scope))
