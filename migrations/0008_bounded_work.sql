-- 0008_bounded_work: every query_memories call does bounded work, whatever the scope holds and
-- whatever the query asks (issue 31). A member who filled a scope with notes of distinct words
-- sharing one three-letter prefix made a query of 32 such words take 24.8 s at 256 notes: the
-- fuzzy stage compared every query word with every word of every record.
-- - The policy holds the bounds of one search: query_terms (32, what search_terms wrote down
--   itself), fuzzy_words (8 query words) and fuzzy_neighbours (16 scope words on each side).
-- - memory_private.record_words: each record's words, keyed by scope and word in byte order,
--   written by index_records (the records trigger) and filled here for the existing records.
-- - memory_private.fuzzy_candidates: the scope's words nearest to a query word, two bounded
--   index scans; search_records' fuzzy stage reads them instead of every record's document.
-- - Claims that never end: a claim that breaks before its model call counts against the input's
--   three claims, so a job whose content kills every worker stops, with its reason in
--   memory.job_status, instead of coming back for ever. memory_private.expire_leases counts a
--   lease that expired with no report and no open call (claims_lost); memory.fail_job counts a
--   failed claim with no open call unless it was a refusal (budget_exceeded, not_priced).

alter type memory_private.policy_values
  add attribute query_terms integer,
  add attribute fuzzy_words integer,
  add attribute fuzzy_neighbours integer;

create or replace function memory_private.policy() returns memory_private.policy_values
  language sql immutable parallel safe security definer
  -- Definer only so that the operator views may read it (their callers have no usage on this
  -- schema); immutable, so every query folds it to constants when it is planned.
  set search_path = pg_catalog, pg_temp
  as $$
  select row(
    200,                    -- id_bytes
    100,                    -- id_list_entries
    64000,                  -- message_bytes
    43200,                  -- max_idle_minutes
    30,                     -- default_idle_minutes
    1000000,                -- max_dollars
    24000,                  -- batch_bytes
    4,                      -- existing_with_batch
    300,                    -- title_bytes
    4000,                   -- summary_bytes
    48,                     -- candidates
    4500,                   -- index_bytes
    12,                     -- index_ids
    3,                      -- max_claims
    interval '2 minutes',   -- lease
    interval '1 hour',      -- failure_backoff
    2000,                   -- error_chars
    8,                      -- directory_records
    300,                    -- directory_summary_chars
    12,                     -- query_limit
    1000,                   -- query_bytes
    20,                     -- shown_sources
    60,                     -- note_title_chars
    30,                     -- unused_days
    256,                    -- workspace_records
    8,                      -- copy_run_words
    4,                      -- copy_message_words
    4,                      -- copy_token_chars
    48,                     -- copy_stock_records
    32,                     -- query_terms
    8,                      -- fuzzy_words
    16                      -- fuzzy_neighbours
  )::memory_private.policy_values
$$;
comment on function memory_private.policy() is
  'Every limit, count and period of the memory''s rules (memory_private.policy_values names '
  'them): byte and count limits of ingest, model output, recall and tools; three model calls per '
  'unchanged input, the two-minute lease, the one-hour backoff; 30 days unused and 256 records '
  'per workspace; what the copy rule counts as a copy (8 consecutive words, a message of 4 '
  'words, a token of 4 characters; stock phrasing looked for in the 48 newest records); the '
  'bounds of one search (32 query terms, 8 fuzzy words, 16 neighbours a side). Immutable: '
  'changing one is a migration.';

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

insert into memory_private.record_words (workspace_id, scope_id, word, record_id)
select d.workspace_id, d.scope_id, l.word, d.record_id
  from memory_private.record_documents d
 cross join lateral unnest(tsvector_to_array(d.document)) l(word)
 where char_length(l.word) >= 3;

