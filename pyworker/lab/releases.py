"""Released schemas: the manifest ``migrations/releases.json``, the freeze, and its guards.

CI clones only ``main``, so releases are not git tags but entries of a manifest that lives beside
the migrations. Each entry names a release, the migration files it shipped with their sha256,
the schema version they end at, and the public API it promised to each role
(``memory.name(arguments) -> result``). From it:

- :func:`freeze_problems`: a released file is never edited, a new file sorts after every
  released one, and every file is named ``NNNN_<what>.sql``;
- :func:`api_breaks`: the rolling-upgrade rule, every function a release promised to a role
  still exists at head with the same arguments and result and is still granted to that role
  (a change ships as a new signature or a ``_v2`` function beside the old one);
- :func:`freeze`: records a new release (``pimem freeze-release VERSION``, docs/migrations.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from pyworker import schema

MANIFEST_NAME = "releases.json"
VERSION = re.compile(r"^\d+\.\d+\.\d+$")

# Each role the memory schema is granted to (found from the schema's ACL, not by name), with the
# signature of every memory function it may execute.
API_QUERY = """
    select r.rolname,
           format('memory.%I(%s) -> %s', p.proname, pg_get_function_arguments(p.oid),
                  pg_get_function_result(p.oid))
      from pg_proc p join pg_namespace n on n.oid = p.pronamespace
      join pg_roles r on has_function_privilege(r.oid, p.oid, 'execute')
     where n.nspname = 'memory'
       and r.oid in (select a.grantee from pg_namespace s, aclexplode(s.nspacl) a
                      where s.nspname = 'memory' and a.grantee <> s.nspowner)
     order by 1, 2"""


@dataclass
class Release:
    version: str
    schema_version: int
    migrations: dict[str, str]                     # file name -> sha256 of its bytes
    api: dict[str, list[str]] = field(default_factory=dict)  # role -> signatures


def manifest_path(directory: Path | None = None) -> Path:
    return (directory or schema.MIGRATIONS_DIR) / MANIFEST_NAME


def load(directory: Path | None = None) -> list[Release]:
    """The releases recorded beside the migrations, oldest first (none before the first)."""
    path = manifest_path(directory)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return [Release(**r) for r in data["releases"]]


def save(releases: list[Release], directory: Path | None = None) -> Path:
    path = manifest_path(directory)
    body = {"about": "Released schemas: written by `pimem freeze-release`, never by hand "
                     "(docs/migrations.md).",
            "releases": [asdict(r) for r in releases]}
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def freeze_problems(releases: list[Release], directory: Path | None = None) -> list[str]:
    """What breaks the freeze: edited or missing released files, a new file that sorts before a
    released one, a badly named file, an inconsistent manifest. Empty when all is well."""
    directory = directory or schema.MIGRATIONS_DIR
    problems = []
    files = sorted(p.name for p in directory.glob("*.sql")
                   if not schema.POST_APPLY_NAME.match(p.name))
    numbers: dict[str, str] = {}
    for name in files:
        if not schema.MIGRATION_NAME.match(name):
            problems.append(f"{name}: a migration is named NNNN_<lowercase words>.sql")
        elif name[:4] in numbers:
            problems.append(f"{name}: number {name[:4]} is taken by {numbers[name[:4]]}")
        else:
            numbers[name[:4]] = name
    previous: Release | None = None
    for release in releases:
        if not VERSION.match(release.version):
            problems.append(f"release {release.version}: a version is MAJOR.MINOR.PATCH")
        elif previous and _version_key(release.version) <= _version_key(previous.version):
            problems.append(f"release {release.version} comes after {previous.version}")
        for name, digest in release.migrations.items():
            path = directory / name
            if not path.exists():
                problems.append(f"{name} was released in {release.version} and is missing")
            elif sha256(path) != digest:
                problems.append(
                    f"{name} was released in {release.version} and has changed since: undo the "
                    "edit and ship the change as a new migration (docs/migrations.md)")
        if previous:
            dropped = sorted(set(previous.migrations) - set(release.migrations))
            if dropped:
                problems.append(f"release {release.version} leaves out {', '.join(dropped)} "
                                f"of {previous.version}")
        if release.migrations:
            last = max(release.migrations)
            if release.schema_version != int(last[:4]):
                problems.append(f"release {release.version}: schema version "
                                f"{release.schema_version} is not its last migration's {last}")
        previous = release
    if previous and previous.migrations:
        last_released = max(previous.migrations)
        for name in files:
            if name not in previous.migrations and name <= last_released:
                problems.append(f"{name} is not released but sorts before the released "
                                f"{last_released}: number it after it")
    return problems


def api_signatures(conn: psycopg.Connection) -> dict[str, list[str]]:
    """The public API per role: ``memory.name(arguments) -> result`` it may execute."""
    api: dict[str, list[str]] = {}
    for role, signature in conn.execute(API_QUERY).fetchall():
        api.setdefault(role, []).append(signature)
    return api


def api_breaks(promised: dict[str, list[str]], current: dict[str, list[str]]) -> list[str]:
    """Every promised signature that a role can no longer call exactly as before."""
    breaks = []
    for role, signatures in sorted(promised.items()):
        have = set(current.get(role, []))
        breaks += [f"{role}: {s}" for s in signatures if s not in have]
    return breaks


@contextmanager
def scratch_database(dsn: str | None) -> Iterator[str]:
    """An empty database that is dropped afterwards: in the server of ``dsn`` (a superuser
    connection), or in a throwaway cluster of the machine's PostgreSQL binaries."""
    cluster = None
    if dsn is None:
        from pyworker.lab.servers import LocalCluster, find_bindir

        bindir = find_bindir()
        if bindir is None or not (bindir / "initdb").exists():
            raise RuntimeError("no PostgreSQL server binaries found: pass --dsn of a server "
                               "where a superuser may create a scratch database")
        cluster = LocalCluster(bindir).init().start()
        dsn = cluster.dsn()
    name = f"pimem_scratch_{os.getpid()}"
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"drop database if exists {name} with (force)")
            admin.execute(f"create database {name}")
        yield psycopg.conninfo.make_conninfo(dsn, dbname=name)
    finally:
        if cluster is not None:
            cluster.destroy()
        else:
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(f"drop database if exists {name} with (force)")


