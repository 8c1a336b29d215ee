-- 0002_query_speed: query_memories reads less (issue 13's search target, docs/benchmarks.md).
-- - Extended statistics: a scope belongs to one workspace, so the planner no longer takes a scope
--   for about one record and reads a whole scope to find a few records by id.
-- - The lines a search finds are found for all shown records in one pass (matching_lines in set
--   form) and shown_sources is one planned statement; query_memories writes its tool_calls row
--   once, at the end.

create statistics memory_private.records_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.records;
comment on statistics memory_private.records_scope_stats is
  'scope_id depends on workspace_id: keeps plans on the primary key when records are asked by id.';
create statistics memory_private.record_documents_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.record_documents;
comment on statistics memory_private.record_documents_scope_stats is
  'scope_id depends on workspace_id (as memory_private.records_scope_stats).';
analyze memory_private.records, memory_private.record_documents;

drop function memory_private.matching_lines(text, bigint, text, text, tsquery[]);

create function memory_private.matching_lines(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_terms tsquery[]
) returns table (record_id bigint, line_no integer)
  language sql stable
  as $$
  -- The lines (from 1) of the records' summaries that a query finds: it is part of the line
  -- (case-folded), or one of its words is (p_terms, memory_private.search_terms of the query,
  -- against the line's stored document in record_lines: as written or English-stemmed, CJK
  -- bigrams). One pass over the records' summaries and one over their line documents.
  select r.record_id, l.n::integer
    from memory_private.records r
   cross join lateral regexp_split_to_table(r.summary, e'\n') with ordinality as l(line, n)
   where p_query is not null
     and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and strpos(r.search_text, lower(p_query)) > 0  -- only summaries holding it are split
     and strpos(lower(l.line), lower(p_query)) > 0
  union
  select d.record_id, d.line_no
    from memory_private.record_lines d
   where p_query is not null
     and d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
     and d.document @@ any(p_terms)
$$;
comment on function memory_private.matching_lines(text, bigint[], text, tsquery[]) is
  'The summary lines (record, line number) a query_memories search finds among the given '
  'records: literal, or by one of its words given as p_terms, read from the lines'' stored '
  'documents (record_lines).';

create or replace function memory_private.shown_sources(
  p_workspace_id text, p_record_ids bigint[], p_query text
) returns table (record_id bigint, source_ids text[], total integer)
  language plpgsql stable
  as $$
declare
  v_terms tsquery[];
begin
  -- Each record's sources in the order its summary uses them; for a search, those cited by the
  -- lines the query finds (literally, or by one of its words) come first. The first
  -- shown_sources of them are shown (R5). One statement for all the records, its plan kept
  -- for the session (plpgsql); a record without sources has no row.
  if p_query is not null then
    v_terms := memory_private.search_terms(p_query);
  end if;
  return query
    with found as materialized (
      select f.record_id, f.line_no
        from memory_private.matching_lines(p_workspace_id, p_record_ids, p_query, v_terms) f
    ), first_line as materialized (
      select ls.record_id, ls.message_id, min(ls.line_no) as line_no
        from found f
       cross join lateral (
         select x.record_id, x.message_id, x.line_no
           from memory_private.record_line_sources x
          where x.workspace_id = p_workspace_id and x.record_id = f.record_id and x.line_no = f.line_no
         offset 0) ls  -- a lookup per line found, not a pass over the workspace's lines
       group by ls.record_id, ls.message_id
    )
    select rs.record_id,
           (array_agg(rs.message_id order by h.line_no nulls last, rs.position))
             [1:(memory_private.policy()).shown_sources],
           count(*)::integer
      from memory_private.record_sources rs
      left join first_line h on h.record_id = rs.record_id and h.message_id = rs.message_id
     where rs.workspace_id = p_workspace_id and rs.record_id = any(p_record_ids)
     group by rs.record_id;
end
$$;
comment on function memory_private.shown_sources(text, bigint[], text) is
  'The source ids query_memories shows of each record (at most policy shown_sources), in the '
  'order the summary uses them, the sources of the lines a search query finds first '
  '(memory_private.matching_lines), and how many sources the record has.';

create or replace function memory.query_memories(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_args jsonb
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_query text;
  v_id bigint;
  v_limit integer;
  v_call memory_private.tool_calls;
  v_start record;
  v_first boolean;
  v_ids bigint[];
  v_records jsonb;
  v_matches jsonb := '{}';
  v_shown text[];
  v_now timestamptz := memory_private.clock_now();
begin
  v_start := memory_private.begin_tool_call(p_workspace_id, p_request_id, p_tool_call_id,
                                        'query_memories', p_args,
                                        array['query', 'id', 'limit']);
  v_request := v_start.request;
  v_scope := v_start.scope;
  v_call := v_start.previous;
  v_query := nullif(btrim(memory_private.arg_text(p_args, 'query',
                                                  (memory_private.policy()).query_bytes)), '');
  v_id := memory_private.arg_integer(p_args, 'id', 1, 9223372036854775807);
  v_limit := coalesce(memory_private.arg_integer(p_args, 'limit', 1,
                                                 (memory_private.policy()).query_limit),
                      (memory_private.policy()).query_limit);
  v_first := v_call.tool_call_id is null;

  if not v_scope.recall_enabled then
    -- Kept so that a replay is recognised (and counts nothing).
    if v_first then
      insert into memory_private.tool_calls
        (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, created_at,
         updated_at)
      values (p_workspace_id, p_request_id, p_tool_call_id, 'query_memories', v_scope.scope_id,
              memory_private.args_hash(p_args), v_now, v_now);
    end if;
    return jsonb_build_object('mode', 'disabled', 'records', '[]'::jsonb, 'count', 0,
                              'replayed', not v_first,
                              'note', 'Memory is turned off in this chat; nothing is read.');
  end if;

  select q.ids, q.matches into v_ids, v_matches
    from memory_private.query_records(p_workspace_id, v_scope.scope_id, v_limit,
                                      v_request.user_id, v_query, v_id) q;

  -- The shown records with their sources (R5): what the call shows makes the citations it
  -- authorizes (R6, memory.request_citations).
  with shown as materialized (
    select * from memory_private.shown_sources(p_workspace_id, v_ids, v_query)
  )
  select coalesce(jsonb_agg(memory_private.record_detail(r,
                    to_jsonb(coalesce(d.source_ids, '{}')), coalesce(d.total, 0))
                    || jsonb_build_object('match', v_matches ->> f.record_id::text)
                  order by f.pos), '[]'::jsonb),
         (select coalesce(array_agg(distinct x), '{}') from shown, unnest(shown.source_ids) x)
    into v_records, v_shown
    from unnest(v_ids) with ordinality as f(record_id, pos)
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = f.record_id
    left join shown d on d.record_id = f.record_id;

  -- What the call returned (the answer's provenance, T2, T3, and its citations, R6), kept with
  -- the tool call (one write: the workspace's memory lock, taken by begin_tool_call, keeps a
  -- concurrent call with the same id out); a replay adds what it returned.
  if v_first then
    insert into memory_private.tool_calls
      (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, record_ids, source_ids,
       created_at, updated_at)
    values (p_workspace_id, p_request_id, p_tool_call_id, 'query_memories', v_scope.scope_id,
            memory_private.args_hash(p_args),
            array(select distinct x from unnest(v_ids) x order by 1),
            array(select distinct x from unnest(v_shown) x order by 1), v_now, v_now);
  else
    update memory_private.tool_calls
       set record_ids = array(select distinct x from unnest(record_ids || v_ids) x order by 1),
           source_ids = array(select distinct x from unnest(source_ids || v_shown) x order by 1),
           updated_at = v_now
     where workspace_id = p_workspace_id and request_id = p_request_id
       and tool_call_id = p_tool_call_id;
  end if;
  -- Usage once per tool call id (R7): a replay re-reads current state but counts nothing.
  if v_first then
    update memory_private.records
       set last_used_at = v_now, usage_count = usage_count + 1
     where workspace_id = p_workspace_id and record_id = any(v_ids);
  end if;

  return jsonb_build_object(
           'mode', case when v_query is not null then 'search'
                        when v_id is not null then 'id' else 'browse' end,
           'label', memory_private.recall_label(v_scope.kind),
           'scope', v_scope.kind,
           'records', v_records,
           'count', cardinality(v_ids),
           'replayed', not v_first);
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
  as $$ select 2 $$;
comment on function memory.schema_version() is
  'The schema version of this database: the number of the last migration applied (0001 = 1). '
  'pimem migrate fails when it differs from the version the package expects.';

