-- 70_maintenance.sql: the tick (P1, P16).
--
-- One maintenance tick of a workspace, under its memory lock, runs the steps the other files
-- define, in this order: expire leases (40_jobs), sweep retention (60_retention), retire stale
-- jobs (40_jobs), schedule jobs (45_scheduling). The worker walks the workspaces one short
-- transaction each (maintain_next_workspace); run_maintenance does one or all at once (psql,
-- pg_cron, tests). Each step answers counts; the tick sums them.
--
-- A pass visits only the workspaces that are due (memory_private.due_workspaces): a row of
-- memory_private.maintenance_due at or before now, written by whatever changed the workspace
-- (ingest, manage_memory, a job leaving 'running', an operator's pause or retry) or by its
-- last tick for the next time-based event (memory_private.next_maintenance_at), or a running
-- job whose lease has expired. An idle workspace is not read at all.

create function memory_private.next_maintenance_at(p_workspace_id text) returns timestamptz
  language plpgsql stable
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_backlog boolean;
  v_retention timestamptz;
  v_prune timestamptz;
begin
  -- The time-based events a tick cannot see coming from a change: expired text still left by
  -- the bounded sweep (due again now), the next message's retention end, the next record's
  -- pruning horizon. A conversation's idle end is kept by the change that set it (note_change)
  -- or, after the idle window itself changed, by the tick (maintain_workspace). A lease is
  -- found by its expiry (due_workspaces); a job's backoff needs no maintenance (claim_job
  -- takes a pending job when it is due).
  v_backlog := exists (select 1 from memory_private.messages
                        where workspace_id = p_workspace_id and body is not null
                          and retain_until <= v_now)
               or exists (select 1 from memory_private.messages
                           where workspace_id = p_workspace_id and scrub_pending);
  if v_backlog then
    return v_now;
  end if;
  select min(retain_until) into v_retention from memory_private.messages
   where workspace_id = p_workspace_id and body is not null and retain_until > v_now;
  -- prune_records deletes a record unused for strictly longer than the horizon.
  select min(coalesce(u.last_used_at, r.created_at))
         + make_interval(days => (memory_private.policy()).unused_days)
         + interval '1 microsecond'
    into v_prune
    from memory_private.records r
    left join memory_private.record_usage u
      on u.workspace_id = r.workspace_id and u.record_id = r.record_id
   where r.workspace_id = p_workspace_id;
  return least(v_retention, v_prune);
end
$$;
comment on function memory_private.next_maintenance_at(text) is
  'When the workspace next needs a tick though nothing changes in it: now while expired or '
  'erased text awaits the sweep, else the earliest of the next retention end and the next '
  'record pruning horizon; NULL when nothing is foreseen.';

create function memory_private.due_workspaces(
  p_after_workspace_id text, p_limit integer, p_now timestamptz
) returns setof text
  language sql stable
  as $$
  -- From the indexes alone: the rows due at p_now, and the running jobs (one per workspace at
  -- most) whose lease has expired. (The caller reads the clock: on Citus this statement runs
  -- on every node, each with its own.)
  select d.workspace_id
    from (select workspace_id from memory_private.maintenance_due
           where due_at <= p_now
          union
          select workspace_id from memory_private.jobs
           where status = 'running' and lease_expires_at <= p_now) d
   where p_after_workspace_id is null or d.workspace_id > p_after_workspace_id
   order by d.workspace_id
   limit p_limit
$$;
comment on function memory_private.due_workspaces(text, integer, timestamptz) is
  'The workspaces due for maintenance at p_now after p_after_workspace_id in id order (all '
  'when NULL), at most p_limit (all when NULL): a maintenance_due row at or before p_now, or a '
  'running job whose lease expired by then.';

