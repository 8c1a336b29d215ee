"""The cluster file: what runs on a Citus cluster in place of sql/'s SQL functions.

On one server the helpers that read tables (the validity rule's pieces, the scheduling's
conversations, the search's candidates) are SQL functions, which PostgreSQL inlines into their
callers' plans. On a Citus cluster that form gives wrong answers: Citus routes a statement by
its text, so an inlined helper comes back on the shard as a call, is inlined there over the
tables' empty shells and finds nothing; and a statement of a SQL function with parameters is
not something Citus plans (docs/scaling.md). There every such function must be PL/pgSQL.

:func:`cluster_code` writes that form from sql/ (``pimem cluster-code``), into the committed
file ``sql/cluster/functions.sql`` that ``pimem migrate`` applies on a coordinator in the
transaction of the migrations (``pyworker.schema.migrate``):

- every function of sql/ written in SQL that is not immutable (an immutable one reads no table;
  one that names a table is refused) becomes ``create or replace`` of the same function in
  PL/pgSQL: its header exactly as sql/ writes it (arguments, result, volatility, ``security
  definer``, every SET clause, strictness, parallel safety, cost, rows, leakproofness) but for
  the language, and its one statement returned by ``return query`` (a set) or ``return (...)``
  (one value), columns winning over variables of the same name as in SQL. ``create or replace``
  keeps the function's owner, comment and grants;
- every function of the API (schema ``memory``) that is not SQL plans its statements for each
  call on the cluster (``alter function ... set plan_cache_mode = force_custom_plan``, which
  reaches everything it calls; also over a generic plan pinned for speed on one server): Citus
  routes a statement by its parameters' values, which a generic plan lacks, and on a worker
  node, where a routed call runs its statements locally, Citus 13.2.2 keeps a new local plan
  in a cached generic plan at every execution, never finding the earlier ones (about 250 kB a
  recall: a pooled connection grew without limit; docs/scaling.md, Routing).

Nothing is guessed: a shape the conversion would change is refused with
:class:`~pyworker.lab.sqlcode.SqlCodeError` naming the function and the place (a body of
several statements or one that writes, a single-value function whose statement may give several
rows or columns, out parameters, a public function, attributes after the body, a body that is
not dollar-quoted). Write such a function in PL/pgSQL in sql/ itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pyworker import schema
from pyworker.lab import sqlcode

HEADER = """\
-- sql/cluster/functions.sql: what runs on a Citus cluster in place of sql/'s SQL functions.
--
-- Written by `pimem cluster-code` from sql/ (pyworker/lab/cluster_code.py); never edit it: edit
-- sql/ and run the command again (tests/test_cluster_code.py checks the file is its output).
-- `pimem migrate` applies it on a Citus coordinator in the transaction of the migrations, so no
-- migration leaves the one-server form running on the cluster (docs/scaling.md).
--
-- On one server these helpers are SQL, inlined into their callers' plans. On Citus an inlined
-- helper reads the tables' empty shells on a shard, and a statement of a SQL function with
-- parameters cannot be planned: each is PL/pgSQL here, with its header exactly as sql/ writes
-- it but for the language, and its one statement returned as it is (columns win over variables
-- of the same name, as in SQL). `create or replace` keeps each function's owner, comment and
-- grants. Then the functions that pin generic plans on one server get the default back: Citus
-- routes a statement by its parameters' values, which a generic plan lacks.
"""

_FIRST_WORDS = ("select", "with", "values", "table", "(")
_WRITES = re.compile(r"\b(insert|update|delete|merge|truncate)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Definition:
    """A ``create function`` statement cut into its parts (positions into ``text``)."""

    name: str
    text: str
    masked: str
    source: str
    args: tuple[int, int]       # the argument list, parentheses included
    body: tuple[int, int]       # inside the dollar quotes

    @property
    def attributes(self) -> str:
        """The header after the arguments, masked (comments and strings blanked), lower case."""
        return self.masked[self.args[1]:self.body[0]].lower()

    @property
    def language(self) -> str:
        m = re.search(r"\blanguage\s+([a-z_]+)", self.attributes)
        if m is None:
            raise self.refuse("it names no language before its body")
        return m.group(1)

    @property
    def volatility(self) -> str:
        found = re.findall(r"\b(immutable|stable|volatile)\b", self.attributes)
        return found[0] if found else "volatile"

    @property
    def returns_set(self) -> bool:
        return re.match(r"\s*returns\s+(setof|table)\b", self.attributes) is not None

    @property
    def masked_body(self) -> str:
        """The body with its comments and strings blanked (``masked`` blanks it whole)."""
        return sqlcode.mask(self.text[self.body[0]:self.body[1]], self.source)

    def refuse(self, why: str) -> sqlcode.SqlCodeError:
        return sqlcode.SqlCodeError(
            f"{self.source}: {self.name} cannot be written for the cluster: {why}. Write it "
            "in PL/pgSQL in sql/ (docs/dev/conventions.md, Citus)")


def parse(statement: sqlcode.Statement) -> Definition:
    """The parts of a ``create function`` statement; refuses one whose body is not a
    dollar-quoted string following every attribute."""
    text = statement.text
    masked = sqlcode.mask(text, statement.source)
    m = sqlcode.CREATE_FUNCTION.match(statement.head)
    if m is None:
        raise sqlcode.SqlCodeError(f"{statement.source}: not a function definition")
    name = m.group(1)
    open_at = masked.index("(")
    depth = 0
    for close_at in range(open_at, len(masked)):
        depth += {"(": 1, ")": -1}.get(masked[close_at], 0)
        if depth == 0:
            break
    quote = re.compile(r"\bas\s+(\$[A-Za-z_0-9]*\$)", re.IGNORECASE).search(masked, close_at)
    partial = Definition(name, text, masked, statement.source, (open_at, close_at + 1),
                         (len(text), len(text)))
    if quote is None:
        raise partial.refuse("its body is not a dollar-quoted string")
    tag = quote.group(1)
    start = quote.end(1)
    end = masked.index(tag, start)
    if masked[end + len(tag):].strip() != ";":
        raise partial.refuse("it has attributes after its body; write them before `as`")
    return Definition(name, text, masked, statement.source, (open_at, close_at + 1),
                      (start, end))


def _depth0(masked: str) -> str:
    """``masked`` with everything inside parentheses blanked: the statement's own words."""
    out, depth = [], 0
    for c in masked:
        if c == "(":
            depth += 1
        out.append(c if depth == 0 or c == "\n" else " ")
        if c == ")":
            depth -= 1
    return "".join(out)


