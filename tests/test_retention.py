"""Retention: edits, removals, expiry, revoked access, pruning and purge (T1-T6)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.factory import World
from tests.records import (
    advance,
    invalid_reason,
    make_record,
    record_exists,
    set_index,
    sweep,
)


def use(conn: psycopg.Connection, record_id: int, at_sql: str) -> None:
    """Marks a record as last returned by query_memories at ``at_sql`` (a SQL expression)."""
    updated = conn.execute("update memory_private.record_usage "
                           "set last_used_at = " + at_sql + ", usage_count = 1 "
                           "where record_id = %s", (record_id,)).rowcount
    assert updated == 1, "every record has its usage row"


@pytest.fixture
def world(conn: psycopg.Connection) -> World:
    w = World(conn)
    w.basic()
    w.conversation("ws1", "r1", chat="dm-alice", user="alice",
                   user_text="I prefer tea", reply="Noted: tea.")
    return w


def test_an_edited_source_hides_the_record_at_once_and_the_sweep_deletes_it(
    conn: psycopg.Connection, world: World
) -> None:
    rec = make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    assert invalid_reason(conn, "ws1", rec) is None
    world.message("ws1", "r1-u", "r1", "user", "alice", "I prefer coffee")
    assert invalid_reason(conn, "ws1", rec) == "source_edited"
    assert sweep(conn, "ws1")["records_invalidated"] == 1
    assert not record_exists(conn, "ws1", rec)


def test_a_removed_source_hides_and_then_deletes_the_record(
    conn: psycopg.Connection, world: World
) -> None:
    rec = make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    world.remove("ws1", "r1-a")
    assert invalid_reason(conn, "ws1", rec) == "source_removed"
    sweep(conn, "ws1")
    assert not record_exists(conn, "ws1", rec)


def test_expiry_hides_the_record_and_the_sweep_erases_the_text(
    conn: psycopg.Connection, world: World
) -> None:
    soon = datetime.now(UTC) + timedelta(hours=1)
    world.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea", retain_until=soon)
    rec = make_record(conn, "ws1", "r1", ["r1-u", "r1-a"])
    assert invalid_reason(conn, "ws1", rec) is None
    advance(conn, "2 hours")
    assert invalid_reason(conn, "ws1", rec) == "source_expired"
    counts = sweep(conn, "ws1")
    assert counts["messages_expired"] == 1 and counts["records_invalidated"] == 1
    body = conn.execute("select body, content_hash from memory_private.messages "
                        "where message_id = 'r1-u'").fetchone()
    assert body == (None, None), "expired text must be erased, not merely hidden"


def test_revoked_grant_and_lost_membership_hide_but_keep_the_record(
    conn: psycopg.Connection, world: World
) -> None:
    world.grant("ws1", "alice", "repo-x")
    world.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea", repositories=["repo-x"])
    rec = make_record(conn, "ws1", "r1", ["r1-u"])
    assert invalid_reason(conn, "ws1", rec, "alice") is None
    world.grant("ws1", "alice", "repo-x", False)
    assert invalid_reason(conn, "ws1", rec, "alice") == "grant_revoked"
    world.grant("ws1", "alice", "repo-x", True)
    world.member("ws1", "alice", "owner", active=False)
    assert invalid_reason(conn, "ws1", rec, "alice") == "membership"
    sweep(conn, "ws1")
    assert record_exists(conn, "ws1", rec), "reversible reasons keep the record"
    world.member("ws1", "alice", "owner", active=True)
    assert invalid_reason(conn, "ws1", rec, "alice") is None


def test_records_unused_for_30_days_are_pruned_and_used_ones_stay(
    conn: psycopg.Connection, world: World
) -> None:
    world.conversation("ws1", "r2", chat="dm-alice", user="alice")
    old = make_record(conn, "ws1", "r1", ["r1-u"])
    used = make_record(conn, "ws1", "r2", ["r2-u"])
    advance(conn, "20 days")
    use(conn, used, "memory_private.clock_now()")
    advance(conn, "11 days")
    assert sweep(conn, "ws1")["records_pruned"] == 1
    assert not record_exists(conn, "ws1", old) and record_exists(conn, "ws1", used)
    due = conn.execute("select consolidation_due_at is not null from memory_private.scopes "
                       "").fetchone()
    assert due == (True,), "pruning marks the scope for consolidation"


def test_a_workspace_keeps_at_most_256_records_least_recently_used_go_first(
    conn: psycopg.Connection, world: World
) -> None:
    first = make_record(conn, "ws1", "r1", ["r1-u"])
    for _ in range(256):
        make_record(conn, "ws1", "r1", ["r1-a"])
    use(conn, first, "memory_private.clock_now() + interval '1 minute'")
    assert sweep(conn, "ws1")["records_pruned"] == 1
    left = conn.execute("select count(*), bool_or(record_id = %s), bool_or(record_id = %s) "
                        "from memory_private.records", (first, first + 1)).fetchone()
    assert left == (256, True, False), "the least recently used record went, the used one stayed"


def test_an_index_naming_a_deleted_record_is_dropped(conn: psycopg.Connection,
                                                      world: World) -> None:
    rec = make_record(conn, "ws1", "r1", ["r1-u"])
    set_index(conn, "ws1", "r1", [rec], "tea")
    world.remove("ws1", "r1-u")
    sweep(conn, "ws1")
    row = conn.execute("select i.index_text, i.record_ids, s.consolidation_due_at is not null "
                       "from memory_private.scopes s left join memory_private.scope_indexes i "
                       "using (workspace_id, scope_id)").fetchone()
    assert row == (None, None, True)


def test_tombstones_last_while_the_original_is_retained(conn: psycopg.Connection,
                                                        world: World) -> None:
    soon = datetime.now(UTC) + timedelta(days=2)
    world.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea", retain_until=soon)
    conn.execute("insert into memory_private.tombstones (workspace_id, scope_id, message_id, "
                 "created_at) select 'ws1', scope_id, 'r1-u', now() "
                 "from memory.resolve_scope('ws1', 'r1')")
    assert sweep(conn, "ws1")["tombstones_dropped"] == 0
    advance(conn, "3 days")
    assert sweep(conn, "ws1")["tombstones_dropped"] == 1


def test_deleting_a_workspace_leaves_no_row_of_it_in_any_table(
    conn: psycopg.Connection, world: World
) -> None:
    make_record(conn, "ws1", "r1", ["r1-u"])
    other = World(conn)
    other.basic("ws2")
    other.conversation("ws2", "r1", chat="dm-alice", user="alice")
    make_record(conn, "ws2", "r1", ["r1-u"])
    conn.execute("select memory.delete_workspace('ws1')")
    tables = conn.execute(
        """select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
            join pg_attribute a on a.attrelid = c.oid and a.attname = 'workspace_id'
           where n.nspname = 'memory_private' and c.relkind = 'r'""").fetchall()
    assert len(tables) >= 10
    for (table,) in tables:
        left = conn.execute(f"select count(*) from memory_private.{table} "
                            "where workspace_id = 'ws1'").fetchone()
        assert left == (0,), f"{table} kept rows of the deleted workspace"
    kept = conn.execute("select count(*) from memory_private.records "
                        "where workspace_id = 'ws2'").fetchone()
    assert kept == (1,)


def test_a_chain_of_derived_answers_and_records_goes_with_its_first_source(
    conn: psycopg.Connection, world: World
) -> None:
    """r1's message makes a memory; r2 recalls it and answers; r2's answer becomes the source of
    another memory; r3 recalls that one and answers. Removing r1's message erases r2's answer,
    the memory built on it, and r3's answer (T3)."""
    first = make_record(conn, "ws1", "r1", ["r1-u"], title="tea", summary="alice likes tea")
    world.conversation("ws1", "r2", chat="dm-alice", user="alice", user_text="what do I like?",
                       reply="You like tea.")
    found = conn.execute("select memory.query_memories('ws1', 'r2', 'c1', '{\"query\": \"tea\"}')"
                         ).fetchone()
    assert found is not None and "r1-u" in str(found[0])
    second = make_record(conn, "ws1", "r2", ["r2-a"], title="answer", summary="likes tea, said")
    world.conversation("ws1", "r3", chat="dm-alice", user="alice", user_text="remind me",
                       reply="Tea, as you said.")
    conn.execute("select memory.query_memories('ws1', 'r3', 'c2', '{\"query\": \"said\"}')")
    cited = conn.execute("select message_id from memory.request_citations('ws1', 'r3')"
                         ).fetchall()
    assert ("r2-a",) in cited

    world.remove("ws1", "r1-u")
    counts = sweep(conn, "ws1")
    assert counts["answers_erased"] == 2
    assert not record_exists(conn, "ws1", first) and not record_exists(conn, "ws1", second)
    rows = conn.execute("select message_id, body is null, removal_reason "
                        "from memory_private.messages where message_id in ('r2-a', 'r3-a', "
                        "'r2-u') order by 1").fetchall()
    assert rows == [("r2-a", True, "derived_from_removed"), ("r2-u", False, None),
                    ("r3-a", True, "derived_from_removed")]