def build_release(version: str, dsn: str, directory: Path | None = None) -> Release:
    """The release the migrations in ``directory`` make: their hashes, the schema version they
    end at and the API they build in the empty database ``dsn`` (which they migrate)."""
    directory = directory or schema.MIGRATIONS_DIR
    files = schema.migration_files(directory)
    schema.migrate(dsn, directory=directory)
    with psycopg.connect(dsn) as conn:
        api = api_signatures(conn)
    return Release(version=version, schema_version=schema.expected_version(directory),
                   migrations={p.name: sha256(p) for p in files}, api=api)


def freeze(version: str, *, dsn: str | None = None, directory: Path | None = None) -> Release:
    """Records ``version`` as a release of every migration in ``directory`` now. Refuses when
    the freeze guard already fails, the version is not new, or nothing changed since the last
    release. ``dsn``: a server to build a scratch database in (default: local binaries)."""
    directory = directory or schema.MIGRATIONS_DIR
    releases = load(directory)
    if not VERSION.match(version):
        raise ValueError(f"{version!r}: a release version is MAJOR.MINOR.PATCH")
    if releases and _version_key(version) <= _version_key(releases[-1].version):
        raise ValueError(f"{version} is not after the last release {releases[-1].version}")
    problems = freeze_problems(releases, directory)
    if problems:
        raise ValueError("the freeze guard fails:\n  " + "\n  ".join(problems))
    with scratch_database(dsn) as scratch:
        release = build_release(version, scratch, directory)
    if releases and release.migrations == releases[-1].migrations:
        raise ValueError(f"no migration since {releases[-1].version}: nothing to release")
    save([*releases, release], directory)
    return release


def copy_release(release: Release, source: Path, target: Path) -> Path:
    """A directory holding exactly the release's migration files (to build a database at it)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in release.migrations:
        shutil.copyfile(source / name, target / name)
    return target


INITIAL_MIGRATION = schema.MIGRATIONS_DIR / "0001_initial.sql"
BUNDLE_HEADER = """\
-- 0001_initial: the first release of the schema, bundled from sql/ by `pimem schema-bundle`.
-- Until the first release is frozen (`pimem freeze-release`, migrations/releases.json) this file
-- is regenerated from sql/; after it, it never changes and every change ships as a new migration
-- (see docs/migrations.md).
"""


def write_initial_migration() -> Path:
    """Regenerates the unreleased first migration from the canonical files; refuses once a
    release has frozen it (then every change is a new migration)."""
    for release in load(INITIAL_MIGRATION.parent):
        if INITIAL_MIGRATION.name in release.migrations:
            raise schema.MigrateError(
                f"{INITIAL_MIGRATION.name} was released in {release.version} and is frozen: "
                "write the change as a new migration NNNN_<what>.sql (docs/migrations.md)")
    INITIAL_MIGRATION.write_text(BUNDLE_HEADER + "\n" + schema.canonical_sql())
    return INITIAL_MIGRATION
