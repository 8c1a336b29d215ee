-- 45_scheduling.sql: maintenance, the tick that turns facts into jobs (P2-P5, P10, P15, V5, V10).
--
-- memory.run_maintenance runs, for each workspace under its memory lock, the steps listed in
-- memory_private.maintenance_steps in position order. Each step is a function
-- (p_workspace_id text) returns jsonb of counts; the counts of all steps and workspaces are
-- summed into the answer. Another file adds a step with one insert, e.g.
--   insert into memory_private.maintenance_steps (position, name, step)
--   values (50, 'retention', 'memory_private.sweep_retention(text)');
-- Positions: 10 expire leases, 20 retire stale jobs, 90 schedule jobs; a step that changes
-- records (retention, pruning) belongs between 20 and 90 so its consolidation is scheduled in
-- the same tick.
--
-- Extraction: a conversation (one request: its user and assistant messages) qualifies when the
-- request is interactive and succeeded, the conversation's own last activity (the request's
-- update or finish, its messages' creation or edit) is older than the workspace's idle window,
-- the scope has recall on, the workspace is not paused, and it has retained directed user and
-- assistant messages, not tombstoned in the scope, at least one of which is not yet extracted
-- at its current content hash. The window is per conversation, not per scope: in a busy group
-- topic, someone always talking must not hold back everyone's finished conversations. Scheduled requests have no scope (V5); group
-- messages not directed at the bot are never stored (V10). The batch takes the most recent
-- conversations whose texts fit 24,000 bytes together; a conversation that cannot fit alone is
-- recorded as a 'skipped' job and its messages marked skipped, so it is never retried.
-- Consolidation: a scope whose index is due gets a job over its 48 most recent valid records,
-- or, with no valid record, just loses its index.

create table memory_private.maintenance_steps (
  position integer primary key,
  name text not null unique,
  step regprocedure not null
);
comment on table memory_private.maintenance_steps is
  'The steps memory.run_maintenance runs for each workspace, in position order: functions '
  '(p_workspace_id text) returning jsonb counts. Not per workspace: the same steps run '
  'everywhere.';

create function memory_private.add_counts(p_total jsonb, p_more jsonb) returns jsonb
  language plpgsql immutable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_key text;
  v_value jsonb;
  v_total jsonb := coalesce(p_total, '{}'::jsonb);
