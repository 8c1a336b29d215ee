"""The schema on a real Citus cluster: a coordinator and two workers of the machine's
PostgreSQL with Citus installed (pyworker.lab.servers.CitusCluster), built and distributed by
``pimem migrate`` on the coordinator (docs/scaling.md).

Skipped, with one line saying why, when Citus is not installed (scripts/bootstrap builds it from
../shared/vendor/citus when that source is present). The cluster is started once for the file;
the tests that add a worker and move shards start one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from typer.testing import CliRunner

from pyworker import schema
from pyworker.adapters import make_adapter
from pyworker.cli import app
from pyworker.client import AsyncMemoryClient, MemoryClient
from pyworker.lab import cluster_code, releases, sqlcode
from pyworker.lab.servers import CitusCluster, LocalCluster, free_port
from pyworker.routing import Node
from pyworker.worker import Worker, WorkerConfig
from tests.conftest import start_citus_cluster
from tests.factory import World
from tests.test_releases import DROPPED_TABLES, load_world, smoke, tenant_rows, usage_of

pytestmark = [pytest.mark.slow, pytest.mark.no_citus("starts a cluster of its own")]


@dataclass
class Cluster:
    citus: CitusCluster
    dsn: str  # the coordinator's, of the distributed database


@contextmanager
def _distributed(dbname: str, settings: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A started cluster (its nodes' ``settings`` added) with the schema distributed in
    database ``dbname``; destroyed afterwards."""
    citus = start_citus_cluster(settings)
    try:
        dsn = citus.create_database(dbname)
        schema.migrate(dsn)
        yield Cluster(citus, dsn)
    finally:
        citus.destroy()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with _distributed("pimem_citus") as c:
        yield c


def _ingest(conn: psycopg.Connection, ws: str, n_messages: int = 2) -> None:
    conn.execute("select memory.upsert_workspace(%s, 1, 50.00)", (ws,))
    conn.execute("select memory.upsert_member(%s, 'alice', 'owner', true)", (ws,))
    conn.execute("select memory.upsert_bot(%s, 'helper', 'tg:1', true)", (ws,))
    conn.execute("select memory.upsert_chat(%s, 'dm', 'private', 'alice', true)", (ws,))
    conn.execute("select memory.upsert_request(%s, 'r1', 'helper', 'dm', 0, 'alice', "
                 "'interactive', 'succeeded', 'openai', 'gpt-4o-mini', 0.50)", (ws,))
    for i in range(n_messages):
        role, speaker = ("user", "alice") if i % 2 == 0 else ("assistant", "helper")
        conn.execute("select memory.upsert_message(%s, %s, 'r1', %s, %s, %s)",
                     (ws, f"m{i}", role, speaker, f"message {i} of {ws}: I prefer tea"))


def test_migrate_on_the_coordinator_distributes_every_table_and_workspace_function(
    cluster: Cluster,
) -> None:
    info = schema.citus_cluster(cluster.dsn)
    assert info is not None and info.coordinator and info.distributed
    assert len(info.workers) == 2
    with psycopg.connect(cluster.dsn) as conn:
        kinds = dict(conn.execute("""
            select c.relname, coalesce(p.partmethod, 'local')
              from pg_class c
              left join pg_dist_partition p on p.logicalrelid = c.oid
             where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
        """).fetchall())
        # global configuration is replicated; every table with a workspace_id is hash-distributed
        assert {t for t, k in kinds.items() if k == "n"} == {
            "clock", "redaction_patterns", "invalid_reasons", "waiting_reasons"}
        workspace_tables = {r[0] for r in conn.execute("""
            select c.relname from pg_class c join pg_attribute a on a.attrelid = c.oid
             where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
               and a.attname = 'workspace_id'""")}
        assert workspace_tables and {t for t, k in kinds.items() if k == "h"} == workspace_tables
        # ... all co-located with the workspaces table, distributed by workspace_id
        groups = conn.execute("""
            select count(distinct p.colocationid),
                   bool_and(column_to_column_name(p.logicalrelid, p.partkey) = 'workspace_id')
              from pg_dist_partition p
             where p.partmethod = 'h'
               and p.logicalrelid::regclass::text like 'memory\\_private.%'""").fetchone()
        assert groups == (1, True)
        # no function is delegated by its workspace argument (a NULL one would crash Citus)
        delegated = conn.execute("""
            select o.objid::regprocedure::text from pg_dist_object o
             where o.classid = 'pg_proc'::regclass
               and o.distribution_argument_index is not null""").fetchall()
        assert delegated == []
        # no SQL function that could be inlined on a shard: the cluster file's forms instead
        inlined = conn.execute("""
            select p.oid::regprocedure::text from pg_proc p
             where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
               and p.prolang = (select oid from pg_language where lanname = 'sql')
               and p.provolatile <> 'i'""").fetchall()
        assert inlined == []
        # every table has a primary key and logs it as its replica identity: Citus's default
        # shard transfer mode (auto) then moves shards by logical replication, updates and
        # deletes included, while writes go on (docs/scaling.md, Operating it)
        without_key = conn.execute("""
            select c.relname from pg_class c
             where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
               and not (c.relreplident = 'd'
                        and exists (select 1 from pg_index i
                                     where i.indrelid = c.oid and i.indisprimary))""")
        assert without_key.fetchall() == []
        # and every function of the schema exists on the workers
        for worker in cluster.citus.workers:
            with psycopg.connect(worker.dsn("pimem_citus")) as w:
                here = w.execute("""select count(*) from pg_proc
                                     where pronamespace in ('memory'::regnamespace,
                                                            'memory_private'::regnamespace)""")
                there = conn.execute("""select count(*) from pg_proc
                                         where pronamespace in ('memory'::regnamespace,
                                                                'memory_private'::regnamespace)""")
                assert here.fetchone() == there.fetchone()


# What a function is, but for its language and body, and what runs it.
FUNCTION_FACTS = """
    select p.oid::regprocedure::text, l.lanname, p.provolatile, p.prosecdef, p.proisstrict,
           p.proparallel, p.procost, p.prorows, p.proleakproof,
           array(select c from unnest(p.proconfig) c
                  where c not like 'plan_cache_mode=%%' order by c),
           obj_description(p.oid, 'pg_proc'), p.proacl::text, p.prosrc
      from pg_proc p join pg_language l on l.oid = p.prolang
     where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
       and p.proname = any(%s)
     order by 1"""


