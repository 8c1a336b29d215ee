"""README.md's tour, run as written: its code blocks, in order, against a fresh empty database.

The shell blocks run in bash with ``PIMEM_DSN`` set and this environment's ``pimem`` first on
the PATH; the SQL blocks run in ``psql "$PIMEM_DSN" -v ON_ERROR_STOP=1``, as the tour says. The
tour must end in a memory: the new request's recall shows it and a search finds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TOUR_HEADING = "## A short tour"


def tour_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, code) of the tour section, in order."""
    start = text.index(TOUR_HEADING)
    end = text.find("\n## ", start + len(TOUR_HEADING))
    section = text[start:end if end >= 0 else len(text)]
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w+)\n(.*?)^```$", section,
                                 re.DOTALL | re.MULTILINE)]


def psql() -> str:
    found = shutil.which("psql") or "/usr/lib/postgresql/15/bin/psql"
    if not Path(found).exists():
        pytest.skip("no psql: apt-get install postgresql-client-15")
    return found


def test_the_tour_has_the_steps_a_backend_takes() -> None:
    blocks = tour_blocks(README.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == ["sh", "sql", "sh", "sql"]
    sql = "\n".join(code for lang, code in blocks if lang == "sql")
    for step in ("upsert_workspace", "upsert_member", "upsert_bot", "upsert_chat",
                 "upsert_request", "'user'", "'assistant'", "finish_request", "recall"):
        assert step in sql, step
    assert "pimem worker --model offline --once" in blocks[2][1]
    # The recall that shows the memory is a new request's, reported after the worker ran.
    assert "'r2'" in blocks[3][1] and "'r2'" not in blocks[1][1]


@pytest.mark.no_citus("creates and migrates a database of its own")
def test_the_readme_tour_ends_in_a_memory(empty_dsn: str) -> None:
    env = {**os.environ, "PIMEM_DSN": empty_dsn,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    client = psql()
    outputs: list[str] = []
    for lang, code in tour_blocks(README.read_text(encoding="utf-8")):
        if lang == "sh":
            command = ["bash", "-euo", "pipefail", "-c", code]
        else:
            command = [client, empty_dsn, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-At",
                       "-c", code]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, f"{lang} block failed:\n{code}\n{done.stdout}{done.stderr}"
        outputs.append(done.stdout)

    *_, last = outputs
    lines = last.strip().splitlines()
    # psql -c runs the block's statements one by one and prints each result: the upsert's
    # answer, then the recall, then the search.
    recall = json.loads(lines[1])
    assert recall["mode"] in ("index", "directory"), recall
    assert recall["records"] and recall["records"][0]["speaker_ids"] == ["alice"]
    shown = recall["index"] if recall["mode"] == "index" else recall["records"][0]["summary"]
    assert "German" in shown, recall
    found = json.loads(lines[2])
    assert found["mode"] == "search" and found["count"] >= 1, found
    assert "m1" in found["records"][0]["source_ids"] and found["records"][0]["rank"] == 1, found

    with psycopg.connect(empty_dsn) as conn:
        first = conn.execute("select memory.recall('acme', 'r1')").fetchone()
    assert first is not None and first[0] == {"mode": "none"}, \
        "r1's recall was frozen at its first call, before the worker ran"
