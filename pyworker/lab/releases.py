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
from pyworker.lab import sqlcode

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


# The unreleased migration: a hand-written part and generated parts -----------------------------
#
# A release migration holds what only a person can write (tables, columns, indexes, types,
# reference rows, data moves, drops, and why), and between the lines
#
#     -- pimem:generated begin[: schema.name ...]
#     -- pimem:generated end
#
# what `pimem schema-bundle` writes from sql/: every function, view and trigger whose
# definition (with its comments and ALTERs) differs from the last release's, as a `create or
# replace`, in sql/'s order, and every grant or revoke on code that is new or names code written
# here. A region naming objects holds those (for a generated column or a backfill that needs a
# function before the rest); the last region holds every other object and the privileges.
# tests/test_migrations.py checks the committed file equals what this writes.

GENERATED_BEGIN = "-- pimem:generated begin"
GENERATED_END = "-- pimem:generated end"
GENERATED_NOTE = ("-- Written by `pimem schema-bundle` from sql/ (docs/migrations.md): edit sql/, "
                  "then run it again.")
_REGION = re.compile(rf"^{re.escape(GENERATED_BEGIN)}(?::(?P<names>[^\n]*))?\n.*?"
                     rf"^{re.escape(GENERATED_END)}\n", re.DOTALL | re.MULTILINE)


def unreleased_migration(directory: Path | None = None) -> Path | None:
    """The migration no release holds (at most one: docs/migrations.md), or None."""
    directory = directory or schema.MIGRATIONS_DIR
    released = {n for r in load(directory) for n in r.migrations}
    files = [p for p in schema.migration_files(directory) if p.name not in released]
    if len(files) > 1:
        raise schema.MigrateError(
            f"{', '.join(p.name for p in files)} are all unreleased: one release, one "
            "migration (fold them into the first)")
    return files[0] if files else None


def released_code(directory: Path | None = None) -> dict[tuple[str, str], str]:
    """Every function, view, trigger and privilege statement the last release's migrations
    leave in a database, each as :meth:`sqlcode.CodeObject.text` writes it."""
    directory = directory or schema.MIGRATIONS_DIR
    releases_ = load(directory)
    if not releases_:
        return {}
    stmts = sqlcode.file_statements(sorted(directory / n for n in releases_[-1].migrations))
    views: set[str] = set()
    code: dict[tuple[str, str], list[str]] = {}
    for s in stmts:
        if m := sqlcode.CREATE_VIEW.match(s.head):
            views.add(m.group(1))
        gone = sqlcode.dropped([s])
        for dropped_key in gone:
            code.pop(dropped_key, None)
        key = sqlcode.code_key(s, views)
        if key is None or gone:
            continue
        if s.head.startswith("create "):
            code[key] = []
        elif key not in code and key[0] != "privileges":
            continue  # speaks of what the schema proper made (sqlcode.objects)
        code.setdefault(key, []).append(sqlcode.replacing(s.text))
    return {k: "\n\n".join(v) for k, v in code.items()}


def generated_regions(text: str) -> list[list[str] | None]:
    """The regions of a migration's text: the names each holds, None for the last (the rest)."""
    found: list[list[str] | None] = []
    for m in _REGION.finditer(text):
        names = (m.group("names") or "").split()
        found.append(names or None)
    return found