def test_every_node_runs_the_cluster_file_with_the_attributes_sql_gives(
    cluster: Cluster, conn: psycopg.Connection,
) -> None:
    # conn: one PostgreSQL server with the schema of sql/ (the main suite's database)
    text = schema.cluster_code_file().read_text()
    names = re.findall(r"^create or replace function [a-z_]+\.([a-z_]+)\(", text, re.MULTILINE)
    generic = re.findall(r"^alter function [a-z_]+\.([a-z_]+) set plan_cache_mode = "
                         r"force_custom_plan;", text, re.MULTILINE)
    assert len(names) >= 15 and "recall" in generic
    one_server = {r[0]: r for r in conn.execute(FUNCTION_FACTS, (names + generic,))}
    assert {r[1] for n, r in one_server.items() if n.split("(")[0].split(".")[1] in names} == {
        "sql"}
    bodies = dict(re.findall(r"^create or replace function ([a-z_.]+)\(.*?as \$\$(.*?)\$\$;",
                             text, re.MULTILINE | re.DOTALL))
    nodes = [cluster.dsn] + [w.dsn("pimem_citus") for w in cluster.citus.workers]
    for dsn in nodes:
        with psycopg.connect(dsn) as node:
            here = {r[0]: r for r in node.execute(FUNCTION_FACTS, (names + generic,))}
            assert set(here) == set(one_server), dsn
            for name, facts in here.items():
                base = one_server[name]
                # every attribute sql/ gives and its grants: the same on every node (and its
                # comment on the coordinator, which Citus does not copy to the workers)
                assert facts[2:10] + facts[11:12] == base[2:10] + base[11:12], (dsn, name)
                if dsn == cluster.dsn:
                    assert facts[10] == base[10], name
                short = name.split("(")[0]
                if short.split(".")[1] in names:
                    assert facts[1] == "plpgsql", (dsn, name)
                    assert facts[12] == bodies[short], (dsn, name)  # the file's body
                else:
                    assert facts[12] == base[12], (dsn, name)  # only its plans, for each call
                    config = node.execute("select proconfig from pg_proc where oid = %s::regprocedure",
                                          (name,)).fetchone()
                    assert config is not None
                    assert "plan_cache_mode=force_custom_plan" in (config[0] or []), name


def test_migrate_again_changes_nothing_and_says_the_database_is_distributed(
    cluster: Cluster,
) -> None:
    with psycopg.connect(cluster.dsn) as conn:
        before = conn.execute("select count(*) from pg_dist_object").fetchone()
    result = CliRunner().invoke(app, ["migrate", "--dsn", cluster.dsn])
    assert result.exit_code == 0, result.output
    assert "already up to date" in result.output
    assert "Citus" in result.output and "2 worker" in result.output
    status = CliRunner().invoke(app, ["status", "--dsn", cluster.dsn])
    assert status.exit_code == 0, status.output
    assert "Citus coordinator, schema distributed on 2 worker node(s)" in status.output
    assert all(w.split(":")[1] in status.output for w in schema.citus_cluster(cluster.dsn).workers)  # type: ignore[union-attr]
    with psycopg.connect(cluster.dsn) as conn:
        assert conn.execute("select count(*) from pg_dist_object").fetchone() == before
        assert conn.execute("select memory_private.distribute()").fetchone() == (
            {"views": 0, "functions": 0, "reference_tables": 0, "distributed_tables": 0},)


def test_migrate_on_a_worker_node_refuses_and_names_the_coordinator(cluster: Cluster) -> None:
    worker = cluster.citus.workers[0].dsn("pimem_citus")
    with pytest.raises(schema.MigrateError, match="Citus worker node.*coordinator"):
        schema.migrate(worker)


def test_workspaces_rows_land_on_both_workers(cluster: Cluster) -> None:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        for i in range(16):
            _ingest(conn, f"spread-{i}")
        counts = {}
        for worker in cluster.citus.workers:
            with psycopg.connect(worker.dsn("pimem_citus")) as w:
                # the worker's own shards of messages (Citus hides shards from pg_class)
                w.execute("set citus.override_table_visibility = off")
                shards = [r[0] for r in w.execute("""
                    select c.relname from pg_class c
                     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
                       and c.relname ~ '^messages_[0-9]+$'""")]
                total = 0
                for shard in shards:
                    total += w.execute(  # type: ignore[index]
                        f"select count(*) from memory_private.{shard} "
                        "where workspace_id like 'spread-%'").fetchone()[0]
                counts[worker.port] = total
        assert sum(counts.values()) == 32
        assert all(n > 0 for n in counts.values()), counts


def test_one_workspaces_calls_run_on_the_node_holding_it(cluster: Cluster) -> None:
    # Citus's tenant statistics, kept by every node for the statements it runs for a value of
    # the distribution column: every statement of one workspace's calls ran on its node.
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("alter database pimem_citus set citus.stat_tenants_track = 'all'")
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("select citus_stat_tenants_reset()")
            _ingest(conn, "solo", n_messages=4)
            conn.execute("select memory.upsert_request('solo', 'r2', 'helper', 'dm', 0, 'alice', "
                         "'interactive', 'running', 'openai', 'gpt-4o-mini', 0.50)")
            conn.execute("select memory.recall('solo', 'r2')")
            conn.execute("""select memory.query_memories('solo', 'r2', 'c1', '{"query": "tea"}')""")
            node = conn.execute("""
                select n.nodeid from pg_dist_placement p
                  join pg_dist_node n on n.groupid = p.groupid
                 where p.shardid = get_shard_id_for_distribution_column(
                                     'memory_private.workspaces', 'solo')""").fetchone()
            ran = conn.execute("""
                select nodeid, sum(query_count_in_this_period)
                  from citus_stat_tenants(true)
                 where tenant_attribute = 'solo' group by 1""").fetchall()
        assert node is not None and ran and {n for n, _ in ran} == {node[0]}, (node, ran)
        assert sum(int(c) for _, c in ran) >= 20, ran  # the calls' statements, not one or two
    finally:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("alter database pimem_citus reset citus.stat_tenants_track")


