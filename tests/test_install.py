"""Installs pimem as a user would, away from the checkout, and runs the documented commands.

The repository's HEAD (``git archive``: what is committed, not the working tree) is unpacked into
a temporary directory; ``python -m build`` makes the sdist and a wheel from that sdist, and
``pip wheel`` makes a wheel straight from the tree (without build isolation, to save time); both
wheels must hold the same files: every
subpackage, the schema, the migrations, the prompts and the data. The wheel built from the sdist
goes into a fresh virtual environment outside the checkout (its dependencies come from the
package index, so pip's cache makes repeated runs cheap), and from a directory outside the
checkout that environment's ``pimem`` migrates an empty database of the throwaway server (twice:
the second run is a no-op), runs the worker once over a finished conversation with the offline
model, runs the demo, shows the status, and exports the tool schemas. About 20 s on the 2-core
machine with a warm pip cache, 45-75 s while other test suites share it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest

import pyworker
from pyworker import schema
from tests.conftest import Server
from tests.factory import World

ROOT = Path(__file__).resolve().parent.parent
# Run by the installed interpreter: where pyworker comes from, whether the test tree is
# importable, and which benchmark modules the CLI and the worker pulled in.
PROBE = """
import importlib.util, sys
import pyworker, pyworker.cli, pyworker.worker
print(pyworker.__file__)
print(importlib.util.find_spec("tests") is None)
print(sorted(m for m in sys.modules if m.startswith("pyworker.bench")))
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
    and the top-level sql/ and migrations/ under pyworker/."""
    files = {f"pyworker/{p.relative_to(src / 'pyworker')}"
             for p in (src / "pyworker").rglob("*") if p.suffix in (".py", ".txt", ".json")}
    for name in ("sql", "migrations"):
        files |= {f"pyworker/{name}/{p.name}" for p in (src / name).iterdir()
                  if p.suffix in (".sql", ".json")}
    return files


def build_and_install(base: Path) -> dict[str, Path]:
    """The clean copy, its sdist, the wheel from the sdist, the wheel from the tree, and a
    fresh venv with the former installed."""
    src = base / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    python = sys.executable
    run([python, "-m", "build", "--outdir", str(base / "dist"), str(src)], cwd=base)
    run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(base / "direct"), str(src)], cwd=base)
    [from_sdist] = (base / "dist").glob("pimem-*.whl")
    [sdist] = (base / "dist").glob("pimem-*.tar.gz")
    [direct] = (base / "direct").glob("pimem-*.whl")
    venv = base / "venv"
    # A bare venv filled by this environment's pip (ensurepip would add 5-10 s and nothing the
    # test looks at).
    run([python, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    run([python, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         str(from_sdist)], cwd=base)
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
    assert {"pyworker/sql/00_base.sql", "pyworker/migrations/0001_initial.sql",
            "pyworker/adapters/offline.py", "pyworker/bench/__init__.py",
            "pyworker/fakemodel.py", "pyworker/prompts/extract.txt",
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
    import tarfile

    with tarfile.open(installed["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"sql/00_base.sql", "migrations/0001_initial.sql", "pgtap/01_roles.sql",
            "tests/conftest.py", "LICENSE", "CHANGELOG.md"} <= names


@pytest.mark.slow  # builds, installs a venv, runs the commands
def test_a_wheel_from_a_clean_copy_installs_away_from_the_checkout_and_runs_the_commands(
        pg_server: Server, tmp_path: Path) -> None:
    """One test, so that parallel test workers do not build and install twice."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the install test builds from `git archive HEAD`: needs git and a checkout")
    (tmp_path / "build").mkdir()
    installed = build_and_install(tmp_path / "build")
    check_distributions(installed)
    venv_bin = installed["venv"] / "bin"
    pimem = str(venv_bin / "pimem")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIMEM_HOME=str(installed["home"]), COLUMNS="200")
    cwd = tmp_path / "elsewhere"  # outside the checkout: nothing can be imported from it
    cwd.mkdir()

    probe = run([str(venv_bin / "python"), "-c", PROBE], cwd=cwd, env=env).stdout.splitlines()
    assert probe[0].startswith(str(installed["venv"])), probe
    assert probe[1:] == ["True", "[]"], "the runtime worker imports no benchmark and no tests"
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