def bundle_migration(text: str, directory: Path | None = None) -> str:
    """``text`` (an unreleased migration) with its generated regions written from sql/.
    Refuses (:class:`sqlcode.SqlCodeError`) what it cannot write unambiguously: no region, a
    region naming code that needs nothing written, code written by hand in the hand-written
    part, or released code that sql/ lost and the hand-written part does not drop."""
    hand = _REGION.sub("", text)
    regions = generated_regions(text)
    if not regions:
        raise sqlcode.SqlCodeError(
            f"the unreleased migration has no `{GENERATED_BEGIN}` ... `{GENERATED_END}` region")
    if regions[-1] is not None:
        raise sqlcode.SqlCodeError("the last generated region must name nothing: it holds "
                                   "every object the others do not name")
    hand_stmts = sqlcode.statements(hand, "hand-written part")
    for s in hand_stmts:
        if sqlcode.CREATE_FUNCTION.match(s.head) or sqlcode.CREATE_VIEW.match(s.head) \
                or sqlcode.CREATE_TRIGGER.match(s.head):
            raise sqlcode.SqlCodeError(
                f"{s.source}: functions, views and triggers come from sql/ (the generated "
                "part), not from the hand-written part")
    code, _ = sqlcode.objects(sqlcode.file_statements(schema.canonical_files()))
    released = released_code(directory)
    dropped = sqlcode.dropped(hand_stmts)
    lost = sorted(k for k in released if k[0] != "privileges" and k not in code
                  and k not in dropped)
    if lost:
        raise sqlcode.SqlCodeError(
            "released code that sql/ no longer defines must be dropped in the hand-written "
            "part: " + ", ".join(f"{kind} {name}" for kind, name in lost))
    for key, obj in code.items():
        before = released.get(key)
        if key[0] == "function" and before is not None and key not in dropped \
                and sqlcode.signature(before) != sqlcode.signature(obj.statements[0].text):
            raise sqlcode.SqlCodeError(
                f"{key[1]}: its arguments or result differ from the last release's, which "
                "create or replace cannot change: drop the released one in the hand-written "
                "part (and ship the change under a new name if a release promised it: "
                "docs/migrations.md, the rolling-upgrade rule)")
    changed = [k for k, o in code.items() if k[0] != "privileges"
               and (released.get(k) != o.text() or k in dropped)]
    changed_names = {name for _, name in changed}
    privileges = [k for k, o in code.items() if k[0] == "privileges"
                  and (k not in released
                       or any(n in changed_names for s in o.statements
                              for n in sqlcode.mentioned(s)))]
    placed: dict[tuple[str, str], int] = {}
    for number, names in enumerate(regions):
        for name in names or []:
            keys = [k for k in changed if k[1] == name]
            if not keys:
                raise sqlcode.SqlCodeError(
                    f"a generated region names {name}, which sql/ does not define or which is "
                    "the same as in the last release")
            placed.update((k, number) for k in keys)
    last = len(regions) - 1
    bodies: list[list[str]] = [[] for _ in regions]
    for key in changed + privileges:
        bodies[placed.get(key, last)].append(code[key].text())
    rendered = iter(bodies)

    def region(m: re.Match[str]) -> str:
        body = next(rendered)
        head = GENERATED_BEGIN + (f":{m.group('names')}" if m.group("names") else "")
        parts = [head, GENERATED_NOTE, "set local check_function_bodies = off;", *body,
                 "set local check_function_bodies = on;", GENERATED_END]
        return "\n\n".join(parts[:2]) + "\n\n" + "\n\n".join(parts[2:]) + "\n"

    return _REGION.sub(region, text)


def write_unreleased_migration(check: bool = False, directory: Path | None = None) -> Path:
    """Writes the generated regions of the unreleased migration from sql/ (``check``: only
    compares, raising when the file differs). Without an unreleased migration, opens the next
    one: ``NNNN_since_<last release>.sql`` with a header to complete and one region."""
    directory = directory or schema.MIGRATIONS_DIR
    path = unreleased_migration(directory)
    if path is None:
        releases_ = load(directory)
        if not releases_:
            raise schema.MigrateError("no release is frozen: nothing to migrate from")
        number = schema.expected_version(directory) + 1
        since = releases_[-1].version.replace(".", "_")
        path = directory / f"{number:04d}_since_{since}.sql"
        if check:
            raise schema.MigrateError(f"no unreleased migration: {path.name} would be opened")
        path.write_text(
            f"-- {path.stem}: every schema change since release {releases_[-1].version}, in one "
            "migration\n-- (docs/migrations.md). Above the generated part: what only a person "
            "writes (tables,\n-- columns, data moves, drops, and why).\n\n"
            f"{GENERATED_BEGIN}\n{GENERATED_END}\n")
    text = path.read_text()
    wanted = bundle_migration(text, directory)
    if check:
        if wanted != text:
            raise schema.MigrateError(
                f"{path.name} is not what `pimem schema-bundle` writes from sql/: run it")
        return path
    if wanted != text:
        path.write_text(wanted)
    return path
