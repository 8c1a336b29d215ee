-- 0004_answer_once: query_memories does less work per call, with the same answers
-- (docs/benchmarks.md, "The session of 2026-12-01, sixth").
-- - The answer is made into JSON once: record_detail makes a row of memory_private.record_answer,
--   the answer is a memory_private.query_answer row holding them, and to_jsonb turns the whole
--   into JSON at the end (jsonb per record, then per list, then per answer was read again, token
--   by token, at each step).
-- - Usage is counted with an update of the rows made with the records
--   (memory_private.count_usage), not an upsert, which locked each row before updating it (a WAL
--   record more per row).
-- - The lines a search finds are searched in each summary folded whole, once
--   (memory_private.matching_lines), not line by line.
-- - The literal search's folding has one home, memory_private.fold: lower() as before, computed
--   byte by byte for ASCII text where that gives the same result. What record_texts holds is
--   unchanged, so nothing is rewritten.


create function memory_private.fold(p_text text) returns text
  language sql immutable parallel safe
  as $$
  -- The literal search's case folding: lower() in the database's collation, the same wherever
  -- text and query are folded (record_texts, the query, the lines a search finds). Inlined. A
  -- text of ASCII characters only (as many bytes as characters, in a UTF-8 database), where
  -- the collation folds the 26 capitals to the 26 small letters (any but a Turkish or Azeri
  -- one), is folded byte by byte (lower() in the "C" collation): the same result, without
  -- turning every character into a wide character and back (docs/benchmarks.md). The tests of
  -- the database's encoding and collation are constants, folded when a statement is planned.
  select case when octet_length(p_text) = char_length(p_text)
               and char_length('é') = 1 and octet_length('é') = 2
               and lower('ABCDEFGHIJKLMNOPQRSTUVWXYZ') = 'abcdefghijklmnopqrstuvwxyz'
              then lower(p_text collate "C") else lower(p_text) end
$$;
comment on function memory_private.fold(text) is
  'The case folding of the literal search: lower(p_text) in the database''s collation '
  '(computed byte by byte for ASCII text in a UTF-8 database where that gives the same).';

comment on table memory_private.record_texts is
  'Each record''s title and summary case-folded at write time (search_text: the folded title, '
  'a newline, the folded summary: memory_private.fold) and the three-character runs of both '
  '(grams: memory_private.text_grams of each, OR-ed), with its scope and date, written by a '
  'trigger on records (memory_private.index_record): what query_memories'' literal search reads. '
  'It scans the scope''s grams newest first in the index alone and reads the folded text only of '
  'the records holding every run of the query. Kept apart from records so that nothing wide is '
  'read and nothing is folded at search time.';

create or replace function memory_private.within_a_part(p_title text, p_summary text, p_query text)
  returns boolean
  language sql immutable parallel safe
  as $$
  -- Inlined (no SET clause). A folded query found in search_text (the folded title, a newline,
  -- the folded summary) is a literal match only within one part: a query holding a newline may
  -- have matched across the title's end, so it is looked for in each part apart.
  select strpos(p_query, e'\n') = 0
      or strpos(memory_private.fold(p_title), p_query) > 0
      or strpos(memory_private.fold(p_summary), p_query) > 0
$$;
comment on function memory_private.within_a_part(text, text, text) is
  'Whether a folded query that search_text holds is a literal match of the record: it holds no '
  'newline, or the folded title or the folded summary holds it (a match across the title''s end '
  'is none). The literal search''s re-check (recent_valid_records).';

create or replace function memory_private.recent_valid_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text default null,
  p_query text default null, p_record_id bigint default null
) returns bigint[]
  language plpgsql stable
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_size integer := p_limit;
  v_offset integer := 0;
  v_query text := memory_private.fold(p_query);
  v_grams bit(1024) := memory_private.text_grams(memory_private.fold(p_query));
