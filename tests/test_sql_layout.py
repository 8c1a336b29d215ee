"""sql/ reads like a book: every file uses only what it or an earlier file defines, every
requirement id it cites is defined in docs/requirements.md, and no function is long without a
reason written above it."""

from __future__ import annotations

import re
from pathlib import Path

from pyworker import schema

DEFINES = re.compile(r"^create (?:function|view|table|type) ((?:memory|memory_private)\.\w+)",
                     re.MULTILINE)
USES = re.compile(r"\b((?:memory|memory_private)\.\w+)\s*\(")
REQUIREMENT = re.compile(r"\b([BVPRCTX]\d{1,2})\b")
LONG = 100  # lines; a longer function says why above it (a comment starting "Long:")


def _code(text: str) -> str:
    """The SQL without its comments and the text of COMMENT ON statements."""
    text = re.sub(r"^comment on .*?';\n", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"--[^\n]*", "", text)


def test_no_file_uses_a_function_defined_in_a_later_file() -> None:
    files = schema.canonical_files()
    defined_in: dict[str, int] = {}
    for i, path in enumerate(files):
        for name in DEFINES.findall(path.read_text()):
            defined_in.setdefault(name, i)
    late = []
    for i, path in enumerate(files):
        for name in set(USES.findall(_code(path.read_text()))):
            if defined_in.get(name, -1) > i:
                late.append(f"{path.name} uses {name} from {files[defined_in[name]].name}")
    assert late == []


def test_every_requirement_id_cited_in_sql_is_defined_in_the_docs() -> None:
    docs = Path(schema.ROOT / "docs" / "requirements.md").read_text()
    defined = set(re.findall(r"\*\*([BVPRCTX]\d{1,2})\*\*", docs)) | {"X"}
    cited = {m for path in schema.canonical_files()
             for m in REQUIREMENT.findall(path.read_text())}
    assert cited, "sql/ cites requirement ids"
    assert sorted(cited - defined) == []


def test_no_function_is_longer_than_a_hundred_lines_without_a_reason() -> None:
    long = []
    for path in schema.canonical_files():
        text = path.read_text()
        for m in re.finditer(r"^create function (\S+?)\(", text, re.MULTILINE):
            body_end = text.index("$$;", text.index("as $$", m.start()) + 5)
            lines = text.count("\n", m.start(), body_end) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n\n", 1)[-1]
            if lines > LONG and "-- Long:" not in before:
                long.append(f"{path.name}: {m.group(1)} ({lines} lines)")
    assert long == []
