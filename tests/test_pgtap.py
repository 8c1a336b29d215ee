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
# The files that cannot run in the Citus profile, and why (pgTAP keeps its plan and its counts
# in temporary tables of the session; every file is one transaction that rolls back).
NO_CITUS = {
    "02_ingest.sql": "its assertions over one workspace's rows go to that workspace's node whole, "
                     "assertion included, where pgTAP's temporary tables are not",
    "04_role_separation.sql": "it creates a role in its transaction, and Citus connects to the "
                              "workers as that role, which does not exist there until commit",
}


@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.name, marks=[pytest.mark.no_citus(NO_CITUS[p.name])]
                 if p.name in NO_CITUS else []) for p in FILES])
def test_pgtap_file(pg_server: Server, shared_dsn: str, path: Path) -> None:
    if not pg_server.has_pgtap or shutil.which("pg_prove") is None:
        pytest.skip("pgTAP or pg_prove missing: apt-get install postgresql-15-pgtap "
                    "libtap-parser-sourcehandler-pgtap-perl")
    info = psycopg.conninfo.conninfo_to_dict(shared_dsn)
    cmd = ["pg_prove", "--failures", "-h", str(info["host"]), "-p", str(info.get("port", 5432)),
           "-U", str(info.get("user", "postgres")), "-d", str(info["dbname"]), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