def test_a_call_without_a_workspace_is_refused_and_the_coordinator_stays_up(
    cluster: Cluster,
) -> None:
    # Delegating a call by a NULL distribution argument crashes Citus 13.2.2's coordinator
    # backend; no function is delegated, so the call gets its coded error instead.
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        started = conn.execute("select pg_postmaster_start_time()").fetchone()
        for call in ("select memory.recall(null, 'r1')", "select memory.run_maintenance(null)",
                     "select memory.upsert_message(null, 'm', 'r1', 'user', 'alice', 'x')"):
            try:
                conn.execute(call)
            except psycopg.Error as exc:
                assert exc.sqlstate and exc.sqlstate.startswith("MB"), (call, exc)
    with psycopg.connect(cluster.dsn) as conn:
        assert conn.execute("select pg_postmaster_start_time()").fetchone() == started


def _release_dir(tmp_path: Path) -> Path:
    """The first released migrations alone (a database at 0.1.0)."""
    release = releases.load()[0]
    directory = tmp_path / "release"
    directory.mkdir()
    for name in release.migrations:
        shutil.copyfile(schema.MIGRATIONS_DIR / name, directory / name)
    return directory


def test_a_database_at_the_first_release_upgrades_onto_the_cluster_with_its_rows(
    cluster: Cluster, tmp_path: Path,
) -> None:
    # 0.1.0 had no Citus support: migrated on a coordinator it stays there, undistributed.
    dsn = cluster.citus.create_database("upgraded")
    schema.migrate(dsn, directory=_release_dir(tmp_path))
    info = schema.citus_cluster(dsn)
    assert info is not None and not info.distributed
    load_world(dsn)
    rows, usage = tenant_rows(dsn), usage_of(dsn)
    assert rows["messages"] > 0 and rows["records"] > 0, rows
    # The head: the later migrations, then the whole schema distributed with the rows in it.
    assert schema.migrate(dsn)
    info = schema.citus_cluster(dsn)
    assert info is not None and info.distributed
    after = tenant_rows(dsn)
    # No row is lost; a record gains the dependencies on what its model call was shown.
    grown = {"record_dependencies"}
    assert {t: n for t, n in after.items() if t in rows and t not in grown} == {
        t: n for t, n in rows.items() if t not in DROPPED_TABLES and t not in grown}, \
        "rows were lost"
    assert after["record_dependencies"] >= rows["record_dependencies"], "rows were lost"
    assert usage_of(dsn) == usage
    with psycopg.connect(dsn) as conn:
        local = conn.execute("""
            select count(*) from pg_class c
             where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
               and not exists (select 1 from pg_dist_partition p where p.logicalrelid = c.oid)
        """).fetchone()
        assert local == (0,)
    smoke(dsn)  # the pipeline, recall and search on the upgraded, distributed data


LATER = """-- {name}: what a later migration does on a distributed database (tests/test_citus.py)
alter table memory_private.messages add column synthetic_flag boolean not null default false;

create table memory_private.synthetic_notes (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  note_id bigint not null,
  body text not null,
  primary key (workspace_id, note_id)
);

create function memory.synthetic_note(p_workspace_id text, p_note_id bigint, p_body text)
  returns integer
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  insert into memory_private.synthetic_notes (workspace_id, note_id, body)
  values (p_workspace_id, p_note_id, p_body);
  return (select count(*) from memory_private.synthetic_notes n
           join memory_private.messages m on m.workspace_id = n.workspace_id
          where n.workspace_id = p_workspace_id and not m.synthetic_flag);
end
$$;

create or replace function memory_private.clip_label(p_text text) returns text
  language sql stable
  as $$ select left(p_text, 3) || (select count(*)::text from memory_private.invalid_reasons) $$;

create function memory_private.later_count(p_workspace_id text) returns bigint
  language sql stable security definer strict parallel safe cost 7
  set search_path = pg_catalog, pg_temp
  as $$
  select (select count(*) from memory_private.messages m where m.workspace_id = p_workspace_id)
$$;

-- a release replacing one of sql/'s SQL functions (its one-server form)
create or replace function memory_private.clock_now() returns timestamptz
  language sql stable
  as $$ select now() + (select time_offset from memory_private.clock) $$;

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select {number} $$;
"""