begin
  for v_key, v_value in select key, value from jsonb_each(coalesce(p_more, '{}'::jsonb)) loop
    if jsonb_typeof(v_value) = 'number'
       and jsonb_typeof(coalesce(v_total -> v_key, '0'::jsonb)) = 'number' then
      v_total := v_total || jsonb_build_object(
        v_key, coalesce((v_total ->> v_key)::numeric, 0) + (v_value #>> '{}')::numeric);
    else
      v_total := v_total || jsonb_build_object(v_key, v_value);
    end if;
  end loop;
  return v_total;
end
$$;
comment on function memory_private.add_counts(jsonb, jsonb) is
  'Adds the numeric counts of one JSON object to another (other values: the newer wins).';

create function memory_private.input_carryover(
  p_workspace_id text, p_scope_id bigint, p_phase text, p_input_hash text,
  p_config_version integer,
  out blocked boolean, out claims integer, out next_attempt_at timestamptz
)
  language sql stable
  set search_path = pg_catalog, pg_temp
  as $$
  -- The most recent earlier job of the same input (scope, phase, input hash) under the same
  -- configuration decides: stopped (unknown outcome, three failed calls; an operator retry is a
  -- newer job) blocks the input (P13); superseded (a transient change: bot or recall off and on,
  -- a source edited and edited back) hands its model calls and its backoff on, so the count is
  -- per unchanged input whatever happened in between; anything else starts afresh.
  select coalesce(bool_or(j.status = 'stopped'
                          or (j.status = 'superseded'
                              and j.claims >= (memory_private.policy()).max_claims)), false),
         coalesce(max(j.claims) filter (where j.status = 'superseded'), 0),
         greatest(memory_private.clock_now(),
                  max(j.next_attempt_at) filter (where j.status = 'superseded'))
    from (select * from memory_private.jobs j
           where j.workspace_id = p_workspace_id and j.scope_id = p_scope_id
             and j.phase = p_phase and j.input_hash = p_input_hash
             and j.config_version = p_config_version and j.status <> 'skipped'
           order by j.job_id desc
           limit 1) j
$$;
comment on function memory_private.input_carryover(text, bigint, text, text, integer) is
  'What an input (scope, phase, input hash, config version) carries into a new job from its '
  'most recent earlier job: blocked (it stopped, or was superseded after its three model '
  'calls), and otherwise the model calls already made and the backoff of a superseded job. '
  'This keeps "at most three model calls per unchanged input" across transient supersedes.';

create function memory_private.create_job(
  p_workspace_id text, p_scope_id bigint, p_phase text, p_input jsonb, p_input_hash text,
  p_origin_request_id text, p_config_version integer
) returns bigint
  language sql volatile
  set search_path = pg_catalog, pg_temp
  as $$
  insert into memory_private.jobs
    (workspace_id, scope_id, phase, input, input_hash, origin_request_id, model_provider,
     model_id, config_version, claims, next_attempt_at, created_at, updated_at)
  select p_workspace_id, p_scope_id, p_phase, p_input, p_input_hash, r.request_id,
         r.model_provider, r.model_id, p_config_version, c.claims, c.next_attempt_at,
         memory_private.clock_now(), memory_private.clock_now()
    from memory_private.requests r
   cross join memory_private.input_carryover(p_workspace_id, p_scope_id, p_phase, p_input_hash,
                                             p_config_version) c
   where r.workspace_id = p_workspace_id and r.request_id = p_origin_request_id
  returning job_id
$$;
comment on function memory_private.create_job(text, bigint, text, jsonb, text, text, integer) is
  'Creates a pending job pinned to the originating request''s model/provider and the workspace '
  'configuration version it was made under (P17, P20), carrying over the model calls and '
  'backoff its input already had (memory_private.input_carryover): due now otherwise. The '
  'caller checks that the input is not blocked.';

create function memory_private.schedule_extraction(p_workspace_id text, p_scope_id bigint)
  returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws memory_private.workspaces;
  v_scope memory_private.scopes;
  v_now timestamptz := memory_private.clock_now();
  v_cutoff timestamptz;
  v_identity text;
  v_unit record;
  v_ceiling integer := (memory_private.policy()).batch_bytes;
  v_bytes integer := 0;
  v_batch jsonb := '[]';
  v_origin text;
  v_skipped jsonb := '[]';
  v_skip_origin text;
  v_skip_reason text;
  v_input jsonb;
  v_hash text;
  v_request memory_private.requests;
  v_open memory_private.jobs;
  v_skip_job bigint;
  v_result jsonb := '{}';
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if v_ws.paused or not v_scope.recall_enabled then
    return v_result;
  end if;
  select identity into v_identity from memory_private.bots
   where workspace_id = p_workspace_id and bot_id = v_scope.bot_id and active;
  if v_identity is null then
    return v_result;
  end if;
  v_cutoff := v_now - v_ws.idle_window;

  for v_unit in
    select r.request_id, sum(octet_length(m.body))::integer as bytes,
           jsonb_agg(jsonb_build_object('id', m.message_id, 'hash', m.content_hash)
                     order by m.created_at, m.message_id) as sources
      from memory_private.requests r
      join memory_private.messages m
        on m.workspace_id = r.workspace_id and m.request_id = r.request_id
      left join memory_private.extracted_sources e
        on e.workspace_id = m.workspace_id and e.scope_id = v_scope.scope_id
       and e.message_id = m.message_id and e.content_hash = m.content_hash
     where r.workspace_id = p_workspace_id and r.kind = 'interactive'
       and r.status = 'succeeded' and r.finished_at <= v_cutoff
       and r.bot_id = v_scope.bot_id and r.chat_id = v_scope.chat_id
       and (v_scope.kind = 'private' or r.topic_id = v_scope.topic_id)
       and memory_private.is_retained(m.body is not null, m.retain_until, v_now)
       and (m.directed or v_scope.kind = 'private')
       and not exists (select 1 from memory_private.tombstones t
                        where t.workspace_id = m.workspace_id and t.scope_id = v_scope.scope_id
                          and t.message_id = m.message_id)
     group by r.request_id, r.finished_at, r.created_at, r.updated_at
    having bool_or(m.role = 'user') and bool_or(m.role = 'assistant')
       and bool_or(e.message_id is null)
       -- Idle window, per conversation: its own last activity (the request's update or finish,
       -- its messages' creation or edit; removed messages count too).
       and greatest(r.updated_at, r.finished_at,
                    (select max(greatest(a.created_at, a.edited_at, a.removed_at))
                       from memory_private.messages a
                      where a.workspace_id = p_workspace_id and a.request_id = r.request_id))
           <= v_cutoff
     order by r.finished_at desc, r.created_at desc, r.request_id desc
  loop
    if v_unit.bytes > v_ceiling then
      v_skipped := v_skipped || v_unit.sources;
      v_skip_origin := coalesce(v_skip_origin, v_unit.request_id);
      v_skip_reason := coalesce(v_skip_reason, format(
        'the conversation of request %s is %s bytes: not even one user/assistant pair fits '
        'the %s-byte batch ceiling', v_unit.request_id, v_unit.bytes, v_ceiling));
    elsif v_bytes + v_unit.bytes <= v_ceiling then
      v_batch := v_batch || v_unit.sources;
      v_bytes := v_bytes + v_unit.bytes;
      v_origin := coalesce(v_origin, v_unit.request_id);
    else
      exit;   -- older conversations wait for the next batch
    end if;
  end loop;

  if jsonb_array_length(v_skipped) > 0 then
    select * into v_request from memory_private.requests
     where workspace_id = p_workspace_id and request_id = v_skip_origin;
    v_input := jsonb_build_object('bot_identity', v_identity, 'sources', v_skipped,
                                  'existing', '[]'::jsonb);
    insert into memory_private.jobs
      (workspace_id, scope_id, phase, status, input, input_hash, origin_request_id,
       model_provider, model_id, config_version, next_attempt_at, last_error, created_at,
       updated_at, finished_at)
    values (p_workspace_id, p_scope_id, 'extract', 'skipped', v_input,
            memory_private.content_hash(v_input::text), v_skip_origin, v_request.model_provider,
            v_request.model_id, v_ws.config_version, v_now, v_skip_reason, v_now, v_now, v_now)
    returning job_id into v_skip_job;
    insert into memory_private.extracted_sources
      (workspace_id, scope_id, message_id, content_hash, outcome, job_id, created_at)
    select p_workspace_id, p_scope_id, s.id, s.hash, 'skipped', v_skip_job, v_now
      from jsonb_to_recordset(v_skipped) as s(id text, hash text)
    on conflict do nothing;
    v_result := v_result || jsonb_build_object('batches_skipped', 1);
  end if;

  if jsonb_array_length(v_batch) = 0 then
    return v_result;
  end if;
  v_input := jsonb_build_object(
    'bot_identity', v_identity,
    'sources', (select jsonb_agg(s order by s ->> 'id') from jsonb_array_elements(v_batch) s),
    'existing', to_jsonb(memory_private.recent_valid_records(
                  p_workspace_id, p_scope_id, (memory_private.policy()).existing_with_batch)));
  v_hash := memory_private.content_hash(v_input::text);

  -- One open extraction job per scope. A running one finishes first; a pending one is replaced
  -- by the newer snapshot (P15) unless it already holds a valid checkpoint to commit.
  select * into v_open from memory_private.jobs
   where workspace_id = p_workspace_id and scope_id = p_scope_id and phase = 'extract'
     and status in ('pending', 'running')
     for update;
  if found then
    if v_open.status = 'running' or v_open.input_hash = v_hash
       or (v_open.checkpoint is not null and memory_private.job_stale_reason(v_open) is null) then
      return v_result;
    end if;
    perform memory_private.release_job(v_open, 'superseded',
      'the conversation changed: a newer snapshot replaces this one');
    v_result := v_result || jsonb_build_object('jobs_superseded_new_input', 1);
  end if;
  -- An input that was stopped (unknown outcome, three failed calls) under this configuration,
  -- or superseded after its three calls, is not replayed automatically (P13).
  if (memory_private.input_carryover(p_workspace_id, p_scope_id, 'extract', v_hash,
                                     v_ws.config_version)).blocked then
    return v_result || jsonb_build_object('replays_blocked', 1);
  end if;

  perform memory_private.create_job(p_workspace_id, p_scope_id, 'extract', v_input, v_hash,
                                    v_origin, v_ws.config_version);
  return v_result || jsonb_build_object('extract_jobs_created', 1);
end
$$;
comment on function memory_private.schedule_extraction(text, bigint) is
  'Creates (or renews) the extraction job of one scope when it has qualifying conversations: '
  'the most recent ones up to 24,000 bytes, with the scope''s recent valid memories; records a '
  'skipped job for a conversation that cannot fit alone. Returns counts.';

create function memory_private.schedule_consolidation(p_workspace_id text, p_scope_id bigint)
  returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws memory_private.workspaces;
  v_scope memory_private.scopes;
  v_now timestamptz := memory_private.clock_now();
  v_identity text;
  v_candidates bigint[];
  v_input jsonb;
  v_hash text;
  v_open memory_private.jobs;
  v_origin text;
  v_result jsonb := '{}';
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if v_ws.paused or not v_scope.recall_enabled or v_scope.consolidation_due_at is null then
    return v_result;
  end if;
  select identity into v_identity from memory_private.bots
   where workspace_id = p_workspace_id and bot_id = v_scope.bot_id and active;
  if v_identity is null then
    return v_result;
  end if;
  select * into v_open from memory_private.jobs
   where workspace_id = p_workspace_id and scope_id = p_scope_id and phase = 'consolidate'
     and status in ('pending', 'running')
     for update;
  if found and v_open.status = 'running' then
    return v_result;
  end if;

  v_candidates := memory_private.recent_valid_records(p_workspace_id, p_scope_id,
                                                       (memory_private.policy()).candidates);
  if cardinality(v_candidates) = 0 then
    if v_open.job_id is not null then
      perform memory_private.release_job(v_open, 'superseded', 'no valid record is left');
    end if;
    update memory_private.scopes
       set consolidation_due_at = null, index_text = null, index_record_ids = null,
           index_candidate_ids = null,
           index_built_at = null
     where workspace_id = p_workspace_id and scope_id = p_scope_id;
    return jsonb_build_object('indexes_cleared', 1);
  end if;

  v_input := jsonb_build_object('bot_identity', v_identity, 'candidates', to_jsonb(v_candidates));
  v_hash := memory_private.content_hash(v_input::text);
  if v_open.job_id is not null then
    if v_open.input_hash = v_hash
       or (v_open.checkpoint is not null and memory_private.job_stale_reason(v_open) is null) then
      return v_result;
    end if;
    perform memory_private.release_job(v_open, 'superseded',
      'the records changed: a newer snapshot replaces this one');
    v_result := jsonb_build_object('jobs_superseded_new_input', 1);
  end if;
  if (memory_private.input_carryover(p_workspace_id, p_scope_id, 'consolidate', v_hash,
                                     v_ws.config_version)).blocked then
    return v_result || jsonb_build_object('replays_blocked', 1);
  end if;

  -- The originating request: the most recent candidate's, preferring succeeded requests.
  select rec.origin_request_id into v_origin
    from memory_private.records rec
    join memory_private.requests r
      on r.workspace_id = rec.workspace_id and r.request_id = rec.origin_request_id
   where rec.workspace_id = p_workspace_id and rec.record_id = any(v_candidates)
   order by (r.status = 'succeeded') desc, rec.created_at desc, rec.record_id desc
   limit 1;
  if v_origin is null then
    return v_result || jsonb_build_object('consolidations_without_origin', 1);
  end if;
  perform memory_private.create_job(p_workspace_id, p_scope_id, 'consolidate', v_input, v_hash,
                                    v_origin, v_ws.config_version);
  return v_result || jsonb_build_object('consolidate_jobs_created', 1);
end
$$;
comment on function memory_private.schedule_consolidation(text, bigint) is
  'Creates (or renews) the consolidation job of a scope whose index is due, over its 48 most '
  'recent valid records, charged to the most recent candidate''s originating request; with no '
  'valid record, clears the index and the due flag instead. Returns counts.';

create function memory_private.schedule_jobs(p_workspace_id text) returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws memory_private.workspaces;
  v_now timestamptz := memory_private.clock_now();
  v_request text;
  v_scope memory_private.scopes;
  v_scope_id bigint;
  v_counts jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                       'batches_skipped', 0);
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  if v_ws.paused then
    return v_counts;
  end if;
  -- One representative request per scope that has something new to extract.
  for v_request in
    select min(r.request_id)
      from memory_private.requests r
      join memory_private.chats c on c.workspace_id = r.workspace_id and c.chat_id = r.chat_id
     where r.workspace_id = p_workspace_id and r.kind = 'interactive'
       and r.status = 'succeeded' and r.finished_at <= v_now - v_ws.idle_window
       and exists (select 1 from memory_private.messages m
                    where m.workspace_id = r.workspace_id and m.request_id = r.request_id
                      and memory_private.is_retained(m.body is not null, m.retain_until,
                                                     v_now)
                      and not exists (select 1 from memory_private.extracted_sources e
                                       where e.workspace_id = m.workspace_id
                                         and e.message_id = m.message_id
                                         and e.content_hash = m.content_hash))
     group by r.bot_id, r.chat_id, case when c.kind = 'group' then r.topic_id end
     order by 1
  loop
    v_scope := memory_private.scope_of_request(p_workspace_id, v_request);
    v_counts := memory_private.add_counts(v_counts,
                  memory_private.schedule_extraction(p_workspace_id, v_scope.scope_id));
  end loop;
  for v_scope_id in
    select scope_id from memory_private.scopes
     where workspace_id = p_workspace_id and consolidation_due_at is not null
     order by scope_id
  loop
    v_counts := memory_private.add_counts(v_counts,
                  memory_private.schedule_consolidation(p_workspace_id, v_scope_id));
  end loop;
  return v_counts;
end
$$;
comment on function memory_private.schedule_jobs(text) is
  'Maintenance step: schedules extraction for every scope with qualifying conversations and '
  'consolidation for every scope whose index is due (nothing while the workspace is paused). '
  'Returns counts.';

create function memory_private.maintain_workspace(p_workspace_id text) returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_step regproc;
  v_counts jsonb;
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
begin
  perform memory_private.lock_workspace(p_workspace_id);
  for v_step in
    select step::oid::regproc from memory_private.maintenance_steps order by position
  loop
    execute format('select %s($1)', v_step) into v_counts using p_workspace_id;
    v_total := memory_private.add_counts(v_total, v_counts);
  end loop;
  update memory_private.workspace_memory set maintained_at = memory_private.clock_now()
   where workspace_id = p_workspace_id;
  return v_total;
end
$$;
comment on function memory_private.maintain_workspace(text) is
  'Runs every maintenance step for one workspace under its memory lock and stamps '
  'maintained_at. '
  'Returns the summed counts.';

create function memory.run_maintenance(p_workspace_id text default null) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
  v_workspaces integer := 0;
begin
  if p_workspace_id is not null then
    perform memory_private.require_workspace(p_workspace_id);
  end if;
  for v_ws in
    select workspace_id from memory_private.workspaces
     where p_workspace_id is null or workspace_id = p_workspace_id
     order by workspace_id
  loop
    v_total := memory_private.add_counts(v_total, memory_private.maintain_workspace(v_ws));
    v_workspaces := v_workspaces + 1;
  end loop;
  return v_total || jsonb_build_object('workspaces', v_workspaces);
end
$$;
comment on function memory.run_maintenance(text) is
  'One maintenance tick for one workspace (or all when NULL, in one transaction: for small '
  'installs, tests and psql; the worker uses maintain_next_workspace so that no workspace lock '
  'is held longer than its own steps): expires leases, sweeps retention, retires jobs whose '
  'config or input changed, schedules extraction and consolidation jobs, plus any step other '
  'areas registered. Returns summed counts: extract_jobs_created, consolidate_jobs_created, '
  'leases_expired, batches_skipped, ...';

create function memory.maintain_next_workspace(p_after_workspace_id text default null)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
begin
  select workspace_id into v_ws from memory_private.workspace_memory
   where p_after_workspace_id is null or workspace_id > p_after_workspace_id
   order by workspace_id
   limit 1
     for no key update skip locked;
  if not found then
    return null;
  end if;
  return memory_private.maintain_workspace(v_ws) || jsonb_build_object('workspace_id', v_ws);
end
$$;
comment on function memory.maintain_next_workspace(text) is
  'Maintains the next workspace after p_after_workspace_id in id order (the first when NULL), '
  'skipping one another worker is maintaining right now, and answers its counts with its '
  'workspace_id; NULL when there is none left. The worker walks all workspaces with it, one '
  'short transaction each, so no lock is held across workspaces (P16).';

insert into memory_private.maintenance_steps (position, name, step) values
  (10, 'expire_leases', 'memory_private.expire_leases(text)'),
  (20, 'retire_stale_jobs', 'memory_private.retire_stale_jobs(text)'),
  (90, 'schedule_jobs', 'memory_private.schedule_jobs(text)');

revoke all on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  from public;
grant execute on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  to memory_worker, memory_operator;
