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
   cross join lateral memory_private.summary_lines(lower(r.summary)) l
   where p_query is not null
     and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and (strpos(l.line, (select lower(p_query))) > 0  -- the query folded once
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