create function memory_private.waiting_conversations(p_workspace_id text, p_now timestamptz)
  returns table (
    request_id text, status text, recall_enabled boolean, bot_active boolean,
    workspace_paused boolean, users bigint, assistants bigint, messages bigint,
    last_activity timestamp with time zone, idle_until timestamp with time zone,
    job_status text, job_holds boolean, job_next_attempt_at timestamp with time zone,
    job_last_error text, budget_left numeric, stopped_holds boolean
  )
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  -- One query over the workspace's own rows, every table joined on workspace_id (on Citus: a
  -- query of the node holding the workspace); the verdict is memory.waiting_status's.
  return query
  select r.request_id, r.status, s.recall_enabled, b.active, w.paused,
         u.users, u.assistants, u.messages, a.last_activity,
         a.last_activity + w.idle_window,
         oj.status, oj.holds, oj.next_attempt_at, oj.last_error,
         least(w.budget_usd - w.spent_usd - wm.memory_spent_usd, oj.request_left),
         exists (select 1 from memory_private.jobs j
                  where j.workspace_id = r.workspace_id and j.scope_id = s.scope_id
                    and j.phase = 'extract' and j.status = 'stopped'
                    and j.config_version = w.config_version
                    and not coalesce(j.result ? 'retried_as_job_id', false)
                    and exists (select 1 from jsonb_array_elements(u.fresh) f
                                 where j.input -> 'sources' @> jsonb_build_array(f)))
    from memory_private.requests r
    join memory_private.workspaces w on w.workspace_id = r.workspace_id
    join memory_private.workspace_memory wm on wm.workspace_id = r.workspace_id
    join memory_private.chats c on c.workspace_id = r.workspace_id and c.chat_id = r.chat_id
    join memory_private.bots b on b.workspace_id = r.workspace_id and b.bot_id = r.bot_id
    join memory_private.scopes s
      on s.workspace_id = r.workspace_id and s.bot_id = r.bot_id and s.chat_id = r.chat_id
     and ((c.kind = 'private' and s.kind = 'private' and s.user_id = c.private_user_id)
          or (c.kind = 'group' and s.kind = 'shared' and s.topic_id = r.topic_id))
   cross join lateral (
     -- Its messages the scope may use: retained, not tombstoned there; fresh: those not yet
     -- extracted (or skipped) at their content.
     select count(*) filter (where m.role = 'user') as users,
            count(*) filter (where m.role = 'assistant') as assistants,
            count(*) filter (where e.message_id is null) as messages,
            jsonb_agg(jsonb_build_object('id', m.message_id, 'hash', m.content_hash))
              filter (where e.message_id is null) as fresh
       from memory_private.messages m
       left join memory_private.extracted_sources e
         on e.workspace_id = m.workspace_id and e.scope_id = s.scope_id
        and e.message_id = m.message_id and e.content_hash = m.content_hash
      where m.workspace_id = r.workspace_id and m.request_id = r.request_id
        and memory_private.is_retained(m.body is not null, m.retain_until, p_now)
        and (m.directed or s.kind = 'private')
        and not exists (select 1 from memory_private.tombstones t
                         where t.workspace_id = m.workspace_id and t.scope_id = s.scope_id
                           and t.message_id = m.message_id)
   ) u
   cross join lateral (
     -- The idle window's clock: the request's update or finish, its messages' creation, edit
     -- or removal (as memory_private.extraction_units reads it).
     select greatest(r.updated_at, r.finished_at,
                     max(greatest(x.created_at, x.edited_at, x.removed_at))) as last_activity
       from memory_private.messages x
      where x.workspace_id = r.workspace_id and x.request_id = r.request_id
   ) a
    left join lateral (
      -- The scope's open extraction job, whether it holds this conversation, and what is
      -- left of its origin request's budget.
      select j.status, j.next_attempt_at, j.last_error,
             exists (select 1 from jsonb_array_elements(u.fresh) f
                      where j.input -> 'sources' @> jsonb_build_array(f)) as holds,
             q.budget_usd - q.spent_usd - coalesce(
               (select sum(rc.cost_usd) from memory_private.request_charges rc
                 where rc.workspace_id = q.workspace_id and rc.request_id = q.request_id), 0)
               as request_left
        from memory_private.jobs j
        join memory_private.requests q
          on q.workspace_id = j.workspace_id and q.request_id = j.origin_request_id
       where j.workspace_id = r.workspace_id and j.scope_id = s.scope_id
         and j.phase = 'extract' and j.status in ('pending', 'running')
       order by j.job_id
       limit 1
    ) oj on true
   where r.workspace_id = p_workspace_id and r.kind = 'interactive' and u.messages > 0;
