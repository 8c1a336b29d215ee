"""A record's own copy of what it rests on (records.dependency_ids, dependency_hashes,
source_ids) is written by the database alone, from record_dependencies, after every statement
that writes that table; the validity rule and query_memories read it from the record's page.
Writing the copy any other way is refused."""

from __future__ import annotations

import psycopg
import pytest

from tests.factory import World
from tests.records import copies_differing, make_record, record_copy, scope_of


def _world(conn: psycopg.Connection) -> list[str]:
    w = World(conn)
    w.basic("ws1", users=("alice",))
    w.request("ws1", "r1", chat="dm-alice", user="alice")
    ids = []
    for i in range(4):
        mid = f"m{i}"
        w.message("ws1", mid, "r1", "user" if i % 2 == 0 else "assistant",
                  "alice" if i % 2 == 0 else "bot1", f"message {i}")
        ids.append(mid)
    return ids


def _hash(conn: psycopg.Connection, mid: str) -> str:
    row = conn.execute("select content_hash from memory_private.messages "
                       "where workspace_id = 'ws1' and message_id = %s", (mid,)).fetchone()
    assert row is not None
    return str(row[0])


def test_the_copy_follows_every_statement_that_writes_record_dependencies(
        conn: psycopg.Connection) -> None:
    m = _world(conn)
    rid = make_record(conn, "ws1", "r1", [m[2], m[0]], reused=[m[1]])
    # Ids and hashes in bytewise id order; sources in the order the summary uses them.
    assert record_copy(conn, "ws1", rid) == ([m[0], m[1], m[2]],
                                             [_hash(conn, x) for x in (m[0], m[1], m[2])],
                                             [m[2], m[0]])
    # A second statement adds a dependency: the copy has both statements' rows.
    conn.execute("insert into memory_private.record_dependencies "
                 "(workspace_id, record_id, message_id, content_hash, via, position) "
                 "values ('ws1', %s, %s, %s, 'cited', 3)", (rid, m[3], _hash(conn, m[3])))
    assert record_copy(conn, "ws1", rid)[0] == [m[0], m[1], m[2], m[3]]
    assert record_copy(conn, "ws1", rid)[2] == [m[2], m[0], m[3]]
    # An update of a kept hash, and a delete, are followed too.
    conn.execute("update memory_private.record_dependencies set content_hash = 'x' "
                 "where workspace_id = 'ws1' and record_id = %s and message_id = %s", (rid, m[1]))
    assert record_copy(conn, "ws1", rid)[1][1] == "x"
    conn.execute("delete from memory_private.record_dependencies "
                 "where workspace_id = 'ws1' and record_id = %s and message_id in (%s, %s)",
                 (rid, m[1], m[3]))
    assert record_copy(conn, "ws1", rid) == ([m[0], m[2]],
                                             [_hash(conn, m[0]), _hash(conn, m[2])],
                                             [m[2], m[0]])
    assert copies_differing(conn) == 0


def test_the_rule_reads_the_copy_so_a_changed_hash_there_is_an_edit(
        conn: psycopg.Connection) -> None:
    """The validity rule reads a record's dependencies from the record, and its plan never reads
    record_dependencies."""
    m = _world(conn)
    rid = make_record(conn, "ws1", "r1", [m[0], m[1]])
    scope = scope_of(conn, "ws1", "r1")

    def reasons() -> list[tuple[str, str | None]]:
        return [(r[0], r[1]) for r in conn.execute(
            "select reason, message_id from memory_private.record_reasons('ws1', %s, %s)",
            (scope, [rid])).fetchall()]

    assert reasons() == []
    conn.execute("update memory_private.record_dependencies set content_hash = 'x' "
                 "where workspace_id = 'ws1' and record_id = %s and message_id = %s", (rid, m[1]))
    assert reasons() == [("source_edited", m[1])]
    plan = "\n".join(str(r[0]) for r in conn.execute(
        "explain select * from memory_private.record_reasons('ws1', %s, %s)",
        (scope, [rid])).fetchall())
    assert "record_dependencies" not in plan, plan


