"""query_memories' ranked search (sql/48_search.sql): literal matches first, then the query's
words over the stored document (stemmed English, language-neutral otherwise, CJK bigrams), then
typo and partial-word matches through pg_trgm; every result says how it matched."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.factory import World
from tests.test_recall import ids, make_record, query


@pytest.fixture
def w(conn: psycopg.Connection) -> World:
    """Alice's private chat with a running request "live" that searches."""
    world = World(conn)
    world.basic()
    world.request("ws1", "live", chat="dm-alice", user="alice", status="running")
    return world


def add(conn: psycopg.Connection, w: World, key: str, title: str, summary: str) -> int:
    u, _ = w.conversation("ws1", f"h-{key}", chat="dm-alice", user="alice", user_text=key)
    return make_record(conn, "ws1", f"h-{key}", [u], title=title, summary=summary)


def matched(answer: dict[str, Any]) -> list[tuple[int, str | None]]:
    return [(r["id"], r["match"]) for r in answer["records"]]


def test_literal_matches_come_first_then_ranked_words_then_fuzzy(
        conn: psycopg.Connection, w: World) -> None:
    literal = add(conn, w, "lit", "Deploy", "the file helm chartz.yaml is wrong")
    in_title = add(conn, w, "title", "Helm", "upgrade notes for the cluster")
    in_summary = add(conn, w, "summary", "Deploys", "we use helm for every deploy")
    similar = add(conn, w, "fuzzy", "Reviews", "weekly charts review with bob")
    add(conn, w, "none", "Lunch", "the lunch menu changed")
    answer = query(conn, "ws1", "live", "q1", {"query": "Helm chartz"})
    # The title outweighs the summary (in_summary is newer); the typo finds "charts".
    assert matched(answer) == [(literal, "literal"), (in_title, "words"),
                               (in_summary, "words"), (similar, "fuzzy")]
    # The limit holds across the stages, in the same order.
    assert matched(query(conn, "ws1", "live", "q2", {"query": "Helm chartz", "limit": 2})) == [
        (literal, "literal"), (in_title, "words")]
    # Browsing matches nothing: match is null.
    assert {r["match"] for r in query(conn, "ws1", "live", "q3", {})["records"]} == {None}


def test_a_record_holding_more_of_the_rarer_words_ranks_first(
        conn: psycopg.Connection, w: World) -> None:
    add(conn, w, "a", "Caroline", "Caroline talked about her week and her plans")
    answer_record = add(conn, w, "b", "Weekend", "Caroline researched adoption agencies")
    add(conn, w, "c", "Caroline again", "Caroline said hello")
    answer = query(conn, "ws1", "live", "q1", {"query": "What did Caroline research?"})
    assert matched(answer)[0] == (answer_record, "words")
    assert len(answer["records"]) == 3  # the query's words are OR-ed


def test_english_is_stemmed_and_other_languages_match_as_written(
        conn: psycopg.Connection, w: World) -> None:
    painting = add(conn, w, "en", "Hobby", "Melanie is painting a sunrise over the lake")
    german = add(conn, w, "de", "Umzug", "Wir haben die Wohnung in Berlin gekündigt")
    assert matched(query(conn, "ws1", "live", "q1", {"query": "who paints sunrises?"})) == [
        (painting, "words")]
    assert matched(query(conn, "ws1", "live", "q2", {"query": "Vertrag Wohnung gekündigt"})) == [
        (german, "words")]
    # No German stemmer: an inflected form is not the same word, but it is a similar one.
    assert matched(query(conn, "ws1", "live", "q3", {"query": "Wohnungen"})) == [
        (german, "fuzzy")]


def test_a_chinese_word_of_two_characters_is_found_inside_a_sentence(
        conn: psycopg.Connection, w: World) -> None:
    coffee = add(conn, w, "zh", "饮料", "我喜欢喝咖啡，每天早上一杯")
    add(conn, w, "tea", "饮料", "她每天喝绿茶")
    # PostgreSQL's own parser makes the clause one token: a word search alone would miss it.
    row = conn.execute("select to_tsvector('simple', '我喜欢喝咖啡') @@ '咖啡'::tsquery, "
                       "document @@ '咖啡'::tsquery from memory_private.record_documents "
                       "where record_id = %s", (coffee,)).fetchone()
    assert row == (False, True)
    assert matched(query(conn, "ws1", "live", "q1", {"query": "咖啡"})) == [(coffee, "literal")]
    # Not a substring: found by its character pairs (你喜 喜欢 欢咖 咖啡 啡吗).
    assert matched(query(conn, "ws1", "live", "q2", {"query": "你喜欢咖啡吗"})) == [
        (coffee, "words")]
    assert ids(query(conn, "ws1", "live", "q3", {"query": "牛奶"})) == []


