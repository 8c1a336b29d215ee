"""Releases and upgrades (docs/migrations.md).

(a) the freeze guard: released migration files are byte-identical to what the release recorded,
    and a new migration sorts after them;
(b) the upgrade: a database built from a release's migrations, holding a small world made
    through the API and the worker, upgrades to the head and then equals a fresh build of the
    head (the catalog, triggers, grants and reference rows included), loses no row, and still
    runs the pipeline;
(c) the rolling-upgrade rule: every function a release promised to a role still exists at the
    head with the same arguments and result, still granted to that role, so workers and
    backends of the previous release keep working until they are replaced.

Each runs against every release in ``migrations/releases.json`` and, so that the mechanism is
proven before the first freeze, against a synthetic release: the current migrations frozen by
``pimem freeze-release`` in a temporary directory, followed by a synthetic later migration that
does what later migrations do (a new column, a replaced function body, a new ``_v2`` function,
the schema version bumped).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from typer.testing import CliRunner

import pyworker
from pyworker import schema
from pyworker.adapters import make_adapter
from pyworker.cli import app
from pyworker.lab import releases
from pyworker.worker import Worker, WorkerConfig
from tests.catalog import SCHEMAS, snapshot
from tests.conftest import Server
from tests.factory import World
from tests.records import copies_differing, usage_rows_missing

RELEASED = releases.load()
SYNTHETIC_VERSION = "0.0.1"
NO_RELEASE = ("no release is frozen yet; `pimem freeze-release VERSION` (docs/migrations.md) "
              "records one and turns this test on")


def real_releases() -> list[Any]:
    return [pytest.param(r, id=r.version) for r in RELEASED] or [
        pytest.param(None, id="none", marks=pytest.mark.skip(reason=NO_RELEASE))]


def empty_db(server: Server, name: str) -> str:
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        admin.execute(f"drop database if exists {name} with (force)")
        admin.execute(f"create database {name}")
    return server.dsn(name)


def api_of(dsn: str) -> dict[str, list[str]]:
    with psycopg.connect(dsn) as conn:
        return releases.api_signatures(conn)


# The synthetic release and head --------------------------------------------------------------


@dataclass
class Synthetic:
    release: releases.Release
    release_dir: Path          # the release's migrations and its manifest
    release_dsn: str           # a database built from them
    head_dir: Path             # the same plus the synthetic later migration
    later: str                 # that migration's id


def later_migration(release_dsn: str, number: int) -> str:
    """What a later migration does, written against the release's own catalog: a new column,
    a worker function's body replaced explicitly, a new ``_v2`` function beside the old ones,
    and the schema version bumped."""
    with psycopg.connect(release_dsn) as conn:
        row = conn.execute(
            """select pg_get_functiondef(p.oid) from pg_proc p
                 join pg_namespace n on n.oid = p.pronamespace
                where n.nspname = 'memory' and p.prolang = (select oid from pg_language
                                                            where lanname = 'plpgsql')
                  and has_function_privilege('memory_worker', p.oid, 'execute')
                order by p.proname limit 1""").fetchone()
    assert row is not None, "the release has no plpgsql worker function"
    replaced = row[0].replace("AS $function$", "AS $function$\n-- body replaced by a later "
                              "migration", 1)
    return f"""-- {number:04d}_synthetic: what a later migration does (tests/test_releases.py)
alter table memory_private.workspaces add column synthetic_note text;
comment on column memory_private.workspaces.synthetic_note is 'Added by a later migration.';

{replaced};

create function memory.synthetic_probe_v2(p_worker_id text) returns text
  language sql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select p_worker_id $$;
