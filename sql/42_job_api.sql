-- 42_job_api.sql: the worker's side of a job's life (P1, P12-P14, P17-P19).
--
-- The worker calls only these: claim_job, extend_lease, start_attempt, save_checkpoint,
-- commit_job, fail_job. Each is one short transaction under the workspace's memory lock; no lock
-- is held across a model call. commit_job writes what a checkpoint holds: the record of an
-- extraction (write_extraction: its sources and dependencies, 20_memory_state.sql) or the scope
-- index of a consolidation (write_index).

create function memory.claim_job(p_worker_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_ws record;
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
begin
  perform memory_private.check_id('worker_id', p_worker_id);
  -- Candidates come from the due jobs (jobs_claimable_idx), not from every workspace. A job
  -- with calls left is claimable, and so is one holding a checkpoint whatever its count: its
  -- claim only commits.
  for v_ws in
    select d.workspace_id
      from (select j.workspace_id, min(j.next_attempt_at) as due
              from memory_private.jobs j
             where j.status = 'pending' and j.next_attempt_at <= v_now
               and (j.claims < (memory_private.policy()).max_claims or j.checkpoint is not null)
             group by j.workspace_id) d
      join memory_private.workspaces w on w.workspace_id = d.workspace_id
     where not w.paused
       and not exists (select 1 from memory_private.jobs r
                        where r.workspace_id = d.workspace_id and r.status = 'running')
     order by d.due, d.workspace_id
  loop
    -- The workspace's memory lock, without waiting: another claim or a memory write holds it
    -- briefly.
    continue when not memory_private.try_lock_workspace(v_ws.workspace_id);
    select config_version into v_config from memory_private.workspaces
     where workspace_id = v_ws.workspace_id and not paused;
    continue when not found;
    -- Re-read under the lock: a concurrent claim may have committed a running job meanwhile.
    continue when exists (select 1 from memory_private.jobs j
                           where j.workspace_id = v_ws.workspace_id and j.status = 'running');
    loop
      select * into v_job from memory_private.jobs j
       where j.workspace_id = v_ws.workspace_id and j.status = 'pending'
         and j.next_attempt_at <= v_now
         and (j.claims < (memory_private.policy()).max_claims or j.checkpoint is not null)
       order by j.next_attempt_at, j.job_id
       limit 1
         for update skip locked;
      exit when not found;
      if v_job.config_version <> v_config then
        perform memory_private.release_job(v_job, 'stopped',
          format('the model/provider configuration changed (version %s -> %s)',
                 v_job.config_version, v_config));
        continue;
      end if;
      v_reason := memory_private.job_stale_reason(v_job);
      if v_reason is not null then
        perform memory_private.release_job(v_job, 'superseded', 'input changed: ' || v_reason);
        continue;
      end if;
      -- The claim is counted by start_attempt, when it can reach the provider.
      update memory_private.jobs
         set status = 'running', token = gen_random_uuid(), worker_id = p_worker_id,
             lease_expires_at = v_now + (memory_private.policy()).lease, updated_at = v_now
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      return memory_private.job_payload(v_job);
    end loop;
  end loop;
  return null;
end
$$;
comment on function memory.claim_job(text) is
  'Claims at most one memory job (NULL when there is none): pending, due, with a model call '
  'left for its input (fewer than three) or a checkpoint to commit, workspace not paused and '
  'with no running job. Issues a fresh token and a two-minute lease and returns the payload: '
  'phase, scope, origin request, pinned model, budget left (decimal strings), limits, redacted '
  'input, and the checkpoint when one exists (then commit without calling the model). Jobs '
  'found stale on the way are superseded or stopped. The claim counts only once start_attempt '
  'opens its model call.';

create function memory.extend_lease(p_workspace_id text, p_job_id bigint, p_token text)
  returns timestamptz
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_until timestamptz := memory_private.clock_now() + (memory_private.policy()).lease;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  update memory_private.jobs
     set lease_expires_at = v_until, updated_at = memory_private.clock_now()
   where workspace_id = v_job.workspace_id and job_id = v_job.job_id;
  return v_until;
end
$$;
comment on function memory.extend_lease(text, bigint, text) is
  'Extends the lease of a job the caller holds to two minutes from now and returns the new '
  'expiry; MB020 when the token is not current or the lease already expired.';

create function memory.start_attempt(
  p_workspace_id text, p_job_id bigint, p_token text, p_reserve_usd numeric
) returns integer
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_request_left numeric;
  v_workspace_left numeric;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  perform memory_private.check_money('reserve_usd', p_reserve_usd);
  if v_job.checkpoint is not null then
    raise exception 'job % already has a checkpoint: commit it without calling the model',
      p_job_id using errcode = 'MB025';
  end if;
  if exists (select 1 from memory_private.job_attempts
              where workspace_id = p_workspace_id and job_id = p_job_id
                and (token = v_job.token or outcome = 'open')) then
    raise exception 'job % already made its attempt for this claim', p_job_id
      using errcode = 'MB025', hint = 'One model call per claim; report its outcome instead.';
  end if;
  if v_job.claims >= (memory_private.policy()).max_claims then
    raise exception 'the input of job % has made its three model calls', p_job_id
      using errcode = 'MB025', hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  select budget_usd - spent_usd
         - memory_private.request_memory_spent(p_workspace_id, v_job.origin_request_id)
    into v_request_left
    from memory_private.requests
   where workspace_id = p_workspace_id and request_id = v_job.origin_request_id;
  if p_reserve_usd > v_request_left then
    raise exception 'a reserve of $% does not fit the $% left of request %', p_reserve_usd,
      greatest(v_request_left, 0), v_job.origin_request_id using errcode = 'MB024',
      hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  select w.budget_usd - w.spent_usd - m.memory_spent_usd into v_workspace_left
    from memory_private.workspaces w
    join memory_private.workspace_memory m on m.workspace_id = w.workspace_id
   where w.workspace_id = p_workspace_id;
  if p_reserve_usd > v_workspace_left then
    raise exception 'a reserve of $% does not fit the $% left of workspace %', p_reserve_usd,
      greatest(v_workspace_left, 0), p_workspace_id using errcode = 'MB024',
      hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  -- This claim can reach the provider now: it counts against the input's three calls.
  update memory_private.jobs set claims = claims + 1, updated_at = memory_private.clock_now()
   where workspace_id = p_workspace_id and job_id = p_job_id;
  insert into memory_private.job_attempts
    (workspace_id, job_id, attempt_no, token, reserved_usd, started_at)
  values (p_workspace_id, p_job_id, v_job.claims + 1, v_job.token, p_reserve_usd,
          memory_private.clock_now());
  return v_job.claims + 1;
end
$$;
comment on function memory.start_attempt(text, bigint, text, numeric) is
  'Opens the model call of the current claim after checking that the input has a call left (at '
  'most three per unchanged input, MB025) and that the reserved dollars fit both the '
  'originating request''s remaining budget (budget - spent - memory charges) and the '
  'workspace''s; MB024 otherwise, before any call is made (P17). Only here does a claim count. '
  'Returns the attempt number (the input''s call number, 1 to 3).';

create function memory.save_checkpoint(
  p_workspace_id text, p_job_id bigint, p_token text, p_output jsonb, p_usage jsonb
) returns void
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_attempt memory_private.job_attempts;
  v_usage jsonb;
  v_output jsonb;
  v_reason text;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  select * into v_attempt from memory_private.job_attempts
   where workspace_id = p_workspace_id and job_id = p_job_id and token = v_job.token
     and outcome = 'open';
  if not found then
    raise exception 'job % has no open attempt for this claim', p_job_id
      using errcode = 'MB025', hint = 'Call memory.start_attempt before the model call.';
  end if;
  v_usage := memory_private.check_usage(p_usage);
  v_output := memory_private.validate_output(v_job, p_output);
  -- An output made from an input that changed meanwhile (a source removed, edited, expired or
  -- forgotten) could never be committed, and it may carry the text that went: store nothing.
  v_reason := memory_private.job_stale_reason(v_job);
  if v_reason is not null then
    raise exception 'the input of job % changed: %', p_job_id, v_reason using errcode = 'MB021',
      hint = 'Report the attempt with fail_job(..., ''failed'', error, usage); maintenance '
             'supersedes the job.';
  end if;
  perform memory_private.close_attempt(v_job, 'ok', v_usage, null);
  update memory_private.jobs
     set checkpoint = jsonb_build_object('output', v_output, 'usage', v_usage),
         updated_at = memory_private.clock_now()
   where workspace_id = p_workspace_id and job_id = p_job_id;
end
$$;
comment on function memory.save_checkpoint(text, bigint, text, jsonb, jsonb) is
  'Stores the model output of the open attempt as the job''s checkpoint, separate from the '
  'transcript (P19): validated (MB023) and redacted, with its usage (every value known); closes '
  'the attempt as ok and charges the originating request the reported cost, at most the '
  'attempt''s reserve. An invalid output (MB023) or an input that changed since the claim '
  '(MB021: the output could never be committed and may carry the text that changed) changes '
  'nothing: report it with fail_job(..., ''failed'', code, usage).';

create function memory_private.passages(p_text text) returns text[]
  language sql immutable strict parallel safe
  as $$
  -- Words are runs of letters and digits; a Chinese, Japanese or Korean character is a word of
  -- its own (those scripts do not separate words with spaces). They are spaced apart first: a
  -- regular expression takes the longest match, so a run of them would otherwise be one word.
  -- One pass with a window over the words (linear in the text).
  select coalesce(array_agg(distinct x.p), '{}')
    from (select concat_ws(' ', w.t, lead(w.t, 1) over o, lead(w.t, 2) over o,
                           lead(w.t, 3) over o, lead(w.t, 4) over o, lead(w.t, 5) over o,
                           lead(w.t, 6) over o, lead(w.t, 7) over o) as p,
                 lead(w.t, 7) over o as eighth
            from (select m.t[1] as t, m.n
                    from regexp_matches(
                           regexp_replace(lower(p_text), '([぀-ヿ㐀-䶿一-鿿가-힯豈-﫿])',
                                          ' \1 ', 'g'),
                           '[぀-ヿ㐀-䶿一-鿿가-힯豈-﫿]|[[:alnum:]]+', 'g')
                         with ordinality as m(t, n)) w
          window o as (order by w.n)) x
   where x.eighth is not null
$$;
comment on function memory_private.passages(text) is
  'Every run of eight consecutive words of a text (lower case; a CJK character counts as a '
  'word): what commit_job compares to find a summary that repeats an uncited message.';

create function memory_private.repeated_sources(
  p_job memory_private.jobs, p_summary text, p_cited text[]
) returns table (message_id text, content_hash text)
  language plpgsql stable
  as $$
declare
  v_said text[];
begin
  -- Defence in depth for provenance: a model may lean on a batch message without citing it. A
  -- summary that repeats eight consecutive words of an uncited message depends on that message
  -- too. Paraphrase passes unseen; docs/retention.md says what this trades. Nothing to compare
  -- when the output cites the whole batch or the summary is shorter than eight words.
  if not exists (select 1 from jsonb_array_elements(p_job.input -> 'sources') s
                  where s ->> 'id' <> all (p_cited)) then
    return;
  end if;
  v_said := memory_private.passages(p_summary);
  if cardinality(v_said) = 0 then
    return;
  end if;
  return query
    with said as (
      select unnest(v_said) as p
    ), uncited as (
      select s.id, s.hash, m.body
        from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
        join memory_private.messages m
          on m.workspace_id = p_job.workspace_id and m.message_id = s.id
       where s.id <> all (p_cited) and m.content_hash = s.hash
    )
    select distinct u.id, u.hash
      from uncited u
     cross join lateral unnest(memory_private.passages(u.body)) as q(p)
      join said on said.p = q.p;
end
$$;
comment on function memory_private.repeated_sources(memory_private.jobs, text, text[]) is
  'The uncited messages of an extraction batch whose words the summary repeats (eight '
  'consecutive words, memory_private.passages), with the hash the job saw: commit_job adds them '
  'to the record''s dependencies (via = repeated).';

create function memory_private.write_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_cited text[] := array(select jsonb_array_elements_text(p_output -> 'source_ids'));
  v_reused bigint[] := array(select jsonb_array_elements_text(p_output -> 'reused_ids')::bigint);
  v_dep_ids text[];
  v_dep_hashes text[];
  v_dep_via text[];
  v_record_id bigint;
begin
  -- The dependencies: the cited messages at the hash the job saw, every dependency of the
  -- memories the output declared it reused (P5: existing memory accompanies the batch; what it
  -- rests on stays tracked without resending it), and uncited messages the summary repeats.
  -- A message that counts twice is kept once, under its first reason in that order.
  select array_agg(d.message_id order by d.message_id),
         array_agg(d.content_hash order by d.message_id),
         array_agg(d.via order by d.message_id)
    into v_dep_ids, v_dep_hashes, v_dep_via
    from (select distinct on (u.message_id) u.message_id, u.content_hash, u.via
            from (select s.id as message_id, s.hash as content_hash, 'cited' as via, 1 as rank
                    from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
                   where s.id = any (v_cited)
                  union all
                  select rd.message_id, rd.content_hash, 'reused', 2
                    from memory_private.record_dependencies rd
                   where rd.workspace_id = p_job.workspace_id and rd.record_id = any (v_reused)
                  union all
                  select r.message_id, r.content_hash, 'repeated', 3
                    from memory_private.repeated_sources(p_job, p_output ->> 'summary', v_cited) r
                 ) u
           order by u.message_id, u.rank) d;

  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  select p_job.workspace_id, p_job.scope_id, 'extracted', p_output ->> 'title',
         p_output ->> 'summary',
         -- Statements are attributed to the people whose messages the record rests on (V9);
         -- grants follow every repository those messages drew on (V6).
         coalesce(array_agg(distinct m.speaker_id order by m.speaker_id)
                    filter (where m.role = 'user'), '{}'),
         coalesce(array_agg(distinct q.thread_id order by q.thread_id), '{}'),
         coalesce(array(select distinct x from memory_private.messages mm,
                                              unnest(mm.repositories) as x
                         where mm.workspace_id = p_job.workspace_id
                           and mm.message_id = any (v_dep_ids) order by 1), '{}'),
         p_job.input ->> 'bot_identity', p_job.origin_request_id, v_now
    from memory_private.messages m
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where m.workspace_id = p_job.workspace_id and m.message_id = any (v_dep_ids)
  returning record_id into v_record_id;
  -- The dependencies; the cited ones are the sources, numbered in the order the summary uses
  -- them: by the first line that cites each, then those no line cites, in the order the
  -- output listed them.
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via, position)
  select p_job.workspace_id, v_record_id, d.id, d.hash, d.via, o.position
    from unnest(v_dep_ids, v_dep_hashes, v_dep_via) as d(id, hash, via)
    left join (select f.id, row_number() over (order by f.first_line nulls last, f.n) as position
                 from (select c.id, c.n,
                              (select min(l.line_no)
                                 from memory_private.line_citations(p_output ->> 'summary',
                                                                    v_cited) l
                                where l.message_id = c.id) as first_line
                         from unnest(v_cited) with ordinality as c(id, n)) f) o
      on d.via = 'cited' and o.id = d.id;
  perform memory_private.mark_consolidation_due(p_job.workspace_id, p_job.scope_id);
  return jsonb_build_object('record_id', v_record_id,
                            'sources', cardinality(v_cited),
                            'dependencies', cardinality(v_dep_ids),
                            'repeated', (select count(*) from unnest(v_dep_via) v
                                          where v = 'repeated'));