begin
  -- Newest first, a page at a time (limit, then four times more), each page validated as
  -- one set: a scope whose newest records are valid costs one short index scan and one
  -- validation, never a read of the whole scope. One snapshot throughout (stable).
  loop
    if v_query is null then
      v_chunk := array(
        select r.record_id from memory_private.records r
         where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
           and (p_record_id is null or r.record_id = p_record_id)
         order by r.created_at desc, r.record_id desc
         limit v_size offset v_offset);
    elsif char_length(v_query) < 3 then
      -- Too short for a three-character run (a two-character Chinese word): every folded text
      -- of the scope newest first, narrow rows, rather than every record itself.
      v_chunk := array(
        select t.record_id from memory_private.record_texts t
         where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
           and (p_record_id is null or t.record_id = p_record_id)
           and strpos(t.search_text, v_query) > 0
           and (strpos(v_query, e'\n') = 0
                or exists (select 1 from memory_private.records r
                            where r.workspace_id = t.workspace_id and r.record_id = t.record_id
                              and memory_private.within_a_part(r.title, r.summary, v_query)))
         order by t.created_at desc, t.record_id desc
         limit v_size offset v_offset);
    else
      -- The scope's grams newest first from the index alone; then, of the records holding
      -- every three-character run of the query, the record itself (its pages are read for
      -- validation and the answer anyway): the query as typed in its title or summary is a
      -- match with nothing folded; otherwise the folded text decides (search_text: the folded
      -- title, a newline and the folded summary; a query holding a newline is re-checked on
      -- each apart, memory_private.within_a_part: one spanning the title's end is no match).
      v_chunk := array(
        select g.record_id
          from (select g.record_id, g.created_at from memory_private.record_texts g
                 where g.workspace_id = p_workspace_id and g.scope_id = p_scope_id
                   and (p_record_id is null or g.record_id = p_record_id)
                   and g.grams & v_grams = v_grams
                 order by g.created_at desc, g.record_id desc
                 offset 0) g  -- kept apart: PostgreSQL 18 would merge it into a full read
          join memory_private.records r
            on r.workspace_id = p_workspace_id and r.record_id = g.record_id
         where strpos(r.title, v_query) > 0 or strpos(r.summary, v_query) > 0
            or exists (select 1 from memory_private.record_texts t
                        where t.workspace_id = r.workspace_id and t.record_id = r.record_id
                          and strpos(t.search_text, v_query) > 0
                          and memory_private.within_a_part(r.title, r.summary, v_query))
         order by g.created_at desc, g.record_id desc
         limit v_size offset v_offset);
    end if;
    v_valid := v_valid || memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_chunk, p_limit - cardinality(v_valid),
                 p_requester);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid;
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Validated set-wise a page at a time.';

create or replace function memory_private.index_records(
  p_workspace_id text, p_record_ids bigint[], p_lines boolean
) returns void
  language sql volatile
  as $$
  -- What the searches read of the given records, derived from their title and summary: the
  -- word search's document, the literal search's folded text and, with p_lines, the documents
  -- of the summary's lines.
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
  delete from memory_private.record_lines
   where p_lines and workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_lines (workspace_id, record_id, line_no, document)
  select r.workspace_id, r.record_id, l.line_no, memory_private.text_document(l.line)
    from memory_private.records r
   cross join lateral memory_private.summary_lines(r.summary) l
   where p_lines and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids);
$$;
comment on function memory_private.index_records(text, bigint[], boolean) is
  'Writes what the searches read of the given records: their documents (record_documents), '
  'their folded texts and three-character runs (record_texts) and, with p_lines, their lines'' '
  'documents (record_lines). The records trigger calls it for one record; a bulk load with '
  'triggers off calls it for all it loaded.';

drop function memory_private.record_detail(memory_private.records, jsonb, bigint, timestamptz,
                                           text);

create type memory_private.record_answer as (
  -- A record as query_memories returns it, field by field (R5). The answer is a row
  -- (memory_private.query_answer) holding these rows, turned into JSON once at the end: jsonb
  -- built per record, then for the list, then for the answer would be read again, token by
  -- token, at each step (docs/benchmarks.md).
  id bigint, kind text, title text, summary text, speaker_ids text[], thread_ids text[],
  source_ids text[], source_count bigint, sources_overflow bigint, created_at timestamptz,
  last_used_at timestamptz, match text
);
comment on type memory_private.record_answer is
  'The fields of one query_memories result, in the order they are named (R5): '
  'memory_private.record_detail makes it.';

create type memory_private.query_answer as (
  mode text, label text, scope text, records memory_private.record_answer[], count integer,
  replayed boolean
);
comment on type memory_private.query_answer is
  'A query_memories answer (mode, label, scope, records, count, replayed), made into JSON '
  'with to_jsonb once.';

create function memory_private.record_detail(
  p_record memory_private.records, p_source_ids text[], p_source_count bigint,
  p_last_used_at timestamptz, p_match text
) returns memory_private.record_answer
  language sql stable
  -- One expression, so that it is inlined into query_memories' statement.
  as $$
  select row(p_record.record_id, p_record.kind, p_record.title, p_record.summary,
             p_record.speaker_ids, p_record.thread_ids, p_source_ids, p_source_count,
             greatest(p_source_count - (memory_private.policy()).shown_sources, 0),
             p_record.created_at, p_last_used_at, p_match)::memory_private.record_answer