def test_a_later_migration_reaches_every_node_of_a_distributed_database(
    cluster: Cluster, tmp_path: Path,
) -> None:
    dsn = cluster.citus.create_database("later")
    schema.migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ingest(conn, "later-1", n_messages=3)
    head = tmp_path / "head"
    shutil.copytree(schema.MIGRATIONS_DIR, head)
    number = schema.expected_version() + 1
    name = f"{number:04d}_synthetic"
    later = LATER.format(name=name, number=number)
    (head / f"{name}.sql").write_text(later)
    # The release's cluster file: the package's, and the cluster form of the new SQL functions.
    new_code = [cluster_code.convert(s) for s in sqlcode.statements(later)
                if re.match(r"create (or replace )?function memory_private\.(clip_label|later_)",
                            s.head)]
    cluster_file = tmp_path / "cluster.sql"
    cluster_file.write_text(schema.cluster_code_file().read_text() + "\n".join(new_code))
    # Meanwhile the catalog of the coordinator and of a worker is read again and again: the
    # replaced function is never seen in its one-server form (it commits with its cluster form).
    seen: set[tuple[str, str]] = set()
    done = threading.Event()

    def watch(node_dsn: str) -> None:
        with psycopg.connect(node_dsn, autocommit=True) as watcher:
            while not done.is_set():
                row = watcher.execute("""select l.lanname from pg_proc p
                                           join pg_language l on l.oid = p.prolang
                                          where p.oid = 'memory_private.clock_now()'::regprocedure
                                       """).fetchone()
                seen.add((node_dsn, row[0] if row else "missing"))

    watchers = [threading.Thread(target=watch, args=(d,))
                for d in (dsn, cluster.citus.workers[0].dsn("later"))]
    for t in watchers:
        t.start()
    try:
        assert schema.migrate(dsn, directory=head, cluster_code=cluster_file) == [name]
    finally:
        done.set()
        for t in watchers:
            t.join()
    assert {lang for _, lang in seen} == {"plpgsql"}, seen
    with psycopg.connect(dsn, autocommit=True) as conn:
        # a new table of a workspace: distributed by it, with the workspaces
        colocated = conn.execute("""
            select p.colocationid = w.colocationid from pg_dist_partition p,
                   pg_dist_partition w
             where p.logicalrelid = 'memory_private.synthetic_notes'::regclass
               and w.logicalrelid = 'memory_private.workspaces'::regclass""").fetchone()
        assert colocated == (True,)
        # a new workspace function: on every node (not delegated); it reads the new column
        placed = conn.execute("""
            select distribution_argument_index from pg_dist_object
             where classid = 'pg_proc'::regclass
               and objid = 'memory.synthetic_note(text,bigint,text)'::regprocedure""").fetchone()
        assert placed == (None,)
        assert conn.execute("select memory.synthetic_note('later-1', 1, 'x')").fetchone() == (3,)
        # a new SQL function that reads a table takes the cluster's form too
        assert conn.execute("select memory_private.clip_label('abcdef')").fetchone() == ("abc10",)
    for worker in cluster.citus.workers:
        with psycopg.connect(worker.dsn("later")) as w:
            assert w.execute("select memory.schema_version()").fetchone() == (number,)
            assert w.execute("""select count(*) from pg_attribute
                                 where attrelid = 'memory_private.messages'::regclass
                                   and attname = 'synthetic_flag'""").fetchone() == (1,)
            assert w.execute("""select l.lanname from pg_proc p join pg_language l
                                    on l.oid = p.prolang
                                 where p.oid = 'memory_private.clip_label(text)'::regprocedure
                             """).fetchone() == ("plpgsql",)
            # the cluster form keeps every attribute: the security definer's search path is the
            # two schemas sql/ names, not one schema of that name
            assert w.execute("""select l.lanname, p.prosecdef, p.proisstrict, p.proparallel,
                                       p.procost, p.proconfig
                                  from pg_proc p join pg_language l on l.oid = p.prolang
                                 where p.oid = 'memory_private.later_count(text)'::regprocedure
                             """).fetchone() == ("plpgsql", True, True, "s", 7,
                                                 ["search_path=pg_catalog, pg_temp"])
            assert w.execute("select memory_private.later_count('later-1')").fetchone() == (3,)
            # the new private functions are no more executable by PUBLIC there than here
            assert w.execute("""select count(*) from pg_proc p
                                 where p.pronamespace = 'memory_private'::regnamespace
                                   and has_function_privilege('public', p.oid, 'execute')
                             """).fetchone() == (0,)