end
$$;
comment on function memory_private.write_extraction(memory_private.jobs, jsonb) is
  'Writes the record of a validated, non-empty extraction output: its sources (the cited '
  'messages in the order given), its dependencies (cited, reused, repeated) with the hashes '
  'the job saw, speakers, threads and repositories taken from the dependencies; marks the '
  'scope due for consolidation. Returns the record id and the counts.';

create function memory_private.install_index(
  p_workspace_id text, p_scope_id bigint, p_text text, p_record_ids bigint[],
  p_candidate_ids bigint[], p_bot_identity text
) returns void
  language plpgsql volatile
  as $$
begin
  -- The index text may speak of any candidate the model saw: it depends on all of them, and
  -- keeps what they rest on (their dependencies, bot identity and repositories) so that recall
  -- checks it in one pass (memory_private.index_holds).
  update memory_private.scopes
     set index_text = p_text, index_record_ids = p_record_ids,
         index_candidate_ids = p_candidate_ids, index_built_at = memory_private.clock_now(),
         index_bot_identity = p_bot_identity,
         index_repositories = array(select distinct x from memory_private.records r,
                                                          unnest(r.repositories) as x
                                     where r.workspace_id = p_workspace_id
                                       and r.record_id = any(p_candidate_ids) order by 1)
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  delete from memory_private.index_dependencies
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  insert into memory_private.index_dependencies
    (workspace_id, scope_id, message_id, content_hash)
  select distinct on (d.message_id) p_workspace_id, p_scope_id, d.message_id, d.content_hash
    from memory_private.record_dependencies d
   where d.workspace_id = p_workspace_id and d.record_id = any(p_candidate_ids)
   order by d.message_id;
