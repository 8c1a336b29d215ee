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
-- (ingest, manage_memory, a job leaving 'running', an operator's pause or retry, and the
-- tick's own steps: a record deleted, a job retired, text erased) or by a tick for a
-- time-based event it foresaw (a conversation's idle end, the next retention end or pruning
-- horizon: memory_private.next_maintenance_at), or a running job whose lease has expired. An
-- idle workspace is not read at all, and a tick derives only the scopes the rows it consumes
-- name (memory_private.schedule_jobs).

create function memory_private.next_maintenance_at(p_workspace_id text) returns timestamptz
  language plpgsql stable
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_retention timestamptz;
  v_prune timestamptz;
begin
  -- The time-based events a tick cannot see coming from a change: the earliest retention end
  -- of a message that still has its text (now while expired text is left by the bounded
  -- sweep), erased text the sweep has yet to follow (now), the next record's pruning horizon.
  -- A conversation's idle end is planned by the tick that derives it (schedule_extraction). A
  -- lease is found by its expiry (due_workspaces); a job's backoff needs no maintenance
  -- (claim_job takes a pending job when it is due).
  if exists (select 1 from memory_private.messages
              where workspace_id = p_workspace_id and scrub_pending) then
    return v_now;
  end if;
  select r.retain_until into v_retention
    from memory_private.retention_ends(p_workspace_id) r
   order by r.retain_until
   limit 1;
  if not memory_private.is_retained(true, v_retention, v_now) then
    return v_now;
  end if;
  select min(memory_private.prune_at(u.last_used_at, r.created_at))
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

create function memory_private.consume_due(
  p_workspace_id text, p_now timestamptz,
  out everything boolean, out request_ids text[], out scope_ids bigint[],
  out changed_requests integer
)
  language plpgsql volatile
  as $$
begin
  -- The rows due now go (in one statement, whatever their number): what they were confined to
  -- (requests, scopes) is what the tick derives; a change confined to nothing means anything
  -- may have changed (everything), unless it is foreseen (a time-based event: the tick's own
  -- steps find what it changes). A change committed after this statement keeps its row, so the
  -- next pass comes back for it.
  with consumed as (
    delete from memory_private.maintenance_due
     where workspace_id = p_workspace_id and due_at <= p_now
    returning request_id, scope_id, foreseen
  )
  select coalesce(bool_or(c.request_id is null and c.scope_id is null and not c.foreseen),
                  false),
         coalesce(array_agg(distinct c.request_id) filter (where c.request_id is not null),
                  '{}'),
         coalesce(array_agg(distinct c.scope_id) filter (where c.scope_id is not null), '{}'),
         count(distinct c.request_id) filter (where not c.foreseen)
    into everything, request_ids, scope_ids, changed_requests
    from consumed c;
end
$$;
comment on function memory_private.consume_due(text, timestamptz) is
  'Deletes the workspace''s maintenance_due rows due at p_now and answers what they name: '
  'everything (a change confined to nothing), the requests and the scopes, and how many '
  'requests changed (foreseen rows aside).';

create function memory_private.maintain_workspace(p_workspace_id text) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
  v_now timestamptz := memory_private.clock_now();
  v_before record;
  v_after record;
  v_next timestamptz;
begin
  perform memory_private.lock_workspace(p_workspace_id);
  -- What changed since the last tick (the rows due now), then the steps, in this order: leases
  -- first (a job whose worker died is released or stopped); then retention, before stale jobs
  -- are retired, so that a job or checkpoint built on a source erased here is superseded in the
  -- same tick (T3); scheduling last, so that what the steps changed is scheduled at once. The
  -- steps note what they change as rows of their own (a job leaving running, a record
  -- deleted, text erased, a job retired), which the tick consumes before it schedules.
  v_before := memory_private.consume_due(p_workspace_id, v_now);
  if v_before.changed_requests >= (memory_private.policy()).analyze_after
     and not exists (select 1 from pg_catalog.pg_extension where extname = 'citus') then
    -- A bulk import since the last tick: the planner's statistics may not know this
    -- workspace's rows yet, and a plan that takes it for a handful would read all of its
    -- messages for each conversation. Refreshed before the steps plan their statements (and
    -- every session's cached plans over these tables are made again). On Citus each node
    -- plans its shards with its own statistics, which its autovacuum keeps.
    analyze memory_private.requests, memory_private.messages;
    v_total := v_total || jsonb_build_object('statistics_refreshed', 1);
  end if;
  v_total := memory_private.add_counts(v_total, memory_private.expire_leases(p_workspace_id));
  v_total := memory_private.add_counts(v_total,
                                       memory_private.sweep_retention(p_workspace_id));
  v_total := memory_private.add_counts(v_total,
                                       memory_private.retire_stale_jobs(p_workspace_id));
  v_after := memory_private.consume_due(p_workspace_id, v_now);
  v_total := memory_private.add_counts(v_total, memory_private.schedule_jobs(
               p_workspace_id,
               case when not (v_before.everything or v_after.everything)
                    then v_before.request_ids || v_after.request_ids end,
               v_before.scope_ids || v_after.scope_ids));
  -- The next time-based event as the workspace's one foreseen row (the idle ends are planned
  -- by schedule_extraction, one row per conversation).
  v_next := memory_private.next_maintenance_at(p_workspace_id);
  if v_next is null then
    delete from memory_private.maintenance_due
     where workspace_id = p_workspace_id and foreseen and request_id is null;
  else
    insert into memory_private.maintenance_due (workspace_id, due_at, foreseen)
    values (p_workspace_id, v_next, true)
    on conflict (workspace_id) where foreseen and request_id is null
    do update set due_at = excluded.due_at;
  end if;
  update memory_private.workspace_memory set maintained_at = v_now
   where workspace_id = p_workspace_id;
  return v_total || jsonb_build_object('sweep_backlog', coalesce(v_next <= v_now, false)::integer);
end
$$;
comment on function memory_private.maintain_workspace(text) is
  'One maintenance tick of one workspace under its memory lock: consumes its due rows, expires '
  'leases, sweeps retention, retires stale jobs, consumes the rows those steps wrote, schedules '
  'jobs in the scopes all of them name (every scope after a change confined to nothing); plans '
  'its next time-based event as its foreseen row; stamps maintained_at. Returns the summed '
  'counts, sweep_backlog 1 when expired text is left for the next tick.';

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