def test_the_demo_runs_on_the_cluster(cluster: Cluster) -> None:
    dsn = cluster.citus.create_database("demo")
    result = CliRunner().invoke(app, ["demo", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    with psycopg.connect(dsn) as conn:
        records = conn.execute("select count(*) from memory_private.records").fetchone()
        assert records is not None and records[0] > 0
        info = schema.citus_cluster(dsn)
        assert info is not None and info.distributed


# Adding a worker and moving shards online --------------------------------------------------------

def _runbook_check() -> str:
    """The first step of docs/scaling.md's runbook for adding a node, as written there: the
    workers on which a session of this database commits asynchronously (synchronous_commit off
    in the server's settings, or set off for the database or for a role), which Citus 13.2.2 can
    lose in an online move."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    block = text[text.index("-- 1. Every worker commits synchronously"):]
    statement = block[block.index("\n") + 1:block.index(";\n")]
    assert "run_command_on_workers" in statement, statement
    return statement


ASYNCHRONOUS_WORKERS = _runbook_check()

def _on_node_alone(node: LocalCluster, statement: str) -> None:
    """A statement on one node of the cluster only (as an operator's on one machine)."""
    with psycopg.connect(node.dsn("pimem_citus"), autocommit=True) as w:
        w.execute("set citus.enable_ddl_propagation = off")
        w.execute(statement)


def test_the_runbooks_check_names_the_workers_that_commit_asynchronously(
    cluster: Cluster,
) -> None:
    first, second = cluster.citus.workers[:2]
    role = "alter role pimem_async_backend in database pimem_citus"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        assert conn.execute(ASYNCHRONOUS_WORKERS).fetchall() == []
        conn.execute("create role pimem_async_backend")  # Citus creates it on every node
    try:
        # on one worker a role commits asynchronously in this database, on the other the
        # database itself
        _on_node_alone(first, f"{role} set synchronous_commit = false")
        _on_node_alone(second, "alter database pimem_citus set synchronous_commit = off")
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            listed = conn.execute(ASYNCHRONOUS_WORKERS).fetchall()
        assert sorted(listed) == sorted(("127.0.0.1", n.port) for n in (first, second))
    finally:
        _on_node_alone(first, f"{role} reset synchronous_commit")
        _on_node_alone(second, "alter database pimem_citus reset synchronous_commit")
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("drop role pimem_async_backend")
            assert conn.execute(ASYNCHRONOUS_WORKERS).fetchall() == []


# The isolation-test hook of Citus (multi_logical_replication.c,
# ConflictWithIsolationTestingAfterCopy): with citus.running_under_citus_test_suite on, a
# logical move takes a share lock on this advisory key after its copy and catch-up, right before
# it blocks the shard group's writes for its final catch-up. Holding the key pauses it there.
MOVE_PAUSE_KEY = (44000, 55152)

# Each run of the loaded rebalance is a fresh cluster: 1.5 to 2 minutes (a third of it starting
# the cluster and migrating) on the shared 2-core machine at a load of 10 to 18.
REBALANCE_RUNS = 3


@pytest.fixture
def moves_cluster() -> Iterator[Cluster]:
    """A cluster of the test's own (a coordinator and two workers, the schema distributed in
    database "moves"), to which the test adds a third worker and moves shards. Its WAL writer
    runs every 10 s instead of 200 ms: a commit that waited for it (an asynchronous one) would
    stay unwritten well past a move's end; a synchronous commit writes its WAL itself."""
    with _distributed("moves", {"wal_writer_delay": "10s"}) as c:
        yield c


def _wait_for(what: str, done: Callable[[], bool], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {seconds:.0f} s waiting for {what}")
        time.sleep(0.1)


KEYS = {"requests": "request_id", "messages": "message_id"}


def _present(dsn: str) -> set[tuple[str, str, str]]:
    """Every request and message the coordinator finds, as (table, workspace, id)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {(table, ws, key) for table, column in KEYS.items()
                for ws, key in conn.execute(
                    f"select workspace_id, {column} from memory_private.{table}")}


def _missing(cluster: Cluster, acknowledged: list[tuple[str, str, str]]) -> list[str]:
    """The acknowledged rows ((table, workspace, id)) that the coordinator does not find, each
    named with the shard that should hold it, that shard's node, and every node's shard of the
    table that does hold it (a move's old placement until Citus drops it)."""
    present = _present(cluster.dsn)
    lost = [row for row in acknowledged if row not in present]
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        named = []
        for table, ws, key in lost:
            shard, port = conn.execute("""
                select p.shardid, n.nodeport from pg_dist_placement p
                  join pg_dist_node n using (groupid)
                 where p.shardid = get_shard_id_for_distribution_column(
                                     %s::regclass, %s::text)""",
                                       (f"memory_private.{table}", ws)).fetchone() or (None, None)
            held = ", ".join(_held_by(cluster, table, ws, key)) or "no shard of any node"
            named.append(f"{table} {ws}/{key}: shard {shard} on port {port}; held by {held}")
    return named


def _held_by(cluster: Cluster, table: str, ws: str, key: str) -> list[str]:
    found = []
    dbname = str(psycopg.conninfo.conninfo_to_dict(cluster.dsn)["dbname"])
    for node in cluster.citus.nodes:
        with psycopg.connect(node.dsn(dbname), autocommit=True) as w:
            w.execute("set citus.override_table_visibility = off")
            for (shard,) in w.execute(
                    "select c.relname from pg_class c where c.relnamespace = "
                    "'memory_private'::regnamespace and c.relname ~ %s",
                    (f"^{table}_[0-9]+$",)).fetchall():
                if w.execute(f"select 1 from memory_private.{shard} "
                             f"where workspace_id = %s and {KEYS[table]} = %s",
                             (ws, key)).fetchone():
                    found.append(f"{shard} on port {node.port}")
    return found


def _conversation(w: World, ws: str, request: str, n: int,
                  acknowledged: list[tuple[str, str, str]]) -> None:
    """One request and its two messages, each call's row noted once the call has returned."""
    w.request(ws, request, chat="dm-alice", user="alice")
    acknowledged.append(("requests", ws, request))
    for suffix, role, speaker, text in (
            ("u", "user", "alice", f"Please remember that item {n} is blue."),
            ("a", "assistant", "bot1", f"Noted: item {n}.")):
        w.message(ws, f"{request}-{suffix}", request, role, speaker, text)
        acknowledged.append(("messages", ws, f"{request}-{suffix}"))


@pytest.mark.parametrize("run", range(1, REBALANCE_RUNS + 1))
def test_adding_a_worker_and_rebalancing_online_under_load_loses_nothing(
    moves_cluster: Cluster, run: int,
) -> None:
    cluster, dsn = moves_cluster, moves_cluster.dsn
    spaces = [f"rb-{i}" for i in range(12)]
    acknowledged: list[tuple[str, str, str]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        w = World(conn)
        for ws in spaces:
            w.basic(ws)
            _conversation(w, ws, "r0", 0, acknowledged)
        conn.execute("select memory_private.advance_clock('31 minutes')")
        assert conn.execute(ASYNCHRONOUS_WORKERS).fetchall() == []  # the runbook's check
    stop, moved_all = threading.Event(), threading.Event()
    errors: list[str] = []
    statuses: set[str] = set()  # of the moves, as Citus reports them while they run

    def ingest() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            w = World(c)
            n = 1
            while not stop.is_set():
                try:
                    _conversation(w, spaces[n % len(spaces)], f"live-{n}", n, acknowledged)
                except psycopg.Error as exc:
                    errors.append(f"ingest: {exc}")
                n += 1

    def work(i: int) -> None:
        worker = Worker(WorkerConfig(dsn=dsn, interval=0, worker_id=f"rebalance-{i}"),
                        make_adapter("offline"))
        try:
            while not stop.is_set():
                if worker.tick().status == "idle":
                    time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - the test names it
            errors.append(f"worker {i}: {exc!r}")
        finally:
            worker.adapter.close()
            worker.db.close()

    def watch() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            while not moved_all.is_set():
                statuses.update(r[0] for r in c.execute(
                    "select status from get_rebalance_progress()"))
                time.sleep(0.05)

    threads = [threading.Thread(target=ingest), threading.Thread(target=watch)] + [
        threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        node = cluster.citus.add_worker()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("select citus_add_node('127.0.0.1', %s)", (node.port,))
            # The runbook's rebalance: Citus's default transfer mode (auto), logical
            # replication, the shard groups' writes going on while they are copied.
            conn.execute("select rebalance_table_shards()")
            moved_all.set()
            moved = conn.execute("""
                select count(*) from pg_dist_placement p join pg_dist_node n using (groupid)
                 where n.nodeport = %s""", (node.port,)).fetchone()
            assert moved is not None and moved[0] > 0, "no shard moved to the new worker"
        time.sleep(1)
    finally:
        stop.set()
        moved_all.set()
        for t in threads:
            t.join(timeout=120)
    assert errors == []
    # The moves ran by logical replication: only those report catching up.
    assert statuses & {"Catching Up", "Final Catchup"}, statuses
    assert len(acknowledged) > 100  # the ingest went on during the rebalance
    # Every request and message whose call returned is there, and nothing else.
    missing = _missing(cluster, acknowledged)
    assert not missing, "acknowledged, then lost:\n" + "\n".join(missing)
    assert _present(dsn) == set(acknowledged)
    # The pipeline finishes on the rebalanced cluster, and every workspace recalls.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select memory_private.advance_clock('31 minutes')")
        worker = Worker(WorkerConfig(dsn=dsn, interval=0), make_adapter("offline"))
        try:
            for _ in range(200):
                if worker.tick().status == "idle":
                    break
            else:
                pytest.fail("the pipeline did not finish")
        finally:
            worker.adapter.close()
            worker.db.close()
        jobs = dict(conn.execute(
            "select status, count(*) from memory_private.jobs group by 1").fetchall())
        assert set(jobs) <= {"succeeded", "skipped", "superseded"}, jobs
        w = World(conn)
        for ws in spaces:
            w.request(ws, "after", chat="dm-alice", user="alice", status="running")
            recall = w.call("recall", ws, "after")
            assert recall["mode"] in ("index", "directory") and recall["records"], (ws, recall)


def test_a_conversation_acknowledged_just_before_a_move_blocks_writes_reaches_the_new_node(
    moves_cluster: Cluster,
) -> None:
    """The moment Citus 13.2.2 loses a commit that was acknowledged before its WAL was written
    (docs/scaling.md, "Online moves need synchronous commits"): after the last catch-up and
    before the writes are blocked, the source's WAL written up to a record's end that the
    subscription has reached, its WAL writer slow. A move is paused right there, a conversation
    written and acknowledged, and the move goes on: the conversation is on the new node. On
    nodes that commit asynchronously it is not (it stays on the old placement only)."""
    cluster, dsn = moves_cluster, moves_cluster.dsn
    acknowledged: list[tuple[str, str, str]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        w = World(conn)
        w.basic("ws-a")
        _conversation(w, "ws-a", "r0", 0, acknowledged)
        assert conn.execute(ASYNCHRONOUS_WORKERS).fetchall() == []
        row = conn.execute("""
            select p.shardid, n.nodeport from pg_dist_placement p join pg_dist_node n using (groupid)
             where p.shardid = get_shard_id_for_distribution_column(
                                 'memory_private.workspaces', 'ws-a'::text)""").fetchone()
        assert row is not None
        shard, port = row
    source = next(n for n in cluster.citus.workers if n.port == port)
    target = cluster.citus.add_worker()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select citus_add_node('127.0.0.1', %s)", (target.port,))
        conn.execute("select replicate_reference_tables()")
    pause = psycopg.connect(dsn, autocommit=True)
    moved: list[str] = []
    try:
        pause.execute("select pg_advisory_lock(%s, %s)", MOVE_PAUSE_KEY)

        def move() -> None:
            with psycopg.connect(dsn, autocommit=True) as m:
                m.execute("set citus.running_under_citus_test_suite = on")
                m.execute("select citus_move_shard_placement(%s, '127.0.0.1', %s, "
                          "'127.0.0.1', %s)", (shard, source.port, target.port))
                moved.append("moved")

        mover = threading.Thread(target=move)
        mover.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            _wait_for("the move to pause before blocking writes", lambda: not mover.is_alive()
                      or conn.execute("select 1 from pg_locks where locktype = 'advisory' "
                                      "and objid = %s and not granted",
                                      (MOVE_PAUSE_KEY[1],)).fetchone() is not None)
        assert mover.is_alive(), "the move ended before its final catch-up"
        with psycopg.connect(source.dsn("moves"), autocommit=True) as s, \
                psycopg.connect(target.dsn("moves"), autocommit=True) as t:
            # The source's WAL written to the end of a commit (this synchronous one's, of a
            # table of the node's own: a temporary one's drop at the session's end would write
            # the WAL again), and the subscription past it: Citus's catch-up check will pass
            # at once.
            s.execute("set synchronous_commit = on")
            s.execute("create table public.flush_mark as select 1 as x")
            written = s.execute("select pg_current_wal_lsn()").fetchone()
            assert written is not None
            _wait_for("the subscription to reach the source's WAL", lambda: bool(t.execute(
                "select min(latest_end_lsn) >= %s from pg_stat_subscription",
                (written[0],)).fetchone()[0]))  # type: ignore[index]
            with psycopg.connect(dsn, autocommit=True) as conn:
                _conversation(World(conn), "ws-a", "late", 1, acknowledged)
    finally:
        pause.execute("select pg_advisory_unlock(%s, %s)", MOVE_PAUSE_KEY)
        pause.close()
    mover.join(timeout=300)
    assert moved == ["moved"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        now = conn.execute("""select n.nodeport from pg_dist_placement p
                               join pg_dist_node n using (groupid) where p.shardid = %s""",
                           (shard,)).fetchone()
    assert now == (target.port,)
    missing = _missing(cluster, acknowledged)
    assert not missing, "acknowledged, then lost:\n" + "\n".join(missing)
# Routing: each workspace's calls on the node holding it (docs/scaling.md, "Routing") ----------

def _holder_port(dsn: str, ws: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("""
            select n.nodeport from pg_dist_placement p join pg_dist_node n using (groupid)
             where p.shardid = get_shard_id_for_distribution_column(
                                 'memory_private.workspaces', %s::text)""", (ws,)).fetchone()
    assert row is not None
    return int(row[0])


def _workers(cluster: Cluster, dsn: str | None = None) -> list[LocalCluster]:
    """The worker nodes of the database's cluster (a worker another test added to another
    database is not one of them)."""
    with psycopg.connect(dsn or cluster.dsn) as conn:
        ports = {int(p) for (p,) in conn.execute(
            "select nodeport from pg_dist_node where groupid <> 0 and isactive")}
    return [w for w in cluster.citus.workers if w.port in ports]


def _one_per_worker(cluster: Cluster, prefix: str) -> dict[int, str]:
    """A workspace id held by each worker node: {port: workspace}."""
    found: dict[int, str] = {}
    workers = _workers(cluster)
    for i in range(64):
        port = _holder_port(cluster.dsn, f"{prefix}-{i}")
        found.setdefault(port, f"{prefix}-{i}")
        if len(found) == len(workers):
            return found
    raise AssertionError("no workspace id lands on every worker")


Counts = dict[int, dict[str, int]]


@contextlib.contextmanager
def _counting(cluster: Cluster, dbname: str = "pimem_citus") -> Iterator[Callable[[], Counts]]:
    """Citus's statement and connection counters of each node (citus_stat_counters), kept by
    the connections opened inside the block. Yields ``take``: the counts since the block began
    or the last ``take`` ({port: counters}), starting again from zero."""
    def alter(action: str) -> None:
        with psycopg.connect(cluster.citus.coordinator.dsn(dbname), autocommit=True) as conn:
            conn.execute(sql.SQL(f"alter database {{}} {action}").format(sql.Identifier(dbname)))

    nodes = [cluster.citus.coordinator, *_workers(cluster, cluster.citus.coordinator.dsn(dbname))]

    def take() -> Counts:
        counts: Counts = {}
        for node in nodes:
            with psycopg.connect(node.dsn(dbname), autocommit=True) as conn:
                row = conn.execute("""
                    select query_execution_single_shard + query_execution_multi_shard,
                           connection_establishment_succeeded + connection_reused
                      from citus_stat_counters where name = current_database()""").fetchone()
                conn.execute("select citus_stat_counters_reset()")
                assert row is not None
                counts[node.port] = {"statements": int(row[0]), "connections": int(row[1])}
        return counts

    alter("set citus.enable_stat_counters = on")
    try:
        take()
        yield take
    finally:
        alter("reset citus.enable_stat_counters")


def _running_request(memory: MemoryClient, ws: str, request: str) -> None:
    memory.upsert_request(ws, request, bot_id="bot1", chat_id="dm-alice", topic_id=0,
                          user_id="alice", kind="interactive", status="running",
                          model_provider="fake", model_id="m", budget_usd="1")


def test_the_node_of_a_workspace_is_answered_by_any_node(cluster: Cluster) -> None:
    spaces = _one_per_worker(cluster, "where")
    workers = _workers(cluster)
    for node in [cluster.citus.coordinator, *workers]:
        with psycopg.connect(node.dsn("pimem_citus")) as conn:
            for port, ws in spaces.items():
                assert conn.execute("select * from memory.workspace_node(%s)", (ws,)).fetchone() \
                    == ("127.0.0.1", port, port == node.port)
            nodes = conn.execute("select * from memory.workspace_nodes()").fetchall()
            assert nodes == sorted(("127.0.0.1", w.port, w.port == node.port) for w in workers)
            with pytest.raises(psycopg.Error) as refused:
                conn.execute("select * from memory.workspace_node(null)")
            assert refused.value.sqlstate == "MB001"


def test_a_client_sends_each_workspaces_calls_to_its_node_and_the_coordinator_does_nothing(
    cluster: Cluster,
) -> None:
    spaces = _one_per_worker(cluster, "routed")
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        w = World(conn)
        for ws in spaces.values():
            w.basic(ws)
            w.conversation(ws, "r0", chat="dm-alice", user="alice",
                           user_text="Please remember that I prefer tea.", reply="Noted.")
    with _counting(cluster) as take, MemoryClient(cluster.dsn) as memory:
        for ws in spaces.values():
            _running_request(memory, ws, "r1")
            assert memory.upsert_message(ws, "m1", "r1", "user", "alice", "hello") == "inserted"
            assert memory.recall(ws, "r1").mode == "none"
            assert memory.query_memories(ws, "r1", "c1", {}).mode == "browse"
            assert memory.workspace_node(ws).here
        routes = {ws: memory.routes.want(ws)[0] for ws in spaces.values()}
        counts = take()
    assert {ws: node.port if node else None for ws, node in routes.items()} == {
        ws: port for port, ws in spaces.items()}
    coordinator = cluster.citus.coordinator.port
    assert counts[coordinator] == {"statements": 0, "connections": 0}, counts
    for port in spaces:
        # every statement of the calls ran on the node, locally: no connection to another node
        assert counts[port]["statements"] >= 20 and counts[port]["connections"] == 0, counts


def test_the_async_client_routes_the_same_way(cluster: Cluster) -> None:
    spaces = _one_per_worker(cluster, "async")
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        for ws in spaces.values():
            World(conn).basic(ws)

    async def calls() -> dict[str, int | None]:
        async with AsyncMemoryClient(cluster.dsn) as memory:
            for ws in spaces.values():
                await memory.upsert_request(ws, "r1", bot_id="bot1", chat_id="dm-alice",
                                            topic_id=0, user_id="alice", kind="interactive",
                                            status="running", model_provider="fake",
                                            model_id="m", budget_usd="1")
                assert (await memory.recall(ws, "r1")).mode == "none"
            return {ws: (n.port if (n := memory.routes.want(ws)[0]) else None)
                    for ws in spaces.values()}

    with _counting(cluster) as take:
        routes = asyncio.run(calls())
        counts = take()
    assert routes == {ws: port for port, ws in spaces.items()}
    assert counts[cluster.citus.coordinator.port]["statements"] == 0, counts


def test_a_backend_role_routes_with_its_own_grants(cluster: Cluster) -> None:
    # The roles reach every node (Citus propagates them): a backend's login routes too.
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("drop role if exists routed_bot")
        conn.execute("create role routed_bot login in role memory_backend")
        World(conn).basic("role-routed")
    dsn = psycopg.conninfo.make_conninfo(cluster.dsn, user="routed_bot")
    with MemoryClient(dsn) as memory:
        _running_request(memory, "role-routed", "r1")
        assert memory.recall("role-routed", "r1").mode == "none"
        node = memory.routes.want("role-routed")[0]
    assert node is not None and node.port == _holder_port(cluster.dsn, "role-routed")


def test_a_connection_on_a_worker_node_keeps_its_memory_over_many_calls(
    cluster: Cluster,
) -> None:
    # Citus 13.2.2 kept a new local plan at every execution of a generic plan on the node
    # holding the shard (about 250 kB a recall); the API's functions plan for each call there.
    ws = next(iter(_one_per_worker(cluster, "memory").values()))
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        World(conn).basic(ws)
        World(conn).request(ws, "r1", chat="dm-alice", user="alice", status="running")
    node = next(w for w in cluster.citus.workers if w.port == _holder_port(cluster.dsn, ws))
    with psycopg.connect(node.dsn("pimem_citus"), autocommit=True) as conn:
        def used() -> int:
            row = conn.execute("select sum(total_bytes) from pg_backend_memory_contexts"
                               ).fetchone()
            assert row is not None
            return int(row[0])

        conn.execute(f"do $$ begin for i in 1..20 loop perform memory.recall('{ws}', 'r1'); "
                     "end loop; end $$")
        before = used()
        conn.execute(f"do $$ begin for i in 1..200 loop perform memory.recall('{ws}', 'r1'); "
                     "end loop; end $$")
        assert used() - before < 4 * 1024 * 1024, (before, used())


def _jobs_ready(conn: psycopg.Connection, spaces: list[str]) -> None:
    w = World(conn)
    for ws in spaces:
        w.basic(ws)
        w.conversation(ws, "r0", chat="dm-alice", user="alice",
                       user_text="Please remember that I prefer tea.", reply="Noted: tea.")
    conn.execute("select memory_private.advance_clock('31 minutes')")
    for ws in spaces:
        conn.execute("select memory.run_maintenance(%s)", (ws,))


def test_claim_job_on_a_worker_node_takes_only_the_workspaces_it_holds(cluster: Cluster) -> None:
    dsn = cluster.citus.create_database("claims_here")
    schema.migrate(dsn)
    spaces = [f"here-{i}" for i in range(8)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        _jobs_ready(conn, spaces)
    taken: dict[int, set[str]] = {}
    for node in _workers(cluster, dsn):
        with psycopg.connect(node.dsn("claims_here"), autocommit=True) as conn:
            while (payload := conn.execute("select memory.claim_job('w')").fetchone()[0]):  # type: ignore[index]
                taken.setdefault(node.port, set()).add(payload["workspace_id"])
    assert {port: sorted(ws) for port, ws in taken.items()} == {
        port: sorted(ws for ws in spaces if _holder_port(dsn, ws) == port)
        for port in {_holder_port(dsn, ws) for ws in spaces}}


def test_workers_claim_on_every_node_and_run_each_job_there_once(cluster: Cluster) -> None:
    dsn = cluster.citus.create_database("routed_jobs")
    schema.migrate(dsn)
    spaces = [f"job-{i}" for i in range(10)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        _jobs_ready(conn, spaces)

    def work(i: int) -> None:
        worker = Worker(WorkerConfig(dsn=dsn, interval=0, maintenance=False,
                                     worker_id=f"routed-{i}"), make_adapter("offline"))
        try:
            while worker.tick().status != "idle":
                pass
        finally:
            worker.adapter.close()
            worker.db.close()

    with _counting(cluster, "routed_jobs") as take:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        counts = take()
    with psycopg.connect(dsn, autocommit=True) as conn:
        jobs = conn.execute("select workspace_id, status, claims from memory_private.jobs"
                            ).fetchall()
        attempts = conn.execute("select count(*) from memory_private.job_attempts").fetchone()
    assert sorted(ws for ws, _, _ in jobs) == spaces
    assert {(status, claims) for _, status, claims in jobs} == {("succeeded", 1)}
    assert attempts == (len(spaces),)  # each job claimed and called once
    assert counts[cluster.citus.coordinator.port]["statements"] == 0, counts
    holders = {_holder_port(dsn, ws) for ws in spaces}
    assert all(counts[port]["statements"] > 0 for port in holders), counts


def test_a_stale_route_after_a_shard_move_answers_right_and_then_refreshes(
    cluster: Cluster,
) -> None:
    dsn = cluster.citus.create_database("moved")
    schema.migrate(dsn)
    ws = "moving"
    with psycopg.connect(dsn, autocommit=True) as conn:
        World(conn).basic(ws)
    now = [0.0]
    with _counting(cluster, "moved") as take, MemoryClient(dsn) as memory:
        memory.routes.clock = lambda: now[0]
        _running_request(memory, ws, "r1")
        old = memory.routes.want(ws)[0]
        assert old is not None and old.port == _holder_port(dsn, ws)
        target = next(w for w in _workers(cluster, dsn) if w.port != old.port)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("""
                select citus_move_shard_placement(
                         get_shard_id_for_distribution_column('memory_private.workspaces',
                                                              %s::text),
                         '127.0.0.1', %s, '127.0.0.1', %s, shard_transfer_mode => 'block_writes')
            """, (ws, old.port, target.port))
        assert _holder_port(dsn, ws) == target.port
        # The route is stale: the call goes to the old node, which answers right through the
        # new one.
        take()
        assert memory.upsert_message(ws, "m1", "r1", "user", "alice", "tea") == "inserted"
        assert memory.routes.want(ws) == (old, False)
        stale = take()
        # (the old node planned the statements and sent them on to the new one's shards)
        assert stale[old.port]["statements"] > 0 and stale[old.port]["connections"] > 0
        # Once the route is due for a check, the old node says where the workspace is now.
        now[0] += memory.routes.ttl
        assert memory.upsert_message(ws, "m2", "r1", "user", "alice", "more tea") == "inserted"
        fresh = take()
        assert memory.routes.want(ws) == (Node("127.0.0.1", target.port), False)
        assert fresh[old.port]["statements"] == 0 and fresh[target.port]["connections"] == 0
        assert fresh[target.port]["statements"] > 0
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select message_id from memory_private.messages "
                            "where workspace_id = %s order by 1", (ws,)).fetchall() == [
            ("m1",), ("m2",)]


def test_a_worker_node_that_cannot_be_reached_sends_its_calls_to_the_coordinator(
    cluster: Cluster,
) -> None:
    spaces = _one_per_worker(cluster, "unreachable")
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        for ws in spaces.values():
            World(conn).basic(ws)
    ws = next(iter(spaces.values()))
    with MemoryClient(cluster.dsn, timeout=2) as memory:
        _running_request(memory, ws, "r1")
        node = memory.routes.want(ws)[0]
        assert node is not None
        # A route to a port where nothing listens (a node gone from the network): the call is
        # not lost, the coordinator takes it.
        gone = Node(node.host, free_port())
        memory.routes.claimed_on(ws, gone)
        assert memory.recall(ws, "r1").mode == "none"
        assert memory.routes.want(ws)[0] is None
