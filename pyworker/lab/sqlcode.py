"""The statements of our SQL files, and which object each one defines.

``sql/`` is read as a list of statements (:func:`statements`): each runs up to its semicolon,
outside comments, quoted strings, quoted identifiers and dollar-quoted bodies. A statement that
defines code (a function, a view, a trigger) or speaks of it (its ``comment on``, ``alter
function``, ``grant`` / ``revoke``) belongs to that object (:func:`objects`); everything else
(schemas, tables, columns, indexes, types, reference rows) is the schema proper, which only a
person writes into a migration.

Two generators read sql/ through this module: the function half of a release migration
(:mod:`pyworker.lab.releases`, ``pimem schema-bundle``) and the cluster file
(:mod:`pyworker.lab.cluster_code`). Neither guesses: a statement whose shape it does not know
raises :class:`SqlCodeError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class SqlCodeError(Exception):
    """A SQL file holds a shape the generators do not handle."""


@dataclass(frozen=True)
class Statement:
    text: str        # from its first word to its semicolon, as written
    source: str      # "file:line" of its first word

    @property
    def head(self) -> str:
        """The statement's first words, lower case, single-spaced (for classifying)."""
        return re.sub(r"\s+", " ", self.text[:400]).lower()


_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")


def statements(text: str, name: str = "<sql>") -> list[Statement]:
    """Splits ``text`` into statements. Comments between statements are dropped; comments and
    strings inside a statement are kept as written."""
    out: list[Statement] = []
    i, n = 0, len(text)
    start: int | None = None
    while i < n:
        c = text[i]
        if start is None:
            if c.isspace():
                i += 1
                continue
            if text.startswith("--", i):
                j = text.find("\n", i)
                i = n if j < 0 else j + 1
                continue
            if text.startswith("/*", i):
                j = text.find("*/", i + 2)
                if j < 0:
                    raise SqlCodeError(f"{name}: a comment is not closed")
                i = j + 2
                continue
            start = i
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise SqlCodeError(f"{name}: a comment is not closed")
            i = j + 2
        elif c == "'":
            escaped = i > 0 and text[i - 1] in "eE" and (i < 2 or not text[i - 2].isalnum())
            j = i + 1
            while True:
                if j >= n:
                    raise SqlCodeError(f"{name}: a string is not closed")
                if escaped and text[j] == "\\":
                    j += 2
                    continue
                if text[j] == "'":
                    if j + 1 < n and text[j + 1] == "'":
                        j += 2
                        continue
                    break
                j += 1
            i = j + 1
        elif c == '"':
            j = text.find('"', i + 1)
            if j < 0:
                raise SqlCodeError(f"{name}: a quoted name is not closed")
            i = j + 1
        elif c == "$" and (m := _DOLLAR.match(text, i)) and not (i > 0 and (
                text[i - 1].isalnum() or text[i - 1] == "_")):
            tag = m.group(0)
            j = text.find(tag, m.end())
            if j < 0:
                raise SqlCodeError(f"{name}: a {tag} body is not closed")
            i = j + len(tag)
        elif c == ";":
            line = text.count("\n", 0, start) + 1
            out.append(Statement(text[start:i + 1], f"{name}:{line}"))
            start = None
            i += 1
        else:
            i += 1
    if start is not None and text[start:].strip():
        raise SqlCodeError(f"{name}: the last statement has no semicolon")
    return out


def file_statements(paths: list[Path]) -> list[Statement]:
    out: list[Statement] = []
    for path in paths:
        out += statements(path.read_text(), path.name)
    return out


_NAME = r"([a-z_][a-z_0-9]*\.[a-z_][a-z_0-9]*)"
CREATE_FUNCTION = re.compile(rf"^create (?:or replace )?(?:function|procedure) {_NAME} ?\(")
CREATE_VIEW = re.compile(rf"^create (?:or replace )?view {_NAME}\b")
CREATE_TRIGGER = re.compile(
    rf"^create (?:or replace )?(?:constraint )?trigger ([a-z_][a-z_0-9]*) .*? on {_NAME}\b")
_COMMENT = re.compile(rf"^comment on (function|procedure|view) {_NAME}\b")
_COMMENT_TRIGGER = re.compile(rf"^comment on trigger ([a-z_][a-z_0-9]*) on {_NAME}\b")
_COMMENT_COLUMN = re.compile(rf"^comment on column {_NAME}\.[a-z_0-9]+\b")
_ALTER_FUNCTION = re.compile(rf"^alter (?:function|procedure) {_NAME} ?\(")
_PRIVILEGE = re.compile(r"^(grant|revoke) .*? on (function|procedure|table|sequence|schema) ",
                        re.DOTALL)
_PRIVILEGE_OBJECT = re.compile(r"^(grant|revoke) [a-z, ]+ on ([a-z_][a-z_0-9]*\.[a-z_]|"
                               r"memory[a-z_]*\.)")
_DROP = re.compile(rf"^drop (function|procedure|view) (?:if exists )?{_NAME}")
_DROP_TRIGGER = re.compile(rf"^drop trigger (?:if exists )?([a-z_][a-z_0-9]*) on {_NAME}")
_MENTIONS = re.compile(_NAME)


