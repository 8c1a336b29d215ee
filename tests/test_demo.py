"""``pimem demo --dsn``: the whole pipeline on the bundled sample, against the test server.

It runs on an empty database, so it also proves that the migrations build what the pipeline,
recall and control need. (``scripts/demo`` without a DSN uses the embedded PostgreSQL instead;
that path is the README's command, checked by hand and by CI's fresh clone.)
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pyworker.cli import app


@pytest.mark.slow  # the whole demo
def test_demo_runs_the_pipeline_and_shows_recall_query_and_forget(empty_dsn: str) -> None:
    result = CliRunner().invoke(app, ["demo", "--dsn", empty_dsn], catch_exceptions=False)
    out = result.output
    assert result.exit_code == 0, out
    assert "migration(s) applied" in out and "5 conversations, 16 messages" in out
    assert out.count("extract     -> committed") == 3  # dm-alice, team topic 1, team topic 2
    assert out.count("consolidate -> committed") == 3
    assert out.count("mode: index") == 3
    assert "OpenTofu" in out and "v2.3 on Friday" in out  # Chinese correction, group decision
    assert "[REDACTED]" in out
    assert "Sunny-Day-42" not in out and "sk-proj-Zq8Xw2Lm4Np6Rt0Vb3Kc" not in out
    assert "secrets redacted" in out
    assert "manage_memory" in out and "forget #" in out and ": done" in out
    assert "now finds 0 record(s)" in out
    # A second run on the same database starts over and shows the same.
    again = CliRunner().invoke(app, ["demo", "--dsn", empty_dsn], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert again.output.count("extract     -> committed") == 3