comment on function memory.synthetic_probe_v2(text) is 'A new worker function (synthetic).';
revoke all on function memory.synthetic_probe_v2(text) from public;
grant execute on function memory.synthetic_probe_v2(text) to memory_worker;

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select {number} $$;
"""


@pytest.fixture(scope="module")
def synthetic(pg_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Synthetic:
    base = tmp_path_factory.mktemp("releases")
    release_dir = base / "release"
    release_dir.mkdir()
    for path in schema.migration_files():
        shutil.copyfile(path, release_dir / path.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schema, "MIGRATIONS_DIR", release_dir)
        mp.setattr(pyworker, "__version__", SYNTHETIC_VERSION)
        refused = CliRunner().invoke(app, ["freeze-release", "9.9.9"])
        assert refused.exit_code == 1 and "set pyworker.__version__" in refused.output
        result = CliRunner().invoke(app, ["freeze-release", SYNTHETIC_VERSION,
                                          "--dsn", pg_server.admin_dsn])
    assert result.exit_code == 0, result.output
    [release] = releases.load(release_dir)
    dsn = empty_db(pg_server, "t_synthetic_release")
    schema.migrate(dsn, directory=release_dir)
    number = release.schema_version + 1
    head_dir = base / "head"
    shutil.copytree(release_dir, head_dir)
    later = f"{number:04d}_synthetic"
    (head_dir / f"{later}.sql").write_text(later_migration(dsn, number))
    return Synthetic(release, release_dir, dsn, head_dir, later)


# (a) The freeze guard --------------------------------------------------------------------------


def test_released_migrations_are_unchanged_and_new_ones_sort_after_them() -> None:
    assert releases.freeze_problems(RELEASED) == []


def test_a_freeze_records_every_migration_its_hash_the_version_and_the_api(
        synthetic: Synthetic) -> None:
    release = synthetic.release
    files = schema.migration_files(synthetic.release_dir)
    assert release.migrations == {p.name: releases.sha256(p) for p in files}
    assert release.schema_version == schema.expected_version()
    assert set(release.api) == {"memory_backend", "memory_worker", "memory_operator"}
    assert any(s.startswith("memory.claim_job(") for s in release.api["memory_worker"])
    assert releases.freeze_problems([release], synthetic.head_dir) == []


def test_the_freeze_guard_refuses_an_edited_release_and_a_migration_numbered_before_it(
        synthetic: Synthetic, tmp_path: Path) -> None:
    work = tmp_path / "m"
    shutil.copytree(synthetic.head_dir, work)
    first = min(synthetic.release.migrations)
    with (work / first).open("a") as f:
        f.write("\n-- an innocent-looking edit\n")
    (work / "0000_early.sql").write_text("select 1;\n")
    (work / "7_badly_named.sql").write_text("select 1;\n")
    problems = "\n".join(releases.freeze_problems([synthetic.release], work))
    assert f"{first} was released in {synthetic.release.version} and has changed" in problems
    assert "0000_early.sql is not released but sorts before" in problems
    assert "7_badly_named.sql: a migration is named" in problems
    (work / first).unlink()
    assert f"{first} was released in {synthetic.release.version} and is missing" in \
        "\n".join(releases.freeze_problems([synthetic.release], work))


def test_after_a_freeze_schema_bundle_opens_the_next_migration_and_a_release_is_frozen_once(
        synthetic: Synthetic, pg_server: Server, tmp_path: Path) -> None:
    work = tmp_path / "m"
    shutil.copytree(synthetic.release_dir, work)
    frozen = {p.name: p.read_bytes() for p in work.iterdir()}
    path = releases.write_unreleased_migration(directory=work)
    # every released file untouched; the next one opened, holding nothing sql/ did not change
    assert {p.name: p.read_bytes() for p in work.iterdir() if p != path} == frozen
    assert path.name == f"{synthetic.release.schema_version + 1:04d}_since_0_0_1.sql"
    assert "create or replace" not in path.read_text()
    assert releases.write_unreleased_migration(check=True, directory=work) == path
    with pytest.raises(ValueError, match="is not after the last release"):
        releases.freeze(synthetic.release.version, dsn=pg_server.admin_dsn,
                        directory=synthetic.release_dir)
    with pytest.raises(ValueError, match="nothing to release"):
        releases.freeze("99.0.0", dsn=pg_server.admin_dsn, directory=synthetic.release_dir)
    assert releases.load(synthetic.release_dir) == [synthetic.release]


# (b) Upgrades ----------------------------------------------------------------------------------


def run_worker_until_idle(dsn: str) -> list[str]:
    worker = Worker(WorkerConfig(dsn=dsn, interval=3600), make_adapter("offline"))
    done = []
    try:
        while (tick := worker.tick()).status != "idle":
            done.append(f"{tick.status}:{tick.phase}")
            assert len(done) < 20, done
    finally:
        worker.adapter.close()
        worker.db.close()
    return done


def load_world(dsn: str) -> None:
    """A small world through the API: two workspaces, a private chat and a group topic with
    finished conversations, turned into records and indexes by the offline worker."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        w = World(conn)
        for ws in ("up1", "up2"):
            w.basic(ws)
            w.conversation(ws, "r1", chat="dm-alice", user="alice",
                           user_text="Please remember that I prefer tea. We decided to ship "
                                     "on Friday.", reply="Noted: tea, and shipping on Friday.")
            w.conversation(ws, "r2", chat="grp", user="bob", topic=7,
                           user_text="TODO: bob writes the release notes for Friday.",
                           reply="Noted, bob owns the release notes.")
        conn.execute("select memory_private.advance_clock('31 minutes')")
    done = run_worker_until_idle(dsn)
    assert "committed:extract" in done and "committed:consolidate" in done, done
    with psycopg.connect(dsn, autocommit=True) as conn:  # usage to carry over
        w = World(conn)
        w.request("up1", "r1b", chat="dm-alice", user="alice", status="running")
        found = conn.execute("select memory.query_memories('up1', 'r1b', 'c1', %s)",
                             (Jsonb({"query": "tea"}),)).fetchone()
        assert found is not None and found[0]["count"] >= 1, found


