"""What runs on a Citus cluster is a committed file (`pimem cluster-code`, docs/scaling.md): the
file is what the generator writes from sql/, the generator keeps every attribute of a function
and changes only its language and the statement's wrapping, and it refuses a shape it cannot
convert without changing what the function does, naming the function.

On a real cluster: tests/test_citus.py (the functions there are the file's, with sql/'s
attributes, and a migration never leaves their one-server form running)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker import schema
from pyworker.cli import app
from pyworker.lab import cluster_code, sqlcode
from tests.factory import World


def test_the_cluster_file_is_what_cluster_code_writes() -> None:
    path = schema.cluster_code_file()
    assert path.read_text() == cluster_code.cluster_code(), (
        f"{path} differs from what `pimem cluster-code` writes from sql/: run it")
    result = CliRunner().invoke(app, ["cluster-code", "--check"])
    assert result.exit_code == 0, result.output


def test_the_file_converts_every_sql_function_that_is_not_immutable_and_nothing_else() -> None:
    stmts = sqlcode.file_statements(schema.canonical_files())
    code, _ = sqlcode.objects(stmts)
    wanted = set()
    for (kind, name), obj in code.items():
        if kind == "function":
            d = cluster_code.parse(obj.statements[0])
            if d.language == "sql" and d.volatility != "immutable":
                wanted.add(name)
    text = schema.cluster_code_file().read_text()
    converted = set(re.findall(r"^create or replace function ([a-z_.]+)\(", text, re.MULTILINE))
    assert converted == wanted
    # the validity rule's pieces, the scheduling's conversations, the search's words
    assert {"memory_private.scope_checks", "memory_private.record_reasons",
            "memory_private.extraction_candidates", "memory_private.fuzzy_candidates"} <= converted
    assert "language sql" not in text.lower().replace("-- ", "")
    # every function of the API plans for each call on the cluster (docs/scaling.md, Routing)
    assert "alter function memory.recall set plan_cache_mode = force_custom_plan;" in text
    assert "alter function memory.upsert_message set plan_cache_mode = force_custom_plan;" in text


# The conversion, on plain PostgreSQL ------------------------------------------------------------

EVERY_ATTRIBUTE = """create function memory_private.probe_count(p_workspace_id text)
  returns bigint
  language sql stable security definer strict parallel safe cost 7 leakproof
  set search_path = pg_catalog, pg_temp
  set work_mem = '8MB'
  -- a comment in the header stays
  as $$
  -- how many messages (one value: no table at the top)
  select (select count(*) from memory_private.messages m
           where m.workspace_id = p_workspace_id)
$$;"""

A_SET = """create function memory_private.probe_ids(p_workspace_id text, p_request_id text)
  returns table (message_id text, role text)
  language sql volatile called on null input parallel restricted cost 3 rows 2
  as $$
  select m.message_id, m.role from memory_private.messages m
   where m.workspace_id = p_workspace_id and m.request_id = p_request_id
   order by m.message_id -- the statement ends in a comment
