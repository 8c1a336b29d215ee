"""Hostile input: every public function, fed malformed, oversized, wrong-typed, NULL, Unicode
edge-case, SQL-injection and JSON-shape-attack arguments, answers with success or one of our
coded errors (class MB), never an internal error, and a refused call changes nothing.

The functions and their argument types are read from the catalog, so a function added later
is attacked too without editing this file.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.factory import World
from tests.records import make_record

TEXT_ATTACKS: list[Any] = [
    None, "", " padded ", "x" * 5000, "'; drop table memory_private.messages; --",
    "1 or 1=1", "%s%s%(x)s", "$1", "\u202eevil\u202c", "\u200b", "😀" * 2000,
    "é" * 33000, "ws1\n", "Robert'); --", "../../etc/passwd", "\\x00",
]
INT_ATTACKS: list[Any] = [None, -1, 0, 2**31 - 1, 2**63 - 1, -(2**63)]
NUMERIC_ATTACKS: list[Any] = [None, Decimal(-1), Decimal("NaN"), Decimal("1e30"),
                              Decimal("0.0000001")]
BOOL_ATTACKS: list[Any] = [None]
TS_ATTACKS: list[Any] = [None, datetime(1, 1, 1, tzinfo=UTC),
                         datetime(9999, 12, 31, tzinfo=UTC)]
ARRAY_ATTACKS: list[Any] = [None, [], [None], [""], ["x" * 300], ["a"] * 500,
                            ["'; drop table x; --"]]
DEEP = "[" * 5000 + "]" * 5000
JSON_ATTACKS: list[Any] = [
    None, "null", "[]", '"a string"', "42", "{}", DEEP, '{"query": 123}', '{"limit": -1}',
    '{"limit": "12"}', '{"limit": 1e308}', '{"id": "1; drop table x"}', '{"unknown": true}',
    '{"action": "forget", "sourceId": null}', '{"action": "remember", "sourceId": [1,2]}',
    '{"title": "' + "t" * 10000 + '", "summary": "s", "source_ids": []}',
    '{"index": "", "record_ids": [1,2,3,4,5,6,7,8,9,10,11,12,13]}',
    '{"input_tokens": -5, "output_tokens": "x", "cost_usd": -1}',
    '{"query": "\\u0000"}',
]
UUID_ATTACKS: list[Any] = [None, uuid.uuid4()]

BY_TYPE: dict[str, list[Any]] = {
    "text": TEXT_ATTACKS, "integer": INT_ATTACKS, "bigint": INT_ATTACKS,
    "numeric": NUMERIC_ATTACKS, "boolean": BOOL_ATTACKS,
    "timestamp with time zone": TS_ATTACKS, "text[]": ARRAY_ATTACKS,
    "bigint[]": [None, [], [None], [-1], list(range(100))], "jsonb": JSON_ATTACKS,
    "uuid": UUID_ATTACKS, "interval": [None, "-1 day", "1000 years"],
}

# Plausible values by argument name, so that one attacked argument at a time meets an
# otherwise well-formed call and reaches the deeper checks.
BASELINE: dict[str, Any] = {
    "p_workspace_id": "ws1", "p_user_id": "alice", "p_bot_id": "bot1", "p_chat_id": "dm-alice",
    "p_request_id": "r1", "p_message_id": "r1-u", "p_tool_call_id": "call-1",
    "p_speaker_id": "alice", "p_role": "user", "p_kind": "private", "p_text": "hello",
    "p_identity": "bot1-identity", "p_repository_id": "repo", "p_topic_id": 0,
    "p_config_version": 1, "p_budget_usd": Decimal(1), "p_spent_usd": Decimal(0),
    "p_idle_minutes": 30, "p_active": True, "p_granted": True, "p_linked": True,
    "p_directed": True, "p_status": "succeeded", "p_model_provider": "fake", "p_model_id": "m",
    "p_worker_id": "w1", "p_job_id": 1, "p_token": uuid.UUID(int=0),
    "p_reserve_usd": Decimal("0.01"), "p_outcome": "failed", "p_error": "boom",
    "p_args": Jsonb({}), "p_output": Jsonb({"title": "", "summary": "", "source_ids": []}),
    "p_usage": Jsonb({"input_tokens": 1, "output_tokens": 1, "cost_usd": 0}),
    "p_record_id": 1, "p_memory_id": 1,
}

SNAPSHOT_SQL = """
select string_agg(format('%s:%s', t.relname, t.digest), ',' order by t.relname)
  from (select c.relname,
               (xpath('/row/d/text()', query_to_xml(format(
                  'select md5(coalesce(string_agg(x::text, %L order by x::text), %L)) as d '
                  'from memory_private.%I x', '|', '', c.relname), false, false, '')))[1]::text
                 as digest
          from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = 'memory_private' and c.relkind = 'r') t