end
$$;
comment on function memory_private.install_index(text, bigint, text, bigint[], bigint[], text) is
  'Makes p_text the scope''s index, naming p_record_ids and built from p_candidate_ids under '
  'the bot identity p_bot_identity: the candidates, their repositories and their dependencies '
  '(memory_private.index_dependencies) are kept with it.';

create function memory_private.write_index(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_ids bigint[] := array(select jsonb_array_elements_text(p_output -> 'record_ids')::bigint);
  v_candidates bigint[] := array(select x::bigint
                                   from jsonb_array_elements_text(p_job.input -> 'candidates') x);
  v_still_due boolean;
begin
  -- A record made after the snapshot changes the candidates: the index is still written, and
  -- the scope stays due for another consolidation.
  v_still_due := array(select x from unnest(memory_private.recent_valid_records(
                                p_job.workspace_id, p_job.scope_id, (memory_private.policy()).candidates)) x
                      order by x)
                 <> array(select x from unnest(v_candidates) x order by x);
  perform memory_private.install_index(p_job.workspace_id, p_job.scope_id,
                                       p_output ->> 'index', v_ids, v_candidates,
                                       p_job.input ->> 'bot_identity');
  update memory_private.scopes
     set consolidation_due_at = case when v_still_due
                                     then coalesce(consolidation_due_at, v_now) end
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id;
  return jsonb_build_object('index_record_ids', to_jsonb(v_ids),
                            'index_candidates', cardinality(v_candidates),
                            'consolidation_still_due', v_still_due);
end
$$;
comment on function memory_private.write_index(memory_private.jobs, jsonb) is
  'Writes a validated consolidation output as the scope index, with every candidate the model '
  'saw as its dependencies (index_candidate_ids); the scope stays due when its valid records '
  'changed since the snapshot.';

create function memory.commit_job(p_workspace_id text, p_job_id bigint, p_token text)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
  v_output jsonb;
  v_now timestamptz := memory_private.clock_now();
  v_result jsonb;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id;
  if v_job.config_version <> v_config then
    raise exception 'the model/provider configuration of workspace % changed (version % -> %)',
      p_workspace_id, v_job.config_version, v_config using errcode = 'MB022',
      hint = 'Drop the work: maintenance stops the job.';
  end if;
  v_reason := memory_private.job_stale_reason(v_job);
  if v_reason is not null then
    raise exception 'the input of job % changed: %', p_job_id, v_reason using errcode = 'MB021',
      hint = 'Drop the work: maintenance supersedes the job and schedules a fresh snapshot.';
  end if;
  if v_job.checkpoint is null then
    raise exception 'job % has no checkpoint to commit', p_job_id using errcode = 'MB025',
      hint = 'Call memory.save_checkpoint with the model output first.';
  end if;
  v_output := memory_private.validate_output(v_job, v_job.checkpoint -> 'output');

  if v_job.phase = 'extract' then
    v_result := jsonb_build_object('record_id', null);
    if v_output ->> 'title' <> '' then
      v_result := memory_private.write_extraction(v_job, v_output);
    end if;
    -- The batch is handled at these hashes, also by an empty (no-op) output.
    insert into memory_private.extracted_sources
      (workspace_id, scope_id, message_id, content_hash, outcome, job_id, created_at)
    select p_workspace_id, v_job.scope_id, s.id, s.hash, 'extracted', v_job.job_id, v_now
      from jsonb_to_recordset(v_job.input -> 'sources') as s(id text, hash text)
    on conflict do nothing;
    v_result := v_result || jsonb_build_object('status', 'committed', 'phase', 'extract',
                                               'noop', v_result ->> 'record_id' is null);
  else
    v_result := memory_private.write_index(v_job, v_output)
                || jsonb_build_object('status', 'committed', 'phase', 'consolidate');
  end if;

  update memory_private.jobs
     set status = 'succeeded', token = null, worker_id = null, lease_expires_at = null,
         checkpoint = null, result = v_result, finished_at = v_now, updated_at = v_now
   where workspace_id = p_workspace_id and job_id = p_job_id;
  return v_result || jsonb_build_object('job_id', p_job_id);
end
$$;
comment on function memory.commit_job(text, bigint, text) is
  'Writes a job''s checkpointed output and marks the job succeeded, after re-checking '
  'ownership (MB020), the config version (MB022) and that the input snapshot is still current '
  '(MB021). extract: one record whose sources are the cited messages and whose dependencies '
  'are what it was made from (cited, reused, repeated), the batch marked extracted, the scope '
  'due for consolidation; an empty output only marks the batch. consolidate: the scope index, '
  'depending on every candidate. All or nothing.';

create function memory.fail_job(
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

revoke all on function
  memory.claim_job(text),
  memory.extend_lease(text, bigint, text),
  memory.start_attempt(text, bigint, text, numeric),
  memory.save_checkpoint(text, bigint, text, jsonb, jsonb),
  memory.commit_job(text, bigint, text),
  memory.fail_job(text, bigint, text, text, text, jsonb)
from public;
grant execute on function
  memory.claim_job(text),
  memory.extend_lease(text, bigint, text),
  memory.start_attempt(text, bigint, text, numeric),
  memory.save_checkpoint(text, bigint, text, jsonb, jsonb),
  memory.commit_job(text, bigint, text),
  memory.fail_job(text, bigint, text, text, text, jsonb)
to memory_worker;
