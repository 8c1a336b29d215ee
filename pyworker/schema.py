"""The canonical schema (``sql/``), the migrations (``migrations/``) and ``pimem migrate``.

``sql/*.sql`` is the canonical definition, applied in name order. The yoyo migrations in
``migrations/`` must build exactly the same schema; ``tests/test_migrations.py`` proves it.
See docs/migrations.md for how function bodies are versioned and releases are frozen.

Both directories stay at the top of the repository; the build maps them into the package as
``pyworker/sql`` and ``pyworker/migrations`` (pyproject.toml), so an installed wheel reads its
own copy and a checkout (editable install) reads the top-level ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from pyworker.logs import event

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parent


def _schema_dir(name: str) -> Path:
    packaged = PACKAGE_DIR / name
    return packaged if packaged.is_dir() else ROOT / name


SQL_DIR = _schema_dir("sql")
MIGRATIONS_DIR = _schema_dir("migrations")
MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# yoyo's hook, run after every migration run that applied something (not a migration: never
# frozen, always idempotent).
POST_APPLY_NAME = re.compile(r"^post-apply[a-z0-9_-]*\.sql$")
LOCK_TIMEOUT = 300.0  # seconds a migrate waits for another one to finish


def in_checkout() -> bool:
    """True when this package runs from a source checkout (not from an installed wheel)."""
    return SQL_DIR == ROOT / "sql" and (ROOT / "pyproject.toml").is_file()


def canonical_files() -> list[Path]:
    """The canonical SQL files in the order they are applied."""
    return sorted(SQL_DIR.glob("*.sql"))


def cluster_code_file() -> Path:
    """What runs on a Citus cluster in place of sql/'s SQL functions: ``sql/cluster/
    functions.sql``, written by ``pimem cluster-code`` from sql/ and applied by :func:`migrate`
    on a coordinator (docs/scaling.md)."""
    return SQL_DIR / "cluster" / "functions.sql"


def canonical_sql() -> str:
    """The whole canonical schema as one script."""
    parts = []
    for path in canonical_files():
        parts.append(f"-- ==== {path.name} ====\n{path.read_text()}")
    return "\n".join(parts)


def apply_canonical(conn: psycopg.Connection) -> None:
    """Builds the schema from ``sql/`` in one transaction (for tests and the drift check)."""
    with conn.transaction():
        conn.execute(canonical_sql().encode())


def yoyo_url(dsn: str) -> str:
    """A yoyo database URL for a libpq DSN or URI (psycopg 3 backend). psycopg parses the DSN;
    the user and password go into the URL's authority, the database into its path, and every
    other parameter (host, port, sslmode, options, ...) into its query, which yoyo hands to
    ``psycopg.connect`` as it is: so a host list, an IPv6 address or a socket directory with
    any characters reaches libpq unchanged, and no parameter (``sslmode``) is dropped. A DSN
    libpq cannot parse raises ``MigrateError``."""
    from urllib.parse import quote, urlencode

    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise MigrateError(f"not a connection string: {exc}") from None
    user = quote(str(info.pop("user", "") or ""), safe="")
    password = info.pop("password", None)
    auth = user + (":" + quote(str(password), safe="") if password else "")
    dbname = quote(str(info.pop("dbname", "") or ""), safe="")
    query = urlencode({k: str(v) for k, v in info.items() if v is not None})
    return (f"postgresql+psycopg://{auth + '@' if auth else ''}/{dbname}"
            + ("?" + query if query else ""))


class MigrateError(Exception):
    """``pimem migrate`` cannot bring the database to the schema this package expects."""


def migration_files(directory: Path | None = None) -> list[Path]:
    """The migration files in the order yoyo applies them (``NNNN_<what>.sql``)."""
    return sorted(p for p in (directory or MIGRATIONS_DIR).glob("[0-9][0-9][0-9][0-9]_*.sql")
                  if not p.name.endswith(".rollback.sql"))


def expected_version(directory: Path | None = None) -> int:
    """The schema version this package builds: the number of its last migration."""
    files = migration_files(directory)
    if not files:
        raise MigrateError(
            f"no migrations found in {directory or MIGRATIONS_DIR}: this pimem installation is "
            "incomplete (reinstall the pimem wheel; from a checkout, run from the repository)")
    return int(files[-1].name[:4])


@dataclass
class SchemaState:
    """Where a database stands against this package's migrations."""

    expected: int
    version: int | None                     # memory.schema_version(), None when absent
    applied: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # applied here, unknown to this package

    @property
    def current(self) -> bool:
        return not self.pending and self.version == self.expected

    def problem(self) -> str | None:
        """Why the database is not at the expected version once nothing is pending."""
        if self.pending or self.version == self.expected:
            return None
        if self.version is None:
            return ("the database has no memory.schema_version(): the memory schema is missing "
                    f"although the migrations {', '.join(self.applied) or '(none)'} are recorded "
                    "as applied (yoyo's _yoyo_migration table); it was changed by hand")
        if self.version > self.expected:
            extra = f" (migrations {', '.join(self.unknown)})" if self.unknown else ""
            return (f"the database is at schema version {self.version}{extra}, newer than this "
                    f"pimem, which expects {self.expected}: upgrade pimem (workers of the "
                    "previous release keep working meanwhile; docs/migrations.md)")
        return (f"the database is at schema version {self.version}, but this pimem's "
                f"migrations end at {self.expected}: a migration does not set "
                "memory.schema_version() to its own number (docs/migrations.md)")


