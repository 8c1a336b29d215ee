"""The validity rule has one verdict (memory_private.invalid_records, the set form every reader
uses) and one explanation (memory_private.record_checks, what explain_record shows). On a world
with every kind of invalidity, for every requester, including records with several bad sources
(the first reason in rank order wins): the explanation gives the verdict's reason, a record's
verdict does not depend on the set it is validated with, and the retention sweep deletes
exactly the records with a permanent reason."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest

from tests.factory import World
from tests.records import advance, make_record, scope_of

REASONS = {"recall_disabled", "bot_inactive", "bot_replaced", "group_unlinked", "membership",
           "source_removed", "source_expired", "source_edited", "forgotten", "grant_revoked"}
REQUESTERS = (None, "alice", "bob", "carol", "dave")


def _world(conn: psycopg.Connection) -> None:
    w = World(conn)
    ws = "ws1"
    w.basic(ws, users=("alice", "bob", "carol"))
    w.bot(ws, "bot2")
    w.group_chat(ws, "grp2")
    w.grant(ws, "alice", "repo-a")
    w.grant(ws, "bob", "repo-a")
    w.grant(ws, "alice", "repo-b")
    soon = datetime(2000, 1, 1, tzinfo=UTC)  # retained until a date the clock passes below

    def conv(req: str, chat: str, user: str, n: int, *, bot: str = "bot1", topic: int = 0,
             repos: list[str] | None = None, retain: bool = False) -> list[str]:
        w.request(ws, req, chat=chat, user=user, bot=bot, topic=topic)
        ids = []
        for i in range(n):
            mid = f"{req}-m{i}"
            w.message(ws, mid, req, "user" if i % 2 == 0 else "assistant",
                      user if i % 2 == 0 else bot, f"message {i} of {req}",
                      repositories=repos if i == 0 else None,
                      retain_until=soon if retain and i == 1 else None)
            ids.append(mid)
        return ids

    # alice's private scope: one record per source-level reason, and mixtures.
    a = conv("ra", "dm-alice", "alice", 12, retain=True)
    a_repo = conv("ra2", "dm-alice", "alice", 2, repos=["repo-b"])
    valid = make_record(conn, ws, "ra", [a[0], a[2]])
    removed = make_record(conn, ws, "ra", [a[3], a[4]])
    expired = make_record(conn, ws, "ra", [a[1], a[5]])
    edited = make_record(conn, ws, "ra", [a[6]])
    forgotten = make_record(conn, ws, "ra", [a[7], a[8]])
    mixed1 = make_record(conn, ws, "ra", [a[3], a[6], a[7]])  # removed, edited, forgotten
    mixed2 = make_record(conn, ws, "ra", [a[6], a[8], a[1]])  # edited, forgotten, expired
    mixed3 = make_record(conn, ws, "ra", [a[8], a[6]])         # forgotten, edited
    make_record(conn, ws, "ra2", a_repo)                       # repo-b: alice's grant revoked
    make_record(conn, ws, "ra", [a[9]])
    replaced = make_record(conn, ws, "ra", [a[10]])
    make_record(conn, ws, "ra", [a[11], a[0]])
    scope_a = scope_of(conn, ws, "ra")
    w.remove(ws, a[3])
    w.message(ws, a[6], "ra", "user", "alice", "message 6 of ra, edited")
    conn.execute("insert into memory_private.tombstones values (%s, %s, %s, "
                 "memory_private.clock_now())", (ws, scope_a, a[8]))
    conn.execute("insert into memory_private.tombstones values (%s, %s, %s, "
                 "memory_private.clock_now())", (ws, scope_a, a[7]))
    conn.execute("update memory_private.records set bot_identity = 'an-older-identity' "
                 "where workspace_id = %s and record_id = %s", (ws, replaced))
    w.grant(ws, "alice", "repo-b", granted=False)
    assert {valid, removed, expired, edited, forgotten, mixed1, mixed2, mixed3}

    # The group (topic 0): statements of alice and bob; repo-a is granted to both, repo-b to
    # nobody now; carol becomes inactive, dave was never a member.
    g = conv("rg", "grp", "alice", 4, repos=["repo-a"])
    g2 = conv("rg2", "grp", "bob", 2, repos=["repo-b"])
    make_record(conn, ws, "rg", g[:2])
    make_record(conn, ws, "rg", g[2:])
    make_record(conn, ws, "rg2", g2)
    w.member(ws, "carol", "member", active=False)

    # bob's private scope (membership for anyone else), carol's (inactive member).
    make_record(conn, ws, "rb", conv("rb", "dm-bob", "bob", 2))
    make_record(conn, ws, "rc", conv("rc", "dm-carol", "carol", 2))

    # An unlinked group, a deactivated bot, recall turned off.
    make_record(conn, ws, "ru", conv("ru", "grp2", "alice", 2))
    w.group_chat(ws, "grp2", linked=False)
    make_record(conn, ws, "rbot", conv("rbot", "dm-alice", "alice", 2, bot="bot2"))
    w.bot(ws, "bot2", active=False)
    make_record(conn, ws, "roff", conv("roff", "grp", "bob", 2, topic=7))
    conn.execute("update memory_private.scopes set recall_enabled = false "
                 "where workspace_id = %s and scope_id = %s", (ws, scope_of(conn, ws, "roff")))
    advance(conn, "1 day")  # past retain_until of a[1]


def test_set_validity_agrees_with_the_rule_for_every_reason_and_requester(
        conn: psycopg.Connection) -> None:
    _world(conn)
    seen: set[str | None] = set()
    scopes = [int(r[0]) for r in conn.execute(
        "select scope_id from memory_private.scopes where workspace_id = 'ws1'").fetchall()]
    assert len(scopes) == 7
    for scope in scopes:
        ids = [int(r[0]) for r in conn.execute(
            "select record_id from memory_private.records where workspace_id = 'ws1' "
            "and scope_id = %s order by record_id", (scope,)).fetchall()]
        for requester in REQUESTERS:
            # The explanation: the first failing check of each record, one record at a time.
            one = dict(conn.execute(
                "select r.record_id, (select c.reason from memory_private.record_checks("
                "'ws1', r.record_id, %s) c where not c.ok order by c.rank limit 1) "
                "from memory_private.records r where workspace_id = 'ws1' and scope_id = %s",
                (requester, scope)).fetchall())
            # A foreign id (another scope's record, an unknown id) is not returned.
            many = dict(conn.execute(
                "select record_id, reason from memory_private.invalid_records('ws1', %s, %s, %s)",
                (scope, [*ids, 999999, *(s for s in scopes if s != scope)], requester)).fetchall())
            assert set(many) <= set(ids) | set(scopes)
            many = {k: v for k, v in many.items() if k in ids}
            assert many == one, (scope, requester)
            seen.update(one.values())
    assert REASONS | {None} <= seen, sorted(REASONS - seen)


@pytest.mark.no_citus("a one-server plan: on Citus the SQL helpers are PL/pgSQL, not inlined")
def test_the_rule_reads_a_records_messages_from_an_index_alone(conn: psycopg.Connection) -> None:
    """What the rule reads of a message (hash, removal, retention) is in messages_state_idx, so a
    scope's validation reads a few index pages, not a heap page per message: with plain index
    scans (which read the heap) off and a table read made dear, the messages are still read from
    that index alone. Reading another column of messages (the body, say) makes this plan
    impossible. (PostgreSQL 15 counts an index-only scan as disabled with the index scans: the
    dear table read keeps a tiny table's full read from winning that tie.)"""
    _world(conn)
    scope = scope_of(conn, "ws1", "ra")
    ids = [int(r[0]) for r in conn.execute(
        "select record_id from memory_private.records where workspace_id = 'ws1' "
        "and scope_id = %s", (scope,)).fetchall()]
    # The plan from this world's statistics, not from those an earlier test of the worker left
    # behind (autoanalyze of a bigger world made the planner prefer the primary key's index).
    conn.execute("analyze memory_private.messages, memory_private.records, "
                 "memory_private.record_dependencies, memory_private.tombstones")
    with conn.transaction():
        conn.execute("set local enable_seqscan = off")
        conn.execute("set local enable_bitmapscan = off")
        conn.execute("set local enable_indexscan = off")
        conn.execute("set local seq_page_cost = 1000")
        plan = "\n".join(str(r[0]) for r in conn.execute(
            "explain select * from memory_private.record_reasons('ws1', %s, %s)",
            (scope, ids)).fetchall())
    assert "Index Only Scan using messages_state_idx on messages" in plan, plan


def test_the_sweep_deletes_exactly_the_records_with_a_permanent_reason(
        conn: psycopg.Connection) -> None:
    _world(conn)
    permanent = {r[0] for r in conn.execute(
        "select reason from memory_private.invalid_reasons where permanent")}
    assert permanent == {"bot_replaced", "source_removed", "source_expired", "source_edited",
                         "forgotten"}
    reasons = {}
    for (scope,) in conn.execute("select scope_id from memory_private.scopes "
                                 "where workspace_id = 'ws1'").fetchall():
        # a scope at a time (on Citus the rule is a call of its own, not a join over shards)
        reasons.update(conn.execute(
            "select v.record_id, v.reason from memory_private.invalid_records('ws1', %s, "
            "array(select record_id from memory_private.records r where r.workspace_id = 'ws1' "
            "and r.scope_id = %s), null) v", (scope, scope)).fetchall())
    doomed = {k for k, v in reasons.items() if v in permanent}
    assert doomed and len(doomed) < len(reasons)
    conn.execute("select memory_private.purge_permanently_invalid('ws1')")
    left = {r[0] for r in conn.execute("select record_id from memory_private.records")}
    assert left == set(reasons) - doomed


def test_first_valid_records_keeps_the_order_and_the_limit(conn: psycopg.Connection) -> None:
    _world(conn)
    scope = scope_of(conn, "ws1", "ra")
    ordered = [int(r[0]) for r in conn.execute(
        "select record_id from memory_private.records where workspace_id = 'ws1' "
        "and scope_id = %s order by created_at desc, record_id desc", (scope,)).fetchall()]
    valid = [i for i in ordered if conn.execute(
        "select memory_private.record_invalid_reason(row(r.*)::memory_private.records, 'alice') "
        "from memory_private.records r where workspace_id = 'ws1' and record_id = %s",
        (i,)).fetchone() == (None,)]
    assert len(valid) == 3
    for limit in (1, 2, 5):
        row = conn.execute("select memory_private.first_valid_records('ws1', %s, %s, %s, "
                           "'alice')", (scope, ordered, limit)).fetchone()
        assert row is not None and row[0] == valid[:limit]
    row = conn.execute("select memory_private.recent_valid_records('ws1', %s, 8, 'alice')",
                       (scope,)).fetchone()
    assert row is not None and row[0] == valid


def test_the_newest_first_walk_validates_as_the_set_rule_does(conn: psycopg.Connection) -> None:
    # recent_valid_records applies the rule record by record as it reads (the scope's checks
    # once, then memory_private.record_failures): for every scope, requester, limit and kind of
    # read (browse, a literal search of three characters or more, one of two characters, one
    # spanning the title's end), it answers the newest matching records that invalid_records
    # finds valid; and where the scope's checks pass, record_failures is empty exactly for the
    # records invalid_records finds valid.
    _world(conn)
    scopes = [int(r[0]) for r in conn.execute(
        "select scope_id from memory_private.scopes where workspace_id = 'ws1'").fetchall()]
    for scope in scopes:
        ordered = [int(r[0]) for r in conn.execute(
            "select record_id from memory_private.records where workspace_id = 'ws1' "
            "and scope_id = %s order by created_at desc, record_id desc", (scope,)).fetchall()]
        for requester in REQUESTERS:
            verdict = dict(conn.execute(
                "select record_id, reason from memory_private.invalid_records('ws1', %s, %s, %s)",
                (scope, ordered, requester)).fetchall())
            valid = [i for i in ordered if verdict[i] is None]
            scope_reason = conn.execute("select memory_private.scope_reason('ws1', %s, %s)",
                                        (scope, requester)).fetchone()
            assert scope_reason is not None
            reader = conn.execute(
                "select coalesce((select user_id from memory_private.scopes where workspace_id "
                "= 'ws1' and scope_id = %s), %s)", (scope, requester)).fetchone()
            assert reader is not None
            for rec in ordered if scope_reason[0] is None else []:
                fails = conn.execute(
                    "select count(*) from memory_private.records r, "
                    "memory_private.record_failures('ws1', %s, (select b.identity from "
                    "memory_private.scopes s join memory_private.bots b using (workspace_id, "
                    "bot_id) where s.workspace_id = 'ws1' and s.scope_id = %s), r.bot_identity, "
                    "r.dependency_ids, r.dependency_hashes, r.repositories, %s, "
                    "memory_private.clock_now()) where r.workspace_id = 'ws1' "
                    "and r.record_id = %s", (scope, scope, reader[0], rec)).fetchone()
                assert fails is not None
                assert (fails[0] == 0) == (verdict[rec] is None), (scope, requester, rec)
            for query, matches in ((None, True), ("WORTH", True), ("me", True),
                                   ("memory\nsome", False)):
                for limit in (1, 2, 48):
                    got = conn.execute(
                        "select memory_private.recent_valid_records('ws1', %s, %s, %s, %s)",
                        (scope, limit, requester, query)).fetchone()
                    assert got is not None
                    assert got[0] == (valid[:limit] if matches else []), (scope, requester, query)


def test_request_citations_follow_the_record_set_wise_and_a_record_gone_authorizes_nothing(
        conn: psycopg.Connection) -> None:
    w = World(conn)
    w.basic()
    w.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    u1, a1 = w.conversation("ws1", "h1", chat="dm-alice", user="alice", user_text="tea")
    u2, _ = w.conversation("ws1", "h2", chat="dm-alice", user="alice", user_text="jazz")
    u3, _ = w.conversation("ws1", "h3", chat="dm-alice", user="alice", user_text="rain")
    both = make_record(conn, "ws1", "h1", [u1, a1], summary="tea")
    gone = make_record(conn, "ws1", "h2", [u2], summary="jazz")
    make_record(conn, "ws1", "h3", [u3], summary="rain")
    conn.execute("select memory.query_memories('ws1', 'live', 'c1', '{}'::jsonb)")

    def cited() -> list[str]:
        return [r[0] for r in conn.execute(
            "select message_id from memory.request_citations('ws1', 'live')")]

    assert cited() == sorted([u1, a1, u2, u3])
    # The record that carried u1 becomes invalid through its other source: u1 (unchanged) is
    # no longer citable through it.
    w.message("ws1", a1, "h1", "assistant", "bot1", "a different reply")
    assert cited() == sorted([u2, u3])
    # A record deleted since (pruned, purged, forgotten) authorizes nothing any more: the
    # citation set never outlives the record that showed it.
    conn.execute("delete from memory_private.records where workspace_id = 'ws1' "
                 "and record_id = %s", (gone,))
    assert cited() == [u3]
    # Recall off makes every record invalid.
    conn.execute("update memory_private.scopes set recall_enabled = false "
                 "where workspace_id = 'ws1' and scope_id = %s", (scope_of(conn, "ws1", "live"),))
    assert cited() == []
    assert both