def test_an_answer_may_be_kept_only_as_long_as_its_recalled_sources(
    conn: psycopg.Connection, world: World
) -> None:
    soon = datetime.now(UTC) + timedelta(days=3)
    world.message("ws1", "r1-u", "r1", "user", "alice", "I prefer tea", retain_until=soon)
    make_record(conn, "ws1", "r1", ["r1-u", "r1-a"], title="tea", summary="alice likes tea")
    world.conversation("ws1", "r2", chat="dm-alice", user="alice")
    boundary = conn.execute("select memory.answer_retention_boundary('ws1', 'r2')").fetchone()
    assert boundary == (None,), "nothing recalled yet: no boundary from memory"
    conn.execute("select memory.query_memories('ws1', 'r2', 'c1', '{}')")
    boundary = conn.execute("select memory.answer_retention_boundary('ws1', 'r2')").fetchone()
    assert boundary is not None and abs((boundary[0] - soon).total_seconds()) < 1


def test_maintenance_runs_the_sweep_and_supersedes_a_checkpoint_built_on_a_removed_source(
    conn: psycopg.Connection, world: World
) -> None:
    advance(conn, "31 minutes")
    counts = conn.execute("select memory.run_maintenance('ws1')").fetchone()[0]
    assert counts["extract_jobs_created"] == 1
    job = conn.execute("select memory.claim_job('w1')").fetchone()[0]
    conn.execute("select memory.start_attempt(%s, %s, %s, 0.01)",
                 ("ws1", job["job_id"], job["token"]))
    conn.execute("select memory.save_checkpoint(%s, %s, %s, %s, %s)",
                 ("ws1", job["job_id"], job["token"],
                  '{"title": "tea", "summary": "alice prefers tea", "source_ids": ["r1-u"]}',
                  '{"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.001}'))
    world.remove("ws1", "r1-u")
    counts = conn.execute("select memory.run_maintenance('ws1')").fetchone()[0]
    assert counts["jobs_superseded_stale"] == 1
    row = conn.execute("select status, checkpoint from memory_private.jobs "
                       "where job_id = %s", (job["job_id"],)).fetchone()
    assert row == ("superseded", None), "the checkpoint built on the removed source is erased"
    with pytest.raises(psycopg.Error) as err:
        conn.execute("select memory.commit_job(%s, %s, %s)",
                     ("ws1", job["job_id"], job["token"]))
    assert err.value.sqlstate.startswith("MB02")
    assert conn.execute("select count(*) from memory_private.records").fetchone() == (0,)


