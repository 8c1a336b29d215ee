"""docs/rules.md stays true: every requirement of docs/requirements.md has its row there, in the
same order; every row names what enforces it and a test (or says "no test yet"); every SQL object
it names is defined in sql/, every file it names exists, every pytest test it names is defined in
its file, and every pgTAP assertion it quotes is in its file."""

from __future__ import annotations

import re
from pathlib import Path

from pyworker import schema

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "rules.md"
REQUIREMENTS = ROOT / "docs" / "requirements.md"

REQUIREMENT = re.compile(r"^- \*\*([BVPRCTX]\d{0,2})\*\*", re.MULTILINE)
ROW = re.compile(r"^\| *([BVPRCTX]\d{0,2}) *\|.*\|$", re.MULTILINE)
CODE = re.compile(r"`([^`\n]+)`")
SQL_NAME = re.compile(r"\b(memory(?:_private)?\.\w+)")
TEST = re.compile(r"^(tests/\w+\.py)::(\w+)$")
SYMBOL = re.compile(r"^(pyworker/[\w/]+\.py)::([\w.]+)$")
PATH = re.compile(r"^(?:sql|migrations|pyworker|tests|pgtap|docs)/[\w./-]*$")
PGTAP = re.compile(r"`(pgtap/\w+\.sql)`(?: \"([^\"]+)\")?")
NO_TEST = "no test yet"


def rules() -> str:
    return RULES.read_text()


def rows() -> dict[str, list[str]]:
    """Each requirement's row as its four cells (id, rule, enforced by, proved by)."""
    found: dict[str, list[str]] = {}
    for m in ROW.finditer(rules()):
        cells = [c.strip() for c in m.group(0).strip("|").split(" | ")]
        assert len(cells) == 4, f"row {m.group(1)} has {len(cells)} cells, not 4: {cells}"
        assert m.group(1) not in found, f"{m.group(1)} has two rows"
        found[m.group(1)] = cells
    return found


def sql_objects() -> set[str]:
    """The functions, views, tables and types sql/ creates, and its indexes and triggers (named
    with the schema of their table)."""
    names: set[str] = set()
    for path in schema.canonical_files():
        text = path.read_text()
        names |= set(re.findall(r"^create (?:or replace )?(?:function|view|table|type) "
                                r"(memory(?:_private)?\.\w+)", text, re.MULTILINE))
        for name, owner in re.findall(r"^create (?:unique )?(?:index|trigger) (\w+)[^;]*? on "
                                      r"(memory(?:_private)?)\.", text, re.MULTILINE):
            names.add(f"{owner}.{name}")
    return names


def defines(path: Path, dotted: str) -> bool:
    """Whether a Python file defines ``Name`` or ``Class.member`` (a method or a field)."""
    text = path.read_text()
    first, *rest = dotted.split(".")
    if not re.search(rf"^(?:class|def|async def) {first}\b|^{first} *[:=]", text, re.MULTILINE):
        return False
    return all(re.search(rf"^\s+(?:def |async def )?{part}\b", text, re.MULTILINE)
               for part in rest)


def test_every_requirement_has_one_row_in_the_order_of_the_requirements() -> None:
    required = REQUIREMENT.findall(REQUIREMENTS.read_text())
    assert len(required) >= 60 and "X" in required
    assert list(rows()) == required


def test_every_row_names_what_enforces_it_and_what_proves_it() -> None:
    for rid, (_, rule, enforced, proved) in rows().items():
        assert rule and enforced, f"{rid}: a rule and what enforces it"
        tests = [c for c in CODE.findall(proved) if TEST.match(c) or c.startswith("pgtap/")]
        assert tests or NO_TEST in proved, f"{rid}: name a test or say '{NO_TEST}'"


def test_every_sql_object_named_is_defined_in_sql() -> None:
    named = set(SQL_NAME.findall(rules()))
    assert len(named) >= 100
    assert sorted(named - sql_objects()) == []


def test_every_pytest_test_named_is_defined_in_its_file() -> None:
    missing = []
    named = {c for c in CODE.findall(rules()) if TEST.match(c)}
    assert len(named) >= 150
    for ref in sorted(named):
        file, name = TEST.match(ref).groups()  # type: ignore[union-attr]
        path = ROOT / file
        if not path.is_file() or not re.search(rf"^(?:async )?def {name}\(", path.read_text(),
                                               re.MULTILINE):
            missing.append(ref)
    assert missing == []


def test_every_pgtap_assertion_quoted_is_in_its_file() -> None:
    quoted = PGTAP.findall(rules())
    assert len([d for _, d in quoted if d]) >= 20
    for _, _, _, proved in rows().values():
        for file, description in PGTAP.findall(proved):
            assert description, f"{file} is named in a row without the assertion's description"
    missing = [f"{file} {description!r}" for file, description in quoted
               if not (ROOT / file).is_file()
               or (description and "'" + description.replace("'", "''") + "'"
                   not in (ROOT / file).read_text())]
    assert missing == []


def test_every_file_and_python_name_named_exists() -> None:
    missing = []
    for code in set(CODE.findall(rules())):
        if m := SYMBOL.match(code):
            if not (ROOT / m.group(1)).is_file() or not defines(ROOT / m.group(1), m.group(2)):
                missing.append(code)
        elif PATH.match(code) and not (ROOT / code).exists():
            missing.append(code)
    assert missing == []


def test_every_test_written_for_a_rule_is_named_in_its_row() -> None:
    gaps = ROOT / "tests" / "test_rules_gaps.py"
    written = re.findall(r"^def (test_\w+)\(", gaps.read_text(), re.MULTILINE)
    assert written
    text = rules()
    assert [t for t in written if f"`tests/test_rules_gaps.py::{t}`" not in text] == []