$$;"""


def one(text: str) -> sqlcode.Statement:
    [statement] = sqlcode.statements(text, "probe.sql")
    return statement


ATTRIBUTES = """
    select l.lanname, p.provolatile, p.prosecdef, p.proisstrict, p.proparallel, p.procost,
           p.prorows, p.proleakproof, p.proconfig, pg_get_function_arguments(p.oid),
           pg_get_function_result(p.oid), obj_description(p.oid, 'pg_proc'),
           p.proacl::text
      from pg_proc p join pg_language l on l.oid = p.prolang
     where p.oid = %s::regprocedure"""


def test_every_attribute_is_kept_and_only_the_language_changes(
        fresh_conn: psycopg.Connection) -> None:
    conn = fresh_conn  # a database of its own: the test creates functions
    w = World(conn)
    w.basic("ws1")
    w.conversation("ws1", "r1", chat="dm-alice", user="alice", user_text="tea", reply="noted")
    converted = {}
    for text, signature, call in (
            (EVERY_ATTRIBUTE, "memory_private.probe_count(text)",
             "select memory_private.probe_count('ws1')"),
            (A_SET, "memory_private.probe_ids(text, text)",
             "select * from memory_private.probe_ids('ws1', 'r1')")):
        conn.execute(text)
        conn.execute(f"comment on function {signature} is 'kept'")
        conn.execute(f"grant execute on function {signature} to memory_operator")
        before = conn.execute(ATTRIBUTES, (signature,)).fetchone()
        answer = conn.execute(call).fetchall()
        converted[signature] = cluster_code.convert(one(text))
        conn.execute(converted[signature])
        after = conn.execute(ATTRIBUTES, (signature,)).fetchone()
        assert before is not None and after is not None
        assert before[0] == "sql" and after[0] == "plpgsql"
        assert after[1:] == before[1:], signature  # volatility ... comment, grants
        assert conn.execute(call).fetchall() == answer
    count = converted["memory_private.probe_count(text)"]
    assert "set search_path = pg_catalog, pg_temp\n  set work_mem = '8MB'" in count
    assert "-- a comment in the header stays" in count
    assert conn.execute("select proconfig from pg_proc where oid = "
                        "'memory_private.probe_count(text)'::regprocedure").fetchone() == (
        ["search_path=pg_catalog, pg_temp", "work_mem=8MB"],)
    # no rows: NULL in both forms; a set: its rows
    assert conn.execute("select memory_private.probe_count(null)").fetchone() == (None,)
    assert conn.execute("select count(*) from memory_private.probe_ids('ws1', 'r1')"
                        ).fetchone() == (2,)


def test_a_single_value_that_may_be_several_rows_ends_in_limit_1() -> None:
    several = """create function memory_private.probe_role(p_workspace_id text) returns text
  language sql stable
  as $$ select m.role from memory_private.messages m where m.workspace_id = p_workspace_id $$;"""
    with pytest.raises(sqlcode.SqlCodeError,
                       match=r"probe\.sql:1: memory_private\.probe_role .*several rows"):
        cluster_code.convert(one(several))
    first = several.replace("p_workspace_id $$", "p_workspace_id\n limit 1 $$")
    assert "return ( select m.role" in cluster_code.convert(one(first))
    for text in (several.replace("select m.role from memory_private.messages m where "
                                 "m.workspace_id = p_workspace_id",
                                 "select unnest(array[p_workspace_id, p_workspace_id])"),
                 several.replace("from memory_private.messages m where m.workspace_id = "
                                 "p_workspace_id", "union select 'x'")):
        with pytest.raises(sqlcode.SqlCodeError, match="several rows"):
            cluster_code.convert(one(text))


@pytest.mark.parametrize(("text", "why"), [
    ("""create function memory_private.p(a int) returns int language sql stable
        as $$ select 1; select 2 $$;""", "several statements"),
    ("""create function memory_private.p(a int) returns setof int language sql volatile
        as $$ with d as (delete from memory_private.clock returning 1) select * from d $$;""",
     "writes"),
    ("""create function memory_private.p(a int) returns setof int language sql stable
        as $$ select 1 from memory_private.clock for update $$;""", "writes"),
    ("""create function memory_private.p(a int) returns record language sql stable
        as $$ select 1, 2 $$;""", "several columns"),
    ("""create function memory_private.p(a int) returns record language sql stable
        as $$ select * from memory_private.clock limit 1 $$;""", "several columns"),
    ("""create function memory.p(a int) returns int language sql stable
        security definer set search_path = pg_catalog, pg_temp
        as $$ select 1 $$;""", "public function"),
    ("""create function memory_private.p(a int, out b int) language sql stable
        as $$ select 1 $$;""", "out parameters"),
    ("""create function memory_private.p(a int) returns int
        as $$ select 1 $$ language sql stable;""", "attributes after its body"),
    ("""create function memory_private.p(a int) returns int language sql stable
        as 'select 1';""", "not a dollar-quoted string"),
    ("""create function memory_private.p(a int) returns int language sql stable
        as $$ call memory_private.q() $$;""", "not one query"),
])
def test_shapes_it_cannot_convert_are_refused_with_the_functions_name(
        text: str, why: str) -> None:
    with pytest.raises(sqlcode.SqlCodeError, match=rf"memory(_private)?\.p cannot .*{why}"):
        cluster_code.convert(one(text))


def test_sql_that_the_file_would_get_wrong_is_refused(tmp_path: Path) -> None:
    files = schema.canonical_files()
    # An immutable function that reads a table (the file would leave it inlined on the cluster).
    bad = tmp_path / "99_bad.sql"
    bad.write_text("create function memory_private.reads_clock() returns interval\n"
                   "  language sql immutable\n"
                   "  as $$ select time_offset from memory_private.clock $$;\n")
    with pytest.raises(sqlcode.SqlCodeError, match="reads_clock .*immutable but reads "
                                                   "memory_private.clock"):
        cluster_code.cluster_code([*files, bad])
    # A function altered after its definition (create or replace would undo the ALTER).
    bad.write_text("create function memory_private.later() returns interval\n"
                   "  language sql stable\n"
                   "  as $$ select time_offset from memory_private.clock $$;\n"
                   "alter function memory_private.later() set work_mem = '1MB';\n")
    with pytest.raises(sqlcode.SqlCodeError, match="later .*alters it after its definition"):
        cluster_code.cluster_code([*files, bad])
    # Immutable and reading no table, or naming a table in a string: left as it is.
    bad.write_text("create function memory_private.label() returns text\n"
                   "  language sql immutable\n"
                   "  as $$ select 'see memory_private.clock' $$;\n")
    assert "memory_private.label" not in cluster_code.cluster_code([*files, bad])


def test_the_generator_writes_the_file_and_check_names_a_stale_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sql = tmp_path / "sql"
    shutil.copytree(schema.SQL_DIR, sql)
    monkeypatch.setattr(schema, "SQL_DIR", sql)
    base = sql / "00_base.sql"
    base.write_text(base.read_text().replace(
        "as $$ select now() + (select time_offset from memory_private.clock) $$;",
        "as $$ select now() + (select time_offset from memory_private.clock) + interval '0' $$;"))
    with pytest.raises(schema.MigrateError, match="cluster-code"):
        cluster_code.write_cluster_code(check=True)
    assert cluster_code.write_cluster_code() == sql / "cluster" / "functions.sql"
    assert "+ interval '0'" in (sql / "cluster" / "functions.sql").read_text()
    cluster_code.write_cluster_code(check=True)