# Functions that return sets, besides sql/'s own (a call of one in a select list gives rows).
_SET_FUNCTIONS = {
    "unnest", "generate_series", "generate_subscripts", "regexp_matches",
    "regexp_split_to_table", "string_to_table", "jsonb_array_elements",
    "jsonb_array_elements_text", "json_array_elements", "json_array_elements_text",
    "jsonb_each", "jsonb_each_text", "json_each", "json_each_text", "jsonb_object_keys",
    "json_object_keys", "jsonb_to_recordset", "json_to_recordset", "jsonb_populate_recordset",
    "json_populate_recordset", "jsonb_path_query", "ts_stat", "ts_parse", "aclexplode",
}


def _one_value(definition: Definition, masked_statement: str, sets: set[str]) -> None:
    """Refuses a single-value function's statement unless it certainly gives one column and at
    most one row: SQL takes the first row, PL/pgSQL's ``return (...)`` raises on a second (and
    on a second column). At most one row: the statement ends in ``limit 1``, or it reads no
    table at its top (no ``from``, no union) and calls no function that returns a set."""
    own = _depth0(masked_statement).lower()
    if own.split()[:1] != ["select"]:
        raise definition.refuse("a single-value body must be one select")
    listed = re.split(r"\bfrom\b", own, maxsplit=1)[0]
    if "," in listed or "*" in listed:
        raise definition.refuse("its select may give several columns; return (...) takes one")
    if re.search(r"\blimit\s+1\s*$", own):
        return
    called = {n.rsplit(".", 1)[-1] for n in re.findall(r"([a-z_][a-z_0-9.]*)\s*\(",
                                                         masked_statement.lower())}
    if re.search(r"\b(from|union|intersect|except)\b", own) or called & (
            _SET_FUNCTIONS | sets):
        raise definition.refuse(
            "its select may give several rows (SQL takes the first, return (...) raises on a "
            "second): end it with `limit 1`")


