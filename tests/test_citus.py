"""The schema on a real Citus cluster: a coordinator and two workers of the machine's
PostgreSQL with Citus installed (pyworker.lab.servers.CitusCluster), built and distributed by
``pimem migrate`` on the coordinator (docs/scaling.md).

Skipped, with one line saying why, when Citus is not installed (scripts/bootstrap builds it from
../shared/vendor/citus when that source is present). The cluster is started once for the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from typer.testing import CliRunner

from pyworker import schema
from pyworker.cli import app
from pyworker.lab.servers import CitusCluster
from tests.conftest import start_citus_cluster

pytestmark = [pytest.mark.slow, pytest.mark.no_citus("starts a cluster of its own")]


@dataclass
class Cluster:
    citus: CitusCluster
    dsn: str  # the coordinator's, of the distributed database


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    citus = start_citus_cluster()
    try:
        dsn = citus.create_database("pimem_citus")
        schema.migrate(dsn)
        yield Cluster(citus, dsn)
    finally:
        citus.destroy()


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
            "clock", "redaction_patterns", "invalid_reasons"}
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
        # every public function that takes the workspace first is delegated by that argument
        undelegated = conn.execute("""
            select p.oid::regprocedure::text from pg_proc p
             where p.pronamespace = 'memory'::regnamespace
               and p.proargnames[1] = 'p_workspace_id'
               and not exists (select 1 from pg_dist_object o
                                where o.classid = 'pg_proc'::regclass and o.objid = p.oid
                                  and o.distribution_argument_index = 0)""").fetchall()
        assert undelegated == []
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


def test_migrate_again_changes_nothing_and_says_the_database_is_distributed(
    cluster: Cluster,
) -> None:
    with psycopg.connect(cluster.dsn) as conn:
        before = conn.execute("select count(*) from pg_dist_object").fetchone()
    result = CliRunner().invoke(app, ["migrate", "--dsn", cluster.dsn])
    assert result.exit_code == 0, result.output
    assert "already up to date" in result.output
    assert "Citus" in result.output and "2 worker" in result.output
    assert "not finished" in result.output  # says what does not run on a cluster yet
    with psycopg.connect(cluster.dsn) as conn:
        assert conn.execute("select count(*) from pg_dist_object").fetchone() == before
        assert conn.execute("select memory_private.distribute()").fetchone() == (
            {"views": 0, "types": 0, "functions": 0, "reference_tables": 0,
             "distributed_tables": 0, "sql_functions_made_plpgsql": 0},)


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


def test_one_workspaces_call_runs_whole_on_the_node_holding_it(cluster: Cluster) -> None:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        _ingest(conn, "solo")
        node = conn.execute("""
            select n.nodeport from pg_dist_placement p
              join pg_dist_node n on n.groupid = p.groupid
             where p.shardid = get_shard_id_for_distribution_column(
                                 'memory_private.workspaces', 'solo')""").fetchone()
        assert node is not None
        plan = "\n".join(r[0] for r in conn.execute(
            "explain (costs off) select memory.upsert_message('solo', 'm9', 'r1', 'user', "
            "'alice', 'one more')"))
        # the whole call is one task on the workspace's node (function call delegation)
        assert "Task Count: 1" in plan, plan
        assert re.search(rf"port={node[0]}\b", plan), plan