$$;
comment on function memory_private.record_detail(memory_private.records, text[], bigint,
                                                  timestamptz, text) is
  'A record as query_memories returns it: title, summary, speakers, threads, the first 20 '
  'source ids, how many sources there are and how many were not shown, dates (R5), and how it '
  'matched (literal, words, fuzzy; null when browsing). '
  'query_memories ranks the sources of all shown records in one pass and passes them in, with '
  'the record''s last use before the call (memory_private.record_usage).';

create function memory_private.count_usage(
  p_workspace_id text, p_record_ids bigint[], p_now timestamptz
) returns void
  language plpgsql volatile
  as $$
declare
  v_counted bigint;
begin
  -- One use of each record (R7): an update of the usage rows made with the records (an upsert
  -- would lock each row before updating it: a WAL record more per row). A row someone removed
  -- is made again, used once.
  update memory_private.record_usage u
     set last_used_at = p_now, usage_count = u.usage_count + 1
   where u.workspace_id = p_workspace_id and u.record_id = any(p_record_ids);
  get diagnostics v_counted = row_count;
  if v_counted < cardinality(p_record_ids) then
    insert into memory_private.record_usage as u (workspace_id, record_id, last_used_at,
                                                  usage_count)
    select p_workspace_id, x, p_now, 1 from unnest(p_record_ids) x
     where not exists (select 1 from memory_private.record_usage e
                        where e.workspace_id = p_workspace_id and e.record_id = x)
    on conflict (workspace_id, record_id)
      do update set last_used_at = excluded.last_used_at, usage_count = u.usage_count + 1;
  end if;
end
$$;
comment on function memory_private.count_usage(text, bigint[], timestamptz) is
  'Counts one use of each given record at p_now (record_usage: usage_count + 1, last_used_at): '
  'query_memories calls it once per tool call id (R7). The given ids are distinct records.';

