-- 42_job_api.sql: the worker's side of a job's life (P1, P12-P14, P17-P19).
--
-- The worker calls only these: claim_job, extend_lease, start_attempt, save_checkpoint,
-- commit_job, fail_job. Each is one short transaction under the workspace's memory lock; no lock
-- is held across a model call. commit_job writes what a checkpoint holds: the record of an
-- extraction (write_extraction: its sources and dependencies, 20_memory_state.sql) or the scope
-- index of a consolidation (write_index).
--
-- Plans: the statements these functions run (and those of what they call) read one
-- workspace's rows by key, or the due jobs through jobs_claimable_idx, so one generic plan
-- serves every call. They run with plan_cache_mode = force_generic_plan: otherwise PostgreSQL
-- plans about 40 of a job's statements again on every call (a custom plan looks cheaper once
-- the arguments are folded in), 2.5 ms of a job (docs/worker.md, "What a tick costs the
-- database").

create function memory_private.claim_workspace_job(p_workspace_id text, p_worker_id text)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
  v_token uuid;
begin
  -- The workspace's memory lock, without waiting: another claim or a memory write holds it
  -- briefly.
  if not memory_private.try_lock_workspace(p_workspace_id) then
    return null;
  end if;
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id and not paused;
  if not found then
    return null;
  end if;
  -- Re-read under the lock: a concurrent claim may have committed a running job meanwhile.
  if exists (select 1 from memory_private.jobs j
              where j.workspace_id = p_workspace_id and j.status = 'running') then
    return null;
  end if;
  loop
    select * into v_job from memory_private.jobs j
     where j.workspace_id = p_workspace_id and j.status = 'pending'
       and j.next_attempt_at <= v_now
       and memory_private.job_claimable(j.claims, j.checkpoint)
     order by j.next_attempt_at, j.job_id
     limit 1
       for update skip locked;
    exit when not found;
    if v_job.config_version <> v_config then
      perform memory_private.release_job(v_job, 'stopped',
        format('the model/provider configuration changed (version %s -> %s)',
               v_job.config_version, v_config));
    else
      v_reason := memory_private.job_stale_reason(v_job);
      if v_reason is not null then
        perform memory_private.release_job(v_job, 'superseded', 'input changed: ' || v_reason);
      end if;
    end if;
    if v_job.config_version <> v_config or v_reason is not null then
      -- its scope needs a new snapshot: the next tick derives it
      perform memory_private.note_change(p_workspace_id, 'updated', null, v_job.scope_id);
      continue;
    end if;
    -- The claim is counted by start_attempt, when it can reach the provider. The token is
    -- drawn first: Citus takes no volatile function in an UPDATE of a distributed table.
    v_token := gen_random_uuid();
    update memory_private.jobs
       set status = 'running', token = v_token, worker_id = p_worker_id,
           lease_expires_at = v_now + (memory_private.policy()).lease, updated_at = v_now
     where workspace_id = v_job.workspace_id and job_id = v_job.job_id
    returning * into v_job;
    return memory_private.job_payload(v_job);
  end loop;
  return null;
end
$$;
comment on function memory_private.claim_workspace_job(text, text) is
  'Claims the next due job of one workspace under its memory lock (not waiting for it): NULL '
  'when the lock is busy, the workspace is paused, a job of it is running, or none is due. '
  'Jobs found stale on the way are superseded or stopped. memory.claim_job calls it for the '
  'workspaces it picks; on Citus the call runs on the node holding the workspace.';

create function memory_private.on_citus_worker_node() returns boolean
  language plpgsql stable
  as $$
begin
  -- citus_is_coordinator() exists only with Citus: PL/pgSQL resolves it only when reached.
  if not exists (select 1 from pg_extension where extname = 'citus') then
    return false;
  end if;
  return not coalesce(citus_is_coordinator(), true);
end
$$;
comment on function memory_private.on_citus_worker_node() is
  'True on a Citus node other than the coordinator (a worker with the cluster''s metadata, which '
  'a caller may send a workspace''s calls to: docs/scaling.md, "Routing"); false on the '
  'coordinator and on plain PostgreSQL.';

create function memory_private.node_due_workspaces(p_now timestamptz) returns setof text
  language plpgsql stable
  as $$
declare
  v_query text;
begin
  -- The workspaces this Citus worker node holds with a job claim_job may take, by their
  -- earliest due job: read from the node's own shards of memory_private.jobs and their
  -- co-located shards of memory_private.workspaces, as Citus's metadata places them
  -- (pg_dist_shard, pg_dist_placement). A read of the distributed tables would visit every
  -- node; this one stays here. It may be stale (a shard moving away, a claim committing): the
  -- claim itself is claim_workspace_job's, under the workspace's lock, routed by Citus.
  select string_agg(format(
           'select j.workspace_id, j.next_attempt_at from %s j join %s w using (workspace_id) '
           'where j.status = ''pending'' and j.next_attempt_at <= $1 '
           'and memory_private.job_claimable(j.claims, j.checkpoint) and not w.paused '
           'and not exists (select 1 from %1$s r where r.workspace_id = j.workspace_id '
           'and r.status = ''running'')',
           shard_name('memory_private.jobs'::regclass, j.shardid),
           shard_name('memory_private.workspaces'::regclass, w.shardid)), ' union all ')
    into v_query
    from pg_dist_shard j
    join pg_dist_placement p on p.shardid = j.shardid
    join pg_dist_shard w on w.logicalrelid = 'memory_private.workspaces'::regclass
                        and w.shardminvalue = j.shardminvalue
   where j.logicalrelid = 'memory_private.jobs'::regclass
     and p.groupid = (select groupid from pg_dist_local_group);
  if v_query is null then
    return;
  end if;
  return query execute format(
    'select d.workspace_id from (%s) d group by d.workspace_id '
    'order by min(d.next_attempt_at), d.workspace_id', v_query)
    using p_now;
exception
  when undefined_table then
    return;  -- a shard that moved away was dropped meanwhile: the next claim reads the new map
end
$$;
comment on function memory_private.node_due_workspaces(timestamptz) is
  'On a Citus worker node: the workspaces it holds (its own shards, per Citus''s metadata) with '
  'a job claim_job may take now, workspace not paused and with no running job, by their '
  'earliest due job. May be stale; claim_workspace_job re-checks under the workspace''s lock.';

create function memory.claim_job(p_worker_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  set plan_cache_mode = force_generic_plan
  as $$
declare
  -- The pick reads the due jobs of every workspace (jobs_claimable_idx) without locking them:
  -- on Citus a multi-shard FOR UPDATE SKIP LOCKED does not exist, and the candidates may be
  -- stale by the time they are tried. A job with calls left is claimable, and so is one holding
  -- a checkpoint whatever its count: its claim only commits. A workspace comes at its earliest
  -- due job (the order of the workspaces by their earliest due job) and is tried once. A
  -- declared cursor is planned to start fast: the jobs are read in the index's order and the
  -- first claim ends the walk, so a claim reads the jobs ahead of the one it takes, not every
  -- due job.
  c_due cursor (p_now timestamptz) for
    select j.workspace_id
      from memory_private.jobs j
      join memory_private.workspaces w on w.workspace_id = j.workspace_id
     where j.status = 'pending' and j.next_attempt_at <= p_now
       and memory_private.job_claimable(j.claims, j.checkpoint)
       and not w.paused
       and not exists (select 1 from memory_private.jobs r
                        where r.workspace_id = j.workspace_id and r.status = 'running')
     order by j.next_attempt_at, j.workspace_id;
  v_tried text[] := '{}';
  v_payload jsonb;
  v_ws text;
begin
  perform memory_private.check_id('worker_id', p_worker_id);
  -- Called on a Citus worker node (a worker sending its claims to each node in turn,
  -- docs/scaling.md), the claim picks among the workspaces that node holds, so a claim and
  -- the calls of its job run there; the coordinator (and one server) picks among all.
  if memory_private.on_citus_worker_node() then
    for v_ws in select memory_private.node_due_workspaces(memory_private.clock_now()) loop
      v_payload := memory_private.claim_workspace_job(v_ws, p_worker_id);
      if v_payload is not null then
        return v_payload;
      end if;
    end loop;
    return null;
  end if;
  -- The claim itself is one workspace's business (claim_workspace_job), which re-checks
  -- everything under the workspace's lock; the FROM form lets Citus run it on the workspace's
  -- node.
  for v_due in c_due(memory_private.clock_now()) loop
    continue when v_due.workspace_id = any (v_tried);
    v_tried := v_tried || v_due.workspace_id;
    select c into v_payload
      from memory_private.claim_workspace_job(v_due.workspace_id, p_worker_id) c;
    if v_payload is not null then
      return v_payload;
    end if;
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
  'opens its model call. Called on a Citus worker node, it picks among the workspaces that node '
  'holds (memory_private.node_due_workspaces); on the coordinator or one server, among all.';

create function memory.extend_lease(p_workspace_id text, p_job_id bigint, p_token text)
  returns timestamptz
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  set plan_cache_mode = force_generic_plan
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
  set plan_cache_mode = force_generic_plan
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
  if memory_private.calls_left(v_job.claims) <= 0 then
    raise exception 'the input of job % has made its three model calls', p_job_id
      using errcode = 'MB025', hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  select b.request_left, b.workspace_left into v_request_left, v_workspace_left
    from memory_private.budget_left(p_workspace_id, v_job.origin_request_id) b;
  if p_reserve_usd > v_request_left then
    raise exception 'a reserve of $% does not fit the $% left of request %', p_reserve_usd,
      greatest(v_request_left, 0), v_job.origin_request_id using errcode = 'MB024',
      hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
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
  set plan_cache_mode = force_generic_plan
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

-- What a record rests on -----------------------------------------------------------------------
-- A record depends on everything its model call was shown: every message of its batch at the
-- hash the job saw, and every dependency of every memory shown with the batch (P5: what those
-- rest on stays tracked without resending it). The model is stateless per call, so nothing
-- else can be in its output, and whatever it restates, in whatever spelling or words, goes
-- when what it was shown goes (docs/retention.md). Its sources are what its output cites.

create function memory_private.write_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_cited text[] := array(select jsonb_array_elements_text(p_output -> 'source_ids'));
  v_counts jsonb;
  v_speakers text[];
  v_threads text[];
  v_repositories text[];
  v_record_id bigint;
begin
  -- Statements are attributed to the people whose messages the output cites (V9: the speaker
  -- of a line is who said it); grants follow every repository any dependency drew on (V6).
  -- Read first, then written by key: on Citus an INSERT ... SELECT cannot carry a subquery
  -- beside aggregates.
  select coalesce(array_agg(distinct m.speaker_id order by m.speaker_id)
                    filter (where m.role = 'user'), '{}'),
         coalesce(array_agg(distinct q.thread_id order by q.thread_id), '{}')
    into v_speakers, v_threads
    from memory_private.messages m
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where m.workspace_id = p_job.workspace_id and m.message_id = any (v_cited);
  v_repositories := coalesce(array(
    select distinct x
      from memory_private.messages mm, unnest(mm.repositories) as x
     where mm.workspace_id = p_job.workspace_id
       and (mm.message_id in (select s.id from jsonb_to_recordset(p_job.input -> 'sources')
                                                 as s(id text))
            or mm.message_id in (select d.message_id from memory_private.record_dependencies d
                                  where d.workspace_id = p_job.workspace_id
                                    and d.record_id in (select e::bigint from
                                          jsonb_array_elements_text(p_job.input -> 'existing') e)))
     order by 1), '{}');
  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  values (p_job.workspace_id, p_job.scope_id, 'extracted', p_output ->> 'title',
          p_output ->> 'summary', v_speakers, v_threads, v_repositories,
          p_job.input ->> 'bot_identity', p_job.origin_request_id, v_now)
  returning record_id into v_record_id;
  -- Everything the call was shown, each message once under its first reason: cited (a source,
  -- numbered in the order the summary uses them: by the first line that cites each, then those
  -- no line cites, in the order the output listed them), shown (the rest of the batch, at the
  -- hash the job saw) and inherited (what the memories shown with the batch rest on, at the
  -- hash they kept; commit_job has checked that each is still valid).
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via, position)
  select distinct on (u.message_id) p_job.workspace_id, v_record_id, u.message_id,
         u.content_hash, u.via, u.position
    from (select s.id as message_id, s.hash as content_hash,
                 case when o.position is not null then 'cited' else 'shown' end as via,
                 o.position, 1 as rank
            from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
            left join (select f.id,
                              row_number() over (order by f.first_line nulls last, f.n)
                                as position
                         from (select c.id, c.n,
                                      (select min(l.line_no)
                                         from memory_private.line_citations(
                                                p_output ->> 'summary', v_cited) l
                                        where l.message_id = c.id) as first_line
                                 from unnest(v_cited) with ordinality as c(id, n)) f) o
              on o.id = s.id
          union all
          select d.message_id, d.content_hash, 'inherited', null, 2
            from memory_private.record_dependencies d
           where d.workspace_id = p_job.workspace_id
             and d.record_id in (select e::bigint
                                   from jsonb_array_elements_text(p_job.input -> 'existing') e)
         ) u
   order by u.message_id, u.rank;
  select jsonb_build_object(
           'dependencies', count(*),
           'shown', count(*) filter (where via = 'shown'),
           'inherited', count(*) filter (where via = 'inherited'),
           -- 0.1.0's name of the uncited messages of the batch a record rests on
           'repeated', count(*) filter (where via = 'shown'))
    into v_counts
    from memory_private.record_dependencies
   where workspace_id = p_job.workspace_id and record_id = v_record_id;
  perform memory_private.mark_consolidation_due(p_job.workspace_id, p_job.scope_id);
  return jsonb_build_object('record_id', v_record_id, 'sources', cardinality(v_cited))
         || v_counts;
end
$$;
comment on function memory_private.write_extraction(memory_private.jobs, jsonb) is
  'Writes the record of a validated, non-empty extraction output: its sources (the cited '
  'messages, numbered in the order the summary uses them) and its dependencies, everything the '
  'call was shown (cited; shown: the rest of the batch at the hashes the job saw; inherited: '
  'what the memories shown with the batch rest on); speakers and threads from the sources, '
  'repositories from every dependency; marks the scope due for consolidation. Returns the '
  'record id and the counts (sources, dependencies, shown, inherited).';

create function memory_private.install_index(
  p_workspace_id text, p_scope_id bigint, p_text text, p_record_ids bigint[],
  p_candidate_ids bigint[], p_bot_identity text
) returns void
  language plpgsql volatile
  as $$
declare
  v_repositories text[];
begin
  -- The index text may speak of any candidate the model saw: it depends on all of them, and
  -- keeps what they rest on (their dependencies, bot identity and repositories) so that recall
  -- checks it in one pass (memory_private.index_holds).
  -- A new index replaces the old one whole: its row and, with it, its dependencies. (The
  -- repositories are read first: Citus takes no subquery in an INSERT ... VALUES.)
  v_repositories := array(select distinct x
                            from memory_private.records r, unnest(r.repositories) as x
                           where r.workspace_id = p_workspace_id
                             and r.record_id = any(p_candidate_ids)
                           order by 1);
  delete from memory_private.scope_indexes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  insert into memory_private.scope_indexes
    (workspace_id, scope_id, index_text, record_ids, candidate_ids, bot_identity, repositories,
     built_at)
  values (p_workspace_id, p_scope_id, p_text, p_record_ids, p_candidate_ids, p_bot_identity,
          v_repositories, memory_private.clock_now());
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
  'saw as its dependencies (scope_indexes.candidate_ids); the scope stays due when its valid '
  'records changed since the snapshot.';

create function memory.commit_job(p_workspace_id text, p_job_id bigint, p_token text)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  set plan_cache_mode = force_generic_plan
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
  -- The checkpoint is the output as save_checkpoint validated and redacted it against this
  -- job's input; only save_checkpoint writes one, and the one place that rewrites an input
  -- (memory_private.scrub_erased) drops it. So it is not validated again.
  v_output := v_job.checkpoint -> 'output';

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
  'are everything the model call was shown (the batch, and what the memories shown with it '
  'rest on), the batch marked extracted, the scope due for consolidation; an empty output '
  'only marks the batch. consolidate: the scope index, depending on every candidate. All or '
  'nothing.';

create function memory.fail_job(
  p_workspace_id text, p_job_id bigint, p_token text, p_outcome text, p_error text,
  p_usage jsonb default null
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  set plan_cache_mode = force_generic_plan
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
       set claims = claims + least(1, memory_private.calls_left(claims))
     where workspace_id = v_job.workspace_id and job_id = v_job.job_id
    returning * into v_job;
  end if;
  -- A paid, valid checkpoint is never dropped: the job waits with it and commits it later.
  if v_job.checkpoint is null and memory_private.calls_left(v_job.claims) <= 0 then
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