def usage_of(dsn: str) -> list[tuple[object, ...]]:
    """Every record's usage as the operator view shows it."""
    with psycopg.connect(dsn) as conn:
        return conn.execute("select workspace_id, record_id, usage_count, last_used_at "
                            "from memory.record_status order by 1, 2").fetchall()


def tenant_rows(dsn: str) -> dict[str, int]:
    """Rows per tenant table (those with a workspace_id), found from the catalog."""
    with psycopg.connect(dsn) as conn:
        tables = conn.execute(
            """select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
                where n.nspname = any(%s) and c.relkind = 'r'
                  and exists (select 1 from pg_attribute a where a.attrelid = c.oid
                               and a.attname = 'workspace_id' and not a.attisdropped)
                order by 1""", (list(SCHEMAS),)).fetchall()
        return {t: conn.execute(f"select count(*) from memory_private.{t}").fetchone()[0]  # type: ignore[index]
                for (t,) in tables}


def snapshot_at_zero_clock(dsn: str) -> dict[str, list[tuple[object, ...]]]:
    """The catalog snapshot with the memory clock's test offset set aside (the world moved it;
    a fresh build has none)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        [offset] = conn.execute("select time_offset from memory_private.clock").fetchone() or [0]
        conn.execute("select memory_private.advance_clock(-%s::interval)", (offset,))
        try:
            return snapshot(conn)
        finally:
            conn.execute("select memory_private.advance_clock(%s::interval)", (offset,))


def smoke(dsn: str) -> None:
    """The pipeline still works on the upgraded data: a new conversation becomes a record, and
    a new request recalls and finds the memories made before and after the upgrade."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        w = World(conn)
        w.conversation("up1", "r3", chat="dm-alice", user="alice",
                       user_text="Please remember that my build server is called kiwi.",
                       reply="Noted: kiwi.")
        conn.execute("select memory_private.advance_clock('31 minutes')")
    assert "committed:extract" in run_worker_until_idle(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        w = World(conn)
        w.request("up1", "r4", chat="dm-alice", user="alice", status="running")
        recall = w.call("recall", "up1", "r4")
        assert recall["mode"] in ("index", "directory") and len(recall["records"]) >= 2, recall
        for text in ("tea", "kiwi"):
            found = conn.execute("select memory.query_memories('up1', 'r4', %s, %s)",
                                 (f"call-{text}", Jsonb({"query": text}))).fetchone()
            assert found is not None and found[0]["count"] >= 1, (text, found)


def upgrade(server: Server, name: str, release_dir: Path, head_dir: Path | None,
            release: releases.Release) -> str:
    """Builds a database at the release, loads the world, upgrades it to the head; checks the
    release's recorded API and that no row was lost. Returns its DSN."""
    dsn = empty_db(server, name)
    assert schema.migrate(dsn, directory=release_dir) == [
        p.stem for p in schema.migration_files(release_dir)]
    assert api_of(dsn) == release.api, "the manifest's API is not what the release builds"
    load_world(dsn)
    rows = tenant_rows(dsn)
    usage = usage_of(dsn)
    assert any(n == 1 for _, _, n, _ in usage), usage
    line_sources = stored_line_sources(dsn)
    sources = record_sources_of(dsn)
    head = head_dir or schema.MIGRATIONS_DIR
    applied = schema.migrate(dsn, directory=head_dir)
    assert applied == [p.stem for p in schema.migration_files(head)
                       if p.name not in release.migrations]
    after = tenant_rows(dsn)
    dropped = set(rows) - set(after)
    assert dropped <= set(DROPPED_TABLES), dropped
    # No row is lost; a record gains the dependencies on what its model call was shown
    # (docs/retention.md: 0002 adds the rest of each 0.1.0 record's batch).
    grown = {"record_dependencies"}
    assert {t: n for t, n in after.items() if t in rows and t not in grown} == {
        t: n for t, n in rows.items() if t not in dropped and t not in grown}, "rows were lost"
    assert all(after[t] >= rows[t] for t in grown if t in rows), "rows were lost"
    assert usage_of(dsn) == usage, "the records' usage changed"
    if "record_line_sources" in dropped:
        # What the table kept is what the summaries say, read by the rule they were written with.
        assert line_sources and read_line_sources(dsn) == line_sources
    if "record_sources" in dropped:
        # Each source kept its place, now as a cited dependency.
        assert sources and record_sources_of(dsn) == sources
    return dsn


# Tables a later migration drops on purpose, with where their facts are read from instead.
DROPPED_TABLES = {
    "record_lines": "the documents of the summaries' lines (record_documents holds the lines "
                    "each word is on, 0002)",
    "record_line_sources": "the summary's lines (memory_private.line_citations, 0002)",
    "record_sources": "the cited dependencies (record_dependencies.position; a view of that "
                      "name lists them, 0002)",
}


def stored_line_sources(dsn: str) -> set[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        if conn.execute("select to_regclass('memory_private.record_line_sources')").fetchone() == (
                None,):
            return set()
        return set(conn.execute("select workspace_id, record_id, line_no, message_id "
                                "from memory_private.record_line_sources").fetchall())


def record_sources_of(dsn: str) -> set[tuple[object, ...]]:
    """Every source with its place (a table up to 0001, then a view of the cited dependencies)."""
    with psycopg.connect(dsn) as conn:
        return set(conn.execute("select workspace_id, record_id, message_id, position "
                                "from memory_private.record_sources").fetchall())


def read_line_sources(dsn: str) -> set[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return set(conn.execute(
            "select r.workspace_id, r.record_id, l.line_no, l.message_id "
            "from memory_private.records r cross join lateral memory_private.line_citations("
            "  r.summary, array(select s.message_id from memory_private.record_sources s "
            "                    where s.workspace_id = r.workspace_id "
            "                      and s.record_id = r.record_id)) l").fetchall())


def assert_same_schema(got: dict[str, list[tuple[object, ...]]],
                       want: dict[str, list[tuple[object, ...]]]) -> None:
    for part, rows in want.items():
        assert got[part] == rows, (
            f"the upgraded database differs from a fresh build in {part}: the later migrations "
            "must do everything sql/ does (docs/migrations.md)")


def test_a_database_at_the_synthetic_release_upgrades_to_equal_a_fresh_build(
        synthetic: Synthetic, pg_server: Server) -> None:
    dsn = upgrade(pg_server, "t_upgrade_synthetic", synthetic.release_dir, synthetic.head_dir,
                  synthetic.release)
    fresh = empty_db(pg_server, "t_fresh_synthetic_head")
    schema.migrate(fresh, directory=synthetic.head_dir)
    with psycopg.connect(fresh) as conn:
        want = snapshot(conn)
        assert conn.execute("select memory.schema_version()").fetchone() == (
            synthetic.release.schema_version + 1,)
    assert_same_schema(snapshot_at_zero_clock(dsn), want)
    assert any("synthetic_note" in str(c) for c in want["columns"])
    smoke(dsn)


@pytest.mark.no_citus("compares with the one-server build of sql/; the Citus profile's database has the "
                      "cluster's form (tests/test_citus.py checks that one)")
@pytest.mark.parametrize("release", real_releases())
def test_a_database_at_a_release_upgrades_to_the_head_and_equals_the_canonical_build(
        release: releases.Release, pg_server: Server, db_dsn: str, tmp_path: Path) -> None:
    release_dir = releases.copy_release(release, schema.MIGRATIONS_DIR, tmp_path / "release")
    dsn = upgrade(pg_server, "t_upgrade_" + release.version.replace(".", "_"), release_dir,
                  None, release)
    with psycopg.connect(db_dsn) as conn:
        want = snapshot(conn)
    assert_same_schema(snapshot_at_zero_clock(dsn), want)
    with psycopg.connect(dsn) as conn:  # what later migrations fill in from the data
        assert conn.execute(
            "select count(*) from memory_private.records r "
            "left join memory_private.record_documents d using (workspace_id, record_id) "
            "where d.document is distinct from "
            "memory_private.search_document(r.title, r.summary, r.speaker_ids)"
            ).fetchone() == (0,)
        assert conn.execute(  # the scopes' vocabulary is their documents' words
            "select count(*) from (select d.workspace_id, d.scope_id, w.word collate \"C\", "
            "count(*)::integer from memory_private.record_documents d, "
            "unnest(tsvector_to_array(d.document)) w(word) "
            "where char_length(w.word) >= 3 and left(w.word, 1) <> '@' group by 1, 2, 3 "
            "except select * from memory_private.scope_words) x").fetchone() == (0,)
        assert conn.execute(
            "select count(*) from memory_private.records r left join memory_private.record_texts t "
            "using (workspace_id, record_id) where t.search_text is distinct from "
            "lower(r.title) || e'\\n' || lower(r.summary) or t.scope_id <> r.scope_id "
            "or t.created_at <> r.created_at or t.grams <> memory_private.text_grams("
            "lower(r.title)) | memory_private.text_grams(lower(r.summary))").fetchone() == (0,)
        # Every record's copy of its dependencies and sources is what record_dependencies holds.
        assert copies_differing(conn) == 0
        assert usage_rows_missing(conn) == 0
        assert conn.execute("select count(*) > 0 from memory_private.records "
                            "where cardinality(source_ids) > 0").fetchone() == (True,)
    smoke(dsn)


@pytest.mark.parametrize("release", real_releases())
def test_an_upgrade_refuses_a_source_that_is_not_a_dependency_and_changes_nothing(
        release: releases.Release, pg_server: Server, tmp_path: Path) -> None:
    """0002 keeps a record's sources as its cited dependencies: data where a source has no
    dependency row (no writer made it, but a hand edit could) stops the upgrade instead of
    losing the source, and the database stays at the release."""
    release_dir = releases.copy_release(release, schema.MIGRATIONS_DIR, tmp_path / "release")
    dsn = empty_db(pg_server, "t_refuse_" + release.version.replace(".", "_"))
    schema.migrate(dsn, directory=release_dir)
    load_world(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("delete from memory_private.record_dependencies d using "
                     "(select workspace_id, record_id, message_id from memory_private.record_sources "
                     " limit 1) s where (d.workspace_id, d.record_id, d.message_id) = "
                     "(s.workspace_id, s.record_id, s.message_id)")
    sources = record_sources_of(dsn)
    with pytest.raises(Exception, match="not among its dependencies"):
        schema.migrate(dsn)
    assert record_sources_of(dsn) == sources
    with psycopg.connect(dsn) as conn:
        assert conn.execute("select to_regclass('memory_private.record_sources') is not null, "
                            "(select relkind from pg_class where oid = "
                            " 'memory_private.record_sources'::regclass)").fetchone() == (True, "r")


# (c) The rolling-upgrade rule ------------------------------------------------------------------


@pytest.mark.parametrize("release", real_releases())
def test_every_function_a_release_promised_exists_unchanged_at_the_head(
        release: releases.Release, conn: psycopg.Connection) -> None:
    breaks = releases.api_breaks(release.api, releases.api_signatures(conn))
    assert breaks == [], (
        f"functions release {release.version} promised changed or vanished: ship a new "
        "signature or a _v2 function beside the old one (docs/migrations.md)")


def test_the_synthetic_head_keeps_the_releases_api_and_adds_the_v2(
        synthetic: Synthetic, pg_server: Server) -> None:
    dsn = empty_db(pg_server, "t_api_synthetic")
    schema.migrate(dsn, directory=synthetic.head_dir)
    head = api_of(dsn)
    assert releases.api_breaks(synthetic.release.api, head) == []
    assert "memory.synthetic_probe_v2(p_worker_id text) -> text" in head["memory_worker"]


@pytest.fixture
def breaking_head(synthetic: Synthetic, tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A head whose later migration silently changes one worker function's signature (drop and
    recreate it with one more, defaulted, argument) and takes another away from the worker.
    Yields the directory and the two functions' names."""
    with psycopg.connect(synthetic.release_dsn) as conn:
        rows = conn.execute(
            """select p.oid::regprocedure::text, p.proname, pg_get_functiondef(p.oid)
                 from pg_proc p join pg_namespace n on n.oid = p.pronamespace
                where n.nspname = 'memory' and p.pronargs > 0
                  and has_function_privilege('memory_worker', p.oid, 'execute')
                order by p.proname limit 2""").fetchall()
    (changed, changed_name, definition), (revoked, revoked_name, _) = rows
    header, body = definition.split("\n", 1)
    header = header[:header.rindex(")")] + ", p_synthetic integer DEFAULT 0)"
    head = tmp_path / "breaking"
    shutil.copytree(synthetic.release_dir, head)
    number = synthetic.release.schema_version + 1
    (head / f"{number:04d}_breaking.sql").write_text(f"""
drop function memory.{changed.removeprefix("memory.")};
{header}
{body};
revoke all on function memory.{changed_name} from public;
grant execute on function memory.{changed_name} to memory_worker;
revoke execute on function {revoked} from memory_worker;
create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select {number} $$;
""")
    yield head, sorted([changed_name, revoked_name])


def test_the_rolling_upgrade_rule_catches_a_silent_signature_change_and_a_lost_grant(
        synthetic: Synthetic, breaking_head: tuple[Path, list[str]], pg_server: Server) -> None:
    directory, names = breaking_head
    dsn = empty_db(pg_server, "t_api_breaking")
    schema.migrate(dsn, directory=directory)
    breaks = releases.api_breaks(synthetic.release.api, api_of(dsn))
    assert [b.split("(")[0] for b in breaks] == [f"memory_worker: memory.{n}" for n in names], \
        breaks