def schema_state(dsn: str, directory: Path | None = None) -> SchemaState:
    """Reads, without changing anything, which migrations a database has and its version."""
    ids = [p.stem for p in migration_files(directory)]
    expected = expected_version(directory)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set default_transaction_read_only = on")
        applied: list[str] = []
        if conn.execute("select to_regclass('_yoyo_migration')").fetchone() != (None,):
            applied = [r[0] for r in conn.execute(
                "select migration_id from _yoyo_migration order by applied_at_utc, migration_id")]
        version = None
        if conn.execute("select to_regprocedure('memory.schema_version()')").fetchone() \
                != (None,):
            version = conn.execute("select memory.schema_version()").fetchone()[0]  # type: ignore[index]
    return SchemaState(expected=expected, version=version, applied=applied,
                       pending=[i for i in ids if i not in applied],
                       unknown=[i for i in applied if i not in ids])


_LOADED: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
_LOADED_LOCK = threading.Lock()


def load_migrations(source: Path) -> Any:
    """yoyo's migrations of ``source``, parsed. yoyo splits every SQL file with sqlparse (0.2 s
    for 0001 alone), so a process that migrates several databases (the tests, a script over a
    fleet) keeps what it parsed, per directory and file contents: a changed file is parsed
    again."""
    from yoyo import read_migrations

    files = tuple((p.name, hashlib.sha256(p.read_bytes()).hexdigest())
                  for p in sorted(source.iterdir()) if p.is_file())
    key = (str(source.resolve()), files)
    with _LOADED_LOCK:
        if key not in _LOADED:
            migrations = read_migrations(str(source))
            for migration in migrations:
                migration.load()
            _LOADED[key] = migrations
        return _LOADED[key]


def migrate(dsn: str, *, lock_timeout: float = LOCK_TIMEOUT, directory: Path | None = None,
            cluster_code: Path | None = None) -> list[str]:
    """Applies every pending yoyo migration, then checks that the database is at the expected
    schema version; returns the ids applied (empty when it was up to date).

    Concurrent runs queue on yoyo's lock (a row in ``yoyo_lock``) for up to ``lock_timeout``
    seconds; the one that waited finds nothing left to apply. Raises :class:`MigrateError` when
    there are no migrations, the lock is not free in time, or the version is not the expected
    one afterwards.

    On a Citus coordinator the pending migrations, the post-apply hook and the cluster file
    (``cluster_code``: by default :func:`cluster_code_file` for this package's migrations, none
    for another ``directory``) are applied in one transaction, so that no migration leaves
    the one-server form of a SQL function running on the cluster; then, still under the lock,
    :func:`distribute` puts what is new on every node (docs/scaling.md).
    """
    from yoyo import get_backend
    from yoyo.exceptions import LockTimeout

    source = directory or MIGRATIONS_DIR
    if cluster_code is None and directory is None:
        cluster_code = cluster_code_file()
    expected_version(source)  # no migrations: say so instead of "up to date"
    migrations = load_migrations(source)
    cluster = citus_cluster(dsn)
    if cluster is not None and not cluster.coordinator:
        raise MigrateError("this is a Citus worker node: run pimem migrate on the coordinator, "
                           "which builds the schema on every node (docs/scaling.md)")
    backend = get_backend(yoyo_url(_migration_dsn(dsn, cluster)))
    printed = io.StringIO()
    try:
        with backend.lock(timeout=lock_timeout):
            pending = backend.to_apply(migrations)
            # yoyo prints the rows of every migration statement that returns some (a
            # backfill's select) on standard output, a caller's (pimem migrate, the
            # demo, the eval); they go to the debug log instead.
            with contextlib.redirect_stdout(printed):
                if cluster is None:
                    backend.apply_migrations(pending)
                elif pending or not cluster.distributed:
                    _apply_on_coordinator(backend, pending, cluster_code)
            if cluster is not None and _can_distribute(dsn):
                distribute(dsn)
    except LockTimeout as exc:
        raise MigrateError(
            f"another migration has held the lock for over {lock_timeout:.0f} s ({exc}); if "
            "none is running, a crashed run left its lock row: `yoyo break-lock`") from None
    finally:
        backend.connection.close()
        if printed.getvalue():
            event("migration_rows", logging.DEBUG, rows=printed.getvalue())
    state = schema_state(dsn, source)
    problem = state.problem() or (
        f"migrations still pending after migrate: {', '.join(state.pending)}"
        if state.pending else None)
    if problem:
        raise MigrateError(problem)
    return [m.id for m in pending]


