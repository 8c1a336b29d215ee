"""CI fails when ruff or mypy does: ``.ci/run`` execs ``scripts/test``, which runs
``scripts/lint`` before pytest. Each test runs the real scripts on a copy of the repository's
skeleton (the scripts, pyproject.toml, a one-module ``pyworker``, a one-test ``tests``) that
shares this checkout's virtual environment, with ``scripts/bootstrap`` replaced by a no-op."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOOD = 'def add(a: int, b: int) -> int:\n    """The sum."""\n    return a + b\n'
PASSING_TEST = "def test_passes() -> None:\n    assert True\n"


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")  # one cache: the stdlib is analysed once


@pytest.fixture
def tree(tmp_path: Path, mypy_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MYPY_CACHE_DIR", str(mypy_cache))
    if not (ROOT / ".venv/bin/ruff").exists() or not (ROOT / ".venv/bin/mypy").exists():
        pytest.skip("no .venv with ruff and mypy (scripts/bootstrap makes it)")
    for name in ("scripts/test", "scripts/lint", ".ci/run", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / "scripts/bootstrap").write_text("#!/usr/bin/env bash\n")
    (tmp_path / "scripts/bootstrap").chmod(0o755)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "pyworker").mkdir()
    (tmp_path / "pyworker/__init__.py").write_text(GOOD)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_one.py").write_text(PASSING_TEST)
    return tmp_path


def run(tree: Path, command: str) -> subprocess.CompletedProcess[str]:
    # The copy holds one test file, not the Citus profile's: PIMEM_SKIP_CITUS leaves it out.
    return subprocess.run([str(tree / command)], cwd=tree, check=False, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PIMEM_SKIP_CITUS": "1"})


def test_a_clean_tree_passes_lint_and_goes_on_to_pytest(tree: Path) -> None:
    done = run(tree, ".ci/run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.mark.parametrize(("path", "text", "tool_says"), [
    ("pyworker/__init__.py", "import os\n" + GOOD, "F401"),          # ruff: unused import
    ("tests/test_one.py", "import os\n" + PASSING_TEST, "F401"),     # ruff covers tests too
    ("pyworker/__init__.py", GOOD.replace("return a + b", "return str(a + b)"),
     "Incompatible return value type"),                               # mypy
], ids=["ruff-pyworker", "ruff-tests", "mypy"])
def test_ci_fails_before_pytest_when_ruff_or_mypy_finds_an_error(
        tree: Path, path: str, text: str, tool_says: str) -> None:
    (tree / path).write_text(text)
    done = run(tree, ".ci/run")
    assert done.returncode != 0
    assert tool_says in done.stdout + done.stderr
    assert "passed" not in done.stdout  # pytest never ran
