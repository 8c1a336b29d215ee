-- 0006_line_sources: a search reads the citations of the lines it found from the record
-- instead of out of the text (docs/benchmarks.md, "The session of 2026-12-01, eighth").
-- - records.line_sources: for each line of the summary, the source ids it cites, a generated
--   column (memory_private.line_sources of summary and source_ids), so PostgreSQL derives it
--   whenever either is written and nothing else can write it. Adding it rewrites records once.
-- - memory_private.answer_records reads it for the lines memory_private.found_lines found,
--   instead of running the citation rule (memory_private.cited_ids) on each of them per call;
--   found_lines gives the lines' numbers only (re-created: its result changed).

create function memory_private.line_sources(p_summary text, p_ids text[]) returns text[]
  language sql immutable parallel safe
  as $$
  -- One element per line of the summary, from line 1: the ids of p_ids the line cites
  -- (memory_private.cited_ids), joined by a space (a cited id holds none), '' for a line that
  -- cites nothing; no element at all when there is nothing to cite (no p_ids: a record before
  -- its sources are written). A line without a bracket cites nothing: the rule is not run on it.
  select case when cardinality(p_ids) = 0 then '{}'::text[]
              else coalesce(array_agg(case when strpos(l.line, '[') = 0 then ''
                                           else coalesce((select string_agg(c.id, ' ')
                                                            from memory_private.cited_ids(
                                                                   l.line, p_ids) as c(id)),
                                                         '') end
                                      order by l.line_no), '{}') end
    from memory_private.summary_lines(p_summary) l
$$;
comment on function memory_private.line_sources(text, text[]) is
  'Each line''s citations of a summary (memory_private.cited_ids against p_ids), one element '
  'per line from line 1, the ids joined by a space (empty when p_ids is): records.line_sources, '
  'what a search reads to show first the sources of the lines it found.';

alter table memory_private.records
  add column line_sources text[] not null
    generated always as (memory_private.line_sources(summary, source_ids)) stored;
comment on column memory_private.records.line_sources is
  'For each line of the summary (from line 1), the source ids it cites, joined by a space '
  '(memory_private.line_sources of summary and source_ids: generated, never written): a search '
  'shows first the sources of the lines it found (memory_private.answer_records).';

-- found_lines gives the numbers alone: the lines' text was read only for the citation rule.
drop function memory_private.found_lines(text, bigint, text, text, tsquery[]);
create function memory_private.found_lines(
  p_workspace_id text, p_record_id bigint, p_summary text, p_folded_query text,
  p_terms tsquery[]
) returns table (line_no integer)
  language sql stable
  as $$
  -- Inlined (no SET clause), for one record at a time. The numbers (from 1) of the lines of
  -- the record's summary a search finds (their citations are the record's line_sources): the
  -- folded query is part of the folded line, or (p_terms: the record was found by its words) the line holds one of the words
  -- (memory_private.search_terms of the query, against the line's stored document in
  -- record_lines: as written or English-stemmed, CJK bigrams). The summary is folded whole,
  -- once: folding maps characters and never makes or removes a newline, so folded line n is
  -- line n (folding line by line costs a call per line). The lines holding a word are read
  -- once, as an array, only when there are words.
  select l.line_no
    from memory_private.summary_lines(memory_private.fold(p_summary)) l
   cross join (select case when p_terms is not null
                           then array(select d.line_no from memory_private.record_lines d
                                       where d.workspace_id = p_workspace_id
                                         and d.record_id = p_record_id
                                         and d.document @@ any(p_terms)) end as ids) w
   where strpos(l.line, p_folded_query) > 0 or l.line_no = any(w.ids)
$$;
comment on function memory_private.found_lines(text, bigint, text, text, tsquery[]) is
  'The numbers of the lines of one record''s summary a query_memories search finds: '
  'those holding the folded query (memory_private.fold), and, when p_terms are given (the '
  'record was found by its words), those holding one of them, read from the lines'' stored '
  'documents (record_lines).';

create or replace function memory_private.answer_records(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_matches text[] default null
) returns memory_private.record_answer[]
  language plpgsql stable
  as $$
declare
  v_folded text := memory_private.fold(p_query);
  v_terms tsquery[];
begin
  -- The given records, in their order, as query_memories returns them (R5): each with its
  -- sources in the order its summary uses them, those cited on the lines a search finds first
  -- (memory_private.found_lines; a line's citations are the record's line_sources, derived
  -- from its summary by memory_private.cited_ids when it was written), the first shown_sources
  -- of them; how it matched (p_matches, at the records' positions: literal, words, fuzzy); its
  -- last use before the call. The words are looked for only in the records found by them. One
  -- statement, each record read once; its plan kept for the session (plpgsql).
  if p_query is not null and ('words' = any(p_matches) or 'fuzzy' = any(p_matches)) then
    v_terms := memory_private.search_terms(p_query);
  end if;
  return array(
    select memory_private.record_detail(r, coalesce(src.ids, '{}'), src.total, u.last_used_at,
                                        p_matches[f.pos])
      from unnest(p_record_ids) with ordinality as f(record_id, pos)
      join memory_private.records r
        on r.workspace_id = p_workspace_id and r.record_id = f.record_id
      left join memory_private.record_usage u
        on u.workspace_id = p_workspace_id and u.record_id = f.record_id
     cross join lateral (
       -- the record's copy of its sources, in order (memory_private.copy_dependencies)
       select (array_agg(s.message_id order by h.line_no nulls last, s.position))
                [1:(memory_private.policy()).shown_sources] as ids,
              count(*) as total
         from unnest(r.source_ids) with ordinality as s(message_id, position)
         left join (select c.id, min(l.line_no) as line_no
                      from memory_private.found_lines(
                             p_workspace_id, r.record_id, r.summary, v_folded,
                             case when p_matches[f.pos] <> 'literal' then v_terms end) l
                     cross join lateral unnest(string_to_array(r.line_sources[l.line_no], ' '))
                                          as c(id)
                     where v_folded is not null
                     group by c.id) h on h.id = s.message_id) src
     order by f.pos);
end
$$;
comment on function memory_private.answer_records(text, bigint[], text, text[]) is
  'The records a query_memories call shows, in the given order, as it shows them '
  '(memory_private.record_detail): the source ids (at most policy shown_sources) in the order '
  'the summary uses them, those cited on the lines a search query finds first '
  '(memory_private.found_lines: literally in every record, by its words in those p_matches '
  '(at the same positions) says were found by words or fuzzy), how many sources there are, and '
  'the last use before the call.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 6 $$;