create or replace function memory_private.index_records(
  p_workspace_id text, p_record_ids bigint[], p_lines boolean
) returns void
  language sql volatile
  as $$
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
$$;
comment on function memory_private.index_records(text, bigint[], boolean) is
  'Writes what the searches read of the given records: their documents (record_documents) and '
  'words (record_words), their folded texts and three-character runs (record_texts) and, with p_lines, their lines'' '
  'documents (record_lines). The records trigger calls it for one record; a bulk load with '
  'triggers off calls it for all it loaded.';

create or replace function memory_private.search_terms(p_query text, p_weight text default '')
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

create or replace function memory_private.fuzzy_words(p_query text) returns text[]
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

create or replace function memory_private.search_records(
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

-- Claims that never end ------------------------------------------------------------------

comment on column memory_private.jobs.claims is
  'The claims this input has used: those that reached start_attempt (a model call), and those '
  'the worker broke on before it (fail_job worker_error, or a lease that expired with no '
  'report); a refusal before the call (budget_exceeded, not_priced) does not count. Carried over '
  'from a superseded job of the same input and config version. At most 3; the third failed or '
  'lost claim stops the job.';

create or replace function memory_private.expire_leases(p_workspace_id text) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_job memory_private.jobs;
  v_expired integer := 0;
  v_unknown integer := 0;
  v_lost integer := 0;
begin
  for v_job in
    select * from memory_private.jobs
     where workspace_id = p_workspace_id and status = 'running'
       and lease_expires_at <= memory_private.clock_now()
     order by job_id
       for update
  loop
    v_expired := v_expired + 1;
    if memory_private.close_attempt(v_job, 'unknown', null, 'lease_expired') then
      v_unknown := v_unknown + 1;
      perform memory_private.release_job(v_job, 'stopped',
        'the lease expired while a model call was open: outcome unknown, not replayed');
    elsif v_job.checkpoint is not null then
      -- A valid answer was paid for: the next claim commits it without a model call, whatever
      -- the number of calls the input has made.
      perform memory_private.release_job(v_job, 'pending',
        'the lease expired after the checkpoint; the next claim commits it',
        memory_private.clock_now());
    elsif v_job.claims + 1 >= (memory_private.policy()).max_claims then
      -- No report and no model call: the worker died or hung holding the job, perhaps on its
      -- content. That claim counts, so a job that kills every worker stops (issue 31).
      v_lost := v_lost + 1;
      update memory_private.jobs set claims = (memory_private.policy()).max_claims
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      perform memory_private.release_job(v_job, 'stopped', format(
        'the lease expired without a report on claim %s of %s (a worker died or hung holding '
        'the job, perhaps on its content): not replayed', v_job.claims,
        (memory_private.policy()).max_claims));
    else
      v_lost := v_lost + 1;
      update memory_private.jobs set claims = claims + 1
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      perform memory_private.release_job(v_job, 'pending', format(
        'the lease expired without a report on claim %s of %s (the claim counts)',
        v_job.claims, (memory_private.policy()).max_claims), memory_private.clock_now());
    end if;
  end loop;
  return jsonb_build_object('leases_expired', v_expired, 'attempts_unknown', v_unknown,
                            'claims_lost', v_lost);
end
$$;
comment on function memory_private.expire_leases(text) is
  'Maintenance step: a running job whose lease passed is stopped when a model call was open '
  '(the attempt becomes unknown and is charged at its reserve; no automatic replay), goes back '
  'to pending due now with its checkpoint when it has one (committed by the next claim without '
  'a model call, even after the third call), and otherwise counts the lost claim (the worker '
  'died or hung holding it, perhaps on its content: claims_lost) and goes back to pending due '
  'now, or stops, not replayed, when that was the input''s third claim. Returns counts.';

create or replace function memory.fail_job(
  p_workspace_id text, p_job_id bigint, p_token text, p_outcome text, p_error text,
  p_usage jsonb default null
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_open boolean;
  v_usage jsonb;
  v_now timestamptz := memory_private.clock_now();
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  if p_outcome is null or p_outcome not in ('failed', 'unknown') then
    raise exception 'outcome must be failed or unknown' using errcode = 'MB001';
  end if;
  -- A code, never text: what a worker would write here can carry the model's output.
  if p_error is null
     or not exists (select 1 from memory_private.failure_codes() c where c.code = p_error) then
    raise exception 'error must be a failure code (see docs/errors.md), not a message'
      using errcode = 'MB001',
      hint = 'e.g. provider_error, reply_not_json, reply_invalid, output_refused, worker_error.';
  end if;
  if p_usage is not null then
    v_usage := memory_private.check_usage(p_usage, false);
  end if;
  v_open := exists (select 1 from memory_private.job_attempts
                     where workspace_id = p_workspace_id and job_id = p_job_id
                       and outcome = 'open');
  if not v_open and p_outcome = 'unknown' then
    raise exception 'job % has no open model call whose outcome could be unknown', p_job_id
      using errcode = 'MB025', hint = 'Report failed instead.';
  end if;
  if not v_open and v_usage is not null then
    raise exception 'job % has no open model call to charge the usage to', p_job_id
      using errcode = 'MB025';
  end if;

  if p_outcome = 'unknown' then
    perform memory_private.close_attempt(v_job, 'unknown', v_usage, p_error);
    perform memory_private.release_job(v_job, 'stopped',
      'outcome unknown, not replayed: ' || p_error);
    return jsonb_build_object('job_id', p_job_id, 'status', 'stopped',
                              'why', 'unknown_outcome');
  end if;

  perform memory_private.close_attempt(v_job, 'failed', v_usage, p_error);
  -- A claim that broke before its model call counts like one that made it (the worker failed
  -- on the job's content: a job that breaks every worker stops); a refusal costs nothing.
  if not v_open and v_job.checkpoint is null
     and p_error not in ('budget_exceeded', 'not_priced') then
    update memory_private.jobs
       set claims = least(claims + 1, (memory_private.policy()).max_claims)
     where workspace_id = v_job.workspace_id and job_id = v_job.job_id
    returning * into v_job;
  end if;
  -- A paid, valid checkpoint is never dropped: the job waits with it and commits it later.
  if v_job.checkpoint is null and v_job.claims >= (memory_private.policy()).max_claims then
    perform memory_private.release_job(v_job, 'stopped',
      case when v_open then 'failed on its third model call, not replayed: '
           else 'failed on its third claim, before its model call, not replayed: ' end
      || p_error);
    return jsonb_build_object('job_id', p_job_id, 'status', 'stopped', 'why', 'third_claim');
  end if;
  perform memory_private.release_job(v_job, 'pending', p_error,
                                     v_now + (memory_private.policy()).failure_backoff);
  return jsonb_build_object('job_id', p_job_id, 'status', 'pending',
                            'next_attempt_at', v_now + (memory_private.policy()).failure_backoff);
end
$$;
comment on function memory.fail_job(text, bigint, text, text, text, jsonb) is
  'Reports that the current claim failed, with a failure code (memory_private.failure_codes; '
  'MB001 for anything else, so no text reaches storage) and the usage the worker could read '
  '(null values for what it could not). failed: the open attempt (if any) closes as failed and '
  'is charged (the reported cost, at most the reserve; the reserve when the cost could not be '
  'read; nothing without usage), and the job backs off one hour, or stops after the input''s '
  'third claim; a claim that failed before its model call counts too, unless it was a refusal '
  '(budget_exceeded, not_priced); a job holding a checkpoint keeps it and stays pending. '
  'unknown: the '
  'provider may have run, so the open attempt is charged at its reserve and the job stops '
  'without automatic replay (P13). Answers the job''s new status: {"status": "pending", '
  '"next_attempt_at"} or {"status": "stopped", "why": "unknown_outcome" | "third_claim"}.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 8 $$;
