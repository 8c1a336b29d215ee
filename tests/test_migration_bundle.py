"""The unreleased migration's code is generated from sql/ (`pimem schema-bundle`,
docs/migrations.md): the committed file is what the generator writes, no migration defines a
function twice or creates and drops one, and the generator refuses what it cannot write
unambiguously instead of guessing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pyworker import schema
from pyworker.cli import app
from pyworker.lab import releases, sqlcode


def test_the_unreleased_migration_is_what_schema_bundle_writes() -> None:
    path = releases.unreleased_migration()
    assert path is not None, "no unreleased migration: nothing changed since the last release?"
    text = path.read_text()
    assert releases.bundle_migration(text) == text, (
        f"{path.name} differs from what `pimem schema-bundle` writes from sql/: run it")
    result = CliRunner().invoke(app, ["schema-bundle", "--check"])
    assert result.exit_code == 0, result.output


def test_no_migration_defines_a_function_twice_or_creates_one_it_drops() -> None:
    for path in schema.migration_files():
        stmts = sqlcode.statements(path.read_text(), path.name)
        created = [m.group(1) for s in stmts
                   if (m := sqlcode.CREATE_FUNCTION.match(s.head))]
        twice = sorted({n for n in created if created.count(n) > 1})
        assert twice == [], f"{path.name} defines {twice} more than once"
        # a drop of the released form before the new one is made is fine; a drop after
        # the file made it is not
        seen: set[str] = set()
        for s in stmts:
            gone = {name for kind, name in sqlcode.dropped([s]) if kind == "function"}
            assert not gone & seen, f"{path.name} creates and then drops {sorted(gone & seen)}"
            if m := sqlcode.CREATE_FUNCTION.match(s.head):
                seen.add(m.group(1))


def test_the_hand_written_part_is_short_and_holds_no_code() -> None:
    path = releases.unreleased_migration()
    assert path is not None
    hand = releases._REGION.sub("", path.read_text())
    assert hand.count("\n") < 600, "the hand-written part grew past a few hundred lines"
    assert not re.search(r"(?mi)^create (or replace )?(function|view|trigger)\b", hand)


# The generator on a copy of sql/ and of the migrations ------------------------------------------


@pytest.fixture
def copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """sql/ and migrations/ copied, the package reading the copies."""
    sql, migrations = tmp_path / "sql", tmp_path / "migrations"
    shutil.copytree(schema.SQL_DIR, sql)
    shutil.copytree(schema.MIGRATIONS_DIR, migrations)
    monkeypatch.setattr(schema, "SQL_DIR", sql)
    monkeypatch.setattr(schema, "MIGRATIONS_DIR", migrations)
    return sql, migrations


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1))


def test_a_changed_function_body_is_written_once_with_its_comment(
        copies: tuple[Path, Path]) -> None:
    sql, migrations = copies
    edit(sql / "60_retention.sql", "create function memory.answer_retention_boundary(",
         "-- a comment outside the body changes nothing\n"
         "create function memory.answer_retention_boundary(")
    unchanged = releases.unreleased_migration(migrations)
    assert unchanged is not None
    before = unchanged.read_text()
    assert releases.bundle_migration(before) == before
    edit(sql / "00_base.sql", "create function memory_private.sorted_set(",
         "create function memory_private.sorted_set(")  # no-op
    edit(sql / "00_base.sql", "  'Moves the memory clock forward",
         "  'Moves the memory clock forward (edited)")
    after = releases.bundle_migration(before)
    assert after != before
    defined = re.findall(r"create or replace function memory_private\.advance_clock\(", after)
    assert len(defined) == 1
    assert "(edited)" in after


def test_a_released_function_sql_lost_must_be_dropped_by_hand(copies: tuple[Path, Path]) -> None:
    sql, migrations = copies
    text = (sql / "60_retention.sql").read_text()
    start = text.index("create function memory.answer_retention_boundary(")
    end = text.index("revoke all on function", start)
    (sql / "60_retention.sql").write_text(text[:start] + text[end:].replace(
        "memory.answer_retention_boundary(text, text),", "").replace(
        ",\n  memory.answer_retention_boundary(text, text)", ""))
    path = releases.unreleased_migration(migrations)
    assert path is not None
    with pytest.raises(sqlcode.SqlCodeError, match="answer_retention_boundary"):
        releases.bundle_migration(path.read_text())


def test_a_changed_signature_must_be_dropped_by_hand(copies: tuple[Path, Path]) -> None:
    sql, migrations = copies
    edit(sql / "00_base.sql", "create function memory_private.advance_clock(p_by interval)",
         "create function memory_private.advance_clock(p_by interval, p_why text default '')")
    edit(sql / "00_base.sql", "comment on function memory_private.advance_clock(interval)",
         "comment on function memory_private.advance_clock(interval, text)")
    path = releases.unreleased_migration(migrations)
    assert path is not None
    text = path.read_text()
    with pytest.raises(sqlcode.SqlCodeError, match="advance_clock: its arguments or result"):
        releases.bundle_migration(text)
    text = text.replace("-- pimem:generated begin\n",
                        "drop function memory_private.advance_clock(interval);\n\n"
                        "-- pimem:generated begin\n", 1)
    assert "p_why text" in releases.bundle_migration(text)


def test_code_in_the_hand_written_part_and_a_region_naming_nothing_new_are_refused(
        copies: tuple[Path, Path]) -> None:
    _, migrations = copies
    path = releases.unreleased_migration(migrations)
    assert path is not None
    text = path.read_text()
    hand_code = text.replace(
        "-- pimem:generated begin\n",
        "create function memory_private.by_hand() returns int language sql as $$ select 1 $$;"
        "\n\n-- pimem:generated begin\n", 1)
    with pytest.raises(sqlcode.SqlCodeError, match="come from sql/"):
        releases.bundle_migration(hand_code)
    named = text.replace("-- pimem:generated begin: memory_private.summary_lines",
                         "-- pimem:generated begin: memory_private.clock_now "
                         "memory_private.summary_lines", 1)
    with pytest.raises(sqlcode.SqlCodeError, match="clock_now"):
        releases.bundle_migration(named)
    with pytest.raises(sqlcode.SqlCodeError, match="no .* region"):
        releases.bundle_migration(releases._REGION.sub("", text))


def test_the_statement_splitter_keeps_bodies_strings_and_names_whole() -> None:
    text = """-- a comment; with a semicolon
create function a.b() returns text language sql as $x$ select ';' $x$;
/* block; comment */ select 'it''s; fine', "odd;name", e'a\\'; b' from t;
do $$ begin perform 1; end $$;"""
    stmts = sqlcode.statements(text, "t")
    assert [s.text.split()[0] for s in stmts] == ["create", "select", "do"]
    assert stmts[1].text.endswith("from t;")
    assert stmts[0].source == "t:2"
    with pytest.raises(sqlcode.SqlCodeError, match="not closed"):
        sqlcode.statements("select $q$ never closed;", "t")
    with pytest.raises(sqlcode.SqlCodeError, match="no semicolon"):
        sqlcode.statements("select 1", "t")
