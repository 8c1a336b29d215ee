-- 80_operator.sql: what a DBA sees and may do (issue 9; docs/operations.md is the runbook).
--
-- One question each, for memory_operator: a function of the workspace (NULL: every workspace)
-- and the view that is that function over every workspace:
--   memory.workspace_status        per workspace: pause, budgets, records valid/invalid by reason,
--                                  pending consolidations, jobs by status, tombstones
--   memory.scope_status            per scope: recall on/off, records valid/invalid by reason, index
--                                  age and size, pending consolidation, open jobs, tombstones
--   memory.record_status           per record: kind, dates, usage, sources, why it is invalid now
--   memory.job_status              per job: phase, status, age, claims, next attempt, last error,
--                                  the outcome of its last attempt, and why it cannot be retried
--   memory.request_memory_charges  per request: what memory work charged to it (P18)
--   memory.waiting_status          per reason: what waits to become a memory, and why (also for
--                                  memory_worker)
-- Each function is security definer (the rules it reads are private) and reads only the
-- workspaces it is asked for, one at a time: on Citus each of its queries is one shard's
-- (memory_private.operator_workspaces). Its columns are written once, in its result; the view
-- is `select * from` it with NULL.
-- Nothing shows message text, a title, a summary or an index text: only ids, hashes, sizes,
-- dates, counts and the coded reasons. Validity is decided by the same read-time rule recall
-- uses (memory_private.invalid_records), a scope at a time and once per scope, without a
-- requester: a private scope is checked for its own user; a shared scope's per-requester checks
-- (membership, grants) need memory.explain_record with a requester.
--
-- Admin functions for memory_operator: memory.retry_job, memory.set_workspace_paused,
-- memory.explain_record. memory.run_maintenance and memory.delete_workspace (the purge) are
-- granted to the operator where they are defined.

-- What the status functions share -------------------------------------------------------------

create function memory_private.operator_workspaces(p_workspace_id text) returns text[]
  language plpgsql stable
  as $$