end
$$;
comment on function memory_private.waiting_conversations(text, timestamptz) is
  'The interactive conversations (requests) of a workspace with something not yet handled (a '
  'retained message its scope may use, not tombstoned there, not yet extracted or skipped at '
  'its content), with the facts memory.waiting_status decides on: the scope, bot and '
  'workspace switches, the request''s status, its user and assistant messages, its last '
  'activity and the idle window''s end, the scope''s open extraction job (whether it holds the '
  'conversation, its next attempt and last error), the budget left (the workspace''s or the '
  'job''s request''s, whichever is less) and whether a stopped job holds it.';

create function memory_private.maintain_workspace(p_workspace_id text) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
  v_now timestamptz := memory_private.clock_now();
  v_idle_ends timestamptz[] := '{}';
  v_idle_requests text[] := '{}';
  v_at timestamptz;
  v_request text;
  v_scope bigint;
  v_all boolean := false;
  v_requests text[] := '{}';
  v_scopes bigint[] := '{}';
  v_seen interval;
  v_window interval;
  v_sweep jsonb;
  v_foreseen boolean;
  v_next timestamptz;
begin
  perform memory_private.lock_workspace(p_workspace_id);
  -- The rows due now are consumed first: a change committed after this statement keeps its
  -- row, so the next pass comes back for it; one committed before is seen by the steps below.
  -- The idle ends the consumed changes set are kept as rows of their own. What the changes
  -- were confined to (requests, scopes) is gathered for scheduling; a row confined to nothing
  -- means anything may have changed.
  for v_at, v_request, v_scope, v_foreseen in
    delete from memory_private.maintenance_due
     where workspace_id = p_workspace_id and due_at <= v_now
    returning idle_at, request_id, scope_id, foreseen
  loop
    v_all := v_all or (v_request is null and v_scope is null and not v_foreseen);
    if v_request is not null and not v_request = any (v_requests) then
      v_requests := v_requests || v_request;
    end if;
    if v_scope is not null and not v_scope = any (v_scopes) then
      v_scopes := v_scopes || v_scope;
    end if;
    if v_at > v_now then
      v_idle_ends := v_idle_ends || v_at;
      v_idle_requests := v_idle_requests || v_request;
    end if;
  end loop;
  select m.idle_window_seen, w.idle_window into v_seen, v_window
    from memory_private.workspace_memory m
    join memory_private.workspaces w on w.workspace_id = m.workspace_id
   where m.workspace_id = p_workspace_id;
  if v_seen is distinct from v_window then
    -- The idle window changed (or was never planned with): every waiting conversation's idle
    -- end is planned anew, as memory.waiting_status computes it.
    select coalesce(array_agg(c.idle_until order by c.request_id), '{}'),
           coalesce(array_agg(c.request_id order by c.request_id), '{}')
      into v_idle_ends, v_idle_requests
      from memory_private.waiting_conversations(p_workspace_id, v_now) c
     where c.idle_until > v_now;
  end if;
  -- The steps, in this order: leases first (a job whose worker died is released or stopped);
  -- then retention, before stale jobs are retired, so that a job or checkpoint built on a
  -- source erased here is superseded in the same tick (T3); scheduling last, so that the
  -- consolidation the sweep's deletions call for is scheduled at once.
  v_total := memory_private.add_counts(v_total, memory_private.expire_leases(p_workspace_id));
  v_sweep := memory_private.sweep_retention(p_workspace_id);
  v_total := memory_private.add_counts(v_total, v_sweep - 'expired_request_ids');
  v_total := memory_private.add_counts(v_total,
                                       memory_private.retire_stale_jobs(p_workspace_id));
  -- What the steps so far deleted, released or retired may change any input; text past its
  -- retention changes its own conversations (and what the erasure makes stale is retired, so
  -- counted here).
  v_requests := v_requests || array(select jsonb_array_elements_text(
                                             v_sweep -> 'expired_request_ids'));
  v_all := v_all or exists (select 1 from jsonb_each(v_total) c
                             where jsonb_typeof(c.value) = 'number' and c.value::numeric > 0
                               and c.key not in ('messages_expired', 'messages_scrubbed',
                                                 'tombstones_dropped'));
  v_total := memory_private.add_counts(v_total, memory_private.schedule_jobs(
               p_workspace_id, case when not v_all then v_requests end, v_scopes));
  -- The idle ends (each with its request) and the next time-based event as foreseen rows (a
  -- retention end names its requests when it erases; a pruning deletes records, which makes
  -- the tick derive every scope); under the memory lock, a row already planned for the same
  -- time and request is consumed by a later tick, so it is not planned twice.
  v_next := memory_private.next_maintenance_at(p_workspace_id);
  for v_at, v_request in
    select e.at, e.request_id
      from unnest(v_idle_ends || v_next, v_idle_requests || null::text) as e(at, request_id)
     where e.at is not null
  loop
    if not exists (select 1 from memory_private.maintenance_due
                    where workspace_id = p_workspace_id and due_at = v_at
                      and request_id is not distinct from v_request) then
      insert into memory_private.maintenance_due (workspace_id, due_at, request_id, foreseen)
      values (p_workspace_id, v_at, v_request, true);
    end if;
  end loop;
  update memory_private.workspace_memory
     set maintained_at = v_now, idle_window_seen = v_window
   where workspace_id = p_workspace_id;
  return v_total || jsonb_build_object('sweep_backlog', coalesce(v_next <= v_now, false)::integer);
