-- 70_maintenance.sql: the tick (P1, P16).
--
-- One maintenance tick of a workspace, under its memory lock, runs the steps the other files
-- define, in this order: expire leases (40_jobs), sweep retention (60_retention), retire stale
-- jobs (40_jobs), schedule jobs (45_scheduling). The worker walks the workspaces one short
-- transaction each (maintain_next_workspace); run_maintenance does one or all at once (psql,
-- pg_cron, tests). Each step answers counts; the tick sums them.

create function memory_private.maintain_workspace(p_workspace_id text) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
begin
  perform memory_private.lock_workspace(p_workspace_id);
  -- The steps, in this order: leases first (a job whose worker died is released or stopped);
  -- then retention, before stale jobs are retired, so that a job or checkpoint built on a
  -- source erased here is superseded in the same tick (T3); scheduling last, so that the
  -- consolidation the sweep's deletions call for is scheduled at once.
  v_total := memory_private.add_counts(v_total, memory_private.expire_leases(p_workspace_id));
  v_total := memory_private.add_counts(v_total, memory_private.sweep_retention(p_workspace_id));
  v_total := memory_private.add_counts(v_total,
                                       memory_private.retire_stale_jobs(p_workspace_id));
  v_total := memory_private.add_counts(v_total, memory_private.schedule_jobs(p_workspace_id));
  update memory_private.workspace_memory set maintained_at = memory_private.clock_now()
   where workspace_id = p_workspace_id;
  return v_total;
end
$$;
comment on function memory_private.maintain_workspace(text) is
  'One maintenance tick of one workspace under its memory lock: expire leases, sweep retention, '
  'retire stale jobs, schedule jobs; stamps maintained_at. Returns the summed counts.';

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
                                 array(select workspace_id from memory_private.workspaces
                                        order by workspace_id))
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
begin
  -- The workspaces after p_after_workspace_id in id order, a batch at a time, read without
  -- locks (on Citus a multi-shard FOR UPDATE SKIP LOCKED does not exist); each is tried under
  -- its own lock, on its own node, and one that is busy is passed over.
  loop
    v_ws := null;
    for v_ws in
      select workspace_id from memory_private.workspaces
       where v_after is null or workspace_id > v_after
       order by workspace_id
       limit 16
    loop
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
  'Maintains the next workspace after p_after_workspace_id in id order (the first when NULL), '
  'skipping one another worker is maintaining right now, and answers its counts with its '
  'workspace_id; NULL when there is none left. The worker walks all workspaces with it, one '
  'short transaction each, so no lock is held across workspaces (P16).';

revoke all on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  from public;
grant execute on function memory.run_maintenance(text), memory.maintain_next_workspace(text)
  to memory_worker, memory_operator;
