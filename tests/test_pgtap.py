"""Runs every pgTAP file in pgtap/ with pg_prove, each in the worker's shared database (every
file rolls back; the harness resets the database after each, as after a ``conn`` test)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.conftest import Server

PGTAP_DIR = Path(__file__).resolve().parent.parent / "pgtap"
FILES = sorted(PGTAP_DIR.glob("*.sql"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_pgtap_file(pg_server: Server, shared_dsn: str, path: Path) -> None:
    if not pg_server.has_pgtap or shutil.which("pg_prove") is None:
        pytest.skip("pgTAP or pg_prove missing: apt-get install postgresql-15-pgtap "
                    "libtap-parser-sourcehandler-pgtap-perl")
    info = psycopg.conninfo.conninfo_to_dict(shared_dsn)
    cmd = ["pg_prove", "--failures", "-h", str(info["host"]), "-p", str(info.get("port", 5432)),
           "-U", str(info.get("user", "postgres")), "-d", str(info["dbname"]), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