begin
  -- NULL: every workspace, in id order (read first, so that no cursor over every shard stays
  -- open while each workspace's rows are read). A workspace: that one, which must exist.
  if p_workspace_id is null then
    return array(select w.workspace_id from memory_private.workspaces w order by 1);
  end if;
  perform memory_private.require_workspace(p_workspace_id);
  return array[p_workspace_id];
end
$$;
comment on function memory_private.operator_workspaces(text) is
  'The workspaces a status function reads, one at a time: the given one (MB001/MB002 unless it '
  'is valid and known), or every workspace in id order when NULL.';

create function memory_private.scope_validity(p_workspace_id text, p_scope_id bigint)
  returns table (record_id bigint, reason text)
  language sql stable
  as $$
  -- The validity rule without a requester for every record of one scope, in one set.
  select v.record_id, v.reason
    from memory_private.invalid_records(
           p_workspace_id, p_scope_id,
           array(select r.record_id from memory_private.records r
                  where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id), null) v
$$;
comment on function memory_private.scope_validity(text, bigint) is
  'memory_private.invalid_records, without a requester, for every record of one scope: each '
  'record with why it may not be recalled now (NULL when it may).';

create function memory_private.scope_validity_counts(p_workspace_id text)
  returns table (scope_id bigint, records_valid bigint, records_invalid bigint,
                 invalid_by_reason jsonb)
  language plpgsql stable
  as $$
declare
  v_scope bigint;
begin
  -- A scope at a time, the scopes read first: on Citus the rule is a call of its own (a
  -- function over a shard's rows in one query is not something Citus plans).
  foreach v_scope in array array(select s.scope_id from memory_private.scopes s
                                  where s.workspace_id = p_workspace_id order by 1)
  loop
    return query
      select v_scope,
             coalesce(sum(g.n) filter (where g.reason is null), 0)::bigint,
             coalesce(sum(g.n) filter (where g.reason is not null), 0)::bigint,
             coalesce(jsonb_object_agg(g.reason, g.n) filter (where g.reason is not null),
                      '{}'::jsonb)
        from (select v.reason, count(*) as n
                from memory_private.scope_validity(p_workspace_id, v_scope) v
               group by 1) g;
  end loop;
end
$$;
comment on function memory_private.scope_validity_counts(text) is
  'For each scope of the workspace: how many of its records are valid and invalid now (the '
  'validity rule without a requester, memory_private.scope_validity) and the invalid ones by '
  'reason. What scope_status shows, and workspace_status sums.';

-- The status functions and their views ----------------------------------------------------------

create function memory.record_status(p_workspace_id text default null)
  returns table (
    workspace_id text, record_id bigint, scope_id bigint, scope_kind text, kind text,
    created_at timestamp with time zone, last_used_at timestamp with time zone, usage_count
    integer, sources bigint, dependencies bigint, title_bytes integer, summary_bytes integer,
    in_index boolean, valid boolean, invalid_reason text
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_scope bigint;
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    -- A scope at a time, the rule called once for the scope (joined laterally, a plan may
    -- call it again for every record).
    foreach v_scope in array array(select s.scope_id from memory_private.scopes s
                                    where s.workspace_id = v_ws order by 1)
    loop
      return query
      select r.workspace_id, r.record_id, r.scope_id, s.kind, r.kind, r.created_at,
             u.last_used_at, coalesce(u.usage_count, 0),
             (select count(*) from memory_private.record_sources rs
               where rs.workspace_id = r.workspace_id and rs.record_id = r.record_id),
             (select count(*) from memory_private.record_dependencies d
               where d.workspace_id = r.workspace_id and d.record_id = r.record_id),
             octet_length(r.title), octet_length(r.summary),
             coalesce(r.record_id = any(i.record_ids), false),
             v.reason is null, v.reason
        from memory_private.scope_validity(v_ws, v_scope) v
        join memory_private.records r on r.workspace_id = v_ws and r.record_id = v.record_id
        join memory_private.scopes s on s.workspace_id = r.workspace_id and s.scope_id = v_scope
        -- joined on the workspace column, not the constant: Citus takes an outer join of its
        -- tables only co-located on their distribution column
        left join memory_private.scope_indexes i
          on i.workspace_id = s.workspace_id and i.scope_id = s.scope_id
        left join memory_private.record_usage u
          on u.workspace_id = r.workspace_id and u.record_id = r.record_id
       where r.workspace_id = v_ws
       order by r.record_id;
    end loop;
  end loop;
end
$$;
comment on function memory.record_status(text) is
  'One row per memory record of the workspace (NULL: of every workspace), without its text: '
  'scope, kind, dates, usage, number of sources (messages it cites) and dependencies (messages '
  'it was made from), title/summary sizes, whether the scope index names it, and whether it '
  'may be recalled now (invalid_reason as recall decides it, for the scope''s own user; NULL '
  'when valid). memory.explain_record(workspace, record) says why. MB001/MB002 for a malformed '
  'or unknown workspace.';

create view memory.record_status as select * from memory.record_status(null);
comment on view memory.record_status is
  'memory.record_status(NULL): one row per memory record of every workspace, without its text '
  '(the function says what each column is; it reads one workspace when given one).';

create function memory.scope_status(p_workspace_id text default null)
  returns table (
    workspace_id text, scope_id bigint, kind text, bot_id text, chat_id text, user_id text,
    topic_id bigint, recall_enabled boolean, records_valid bigint, records_invalid bigint,
    invalid_by_reason jsonb, index_records integer, index_candidates integer, index_bytes
    integer, index_built_at timestamp with time zone, index_age interval,
    consolidation_pending boolean, consolidation_due_at timestamp with time zone,
    extract_job_id bigint, extract_job_status text, consolidate_job_id bigint,
    consolidate_job_status text, tombstones bigint, created_at timestamp with time zone
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_now timestamptz := memory_private.clock_now();
  v_counts jsonb;
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    v_counts := coalesce((select jsonb_object_agg(c.scope_id::text, to_jsonb(c))
                            from memory_private.scope_validity_counts(v_ws) c), '{}');
    return query
    select s.workspace_id, s.scope_id, s.kind, s.bot_id, s.chat_id, s.user_id, s.topic_id,
           s.recall_enabled,
           coalesce((v_counts -> s.scope_id::text ->> 'records_valid')::bigint, 0),
           coalesce((v_counts -> s.scope_id::text ->> 'records_invalid')::bigint, 0),
           coalesce(v_counts -> s.scope_id::text -> 'invalid_by_reason', '{}'),
           coalesce(cardinality(i.record_ids), 0), coalesce(cardinality(i.candidate_ids), 0),
           octet_length(i.index_text), i.built_at, v_now - i.built_at,
           s.consolidation_due_at is not null, s.consolidation_due_at,
           ej.job_id, ej.status, cj.job_id, cj.status,
           (select count(*) from memory_private.tombstones t
             where t.workspace_id = s.workspace_id and t.scope_id = s.scope_id),
           s.created_at
      from memory_private.scopes s
      left join memory_private.scope_indexes i
        on i.workspace_id = s.workspace_id and i.scope_id = s.scope_id
      left join memory_private.jobs ej
        on ej.workspace_id = s.workspace_id and ej.scope_id = s.scope_id and ej.phase = 'extract'
       and ej.status in ('pending', 'running')
      left join memory_private.jobs cj
        on cj.workspace_id = s.workspace_id and cj.scope_id = s.scope_id
       and cj.phase = 'consolidate' and cj.status in ('pending', 'running')
     where s.workspace_id = v_ws
     order by s.scope_id;
  end loop;
end
$$;
comment on function memory.scope_status(text) is
  'One row per memory scope of the workspace (NULL: of every workspace): kind and key, recall '
  'on/off, records valid and invalid (by reason; the rule once per scope), the index (how many '
  'records it names, how many candidates it was built from and depends on, bytes, when built, '
  'age), whether a consolidation is pending, the open extraction and consolidation jobs, and '
  'the tombstone count. No text. MB001/MB002 for a malformed or unknown workspace.';

create view memory.scope_status as select * from memory.scope_status(null);
comment on view memory.scope_status is
  'memory.scope_status(NULL): one row per memory scope of every workspace (the function says '
  'what each column is; it reads one workspace when given one). No text.';

create function memory.workspace_status(
  p_workspace_id text default null, p_count_records boolean default true
) returns table (
    workspace_id text, paused boolean, config_version integer, idle_window interval,
    maintained_at timestamp with time zone, budget_usd numeric, spent_usd numeric,
    memory_spent_usd numeric, budget_left_usd numeric, scopes bigint, scopes_recall_off
    bigint, records_valid bigint, records_invalid bigint, invalid_by_reason jsonb,
    consolidations_pending bigint, jobs_pending bigint, jobs_due bigint, jobs_running bigint,
    jobs_stopped bigint, jobs_succeeded bigint, oldest_pending_age interval, tombstones bigint
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_now timestamptz := memory_private.clock_now();
  v_valid bigint;
  v_invalid bigint;
  v_by_reason jsonb;
  v_budget_left numeric;
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    v_budget_left := (select b.workspace_left from memory_private.budget_left(v_ws, null) b);
    -- The scopes' counts summed (memory.scope_status shows the same counts per scope: a
    -- caller that reads both asks for them once, there, with p_count_records false).
    if coalesce(p_count_records, true) then
      select coalesce(sum(c.records_valid), 0), coalesce(sum(c.records_invalid), 0),
             coalesce(jsonb_agg(c.invalid_by_reason), '[]')
        into v_valid, v_invalid, v_by_reason
        from memory_private.scope_validity_counts(v_ws) c;
      select coalesce(jsonb_object_agg(x.reason, x.n), '{}') into v_by_reason
        from (select e.key as reason, sum(e.value::bigint) as n
                from jsonb_array_elements(v_by_reason) s, jsonb_each_text(s) e
               group by 1) x;
    end if;
    return query
    select w.workspace_id, w.paused, w.config_version, w.idle_window, wm.maintained_at,
           w.budget_usd, w.spent_usd, wm.memory_spent_usd, v_budget_left,
           (select count(*) from memory_private.scopes s where s.workspace_id = w.workspace_id),
           (select count(*) from memory_private.scopes s
             where s.workspace_id = w.workspace_id and not s.recall_enabled),
           v_valid, v_invalid, v_by_reason,
           (select count(*) from memory_private.scopes s
             where s.workspace_id = w.workspace_id and s.consolidation_due_at is not null),
           coalesce(jc.pending, 0), coalesce(jc.due, 0), coalesce(jc.running, 0),
           coalesce(jc.stopped, 0), coalesce(jc.succeeded, 0), jc.oldest_pending_age,
           (select count(*) from memory_private.tombstones t
             where t.workspace_id = w.workspace_id)
      from memory_private.workspaces w
      join memory_private.workspace_memory wm on wm.workspace_id = w.workspace_id
      left join lateral (
        select count(*) filter (where j.status = 'pending') as pending,
               count(*) filter (where j.status = 'pending' and j.next_attempt_at <= v_now)
                 as due,
               count(*) filter (where j.status = 'running') as running,
               count(*) filter (where j.status = 'stopped'
                                  and not coalesce(j.result ? 'retried_as_job_id', false))
                 as stopped,
               count(*) filter (where j.status = 'succeeded') as succeeded,
               v_now - min(j.created_at) filter (where j.status = 'pending')
                 as oldest_pending_age
          from memory_private.jobs j
         where j.workspace_id = w.workspace_id
      ) jc on true
     where w.workspace_id = v_ws;
  end loop;
end
$$;
comment on function memory.workspace_status(text, boolean) is
  'One row per workspace (NULL: every workspace): paused or not, config version, idle window, '
  'when maintenance last ran for it, budget and spend (backend and memory), scopes (and how '
  'many have recall off), records valid and invalid (by reason: memory.scope_status''s counts '
  'summed; NULL with p_count_records false, for a caller that reads those), pending '
  'consolidations, jobs pending (and due now), running, stopped (not yet retried) and '
  'succeeded, the age of the oldest pending job, and the tombstone count. No text. '
  'MB001/MB002 for a malformed or unknown workspace.';

create view memory.workspace_status as select * from memory.workspace_status(null);
comment on view memory.workspace_status is
  'memory.workspace_status(NULL): one row per workspace (the function says what each column '
  'is; it reads one workspace when given one). No text.';

-- What is waiting, and why: the scheduling verdict (memory_private.extraction_verdict,
-- 45_scheduling.sql) of every conversation not yet turned into a memory, counted by its reason
-- (memory_private.waiting_reasons, in their order). `pimem status` shows it, and the worker logs
-- it when it finds no work.
create function memory.waiting_status(p_workspace_id text default null)
  returns table (
    workspace_id text, reason text, conversations bigint, messages bigint,
    oldest_activity_at timestamp with time zone, next_change_at timestamp with time zone,
    explanation text
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_now timestamptz := memory_private.clock_now();
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    return query
    select v_ws, rs.reason, count(*), sum(v.messages)::bigint, min(v.last_activity),
           -- when the earliest of them moves on by itself: the idle window's end, the job's
           -- next attempt
           min(v.next_change_at), rs.explanation
      from memory_private.extraction_verdict(
             v_ws,
             array(select s.scope_id from memory_private.scopes s where s.workspace_id = v_ws),
             v_now) v
      join memory_private.waiting_reasons rs
        on rs.reason = coalesce(v.reason, 'awaiting_maintenance')
     group by rs.reason, rs.rank, rs.explanation
     order by rs.rank;
  end loop;
end
$$;
comment on function memory.waiting_status(text) is
  'What waits to become a memory in the workspace (NULL: in every workspace, each read alone), '
  'and why: per workspace and reason, the conversations (interactive requests) with messages '
  'not yet extracted, counted by the reason the scheduling verdict gives them '
  '(memory_private.waiting_reasons, in their order: workspace_paused, recall_off, '
  'bot_inactive, request_not_finished, request_failed, no_user_message, no_assistant_message, '
  'idle_window, job_running, no_budget, not_priced, job_backoff, job_due, next_batch, '
  'job_stopped, awaiting_maintenance: none, the next tick schedules it), their messages, the '
  'oldest last activity, when the '
  'earliest of them moves on by itself (next_change_at: the idle window''s end, the job''s '
  'next attempt) and what the reason means. No text. For memory_operator and memory_worker '
  '(the worker logs it when idle). MB001/MB002 for a malformed or unknown workspace.';

create view memory.waiting_status as select * from memory.waiting_status(null);
comment on view memory.waiting_status is
  'memory.waiting_status(NULL): what waits to become a memory in every workspace, and why (the '
  'function says what each column is; it reads one workspace when given one). No text. '
  'Readable by memory_operator and memory_worker.';

-- Retry rules: one place, read by memory.job_status and by memory.retry_job.
create function memory_private.job_retry_refusal(p_job memory_private.jobs) returns jsonb
  language plpgsql stable
  as $$
declare
  v_config integer;
  v_reason text;
  v_open memory_private.jobs;
begin
  if p_job.status <> 'stopped' then
    return jsonb_build_object('code', 'MB025', 'reason',
      format('job %s is %s; only a stopped job can be retried', p_job.job_id, p_job.status));
  end if;
  if p_job.result ? 'retried_as_job_id' then
    return jsonb_build_object('code', 'MB025', 'reason',
      format('job %s was already retried as job %s', p_job.job_id,
             p_job.result ->> 'retried_as_job_id'));
  end if;
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_job.workspace_id;
  if p_job.config_version <> v_config then
    return jsonb_build_object('code', 'MB022', 'reason',
      format('the model/provider configuration changed since job %s was made (version %s -> '
             '%s); maintenance schedules this work afresh under the current configuration',
             p_job.job_id, p_job.config_version, v_config));
  end if;
  v_reason := memory_private.job_stale_reason(p_job);
  if v_reason is not null then
    return jsonb_build_object('code', 'MB021', 'reason',
      format('the input of job %s changed (%s); a retry would replay a stale snapshot, and '
             'maintenance schedules a fresh one of the current sources instead',
             p_job.job_id, v_reason));
  end if;
  select * into v_open from memory_private.jobs
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id
     and phase = p_job.phase and status in ('pending', 'running')
   limit 1;
  if found then
    return jsonb_build_object('code', 'MB025', 'reason',
      format('scope %s already has %s %s job %s; it covers the scope''s current input',
             p_job.scope_id, v_open.status, v_open.phase, v_open.job_id));
  end if;
  if p_job.phase = 'extract'
     and not exists (select 1
                       from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
                      where not exists (select 1 from memory_private.extracted_sources e
                                         where e.workspace_id = p_job.workspace_id
                                           and e.scope_id = p_job.scope_id
                                           and e.message_id = s.id and e.content_hash = s.hash))
  then
    return jsonb_build_object('code', 'MB025', 'reason',
      format('every source of job %s has been extracted by a later job; nothing is left to do',
             p_job.job_id));
  end if;
  if p_job.phase = 'consolidate'
     and not exists (select 1 from memory_private.scopes s
                      where s.workspace_id = p_job.workspace_id and s.scope_id = p_job.scope_id
                        and s.consolidation_due_at is not null) then
    return jsonb_build_object('code', 'MB025', 'reason',
      format('the index of scope %s is current; nothing is left to do', p_job.scope_id));
  end if;
  return null;
end
$$;
comment on function memory_private.job_retry_refusal(memory_private.jobs) is
  'Why a job cannot be retried by an operator, as {"code", "reason"}, or NULL when it can: it '
  'is not stopped (MB025), was already retried (MB025), was made under an older model/provider '
  'configuration (MB022), its input changed (MB021), its scope already has an open job of the '
  'phase (MB025), or its work was done since (MB025).';

create function memory.job_status(p_workspace_id text default null)
  returns table (
    workspace_id text, job_id bigint, scope_id bigint, phase text, status text, age interval,
    claims integer, claims_left integer, next_attempt_at timestamp with time zone, worker_id
    text, lease_expires_at timestamp with time zone, has_checkpoint boolean, last_error text,
    last_attempt_no integer, last_attempt_outcome text, last_attempt_error text,
    last_attempt_at timestamp with time zone, cost_usd numeric, origin_request_id text,
    model_provider text, model_id text, config_version integer, config_current boolean,
    input_items integer, stale_reason text, retry_refusal text, retried_as_job_id bigint,
    created_at timestamp with time zone, updated_at timestamp with time zone, finished_at
    timestamp with time zone
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_now timestamptz := memory_private.clock_now();
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    return query
    select j.workspace_id, j.job_id, j.scope_id, j.phase, j.status, v_now - j.created_at,
           j.claims, memory_private.calls_left(j.claims),
           case when j.status = 'pending' then j.next_attempt_at end,
           j.worker_id, j.lease_expires_at, j.checkpoint is not null, j.last_error,
           a.attempt_no, a.outcome, a.error, a.started_at,
           coalesce(c.cost_usd, 0),
           j.origin_request_id, j.model_provider, j.model_id, j.config_version,
           j.config_version = w.config_version,
           case when j.phase = 'extract' then jsonb_array_length(j.input -> 'sources')
                else jsonb_array_length(j.input -> 'candidates') end,
           -- the job's row built as the table's type: on Citus a shard's row is of the
           -- shard's own type, which no function takes
           case when j.status in ('pending', 'running', 'stopped')
                then memory_private.job_stale_reason(row(j.*)::memory_private.jobs) end,
           case when j.status = 'stopped'
                then memory_private.job_retry_refusal(row(j.*)::memory_private.jobs)
                       ->> 'reason' end,
           (j.result ->> 'retried_as_job_id')::bigint,
           j.created_at, j.updated_at, j.finished_at
      from memory_private.jobs j
      join memory_private.workspaces w on w.workspace_id = j.workspace_id
      left join lateral (
        select ja.attempt_no, ja.outcome, ja.error, ja.started_at
          from memory_private.job_attempts ja
         where ja.workspace_id = j.workspace_id and ja.job_id = j.job_id
         order by ja.attempt_no desc
         limit 1
      ) a on true
      left join lateral (
        select sum(rc.cost_usd) as cost_usd from memory_private.request_charges rc
         where rc.workspace_id = j.workspace_id and rc.job_id = j.job_id
      ) c on true
     where j.workspace_id = v_ws
     order by j.job_id;
  end loop;
end
$$;
comment on function memory.job_status(text) is
  'One row per memory job of the workspace (NULL: of every workspace): phase, status, age, '
  'claims used and left (of 3), next attempt (pending only), the worker and lease of a running '
  'job, whether a checkpoint waits to be committed, the last error, the last attempt''s '
  'number, outcome (open | ok | failed | unknown) and error, the dollars charged, the pinned '
  'model and config version (and whether it is still current), the input size, why the input '
  'is stale (if it is), and for a stopped job why it cannot be retried (NULL: '
  'memory.retry_job will take it). No text. MB001/MB002 for a malformed or unknown workspace.';

create view memory.job_status as select * from memory.job_status(null);
comment on view memory.job_status is
  'memory.job_status(NULL): one row per memory job of every workspace (the function says what '
  'each column is; it reads one workspace when given one). No text.';

create function memory.request_memory_charges(p_workspace_id text default null)
  returns table (
    workspace_id text, request_id text, request_status text, model_provider text, model_id text,
    budget_usd numeric, spent_usd numeric, memory_spent_usd numeric, budget_left_usd numeric,
    attempts bigint, extract_attempts bigint, extract_usd numeric, consolidate_attempts bigint,
    consolidate_usd numeric, failed_attempts bigint, unknown_attempts bigint, input_tokens bigint,
    output_tokens bigint, last_charge_at timestamp with time zone
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
#variable_conflict use_column
declare
  v_ws text;
  v_id text;
  v_left jsonb;
begin
  foreach v_ws in array memory_private.operator_workspaces(p_workspace_id) loop
    -- What each charged request has left (memory_private.budget_left), asked a request at a
    -- time (on Citus a query may not take a stable function of a column as a table).
    v_left := '{}';
    for v_id in select distinct c.request_id from memory_private.request_charges c
                 where c.workspace_id = v_ws loop
      v_left := v_left || jsonb_build_object(v_id, (
        select l.request_left from memory_private.budget_left(v_ws, v_id) l));
    end loop;
    return query
    select q.workspace_id, q.request_id, q.status, q.model_provider, q.model_id,
           q.budget_usd, q.spent_usd, sum(c.cost_usd), (v_left ->> q.request_id)::numeric,
           count(*),
           count(*) filter (where c.kind = 'memory_extract'),
           coalesce(sum(c.cost_usd) filter (where c.kind = 'memory_extract'), 0),
           count(*) filter (where c.kind = 'memory_consolidate'),
           coalesce(sum(c.cost_usd) filter (where c.kind = 'memory_consolidate'), 0),
           count(*) filter (where c.outcome = 'failed'),
           count(*) filter (where c.outcome = 'unknown'),
           coalesce(sum(c.input_tokens), 0), coalesce(sum(c.output_tokens), 0),
           max(c.created_at)
      from memory_private.request_charges c
      join memory_private.requests q
        on q.workspace_id = c.workspace_id and q.request_id = c.request_id
     where c.workspace_id = v_ws
     group by q.workspace_id, q.request_id
     order by q.request_id;
  end loop;
end
$$;
comment on function memory.request_memory_charges(text) is
  'One row per request of the workspace (NULL: of every workspace) that memory work charged '
  '(P18): its budget, the spend the backend reported, the memory spend, what is left, and the '
  'memory attempts by kind (memory_extract, memory_consolidate) and outcome with their tokens '
  'and dollars. An unknown outcome is charged at its reserve. MB001/MB002 for a malformed or '
  'unknown workspace.';

create view memory.request_memory_charges as
  select * from memory.request_memory_charges(null);
comment on view memory.request_memory_charges is
  'memory.request_memory_charges(NULL): one row per request of every workspace that memory '
  'work charged (the function says what each column is; it reads one workspace when given '
  'one).';

-- Admin functions ----------------------------------------------------------------------------

create function memory.retry_job(p_workspace_id text, p_job_id bigint) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_refusal jsonb;
  v_now timestamptz := memory_private.clock_now();
  v_new bigint;
  v_ws memory_private.workspaces;
  v_budget record;
begin
  perform memory_private.require_workspace(p_workspace_id);
  if p_job_id is null then
    raise exception 'job_id is required' using errcode = 'MB001';
  end if;
  perform memory_private.lock_workspace(p_workspace_id);
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_job from memory_private.jobs
   where workspace_id = p_workspace_id and job_id = p_job_id
     for update;
  if not found then
    raise exception 'job % is unknown in workspace %', p_job_id, p_workspace_id
      using errcode = 'MB002', hint = 'See memory.job_status.';
  end if;
  v_refusal := memory_private.job_retry_refusal(v_job);
  if v_refusal is not null then
    raise exception '%', v_refusal ->> 'reason' using errcode = v_refusal ->> 'code',
      hint = 'Nothing was changed. See memory.job_status.';
  end if;

  -- A fresh job with the same input, origin request and pinned model: three new claims, due
  -- now. The stopped job stays as it was (its attempts and charges are history) and names its
  -- successor.
  insert into memory_private.jobs
    (workspace_id, scope_id, phase, input, input_hash, origin_request_id, model_provider,
     model_id, config_version, next_attempt_at, last_error, created_at, updated_at)
  values (p_workspace_id, v_job.scope_id, v_job.phase, v_job.input, v_job.input_hash,
          v_job.origin_request_id, v_job.model_provider, v_job.model_id, v_job.config_version,
          v_now,
          left(format('operator retry of job %s, which stopped: %s', v_job.job_id,
                      coalesce(v_job.last_error, 'no error recorded')), (memory_private.policy()).error_chars),
          v_now, v_now)
  returning job_id into v_new;
  perform memory_private.note_change(p_workspace_id, 'inserted');
  update memory_private.jobs
     set result = coalesce(result, '{}'::jsonb)
                  || jsonb_build_object('retried_as_job_id', v_new, 'retried_at', v_now),
         updated_at = v_now
   where workspace_id = p_workspace_id and job_id = p_job_id;

  select * into v_budget
    from memory_private.budget_left(p_workspace_id, v_job.origin_request_id);
  return jsonb_build_object(
    'job_id', p_job_id,
    'retried_as_job_id', v_new,
    'status', 'pending',
    'next_attempt_at', v_now,
    'workspace_paused', v_ws.paused,
    'request_budget_left_usd', v_budget.request_left,
    'workspace_budget_left_usd', v_budget.workspace_left);
end
$$;
comment on function memory.retry_job(text, bigint) is
  'Retries a stopped job: a new pending job with the same input, origin request and pinned '
  'model, due now with three fresh claims; the stopped job stays as history and names it '
  '(retried_as_job_id). A retry replays the model call, which may be charged again. Refused, '
  'changing nothing, when the job is not stopped or was already retried (MB025), its '
  'configuration is outdated (MB022: maintenance schedules the work afresh), its input changed '
  'since (MB021: maintenance schedules a fresh snapshot), or its scope has an open job of the '
  'phase or its work was done since (MB025). A paused workspace keeps the job until resumed.';

create function memory.set_workspace_paused(p_workspace_id text, p_paused boolean)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_changed boolean;
  v_running bigint;
  v_pending integer;
begin
  perform memory_private.require_workspace(p_workspace_id);
  if p_paused is null then
    raise exception 'paused is required (true pauses memory work, false resumes it)'
      using errcode = 'MB001';
  end if;
  update memory_private.workspaces
     set paused = p_paused, updated_at = memory_private.clock_now()
   where workspace_id = p_workspace_id and paused is distinct from p_paused;
  v_changed := found;
  perform memory_private.note_change(p_workspace_id,
                                     case when v_changed then 'updated' else 'unchanged' end);
  select job_id into v_running from memory_private.jobs
   where workspace_id = p_workspace_id and status = 'running';
  select count(*) into v_pending from memory_private.jobs
   where workspace_id = p_workspace_id and status = 'pending';
  return jsonb_build_object('workspace_id', p_workspace_id, 'paused', p_paused,
                            'changed', v_changed, 'running_job_id', v_running,
                            'pending_jobs', v_pending);
end
$$;
comment on function memory.set_workspace_paused(text, boolean) is
  'Pauses (true) or resumes (false) the background memory work of a workspace. While paused no '
  'job is claimed and maintenance schedules no extraction or consolidation; it still expires '
  'leases, retires stale jobs and runs the retention sweep, and recall of existing memories '
  'goes on. A job already running finishes its current claim. Returns whether anything '
  'changed, the running job (if any) and the pending count.';

create function memory_private.record_forgotten(p_workspace_id text, p_record_id bigint)
  returns jsonb
  language plpgsql stable
  as $$
begin
  -- The manage_memory call that forgot the record: when, by whom, with which others. (PL/pgSQL:
  -- Citus plans no parameterized SQL function over distributed tables.)
  return (
  select jsonb_build_object(
           'at', c.updated_at, 'by_user_id', q.user_id, 'request_id', c.request_id,
           'tool_call_id', c.tool_call_id, 'scope_id', c.scope_id,
           'memory_id', (c.outcome ->> 'memory_id')::bigint,
           'forgotten_ids', c.outcome -> 'forgotten_ids')
    from memory_private.tool_calls c
    join memory_private.requests q
      on q.workspace_id = c.workspace_id and q.request_id = c.request_id
   where c.workspace_id = p_workspace_id and c.tool = 'manage_memory'
     and c.outcome ->> 'action' = 'forget' and c.outcome ->> 'status' = 'done'
     and c.outcome -> 'forgotten_ids' @> to_jsonb(p_record_id)
   order by c.updated_at
   limit 1);
end
$$;
comment on function memory_private.record_forgotten(text, bigint) is
  'When, by which user, in which request and tool call a record was forgotten through '
  'manage_memory, with the memory the forget named and every record it removed (ids and '
  'times only); NULL when no forget removed it.';

create function memory_private.record_dependency_states(
  p_workspace_id text, p_record_id bigint, p_scope_id bigint, p_now timestamptz
) returns jsonb
  language plpgsql stable
  as $$
begin
  -- Each dependency: why it counts, the hash it had when used, the hash it has now, and its
  -- state by the rule (memory_private.dependency_state).
  return (
  select coalesce(jsonb_agg(jsonb_build_object(
           'message_id', d.message_id, 'via', d.via,
           'role', m.role, 'speaker_id', m.speaker_id,
           'recorded_hash', d.content_hash, 'current_hash', m.content_hash,
           'retain_until', m.retain_until, 'removed_at', m.removed_at,
           'removal_reason', m.removal_reason, 'edited_at', m.edited_at,
           'tombstoned', t.tombstoned,
           'state', coalesce(memory_private.dependency_state(
                      m.removed_at, m.body is not null, m.retain_until, m.content_hash,
                      d.content_hash, t.tombstoned, p_now), 'current'))
         order by d.message_id), '[]')
    from memory_private.record_dependencies d
    join memory_private.messages m
      on m.workspace_id = d.workspace_id and m.message_id = d.message_id
   cross join lateral (
     select exists (select from memory_private.tombstone(d.workspace_id, p_scope_id,
                                                         d.message_id)) as tombstoned) t
   where d.workspace_id = p_workspace_id and d.record_id = p_record_id);
end
$$;
comment on function memory_private.record_dependency_states(text, bigint, bigint, timestamptz) is
  'What explain_record shows of each message a record may have been made from: via, role, '
  'speaker, the hash when used and now, retention, removal, edit, tombstone and its state by '
  'the rule at p_now. No text.';

create function memory.explain_record(
  p_workspace_id text, p_record_id bigint, p_requester text default null
) returns jsonb
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_record memory_private.records;
  v_usage memory_private.record_usage;
  v_scope memory_private.scopes;
  v_now timestamptz := memory_private.clock_now();
  v_checks jsonb;
  v_reason text;
  v_forgotten jsonb;
begin
  perform memory_private.require_workspace(p_workspace_id);
  if p_record_id is null then
    raise exception 'record_id is required' using errcode = 'MB001';
  end if;
  if p_requester is not null then
    perform memory_private.check_id('requester', p_requester);
  end if;
  select * into v_record from memory_private.records
   where workspace_id = p_workspace_id and record_id = p_record_id;
  if not found then
    v_forgotten := memory_private.record_forgotten(p_workspace_id, p_record_id);
    if v_forgotten is not null then
      return jsonb_build_object('workspace_id', p_workspace_id, 'record_id', p_record_id,
                                'requester', p_requester, 'exists', false, 'valid', false,
                                'invalid_reason', 'forgotten', 'forgotten', v_forgotten);
    end if;
    raise exception 'record % is unknown in workspace %', p_record_id, p_workspace_id
      using errcode = 'MB002', hint = 'It was never made, or was pruned, deleted by the '
                                      'retention sweep or purged; see memory.record_status.';
  end if;
  select * into v_usage from memory_private.record_usage
   where workspace_id = p_workspace_id and record_id = p_record_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = v_record.scope_id;
  -- The rule's own checks, in its order, formatted; the verdict is the rule's (invalid_records).
  select jsonb_agg(jsonb_build_object('check', c.check_name, 'reason', c.reason, 'ok', c.ok,
                                      'detail', c.detail) order by c.rank, c.check_name <> 'membership')
    into v_checks
    from memory_private.record_checks(p_workspace_id, p_record_id, p_requester) c;
  v_reason := memory_private.record_invalid_reason(v_record, p_requester);
  return jsonb_build_object(
    'workspace_id', p_workspace_id,
    'record_id', v_record.record_id,
    'requester', p_requester,
    'exists', true,
    'valid', v_reason is null,
    'invalid_reason', v_reason,
    'record', jsonb_build_object(
      'kind', v_record.kind, 'created_at', v_record.created_at,
      'last_used_at', v_usage.last_used_at, 'usage_count', coalesce(v_usage.usage_count, 0),
      'title_bytes', octet_length(v_record.title),
      'summary_bytes', octet_length(v_record.summary),
      'speaker_ids', to_jsonb(v_record.speaker_ids), 'thread_ids', to_jsonb(v_record.thread_ids),
      'repositories', to_jsonb(v_record.repositories),
      'bot_identity', v_record.bot_identity, 'origin_request_id', v_record.origin_request_id,
      'in_index', exists (select from memory_private.scope_indexes i
                           where i.workspace_id = p_workspace_id
                             and i.scope_id = v_scope.scope_id
                             and v_record.record_id = any(i.record_ids))),
    'scope', jsonb_build_object(
      'scope_id', v_scope.scope_id, 'kind', v_scope.kind, 'bot_id', v_scope.bot_id,
      'chat_id', v_scope.chat_id, 'user_id', v_scope.user_id, 'topic_id', v_scope.topic_id,
      'recall_enabled', v_scope.recall_enabled),
    'checks', v_checks,
    -- The sources: what the summary cites, in the order it uses them.
    'sources', to_jsonb(array(select rs.message_id from memory_private.record_sources rs
                               where rs.workspace_id = p_workspace_id
                                 and rs.record_id = p_record_id
                               order by rs.position)),
    -- Which line of the summary cites which source (by number, never the text): read from the
    -- summary by the rule the record was written with (memory_private.line_citations).
    'lines', coalesce((
      select jsonb_agg(jsonb_build_object('line', x.line_no, 'sources', x.ids) order by x.line_no)
        from (select l.line_no, jsonb_agg(l.message_id order by rs.position) as ids
                from memory_private.line_citations(
                       v_record.summary,
                       array(select s.message_id from memory_private.record_sources s
                              where s.workspace_id = p_workspace_id
                                and s.record_id = p_record_id)) l
                join memory_private.record_sources rs
                  on rs.workspace_id = p_workspace_id and rs.record_id = p_record_id
                 and rs.message_id = l.message_id
               group by l.line_no) x), '[]'),
    -- Each dependency with its state by the rule (no text).
    'dependencies', memory_private.record_dependency_states(p_workspace_id, p_record_id,
                                                            v_record.scope_id, v_now));
end
$$;
comment on function memory.explain_record(text, bigint, text) is
  'Why a record is or is not valid now, without its text: valid and invalid_reason exactly as '
  'recall decides them (for the given requester, or for the scope''s own user when NULL), '
  'every check in the order the rule applies them (recall on, bot '
  'active, group linked, membership, requester owns the private scope, bot identity, '
  'dependencies current, repository grants) with ok and a detail, its sources (the messages it '
  'cites, in summary order), which line of the summary cites which source, and every dependency (everything its '
  'model call was shown: via cited, shown or inherited) with the hash it had when used, the hash it has now and its state '
  '(current, source_removed, source_expired, source_edited, forgotten). A record forgotten '
  'through manage_memory answers exists false, invalid_reason forgotten and forgotten: when, '
  'by which user, in which request and tool call, with which other records (ids only). MB001, '
  'MB002 when the record is unknown (never made, pruned, swept or purged).';

-- Grants -------------------------------------------------------------------------------------

revoke all on memory.record_status, memory.scope_status, memory.workspace_status,
              memory.job_status, memory.request_memory_charges, memory.waiting_status
from public;
grant select on memory.record_status, memory.scope_status, memory.workspace_status,
                memory.job_status, memory.request_memory_charges to memory_operator;
revoke all on function
  memory.record_status(text), memory.scope_status(text), memory.workspace_status(text, boolean),
  memory.job_status(text), memory.request_memory_charges(text), memory.waiting_status(text)
from public;
grant execute on function
  memory.record_status(text), memory.scope_status(text), memory.workspace_status(text, boolean),
  memory.job_status(text), memory.request_memory_charges(text), memory.waiting_status(text)
to memory_operator;
-- What waits, and why: for the operator, and for the worker, which logs it when idle.
grant select on memory.waiting_status to memory_operator, memory_worker;
grant execute on function memory.waiting_status(text) to memory_worker;

revoke all on function
  memory.retry_job(text, bigint),
  memory.set_workspace_paused(text, boolean),
  memory.explain_record(text, bigint, text)
from public;
grant execute on function
  memory.retry_job(text, bigint),
  memory.set_workspace_paused(text, boolean),
  memory.explain_record(text, bigint, text)
to memory_operator;