create or replace function memory_private.matching_lines(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_word_ids bigint[],
  p_terms tsquery[]
) returns table (record_id bigint, line_no integer, line text)
  language sql stable
  as $$
  -- The lines (from 1) of the records' summaries that a query finds, with their text: the query
  -- is part of the line (case-folded), or, in the records found by their words (p_word_ids), the
  -- line holds one of the words (p_terms, memory_private.search_terms of the query, against the
  -- line's stored document in record_lines: as written or English-stemmed, CJK bigrams). One
  -- pass over the lines of the summaries themselves (the records a call shows, in pages it has
  -- just read). Each summary is folded whole, once, and its folded lines are searched: folding
  -- maps characters and never makes or removes a newline, so folded line n is line n (folding
  -- line by line costs a call per line). A found line's text is cut from the summary as written.
  select r.record_id, l.line_no, split_part(r.summary, e'\n', l.line_no)
    from memory_private.records r
   cross join lateral memory_private.summary_lines(memory_private.fold(r.summary)) l
   where p_query is not null
     and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and (strpos(l.line, (select memory_private.fold(p_query))) > 0  -- the query folded once
          -- not correlated: one index read of the word-found records' lines, then a hash
          -- probe per line (a correlated EXISTS may be hashed over every line of the table)
          or (r.record_id, l.line_no) in (
               select d.record_id, d.line_no
                 from memory_private.record_lines d
                where d.workspace_id = p_workspace_id and d.record_id = any(p_word_ids)
                  and d.document @@ any(p_terms)))
$$;
comment on function memory_private.matching_lines(text, bigint[], text, bigint[], tsquery[]) is
  'The summary lines (record, line number, text) a query_memories search finds among the given '
  'records: those holding the query (case-insensitive), and in the records found by their words '
  '(p_word_ids) those holding one of the words given as p_terms, read from the lines'' stored '
  'documents (record_lines).';

create or replace function memory.query_memories(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_args jsonb
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  -- One plan per statement for the session (re-planning cost ms: docs/benchmarks.md).
  set plan_cache_mode = force_generic_plan
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_query text;
  v_id bigint;
  v_limit integer;
  v_start record;
  v_first boolean;
  v_ids bigint[] := '{}';
  v_records memory_private.record_answer[];
  v_matches jsonb := '{}';
  v_shown text[];
  v_now timestamptz := memory_private.clock_now();
begin
  v_start := memory_private.begin_tool_call(p_workspace_id, p_request_id, p_tool_call_id,
                                        'query_memories', p_args,
                                        array['query', 'id', 'limit']);
  v_request := v_start.request;
  v_scope := v_start.scope;
  v_query := nullif(btrim(memory_private.arg_text(p_args, 'query',
                                                  (memory_private.policy()).query_bytes)), '');
  v_id := memory_private.arg_integer(p_args, 'id', 1, 9223372036854775807);
  v_limit := coalesce(memory_private.arg_integer(p_args, 'limit', 1,
                                                 (memory_private.policy()).query_limit),
                      (memory_private.policy()).query_limit);
  v_first := (v_start.previous).tool_call_id is null;

  -- Recall turned off in the scope: nothing is read (C8); the call is still kept, so that a
  -- replay is recognised.
  if v_scope.recall_enabled then
    select q.ids, q.matches into v_ids, v_matches
      from memory_private.query_records(p_workspace_id, v_scope.scope_id, v_limit,
                                        v_request.user_id, v_query, v_id) q;
  end if;

  -- The shown records with their sources (R5): what the call shows makes the citations it
  -- authorizes (R6, memory.request_citations).
  with shown as materialized (
    select * from memory_private.shown_sources(p_workspace_id, v_ids, v_query, v_matches)
  )
  select coalesce(array_agg(memory_private.record_detail(r,
                    coalesce(d.source_ids, '{}'), coalesce(d.total, 0), u.last_used_at,
                    v_matches ->> f.record_id::text)
                  order by f.pos), '{}'),
         (select coalesce(array_agg(distinct x), '{}') from shown, unnest(shown.source_ids) x)
    into v_records, v_shown
    from unnest(v_ids) with ordinality as f(record_id, pos)
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = f.record_id
    left join memory_private.record_usage u
      on u.workspace_id = p_workspace_id and u.record_id = f.record_id
    left join shown d on d.record_id = f.record_id;

  -- What the call returned (the answer's provenance, T2, T3, and its citations, R6), kept with
  -- the tool call (one write: the workspace's memory lock, taken by begin_tool_call, keeps a
  -- concurrent call with the same id out); a replay adds what it returned.
  insert into memory_private.tool_calls as c
    (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, record_ids, source_ids,
     created_at, updated_at)
  values (p_workspace_id, p_request_id, p_tool_call_id, 'query_memories', v_scope.scope_id,
          memory_private.args_hash(p_args), array(select distinct x from unnest(v_ids) x order by 1),
          array(select distinct x from unnest(v_shown) x order by 1), v_now, v_now)
  on conflict (workspace_id, request_id, tool_call_id) do update
    set record_ids = array(select distinct x from unnest(c.record_ids || v_ids) x order by 1),
        source_ids = array(select distinct x from unnest(c.source_ids || v_shown) x order by 1),
        updated_at = v_now;
  -- Usage once per tool call id (R7; a replay counts nothing).
  if v_first then
    perform memory_private.count_usage(p_workspace_id, v_ids, v_now);
  end if;

  if not v_scope.recall_enabled then
    return jsonb_build_object('mode', 'disabled', 'records', '[]'::jsonb, 'count', 0,
                              'replayed', not v_first,
                              'note', 'Memory is turned off in this chat; nothing is read.');
  end if;
  return to_jsonb(row(case when v_query is not null then 'search'
                          when v_id is not null then 'id' else 'browse' end,
                     memory_private.recall_label(v_scope.kind), v_scope.kind, v_records,
                     cardinality(v_ids), not v_first)::memory_private.query_answer);
end
$$;
comment on function memory.query_memories(text, text, text, jsonb) is
  'The query_memories tool: args {query?, id?, limit?} (validated here, MB001). Browses newest '
  'first, or searches the records of the request''s scope that are valid now: literal, '
  'case-insensitive matches of the query in title or summary first, then ranked matches of its '
  'words, then typo and partial-word matches (memory_private.search_records); at most limit '
  '(1..12, default 12). Each result has title, summary, speaker ids, thread ids, up to 20 source '
  'ids (the messages its summary cites, in the order it uses them), the source count and '
  'overflow, dates, and match: how it matched (literal, words, fuzzy; null when browsing) (R4, '
  'R5). The source ids join the request''s citation set (R6); the returned records are the '
  'request''s provenance (T2). Usage is counted once per tool call id; a replay re-reads '
  'current state (R7, C9). MB003 when the id was used with other arguments; MB005 for a '
  'scheduled request.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 4 $$;