def convert(statement: sqlcode.Statement, sets: set[str] | frozenset[str] = frozenset()) -> str:
    """The PL/pgSQL form of a SQL function's definition (``create or replace``), every
    attribute as written; refuses what it cannot convert without changing what it does.
    ``sets``: the names (without schema) of the functions that return sets."""
    d = parse(statement)
    if d.language != "sql":
        raise d.refuse(f"it is {d.language}, not SQL")
    if d.name.startswith("memory."):
        raise d.refuse("it is a public function (sql/90_privileges.sql sets jit = off on "
                       "those outside their definition, which create or replace would drop; "
                       "and its SET clause keeps it from being inlined anyway)")
    for parameter in d.masked[d.args[0] + 1:d.args[1] - 1].lower().split(","):
        if parameter.split()[:1] in (["out"], ["inout"]):
            raise d.refuse("it has out parameters")
    if not re.match(r"\s*returns\b", d.attributes):
        raise d.refuse("it names no result")
    body = d.text[d.body[0]:d.body[1]]
    masked_body = d.masked_body
    semicolons = [i for i, c in enumerate(masked_body) if c == ";"]
    if len(semicolons) > 1 or (semicolons and masked_body[semicolons[0] + 1:].strip()):
        raise d.refuse("its body holds several statements")
    query = body[:semicolons[0] if semicolons else len(body)].rstrip()
    after = body[semicolons[0] + 1:].rstrip() if semicolons else ""  # comments after the ;
    masked_query = masked_body[:len(query)]
    words = masked_query.lower().split()
    if not words or not words[0].startswith(_FIRST_WORDS):
        raise d.refuse("its body is not one query (select, with, values, table)")
    if _WRITES.search(masked_query):
        raise d.refuse("its body writes (or locks rows), which is not one query")
    # The query as written; what ends it goes on a line of its own after a closing comment.
    end = "\n  " if len(masked_query.rstrip()) < len(query) else ""
    if d.returns_set:
        statement_text = f"  return query{query}{end};"
    else:
        _one_value(d, masked_query, set(sets))
        statement_text = f"  return ({query}{end});"
    new_body = f"\n#variable_conflict use_column\nbegin\n{statement_text}{after}\nend\n"
    language = re.search(r"\blanguage\s+sql\b", d.masked[d.args[1]:d.body[0]], re.IGNORECASE)
    assert language is not None
    start, stop = d.args[1] + language.start(), d.args[1] + language.end()
    header = d.text[:start] + "language plpgsql" + d.text[stop:d.body[0]]
    return sqlcode.replacing(header + new_body + d.text[d.body[1]:])


def _relations(statements: list[sqlcode.Statement]) -> set[str]:
    """The tables and views sql/ defines."""
    out = set()
    for s in statements:
        m = re.match(r"create (?:unlogged )?(?:table|view) ([a-z_]+\.[a-z_0-9]+)", s.head)
        if m:
            out.add(m.group(1))
    return out


def cluster_code(files: list[Path] | None = None) -> str:
    """The cluster file's text for the SQL files ``files`` (default: sql/)."""
    stmts = sqlcode.file_statements(files if files is not None else schema.canonical_files())
    code, _ = sqlcode.objects(stmts)
    relations = _relations(stmts)
    sets = {name.rsplit(".", 1)[1] for (kind, name), obj in code.items()
            if kind == "function" and parse(obj.statements[0]).returns_set}
    converted: list[str] = []
    generic: list[str] = []
    for (kind, name), obj in code.items():
        if kind != "function":
            continue
        definition = obj.statements[0]
        d = parse(definition)
        if d.language == "sql" and d.volatility == "immutable":
            read = sorted(n for n in sqlcode.mentioned(
                sqlcode.Statement(d.masked_body, d.source)) if n in relations)
            if read:
                raise d.refuse(f"it is immutable but reads {', '.join(read)}")
        elif d.language == "sql":
            later = [s for s in obj.statements[1:] if s.head.startswith("alter function")]
            if later:
                raise d.refuse(f"{later[0].source} alters it after its definition, which "
                               "create or replace would undo")
            converted.append(f"-- {name} ({d.source})\n{convert(definition, sets)}")
        if name.startswith("memory.") and d.language != "sql":
            generic.append(f"alter function {name} set plan_cache_mode = force_custom_plan;")
    parts = [HEADER, *converted]
    if generic:
        parts.append("-- The API plans its statements for each call on the cluster (docs/scaling.md, "
                     "Routing).\n" + "\n".join(generic))
    return "\n".join(p.rstrip("\n") + "\n" for p in parts)


def write_cluster_code(check: bool = False) -> Path:
    """Writes the cluster file from sql/ (``check``: only compares, raising
    :class:`~pyworker.schema.MigrateError` when the file differs)."""
    path = schema.cluster_code_file()
    wanted = cluster_code()
    current = path.read_text() if path.exists() else None
    if check:
        if current != wanted:
            raise schema.MigrateError(
                f"{path} is not what `pimem cluster-code` writes from sql/: run it")
        return path
    if current != wanted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted)
    return path
