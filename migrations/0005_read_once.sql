-- 0005_read_once: a query_memories call reads its records fewer times, with the same answers
-- (docs/benchmarks.md, "The session of 2026-12-01, seventh").
-- - The newest-first walk (memory_private.recent_valid_records: browse, the literal search,
--   recall's directory, the consolidation candidates) checks the scope once, then each record
--   of a page in one statement (memory_private.record_failures: its own reasons and its missing
--   repository grants), instead of handing each page to invalid_records (two statements and the
--   scope's checks again, the records read three more times).
-- - A record's own reasons are read from the columns its reader has in hand
--   (memory_private.own_reasons; record_reasons applies it to a set of records read by id), and
--   each dependency is looked up by its key.
-- - The repository-grant check has one home, memory_private.missing_grants (invalid_records,
--   index_holds, record_checks and record_failures use it).
-- - The answer reads each shown record once (memory_private.answer_records): its sources, the
--   lines a search finds (memory_private.found_lines, per record) and the answer row in one
--   statement. memory_private.shown_sources and memory_private.matching_lines are gone.
-- - The search hands its records on as arrays (ids, and how each matched at the same
--   positions), not as rows gathered again by a statement at each level
--   (memory_private.search_records, memory_private.query_records).


create function memory_private.own_reasons(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_now timestamptz
) returns table (reason text, message_id text)
  language sql stable
  as $$
  -- Inlined (no SET clause), from columns a reader of the record has in hand: no read of the
  -- record itself. The bot replaced since the record was made (p_bot_identity: the scope's bot
  -- now; p_record_identity: the record's) ...
  select 'bot_replaced', null::text
   where p_record_identity <> p_bot_identity
  union all
  -- ... and every dependency that is not current (the record's copy of its dependencies, with
  -- the hashes they had when it was made).
  select x.state, d.message_id
    from unnest(p_dependency_ids, p_dependency_hashes) as d(message_id, content_hash)
   cross join lateral (
     -- each message by its key (kept apart: joined, a planner that takes the dependencies for
     -- ten may read every message of the workspace for them)
     select m.removed_at, m.content_hash, m.retain_until from memory_private.messages m
      where m.workspace_id = p_workspace_id and m.message_id = d.message_id
     offset 0) m
    left join memory_private.tombstones t
      on t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
     and t.message_id = d.message_id
   cross join lateral (
     -- content_hash, not body: NULL exactly when the text is gone, and in messages_state_idx
     select memory_private.dependency_state(
              m.removed_at, m.content_hash is not null, m.retain_until, m.content_hash,
              d.content_hash, t.message_id is not null, p_now) as state) x
   where x.state is not null
$$;
comment on function memory_private.own_reasons(text, bigint, text, text, text[], text[],
                                               timestamptz) is
  'Every reason a record of the scope fails whatever the reader, from its bot identity and its '
  'dependencies (ids and the hashes they had): bot_replaced when the scope''s bot '
  '(p_bot_identity) has another identity now, and the state of each dependency that is not '
  'current (removed, expired, edited, forgotten) with the message. No row: none.';

create or replace function memory_private.record_reasons(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[],
  p_now timestamptz default memory_private.clock_now()
) returns table (record_id bigint, reason text, message_id text)
  language sql stable
  as $$
  -- memory_private.own_reasons of each record, read from its own page (its copy of its
  -- dependencies), which every reader of the record reads anyway; the scope's bot identity
  -- once.
  select r.record_id, x.reason, x.message_id
    from (select (select b.identity
                    from memory_private.scopes s
                    join memory_private.bots b
                      on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
                   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id) as identity
          offset 0) sb  -- a column, not a subquery: own_reasons is then inlined
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
   cross join lateral memory_private.own_reasons(p_workspace_id, p_scope_id, sb.identity,
                                                 r.bot_identity, r.dependency_ids,
                                                 r.dependency_hashes, p_now) x
$$;
comment on function memory_private.record_reasons(text, bigint, bigint[], timestamptz) is
  'Every reason each given record of the scope fails whatever the reader '
  '(memory_private.own_reasons): bot_replaced, and the state of each dependency that is not '
  'current (removed, expired, edited, forgotten) with the message. A record that fails none has '
  'no row. The retention sweep deletes the records with a permanent one.';

create function memory_private.missing_grants(
  p_workspace_id text, p_reader text, p_repositories text[]
) returns table (repository_id text)
  language sql stable
  as $$
  -- Inlined (no SET clause). No reader (background work on a shared scope): nothing is checked.
  select repo.repository_id
    from unnest(p_repositories) as repo(repository_id)
   where p_reader is not null
     and not exists (select 1 from memory_private.repository_grants g
                      where g.workspace_id = p_workspace_id and g.user_id = p_reader
                        and g.repository_id = repo.repository_id)
$$;
comment on function memory_private.missing_grants(text, text, text[]) is
  'The repositories of p_repositories the reader may not read (no repository_grants row): a '
  'record drawing on one is not valid for them (grant_revoked). None when there is no reader.';

create or replace function memory_private.invalid_records(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[], p_requester text
) returns table (record_id bigint, reason text)
  language plpgsql stable
  as $$
declare
  v_scope_reason text;
  v_ids bigint[];
  v_no_grant bigint[];
  v_now timestamptz := memory_private.clock_now();
begin
  -- Two queries. The first reads the scope's first failing check for the reader (scope_reason's
  -- query, inlined), the records of the set that are the scope's, and those drawing on a
  -- repository the reader (the private scope's user, else the requester) may not read. The
  -- second decides every record of the set: the first reason in rank order among its record
  -- reasons and its repository grants. plpgsql so that the plans are cached for the session; the
  -- ids are a variable so that record_reasons is inlined into that plan. Ids that are not
  -- records of the scope are not returned (no scope, no records of it).
  select (select c.reason
            from memory_private.scope_checks(p_workspace_id, p_scope_id, p_requester) c
           where not c.ok order by c.rank limit 1),
         coalesce(array_agg(r.record_id), '{}'),
         coalesce(array_agg(r.record_id) filter (
           where exists (select 1 from memory_private.missing_grants(p_workspace_id, rd.id,
                                                                     r.repositories))),
           '{}')
    into v_scope_reason, v_ids, v_no_grant
    from memory_private.records r
   cross join (select coalesce((select s.user_id from memory_private.scopes s
                                 where s.workspace_id = p_workspace_id
                                   and s.scope_id = p_scope_id), p_requester) as id
               offset 0) rd  -- kept a column: missing_grants is inlined only without a subquery
                             -- in its arguments
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and r.scope_id = p_scope_id;
  return query
    with failing as materialized (
      -- One pass over every record of the set (not one per record).
      select x.record_id, x.reason
        from memory_private.record_reasons(p_workspace_id, p_scope_id, v_ids, v_now) x
      union all
      select g.id, 'grant_revoked' from unnest(v_no_grant) as g(id)
    )
    , first as (
      select distinct on (f.record_id) f.record_id, f.reason
        from failing f join memory_private.invalid_reasons ir on ir.reason = f.reason
       order by f.record_id, ir.rank
    )
    select i.id, coalesce(v_scope_reason, first.reason)
      from unnest(v_ids) as i(id)
      left join first on first.record_id = i.id;
end
$$;
comment on function memory_private.invalid_records(text, bigint, bigint[], text) is
  'The validity rule for records of one scope: each given id that is a record of the scope, with '
  'the first reason in rank order (memory_private.invalid_reasons) why it may not be recalled '
  'now for the requester, or NULL when it may: the scope''s checks for the reader, then the '
  'record''s reasons (bot replaced, a dependency removed, expired, edited or forgotten), then a '
  'repository grant the reader lacks. One query for the whole set; every reader of records uses '
  'it (V6, T1). With no requester (background work on a shared scope) the requester''s '
  'membership and grants are not checked.';

create or replace function memory_private.index_holds(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns boolean
  language plpgsql stable
  as $$
declare
  v_scope memory_private.scopes;
  v_reader text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The validity rule for every candidate of the scope's index at once, in the form the index
  -- keeps (its candidates' dependencies, bot identity and repositories, taken when it was built):
  -- what invalid_records would say of each candidate, without reading them one by one. A test
  -- keeps the two equal for every reason (tests/test_provenance.py,
  -- test_index_holds_exactly_when_every_candidate_is_valid_for_the_reader).
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if not found or v_scope.index_text is null then
    return false;
  end if;
  v_reader := coalesce(v_scope.user_id, p_requester);
  return memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester) is null
     and (select b.identity from memory_private.bots b
           where b.workspace_id = p_workspace_id and b.bot_id = v_scope.bot_id)
         = v_scope.index_bot_identity
     and not exists (select 1 from memory_private.missing_grants(p_workspace_id, v_reader,
                                                                 v_scope.index_repositories))
     and not exists (select 1 from memory_private.tombstones t
                      join memory_private.index_dependencies d
                        on d.workspace_id = t.workspace_id and d.scope_id = t.scope_id
                       and d.message_id = t.message_id
                     where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id)
     and not exists (select 1 from memory_private.index_dependencies d
                      join memory_private.messages m
                        on m.workspace_id = d.workspace_id and m.message_id = d.message_id
                     where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
                       -- content_hash is not null: the text is there (messages_state_idx)
                       and memory_private.dependency_state(m.removed_at,
                             m.content_hash is not null, m.retain_until, m.content_hash,
                             d.content_hash, false, v_now)
                           is not null);
end
$$;
comment on function memory_private.index_holds(text, bigint, text) is
  'Whether the scope''s index may be given to the requester now: every record it was built from '
  'is valid for them (the scope''s checks, the bot identity, the repository grants, and every '
  'dependency current and not forgotten), checked from what the index kept when it was built.';

create or replace function memory_private.record_checks(
  p_workspace_id text, p_record_id bigint, p_requester text
) returns table (rank integer, check_name text, reason text, ok boolean, detail text)
  language plpgsql stable
  as $$
declare
  v_record memory_private.records;
  v_identity text;
  v_reader text;
  v_states text[];
  v_bad text[];
  v_deps integer;
  v_missing text[];
begin
  -- The same checks as memory_private.invalid_records, one row each with a detail, for
  -- explain_record; the first failing row is the record's reason (a test keeps them equal).
  select * into v_record from memory_private.records
   where workspace_id = p_workspace_id and record_id = p_record_id;
  if not found then
    return;
  end if;
  return query select * from memory_private.scope_checks(p_workspace_id, v_record.scope_id,
                                                         p_requester);
  select b.identity, coalesce(s.user_id, p_requester) into v_identity, v_reader
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
   where s.workspace_id = p_workspace_id and s.scope_id = v_record.scope_id;
  return query select 5, 'bot_identity', 'bot_replaced',
    v_identity is null or v_identity = v_record.bot_identity,
    case when v_identity is null then 'no bot to compare with'
         when v_identity = v_record.bot_identity then 'made under the bot''s current identity'
         else format('made under identity %s; the bot is now %s', v_record.bot_identity,
                     v_identity) end;
  select count(*) into v_deps from memory_private.record_dependencies
   where workspace_id = p_workspace_id and record_id = p_record_id;
  select array_agg(x.reason order by ir.rank, x.message_id),
         array_agg(x.message_id || ' ' || x.reason order by ir.rank, x.message_id)
    into v_states, v_bad
    from memory_private.record_reasons(p_workspace_id, v_record.scope_id, array[p_record_id]) x
    join memory_private.invalid_reasons ir on ir.reason = x.reason
   where x.reason <> 'bot_replaced';
  return query select coalesce((select ir.rank from memory_private.invalid_reasons ir
                                 where ir.reason = v_states[1]), 6),
    'dependencies_current', v_states[1], v_states is null,
    case when v_states is null
           then format('all %s messages it was made from are retained and unchanged', v_deps)
         else format('%s of the %s messages it was made from are not current: %s',
                     cardinality(v_states), v_deps, array_to_string(v_bad, ', ')) end;
  select array_agg(m.repository_id order by m.repository_id) into v_missing
    from memory_private.missing_grants(p_workspace_id, v_reader, v_record.repositories) m;
  return query select 10, 'repository_grants', 'grant_revoked',
    coalesce(cardinality(v_missing), 0) = 0,
    case when cardinality(v_record.repositories) = 0 then 'drew on no repository'
         when v_reader is null
           then 'shared scope and no requester: per-requester grants not checked'
         when coalesce(cardinality(v_missing), 0) = 0
           then format('%s can read every repository it drew on', v_reader)
         else format('%s can no longer read %s', v_reader, array_to_string(v_missing, ', '))
    end;
end
$$;
comment on function memory_private.record_checks(text, bigint, text) is
  'Every check of the validity rule for one record and reader, in rank order, with ok and a '
  'detail (explain_record shows them): the scope''s checks, the bot identity, the dependencies, '
  'the repository grants. The first failing one is what memory_private.invalid_records answers.';

create function memory_private.record_failures(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_repositories text[], p_reader text,
  p_now timestamptz
) returns table (reason text)
  language sql stable
  as $$
  -- Inlined (no SET clause), with own_reasons and missing_grants inside it: the checks of one
  -- record for a reader, from the record's columns, as a reader walking records one by one
  -- asks them.
  select x.reason
    from memory_private.own_reasons(p_workspace_id, p_scope_id, p_bot_identity,
                                    p_record_identity, p_dependency_ids, p_dependency_hashes,
                                    p_now) x
  union all
  select 'grant_revoked'
    from memory_private.missing_grants(p_workspace_id, p_reader, p_repositories)
$$;
comment on function memory_private.record_failures(text, bigint, text, text, text[], text[],
                                                   text[], text, timestamptz) is
  'Every reason one record of the scope fails for the reader (the private scope''s user or the '
  'requester), the scope''s checks aside, from its bot identity, dependencies and repositories: '
  'its own reasons (memory_private.own_reasons; p_bot_identity is the scope''s bot now) and '
  'grant_revoked for each repository the reader lacks. No row: valid, once the scope''s checks '
  'pass. memory_private.invalid_records, one record at a time.';

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
  v_grams bit(1024);
  v_scope_reason text;
  v_reader text;
  v_identity text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- Newest first, a page at a time (limit, then four times more); a page's records checked
  -- in one statement (record_failures: invalid_records' verdict, tests/test_validity_set.py)
  -- after the scope's checks (scope_reason), asked with the reader and the bot's identity. A
  -- scope whose newest records are valid costs one short index scan and one pass over just
  -- those, never a read of the whole scope. One snapshot throughout (stable).
  select memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester),
         coalesce(s.user_id, p_requester), b.identity
    into v_scope_reason, v_reader, v_identity
    from (values (1)) one
    left join memory_private.scopes s on s.workspace_id = p_workspace_id and s.scope_id = p_scope_id
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id;
  if v_scope_reason is not null then
    return '{}';
  end if;
  if char_length(v_query) >= 3 then
    v_grams := memory_private.text_grams(v_query);
  end if;
  loop
    if v_query is null then
      v_chunk := array(
        select r.record_id from memory_private.records r
         where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
           and (p_record_id is null or r.record_id = p_record_id)
         order by r.created_at desc, r.record_id desc
         limit v_size offset v_offset);
    elsif v_grams is null then
      -- Too short for a three-character run (a two-character Chinese word): every folded text
      -- of the scope newest first (narrow rows).
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
      -- every three-character run of the query, the record: the query as typed in its title or
      -- summary matches; else the folded text decides (search_text; a query holding a newline
      -- is re-checked in each part, within_a_part: across the title's end is no match).
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
    v_valid := v_valid || array(
      select c.record_id
        from unnest(v_chunk) with ordinality as c(record_id, pos)
        join memory_private.records r
          on r.workspace_id = p_workspace_id and r.record_id = c.record_id
       where r.scope_id = p_scope_id
         and not exists (select 1 from memory_private.record_failures(
                           p_workspace_id, p_scope_id, v_identity, r.bot_identity,
                           r.dependency_ids, r.dependency_hashes, r.repositories, v_reader,
                           v_now))
       order by c.pos);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid[1:p_limit];
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Read a page at a time; the scope''s checks once, then each record of '
  'a page (memory_private.record_failures).';

create or replace function memory_private.record_detail(
  p_record memory_private.records, p_source_ids text[], p_source_count bigint,
  p_last_used_at timestamptz, p_match text
) returns memory_private.record_answer
  language sql stable
  -- One expression, so that it is inlined into answer_records' statement.
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
  'memory_private.answer_records orders the record''s sources and passes them in, with the '
  'record''s last use before the call (memory_private.record_usage).';

create function memory_private.found_lines(
  p_workspace_id text, p_record_id bigint, p_summary text, p_folded_query text,
  p_terms tsquery[]
) returns table (line_no integer, line text)
  language sql stable
  as $$
  -- Inlined (no SET clause), for one record at a time. The lines (from 1) of the record's
  -- summary a search finds, with their text as written: the folded query is part of the folded
  -- line, or (p_terms: the record was found by its words) the line holds one of the words
  -- (memory_private.search_terms of the query, against the line's stored document in
  -- record_lines: as written or English-stemmed, CJK bigrams). The summary is folded whole,
  -- once: folding maps characters and never makes or removes a newline, so folded line n is
  -- line n (folding line by line costs a call per line). The lines holding a word are read
  -- once, as an array, only when there are words.
  select l.line_no, split_part(p_summary, e'\n', l.line_no)
    from memory_private.summary_lines(memory_private.fold(p_summary)) l
   cross join (select case when p_terms is not null
                           then array(select d.line_no from memory_private.record_lines d
                                       where d.workspace_id = p_workspace_id
                                         and d.record_id = p_record_id
                                         and d.document @@ any(p_terms)) end as ids) w
   where strpos(l.line, p_folded_query) > 0 or l.line_no = any(w.ids)
$$;
comment on function memory_private.found_lines(text, bigint, text, text, tsquery[]) is
  'The lines (number, text as written) of one record''s summary a query_memories search finds: '
  'those holding the folded query (memory_private.fold), and, when p_terms are given (the '
  'record was found by its words), those holding one of them, read from the lines'' stored '
  'documents (record_lines).';

create function memory_private.answer_records(
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
  -- (memory_private.found_lines; a line's citations are its bracketed ids,
  -- memory_private.cited_ids, as when the record was written), the first shown_sources of
  -- them; how it matched (p_matches, at the records' positions: literal, words, fuzzy); its
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
                     cross join lateral memory_private.cited_ids(l.line, r.source_ids) as c(id)
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

drop function memory_private.search_records(text, bigint, integer, text, text);

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
  v_prefixes tsquery;
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
  -- characters, a prefix search of the stored document: cheap), scored by the best word
  -- similarity between a query word and such a word of the record.
  if cardinality(v_literal) + cardinality(v_words) < p_limit then
    v_fuzzy_words := memory_private.fuzzy_words(p_query);
  end if;
  if cardinality(v_fuzzy_words) > 0 then
    v_prefixes := (select string_agg(memory_private.lexeme_query(left(w, 3), ':*')::text, ' | ')
                     from unnest(v_fuzzy_words) w)::tsquery;
    v_candidates := array(
      select s.record_id
        from (select d.record_id, d.created_at,
                     (select max(memory_private.trgm_word_similarity(w, l))
                        from unnest(v_fuzzy_words) w
                        join unnest(tsvector_to_array(d.document)) l
                          on left(l, 3) = left(w, 3)) as similarity
                from memory_private.record_documents d
               where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
                 and d.document @@ v_prefixes
                 and not d.record_id = any(v_literal || v_words)) s
       where s.similarity >= 0.5
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
  'of a query word to a word of the record starting with the same three characters; most '
  'similar, then newest). A stage runs only while fewer than p_limit were found.';

drop function memory_private.query_records(text, bigint, integer, text, text, bigint);

create function memory_private.query_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text, p_query text,
  p_record_id bigint, out ids bigint[], out matches text[]
)
  language plpgsql stable
  as $$
declare
  v_found record;
begin
  -- Search (literal matches first, then ranked word and fuzzy matches: 48_search.sql), or
  -- browse newest first, or one id (with a query: only if it matches literally); valid records
  -- only. Arrays passed along, not rows: no statement of its own.
  if p_query is not null and p_record_id is null then
    v_found := memory_private.search_records(p_workspace_id, p_scope_id, p_limit, p_requester,
                                             p_query);
    ids := v_found.ids;
    matches := v_found.matches;
  else
    ids := memory_private.recent_valid_records(p_workspace_id, p_scope_id, p_limit,
                                               p_requester, p_query, p_record_id);
    if p_query is not null then
      matches := array_fill('literal'::text, array[cardinality(ids)]);
    end if;
  end if;
end
$$;
comment on function memory_private.query_records(text, bigint, integer, text, text, bigint) is
  'The records a query_memories call returns, in order (ids), with how each matched (matches, '
  'the same positions: literal, words, fuzzy; NULL when browsing): a search '
  '(memory_private.search_records), the newest valid ones, or one by id.';

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
  v_found record;
  v_records memory_private.record_answer[];
  v_matches text[];
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
    v_found := memory_private.query_records(p_workspace_id, v_scope.scope_id, v_limit,
                                            v_request.user_id, v_query, v_id);
    v_ids := v_found.ids;
    v_matches := v_found.matches;
  end if;

  -- The shown records with their sources (R5): what the call shows makes the citations it
  -- authorizes (R6, memory.request_citations).
  v_records := memory_private.answer_records(p_workspace_id, v_ids, v_query, v_matches);
  v_shown := array(select x from unnest(v_records) a, unnest(a.source_ids) x);

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

drop function memory_private.shown_sources(text, bigint[], text, jsonb);
drop function memory_private.matching_lines(text, bigint[], text, bigint[], tsquery[]);

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 5 $$;