"""


def public_functions(conn: psycopg.Connection) -> list[tuple[str, list[str], list[str]]]:
    rows = conn.execute(
        """select p.proname, coalesce(p.proargnames[1:p.pronargs], '{}'),
                  array(select format_type(t, null) from unnest(p.proargtypes) t)
             from pg_proc p join pg_namespace n on n.oid = p.pronamespace
            where n.nspname = 'memory' and p.prokind = 'f'
              and p.proname not in ('delete_workspace')
            order by 1""").fetchall()
    return [(name, list(names), list(types)) for name, names, types in rows]


def adapt(value: Any, pgtype: str) -> Any:
    if pgtype == "jsonb" and isinstance(value, str):
        return Jsonb(json.loads(value)) if value != DEEP else value
    return value


def call_cases(conn: psycopg.Connection) -> list[tuple[str, str, list[Any], list[str]]]:
    cases = []
    for name, argnames, types in public_functions(conn):
        for i, (argname, pgtype) in enumerate(zip(argnames, types, strict=True)):
            for attack in BY_TYPE.get(pgtype, [None]):
                args = [BASELINE.get(a) for a in argnames]
                args[i] = adapt(attack, pgtype)
                cases.append((name, f"{argname}={str(attack)[:30]!r}", args, types))
    return cases


def representable(conn: psycopg.Connection, args: list[Any], types: list[str]) -> bool:
    try:
        with conn.transaction():
            conn.execute("select " + ", ".join(f"%s::{t}" for t in types), args)
        return True
    except psycopg.Error:
        return False


@pytest.fixture
def hostile_world(conn: psycopg.Connection) -> psycopg.Connection:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="remember I like tea")
    make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    return conn


@pytest.mark.slow  # every function times every attack
def test_every_public_function_refuses_hostile_input_with_our_codes_and_writes_nothing(
    hostile_world: psycopg.Connection,
) -> None:
    conn = hostile_world
    cases = call_cases(conn)
    assert len(cases) > 200, "the catalog should expose the whole API"
    failures = []
    # The rows before each call: taken again only after a call that may have written (one that
    # succeeded, or failed outside our codes); a refusal that wrote nothing leaves them as is.
    before = conn.execute(SNAPSHOT_SQL).fetchone()
    for name, label, args, types in cases:
        placeholders = ", ".join(f"%s::{t}" for t in types)
        if not representable(conn, args, types):
            continue  # PostgreSQL itself refuses the value before any function sees it
        try:
            with conn.transaction():
                conn.execute(f"select memory.{name}({placeholders})", args).fetchall()
        except psycopg.Error as exc:
            code = exc.sqlstate or ""
            if not code.startswith("MB"):
                failures.append(f"{name}({label}): {code} {str(exc).splitlines()[0]}")
                before = conn.execute(SNAPSHOT_SQL).fetchone()
                continue
            after = conn.execute(SNAPSHOT_SQL).fetchone()
            if after != before:
                failures.append(f"{name}({label}): refused with {code} but changed rows")
                before = after
            continue
        before = conn.execute(SNAPSHOT_SQL).fetchone()
    assert not failures, "\n".join(failures[:40]) + f"\n({len(failures)} in all)"


def test_text_with_nul_bytes_cannot_reach_the_database(conn: psycopg.Connection) -> None:
    """PostgreSQL text cannot hold NUL: the driver refuses it before any call is made."""
    World(conn).basic()
    with pytest.raises(psycopg.DataError):
        conn.execute("select memory.upsert_member('ws1', %s, 'member', true)", ("a\x00b",))
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.upsert_member('ws1', 'a' || chr(0), 'member', true)")
    assert err.value.sqlstate == "54000"  # the server refuses to build such a string at all
    assert conn.execute("select count(*) from memory_private.members").fetchone() == (2,)