def test_stop_words_alone_find_nothing(conn: psycopg.Connection, w: World) -> None:
    add(conn, w, "a", "Notes", "what is the plan for the day")
    assert ids(query(conn, "ws1", "live", "q1", {"query": "was it the"})) == []


def test_a_query_that_looks_like_tsquery_syntax_is_only_text(
        conn: psycopg.Connection, w: World) -> None:
    rec = add(conn, w, "a", "Odd", "o'brien wrote a\\b & c | d ! e:* (f)")
    for i, q in enumerate(["o'brien", "a\\b & c", "!e:* | (f", "''", "\\", ":*", "&|!()"]):
        answer = query(conn, "ws1", "live", f"q{i}", {"query": q})
        assert set(ids(answer)) <= {rec}, q
    assert matched(query(conn, "ws1", "live", "q9", {"query": "brien"})) == [(rec, "literal")]


def test_ranked_matches_skip_records_that_are_not_valid_now(
        conn: psycopg.Connection, w: World) -> None:
    gone = add(conn, w, "gone", "Helm", "helm notes")
    kept = add(conn, w, "kept", "Deploys", "we use helm")
    w.remove("ws1", "h-gone-u")
    assert matched(query(conn, "ws1", "live", "q1", {"query": "helm chart"})) == [
        (kept, "words")]
    assert gone not in ids(query(conn, "ws1", "live", "q2", {"query": "helmm"}))


def test_pg_trgm_is_installed_and_reached_by_its_schema(conn: psycopg.Connection) -> None:
    row = conn.execute(
        "select n.nspname, memory_private.trgm_word_similarity('kube', 'kubernetes cluster') "
        "from pg_extension e join pg_namespace n on n.oid = e.extnamespace "
        "where e.extname = 'pg_trgm'").fetchone()
    assert row is not None and row[1] == pytest.approx(0.8)
    # Reached by name: a search_path without the extension's schema still finds it.
    conn.execute("set search_path = pg_catalog")
    assert conn.execute("select memory_private.trgm_word_similarity('kube', 'kube')"
                        ).fetchone() == (1.0,)


def test_a_long_query_searches_its_first_32_words(conn: psycopg.Connection, w: World) -> None:
    early = add(conn, w, "early", "Alpha", "the word alpha")
    late = add(conn, w, "late", "Omega", "the word omega")
    words = ["alpha"] + [f"filler{i}" for i in range(40)] + ["omega"]
    terms = conn.execute("select count(*) from memory_private.query_words(%s)",
                         (" ".join(words),)).fetchone()
    assert terms == (32,)
    assert matched(query(conn, "ws1", "live", "q1", {"query": " ".join(words)})) == [
        (early, "words")]
    assert late in ids(query(conn, "ws1", "live", "q2", {"query": "omega"}))


def test_a_literal_match_lies_in_the_title_or_in_the_summary_never_across_them(
        conn: psycopg.Connection, w: World) -> None:
    # search_text folds the title, a newline and the summary into one text: a query holding a
    # newline may be found there across the two, and that is no literal match.
    across = add(conn, w, "across", "Zephyr alpha", "beta and more")
    inside = add(conn, w, "inside", "Notes", "zephyr alpha\nbeta and more")
    found = matched(query(conn, "ws1", "live", "q1", {"query": "Zephyr alpha\nbeta"}))
    assert (inside, "literal") in found and (across, "literal") not in found, found
    assert matched(query(conn, "ws1", "live", "q2", {"query": "ALPHA"}))[:2] == [
        (inside, "literal"), (across, "literal")]


# Bounded work (issue 31): a member who fills a scope with notes of words sharing one prefix,
# then asks for many such words, gets an answer from a bounded number of comparisons.