@dataclass
class CodeObject:
    """One function, view or trigger with the statements that speak of it, in order."""

    kind: str                   # function | view | trigger | privileges
    name: str                   # schema.name; a trigger: table.trigger
    statements: list[Statement] = field(default_factory=list)

    def text(self) -> str:
        """The object's statements, normalised to a definition that replaces (create or
        replace), joined by blank lines: what a migration emits for it."""
        return "\n\n".join(replacing(s.text) for s in self.statements)


def signature(text: str) -> str:
    """A function definition's arguments and result, single-spaced and lower case: what
    ``create or replace`` cannot change (a different one is another function, or an error)."""
    flat = " ".join(text.split()).lower()
    m = CREATE_FUNCTION.match(flat)
    if m is None:
        raise SqlCodeError(f"not a function definition: {flat[:80]}")
    depth, i = 0, m.end() - 1
    for i in range(m.end() - 1, len(flat)):
        depth += {"(": 1, ")": -1}.get(flat[i], 0)
        if depth == 0:
            break
    arguments = flat[m.end() - 1:i + 1]
    rest = flat[i + 1:]
    result = re.match(r" ?returns (.*?) (language|immutable|stable|volatile|strict|security|"
                      r"set|as|parallel|cost|rows|leakproof|called)\b", rest)
    # out parameters and no returns clause: the arguments say the result
    # (the parameter names and defaults stay in: renaming a parameter needs a drop too)
    return f"{arguments} returns {result.group(1) if result else '(out parameters)'}"


def replacing(text: str) -> str:
    """``create function/view/trigger`` written as ``create or replace ...``."""
    return re.sub(r"^create (function|procedure|view|trigger)\b", r"create or replace \1", text,
                  count=1, flags=re.IGNORECASE)


def code_key(statement: Statement, views: set[str]) -> tuple[str, str] | None:
    """(kind, name) of the code object a statement defines or speaks of; None for the schema
    proper. ``views``: the names the files define as views (a column comment of one belongs
    to it)."""
    head = statement.head
    if m := CREATE_FUNCTION.match(head):
        return "function", m.group(1)
    if m := CREATE_VIEW.match(head):
        return "view", m.group(1)
    if m := CREATE_TRIGGER.match(head):
        return "trigger", f"{m.group(2)}.{m.group(1)}"
    if m := _COMMENT.match(head):
        return ("view" if m.group(1) == "view" else "function"), m.group(2)
    if m := _COMMENT_TRIGGER.match(head):
        return "trigger", f"{m.group(2)}.{m.group(1)}"
    if (m := _COMMENT_COLUMN.match(head)) and m.group(1) in views:
        return "view", m.group(1)
    if m := _ALTER_FUNCTION.match(head):
        return "function", m.group(1)
    if (m := _PRIVILEGE.match(head)) and m.group(2) in ("function", "procedure"):
        return "privileges", " ".join(statement.text.split())
    if head.startswith(("grant select on memory.", "revoke all on memory.")) and any(
            v in head for v in views):
        return "privileges", " ".join(statement.text.split())
    return None


def objects(stmts: list[Statement]) -> tuple[dict[tuple[str, str], CodeObject],
                                                list[Statement]]:
    """The code objects of ``stmts`` in the order they are first defined, and the statements
    of the schema proper. A function name defined twice (an overload, or a definition written
    again) is refused: the generators key functions by name."""
    views = {m.group(1) for s in stmts if (m := CREATE_VIEW.match(s.head))}
    found: dict[tuple[str, str], CodeObject] = {}
    schema: list[Statement] = []
    for s in stmts:
        key = code_key(s, views)
        if key is None:
            schema.append(s)
            continue
        kind, name = key
        creating = s.head.startswith("create ")
        if creating and key in found and any(
                t.head.startswith("create ") for t in found[key].statements):
            raise SqlCodeError(f"{s.source}: {kind} {name} is defined twice (an overload or a "
                               "second definition): the generators key code by name")
        if not creating and key not in found and kind != "privileges":
            # speaks of something the schema proper makes (a function a DO block creates
            # from the catalog's facts): part of the schema proper too
            schema.append(s)
            continue
        found.setdefault(key, CodeObject(kind, name)).statements.append(s)
    return found, schema


def dropped(stmts: list[Statement]) -> set[tuple[str, str]]:
    """The code objects that ``drop`` statements among ``stmts`` remove."""
    out: set[tuple[str, str]] = set()
    for s in stmts:
        flat = " ".join(s.text.split()).lower()
        if m := _DROP.match(flat):
            kind = "view" if m.group(1) == "view" else "function"
            # drop function a(x), b(y): every name it lists (argument types are no functions)
            out |= {(kind, n) for n in _MENTIONS.findall(flat)}
        elif m := _DROP_TRIGGER.match(flat):
            out.add(("trigger", f"{m.group(2)}.{m.group(1)}"))
    return out


def mentioned(statement: Statement) -> set[str]:
    """Every schema-qualified name a statement mentions (for privileges: what they grant)."""
    return set(_MENTIONS.findall(" ".join(statement.text.split()).lower()))