end
$$;
comment on function memory_private.maintain_workspace(text) is
  'One maintenance tick of one workspace under its memory lock: consumes its due rows, expires '
  'leases, sweeps retention, retires stale jobs, schedules jobs; plans its next time-based '
  'event (and the idle ends of its conversations) as due rows; stamps maintained_at. Returns '
  'the summed counts, sweep_backlog 1 when expired text is left for the next tick.';

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
  -- The workspaces are read first, then ticked one by one (on Citus each statement of a tick
  -- goes to the workspace's node): no multi-shard cursor stays open while the ticks write.
  foreach v_ws in array coalesce(case when p_workspace_id is not null
                                      then array[p_workspace_id] end,
                                 array(select memory_private.due_workspaces(null, null,
                                                                   memory_private.clock_now())))
  loop
    v_total := memory_private.add_counts(v_total, memory_private.maintain_workspace(v_ws));
    v_workspaces := v_workspaces + 1;
  end loop;
  return v_total || jsonb_build_object('workspaces', v_workspaces);
end
$$;
comment on function memory.run_maintenance(text) is
  'One maintenance tick for one workspace (or every due one when NULL, in one transaction: for small '
  'installs, tests and psql; the worker uses maintain_next_workspace so that no workspace lock '
  'is held longer than its own steps): expires leases, sweeps retention, retires jobs whose '
  'config or input changed, schedules extraction and consolidation jobs. Returns summed '
  'counts: extract_jobs_created, consolidate_jobs_created, leases_expired, batches_skipped, ...';

create function memory_private.maintain_workspace_unless_busy(p_workspace_id text)
  returns jsonb
  language plpgsql volatile
  as $$
begin
  if not memory_private.try_lock_workspace(p_workspace_id) then
    return null;
  end if;
  return memory_private.maintain_workspace(p_workspace_id)
         || jsonb_build_object('workspace_id', p_workspace_id);
end
$$;
comment on function memory_private.maintain_workspace_unless_busy(text) is
  'One maintenance tick of the workspace with its workspace_id, or NULL without waiting when '
  'another transaction holds its memory lock (another worker maintaining it, a claim, a '
  'memory write).';

create function memory.maintain_next_workspace(p_after_workspace_id text default null)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
  v_result jsonb;
  v_after text := p_after_workspace_id;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The due workspaces after p_after_workspace_id in id order, a batch at a time, read without
  -- locks (on Citus a multi-shard FOR UPDATE SKIP LOCKED does not exist); each is tried under
  -- its own lock, on its own node, and one that is busy is passed over.
  loop
    v_ws := null;
    for v_ws in select memory_private.due_workspaces(v_after, 16, v_now) loop
      select m into v_result from memory_private.maintain_workspace_unless_busy(v_ws) m;
      if v_result is not null then
        return v_result;
      end if;
      v_after := v_ws;
    end loop;
    exit when v_ws is null;
  end loop;
  return null;
end
$$;
comment on function memory.maintain_next_workspace(text) is
  'Maintains the next due workspace after p_after_workspace_id in id order (the first when '
  'NULL), skipping one another worker is maintaining right now, and answers its counts with '
  'its workspace_id; NULL when there is none left. The worker walks the due workspaces with '
  'it, one short transaction each, so no lock is held across workspaces (P16); an idle '
  'workspace is not read.';

revoke all on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  from public;
grant execute on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  to memory_worker, memory_operator;