def policy(conn: psycopg.Connection, name: str) -> int:
    row = conn.execute(f"select (memory_private.policy()).{name}").fetchone()
    assert row is not None
    return int(row[0])


def test_fuzzy_search_compares_the_query_s_first_eight_words(
        conn: psycopg.Connection, w: World) -> None:
    cap = policy(conn, "fuzzy_words")
    assert cap == 8
    words = ["kestrel", "marigold", "tundra", "obelisk", "saffron", "quarry", "lantern",
             "velvet", "harbor", "juniper", "cobalt", "meadow", "pixel", "walrus", "fjord",
             "gazebo", "nectar", "orchid", "zephyr", "biscuit"]
    row = conn.execute("select memory_private.fuzzy_words(%s), "
                       "array(select memory_private.word_stem(x) from unnest(%s::text[]) x)",
                       (" ".join(words + words), words[:cap])).fetchone()
    assert row is not None and row[0] == row[1]  # stemmed as the vocabulary is: quarry, quarri
    # A typo of the ninth distinct word is not looked for; of the eighth, it is.
    eighth = add(conn, w, "eighth", "Eighth", f"the word {words[7]}q")
    ninth = add(conn, w, "ninth", "Ninth", f"the word {words[8]}q")
    found = ids(query(conn, "ws1", "live", "q1", {"query": " ".join(words)}))
    assert eighth in found and ninth not in found


def scope_words(conn: psycopg.Connection, w: World, n_records: int, per_record: int) -> list[str]:
    """Records whose words all start with "zor", none a query word: the hostile scope."""
    words = [f"zor{i:05d}" for i in range(n_records * per_record)]
    for r in range(n_records):
        add(conn, w, f"n{r}", "Notes", " ".join(words[r * per_record:(r + 1) * per_record]))
    return words


def test_each_fuzzy_word_is_compared_with_a_bounded_number_of_the_scope_s_words(
        conn: psycopg.Connection, w: World) -> None:
    words = scope_words(conn, w, 6, 100)  # 600 words of one prefix
    near = policy(conn, "fuzzy_neighbours")
    scope = conn.execute("select scope_id from memory.resolve_scope('ws1', 'live')").fetchone()
    assert scope is not None
    query_words = [f"zor{i:05d}x" for i in range(0, 600, 75)]  # 8 words, none held exactly
    rows = conn.execute(
        "select query_word, word from memory_private.fuzzy_candidates('ws1', %s, %s)",
        (scope[0], query_words)).fetchall()
    by_word: dict[str, list[str]] = {}
    for q, word in rows:
        by_word.setdefault(q, []).append(word)
    assert set(by_word) == set(query_words)
    for q, compared in by_word.items():
        # The nearest words in byte order on each side, not the scope's 600.
        ordered = sorted({*words, *(w.lower() for w in words)})
        before = [x for x in ordered if x < q][-near:]
        after = [x for x in ordered if x >= q][:near]
        assert sorted(compared) == sorted(before + after), q
        assert len(compared) <= 2 * near


def test_a_typo_is_still_found_among_many_words_of_its_prefix(
        conn: psycopg.Connection, w: World) -> None:
    scope_words(conn, w, 4, 150)
    target = add(conn, w, "target", "Zoology", "she studies zoroastrianism at night")
    answer = query(conn, "ws1", "live", "q1", {"query": "zoroastrianizm"})
    assert matched(answer)[0] == (target, "fuzzy")


@pytest.mark.no_citus("a one-server plan: on Citus the SQL helpers are PL/pgSQL, not inlined")
def test_the_fuzzy_stage_reads_the_scope_s_words_through_their_key(
        conn: psycopg.Connection, w: World) -> None:
    scope_words(conn, w, 2, 50)
    conn.execute("analyze memory_private.scope_words")
    scope = conn.execute("select scope_id from memory.resolve_scope('ws1', 'live')").fetchone()
    assert scope is not None
    plan = "\n".join(r[0] for r in conn.execute(
        "explain (costs off) select * from memory_private.fuzzy_candidates('ws1', %s, %s)",
        (scope[0], ["zor00010x", "zor00070x"])).fetchall())
    assert plan.count("scope_words_pkey") == 2, plan
    assert "Limit" in plan and "Seq Scan" not in plan, plan