def test_tombstones_keep_forgotten_messages_out_of_the_next_extraction(
    conn: psycopg.Connection, world: World
) -> None:
    """Forget writes tombstones; the next maintenance tick and extraction never take the
    forgotten messages again while they are retained (T8)."""
    advance(conn, "31 minutes")
    conn.execute("select memory.run_maintenance('ws1')")
    job = conn.execute("select memory.claim_job('w1')").fetchone()[0]
    token = job["token"]
    conn.execute("select memory.start_attempt('ws1', %s, %s, 0.01)", (job["job_id"], token))
    conn.execute("select memory.save_checkpoint('ws1', %s, %s, %s, %s)",
                 (job["job_id"], token,
                  '{"title": "tea", "summary": "alice prefers tea", "source_ids": ["r1-u"]}',
                  '{"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.001}'))
    committed = conn.execute("select memory.commit_job('ws1', %s, %s)",
                             (job["job_id"], token)).fetchone()[0]
    record_id = committed["record_id"]
    world.conversation("ws1", "r2", chat="dm-alice", user="alice",
                       user_text="please forget that I prefer tea", reply="Done.")
    out = conn.execute("select memory.manage_memory('ws1', 'r2', 'f1', %s)",
                       (f'{{"action": "forget", "sourceId": "r2-u", "memoryId": {record_id}}}',)
                       ).fetchone()[0]
    assert out["status"] == "done", out
    # Make the forgotten messages look new to extraction: nothing may bring them back.
    conn.execute("delete from memory_private.extracted_sources where message_id like 'r1-%'")
    advance(conn, "31 minutes")
    conn.execute("select memory.run_maintenance('ws1')")
    sources = conn.execute(
        "select jsonb_path_query_array(input, '$.sources[*].id') from memory_private.jobs "
        "where phase = 'extract' and status = 'pending'").fetchall()
    for (ids,) in sources:
        assert "r1-u" not in ids and "r1-a" not in ids, ids
    claimed = conn.execute("select memory.claim_job('w2')").fetchone()[0]
    if claimed is not None:
        texts = [s["id"] for s in claimed["input"].get("sources", [])]
        assert "r1-u" not in texts and "r1-a" not in texts
