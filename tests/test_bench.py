"""`pimem bench --quick` runs end to end and reports every section.

Speed targets are shown by the benchmark itself (docs/benchmarks.md), never asserted here: a
timed unit test on a shared 2-core machine would fail for reasons that are not bugs.

The test grows the dataset to 2 and then 4 workspaces (``--sizes 2,4``) instead of the quick
profile's 4 and 16: every section runs the same code over two sizes, and growing to 16 took a
quarter of the test's time. ``PIMEM_TEST_BENCH=quick`` runs the quick profile's own sizes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pyworker.cli import app

# The quick profile over fewer workspaces, unless PIMEM_TEST_BENCH=quick.
SIZES = [] if os.environ.get("PIMEM_TEST_BENCH") == "quick" else ["--sizes", "2,4"]
SECTIONS = ("server", "machine", "floor", "dataset", "recall", "query", "recall_directory",
            "ingest", "explain", "jobs", "worker_overhead", "memory", "growth", "verdict")


@pytest.mark.slow  # the whole bench --quick
def test_quick_bench_writes_json_markdown_and_every_section(db_dsn: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "--quick", *SIZES, "--dsn", db_dsn, "--out",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)

    report = json.loads((tmp_path / "bench.json").read_text())
    missing = [s for s in SECTIONS if s not in report]
    assert missing == []
    assert (tmp_path / "bench.md").read_text().startswith("# pimem bench (quick)")

    # The parts that measure this product's own code run (a schema change that breaks one,
    # such as a new signature, must not pass as "not available"); the others either ran or say
    # why they could not (Pi missing), never a made-up number.
    ours = [report["floor"], report["recall_directory"], report["ingest"], report["explain"],
            report["jobs"], report["growth"],
            *report["recall"].values(), *report["query"].values()]
    for part in ours:
        assert part["status"] == "ok", part
    for part in (report["worker_overhead"], report["memory"]):
        assert part["status"] in ("ok", "not_available"), part
        if part["status"] == "not_available":
            assert part["reason"]
    assert sorted(int(w) for w in report["recall"]) == list(report["profile"]["sizes"])
    assert report["dataset"]["consistency"] == {
        "sources_without_message": 0, "records_without_scope": 0,
        "hash_mismatches_in_sample": 0}
    assert report["floor"]["round_trip"]["n"] > 0
    assert report["ingest"]["per_commit"]["upsert_message"]["n"] > 0
    for row in report["verdict"]:
        assert row["met"] in (True, False, None)