@pytest.mark.parametrize("column", ["dependency_ids", "dependency_hashes", "source_ids"])
def test_writing_the_copy_directly_is_refused_and_changes_nothing(
        conn: psycopg.Connection, column: str) -> None:
    m = _world(conn)
    rid = make_record(conn, "ws1", "r1", [m[0]])
    before = record_copy(conn, "ws1", rid)
    with pytest.raises(psycopg.errors.CheckViolation, match="copy of record_dependencies"):
        conn.execute(f"update memory_private.records set {column} = '{{}}' "
                     "where workspace_id = 'ws1' and record_id = %s", (rid,))
    assert record_copy(conn, "ws1", rid) == before
    # An update that leaves the copy as it is (of another column) is not refused.
    conn.execute("update memory_private.records set title = 'renamed' "
                 "where workspace_id = 'ws1' and record_id = %s", (rid,))
    with pytest.raises(psycopg.errors.CheckViolation, match="copy of record_dependencies"):
        conn.execute(
            f"""insert into memory_private.records
                  (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids,
                   bot_identity, created_at, {column})
                values ('ws1', %s, 'note', 't', 's', '{{}}', '{{}}', 'b', now(), '{{m0}}')""",
            (scope_of(conn, "ws1", "r1"),))
    assert conn.execute("select count(*) from memory_private.records").fetchone() == (1,)


def test_a_copy_with_ids_and_hashes_of_different_lengths_is_refused_even_with_triggers_off(
        conn: psycopg.Connection) -> None:
    """A superuser loading with triggers off (as the bench's loader) writes the copy itself; the
    table's check still keeps ids and hashes in step."""
    m = _world(conn)
    rid = make_record(conn, "ws1", "r1", [m[0], m[1]])
    with (pytest.raises(psycopg.errors.CheckViolation, match="records_dependency_hashes_check"),
          conn.transaction()):
        # (on Citus the setting goes to the workers' connections too, where the shards are)
        conn.execute("set local citus.propagate_set_commands = 'local'")
        conn.execute("set local session_replication_role = replica")
        conn.execute("update memory_private.records set dependency_hashes = '{x}' "
                     "where workspace_id = 'ws1' and record_id = %s", (rid,))
    assert copies_differing(conn) == 0



def test_line_sources_are_each_lines_citations_of_the_sources_and_follow_every_write(
        conn: psycopg.Connection) -> None:
    """records.line_sources (what a search reads for the lines it found) is derived by
    PostgreSQL from the summary and the sources whenever either is written, and cannot be
    written otherwise."""
    m = _world(conn)
    summary = f"first [{m[0]}]\nsecond [{m[1]}; {m[2]}] and [note]\nthird, no citation"
    # m2 is a dependency but no source: a bracketed id that is not a source is text.
    rid = make_record(conn, "ws1", "r1", [m[0], m[1]], reused=[m[2]], summary=summary)

    def line_sources() -> list[str]:
        row = conn.execute("select line_sources from memory_private.records "
                           "where workspace_id = 'ws1' and record_id = %s", (rid,)).fetchone()
        assert row is not None
        return list(row[0])

    assert line_sources() == [m[0], m[1], ""]
    # A record without sources cites nothing: no element at all.
    bare = make_record(conn, "ws1", "r1", [], summary=f"mentions [{m[0]}]\nand more")
    assert conn.execute("select line_sources from memory_private.records "
                        "where workspace_id = 'ws1' and record_id = %s", (bare,)).fetchone() == ([],)
    # A source removed from record_dependencies is no longer a citation of its line.
    conn.execute("delete from memory_private.record_dependencies "
                 "where workspace_id = 'ws1' and record_id = %s and message_id = %s", (rid, m[1]))
    assert line_sources() == [m[0], "", ""]
    # A new source cited on a line becomes that line's citation.
    conn.execute("update memory_private.record_dependencies set via = 'cited', position = 2 "
                 "where workspace_id = 'ws1' and record_id = %s and message_id = %s", (rid, m[2]))
    assert line_sources() == [m[0], m[2], ""]
    # A changed summary is followed too, line by line.
    conn.execute("update memory_private.records set summary = %s "
                 "where workspace_id = 'ws1' and record_id = %s",
                 (f"only [{m[2]}, {m[0]}]\n[{m[0]}]", rid))
    assert line_sources() == [f"{m[2]} {m[0]}", m[0]]
    # Writing it directly is refused and changes nothing.
    with pytest.raises(psycopg.errors.GeneratedAlways), conn.transaction():
        conn.execute("update memory_private.records set line_sources = '{x}' "
                     "where workspace_id = 'ws1' and record_id = %s", (rid,))
    assert line_sources() == [f"{m[2]} {m[0]}", m[0]]