def _apply_on_coordinator(backend: Any, pending: Any, cluster_code: Path | None) -> None:
    """On a Citus coordinator: the pending migrations, the post-apply hook when something was
    pending, and the cluster file, in one transaction of yoyo's connection (each migration's
    statements in savepoints, as yoyo runs them), each migration marked applied in it too. Once
    the schema is distributed, Citus carries every statement to the workers; a replaced SQL
    function is never seen in its one-server form there, because its cluster form commits with
    it."""
    if any(not m.use_transactions for m in pending):
        raise MigrateError(
            "a migration that runs outside a transaction (__transactional__ = False) cannot "
            "be applied with the cluster file in one transaction on a Citus coordinator")
    backend.ensure_internal_schema_updated()
    with backend.transaction():
        for migration in pending:
            migration.process_steps(backend, "apply")
            backend.log_migration(migration, "apply")
            backend.mark_one(migration, log=False)
        if pending:
            for hook in pending.post_apply:
                hook.process_steps(backend, "apply")
        if cluster_code is not None:
            backend.cursor().execute(cluster_code.read_text())


@dataclass
class CitusCluster:
    """What a database on a Citus cluster is: the node we are connected to and the schema."""

    coordinator: bool                 # connected to the coordinator (else a worker node)
    distributed: bool                 # memory_private.distribute() has run
    workers: list[str] = field(default_factory=list)  # host:port of the active workers
    reference_tables: int = 0
    distributed_tables: int = 0
    functions: int = 0                # ours, on every node


def citus_cluster(dsn: str) -> CitusCluster | None:
    """The Citus cluster the database is on, or None on plain PostgreSQL (no citus extension).
    Reads only."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("select 1 from pg_extension where extname = 'citus'").fetchone() is None:
            return None
        coordinator = bool(conn.execute(
            "select coalesce(citus_is_coordinator(), false)").fetchone()[0])  # type: ignore[index]
        workers = [f"{h}:{p}" for h, p in conn.execute(
            "select nodename, nodeport from pg_dist_node where noderole = 'primary' "
            "and isactive and groupid <> 0 order by nodename, nodeport")]
        counts = conn.execute("""
            select count(*) filter (where p.partmethod = 'n'),
                   count(*) filter (where p.partmethod = 'h'),
                   (select count(*) from pg_dist_object o join pg_proc f on f.oid = o.objid
                     where o.classid = 'pg_proc'::regclass
                       and f.pronamespace::regnamespace::text in ('memory',
                                                                  'memory_private'))
              from pg_dist_partition p
             where p.logicalrelid::regclass::text like 'memory\\_private.%'""").fetchone()
        assert counts is not None
        return CitusCluster(coordinator=coordinator, distributed=counts[1] > 0,
                            workers=workers, reference_tables=int(counts[0]),
                            distributed_tables=int(counts[1]),
                            functions=int(counts[2]))


def _migration_dsn(dsn: str, cluster: CitusCluster | None) -> str:
    """The DSN yoyo migrates with. On a Citus coordinator whose schema is not distributed yet
    the migrations build it on the coordinator alone (DDL propagation off: the objects reach
    the workers when distribute() distributes them, in an order Citus accepts); once it is
    distributed, Citus propagates every later change (a replaced function, a new column) to the
    workers, a trigger may be created on a distributed table, and a migration's statements run
    over one connection per node (a migration is one transaction, and Citus refuses a function's
    DDL after a parallel change to a distributed table in the same transaction)."""
    if cluster is None:
        return dsn
    settings = ("-c citus.enable_ddl_propagation=off" if not cluster.distributed else
                "-c citus.enable_unsafe_triggers=on "
                "-c citus.allow_nested_distributed_execution=on "
                "-c citus.multi_shard_modify_mode=sequential")
    options = psycopg.conninfo.conninfo_to_dict(dsn).get("options")
    return psycopg.conninfo.make_conninfo(
        dsn, options=f"{options} {settings}" if options else settings)


def _can_distribute(dsn: str) -> bool:
    """Whether the schema has memory_private.distribute() (a release before Citus support,
    migrated on a coordinator, stays on the coordinator until a later one is applied)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("select to_regprocedure('memory_private.distribute()') is not null"
                           ).fetchone()
    return bool(row and row[0])


def distribute(dsn: str) -> dict[str, int]:
    """Distributes whatever of the schema is not yet on the Citus cluster
    (memory_private.distribute(), sql/85_distribution.sql) and answers its counts."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("select memory_private.distribute()").fetchone()
    assert row is not None
    counts = dict(row[0])
    event("citus_distributed", logging.INFO, **counts)
    return counts
