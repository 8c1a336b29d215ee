-- 60_retention.sql: what makes memories go away and stay away (T1-T9).
--
-- Reads already refuse a record whose sources changed (record_invalid_reason). The sweep here
-- makes that permanent and erases what must not outlive its sources:
--   1. message text past its retention is erased (memory limits never extend retention, T6);
--   2. answers derived from recalled sources that are gone are erased too, transitively (T3);
--   3. records that can never be valid again are deleted, with the index entries naming them;
--   4. tombstones whose original message is no longer retained are dropped (T8);
--   5. records unused for 30 days are pruned, and a workspace keeps at most 256 (T5).
-- Deleting a workspace purges every row it owns (T4).

create function memory_private.delete_records(
  p_workspace_id text, p_record_ids bigint[]
) returns integer
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_deleted integer;
begin
  with gone as (
    delete from memory_private.records
     where workspace_id = p_workspace_id and record_id = any(p_record_ids)
    returning scope_id, record_id
  ), touched as (
    select scope_id, array_agg(record_id) as ids from gone group by scope_id
  ), marked as (
    update memory_private.scopes s
       set consolidation_due_at = coalesce(s.consolidation_due_at, memory_private.clock_now()),
           index_text = case when s.index_record_ids && t.ids then null else s.index_text end,
           index_record_ids = case when s.index_record_ids && t.ids then null
                                   else s.index_record_ids end
      from touched t
     where s.workspace_id = p_workspace_id and s.scope_id = t.scope_id
    returning 1
  )
  select count(*) into v_deleted from gone;
  return v_deleted;
end
$$;
comment on function memory_private.delete_records(text, bigint[]) is
  'Deletes records of one workspace, drops every index that names one of them, and marks their '
  'scopes for consolidation. Returns how many were deleted.';

create function memory_private.erase_expired_messages(p_workspace_id text) returns integer
  language sql volatile
  set search_path = pg_catalog, pg_temp
  as $$
  with erased as (
    update memory_private.messages
       set body = null, content_hash = null
     where workspace_id = p_workspace_id and body is not null
       and retain_until <= memory_private.clock_now()
    returning 1
  )
  select count(*)::integer from erased
$$;
comment on function memory_private.erase_expired_messages(text) is
  'Erases the text and hash of every message of the workspace past its retention (T6).';

create function memory_private.erase_derived_answers(p_workspace_id text) returns integer
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_total integer := 0;
  v_round integer;
begin
  -- An assistant answer is derived from the sources its request cited (query_memories puts
  -- them in the citation set). When one of them is gone, the answer goes too; an answer that
  -- cited that answer goes next, and so on until nothing changes (T3).
  loop
    with erased as (
      update memory_private.messages a
         set body = null, content_hash = null, removed_at = memory_private.clock_now(),
             removal_reason = 'derived_from_removed'
       where a.workspace_id = p_workspace_id and a.role = 'assistant' and a.body is not null
         and exists (select 1
                       from memory_private.request_citations c
                       join memory_private.messages s
                         on s.workspace_id = c.workspace_id and s.message_id = c.message_id
                      where c.workspace_id = a.workspace_id and c.request_id = a.request_id
                        and s.body is null)
      returning 1
    )
    select count(*) into v_round from erased;
    exit when v_round = 0;
    v_total := v_total + v_round;
  end loop;
  return v_total;
end
$$;
comment on function memory_private.erase_derived_answers(text) is
  'Erases, transitively, assistant answers whose request cited a source that is now removed or '
  'past retention; records built on those answers then fail validation in turn (T3).';

create function memory_private.purge_permanently_invalid(p_workspace_id text) returns integer
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ids bigint[];
begin
  select coalesce(array_agg(r.record_id), '{}') into v_ids
    from memory_private.records r
   where r.workspace_id = p_workspace_id
     and memory_private.record_invalid_reason(r, null)
         in ('source_removed', 'source_expired', 'source_edited', 'forgotten', 'bot_replaced');
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.purge_permanently_invalid(text) is
  'Deletes the records that can never be valid again: a source removed, expired, edited or '
  'forgotten, or the bot replaced. Reversible reasons (recall off, membership, link, grants) '
  'keep the record.';

create function memory_private.drop_stale_tombstones(p_workspace_id text) returns integer
  language sql volatile
  set search_path = pg_catalog, pg_temp
  as $$
  with dropped as (
    delete from memory_private.tombstones t
     using memory_private.messages m
     where t.workspace_id = p_workspace_id and m.workspace_id = t.workspace_id
       and m.message_id = t.message_id and m.body is null
    returning 1
  )
  select count(*)::integer from dropped
$$;
comment on function memory_private.drop_stale_tombstones(text) is
  'Drops tombstones whose original message is no longer retained: nothing is left to restore.';

create function memory_private.prune_records(p_workspace_id text) returns integer
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ids bigint[];
begin
  select coalesce(array_agg(record_id), '{}') into v_ids
    from (select record_id,
                 coalesce(last_used_at, created_at) as used,
                 row_number() over (order by coalesce(last_used_at, created_at) desc,
                                             record_id desc) as rank
            from memory_private.records
           where workspace_id = p_workspace_id) r
   where r.used < memory_private.clock_now() - interval '30 days' or r.rank > 256;
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.prune_records(text) is
  'Prunes records unused for 30 days and, beyond 256 records in the workspace, the least '
  'recently used; their scopes are marked for consolidation (T5).';

create function memory_private.sweep_retention(p_workspace_id text) returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_expired integer;
  v_derived integer := 0;
  v_invalid integer;
  v_tombstones integer;
  v_pruned integer;
begin
  perform memory_private.lock_workspace(p_workspace_id);
  v_expired := memory_private.erase_expired_messages(p_workspace_id);
  v_derived := memory_private.erase_derived_answers(p_workspace_id);
  v_invalid := memory_private.purge_permanently_invalid(p_workspace_id);
  v_tombstones := memory_private.drop_stale_tombstones(p_workspace_id);
  v_pruned := memory_private.prune_records(p_workspace_id);
  return jsonb_build_object('messages_expired', v_expired, 'answers_erased', v_derived,
                            'records_invalidated', v_invalid, 'tombstones_dropped', v_tombstones,
                            'records_pruned', v_pruned);
end
$$;
comment on function memory_private.sweep_retention(text) is
  'The retention sweep of one workspace, run by maintenance: erase expired text, erase derived '
  'answers, delete permanently invalid records, drop stale tombstones, prune. Returns counts.';

create function memory.delete_workspace(p_workspace_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_records integer;
  v_messages integer;
begin
  perform memory_private.require_workspace(p_workspace_id);
  select count(*) into v_records from memory_private.records where workspace_id = p_workspace_id;
  select count(*) into v_messages from memory_private.messages
   where workspace_id = p_workspace_id;
  -- Every table's foreign keys lead with workspace_id and cascade from the workspace row;
  -- tests/test_retention.py checks from the catalog that no table keeps a row behind.
  delete from memory_private.workspaces where workspace_id = p_workspace_id;
  return jsonb_build_object('workspace_id', p_workspace_id, 'records_deleted', v_records,
                            'messages_deleted', v_messages);
end
$$;
comment on function memory.delete_workspace(text) is
  'Purges a workspace: every row of it in every memory table (facts, messages, scopes, records, '
  'tombstones, jobs, charges). Other workspaces are untouched (T4).';

revoke all on function memory.delete_workspace(text) from public;
grant execute on function memory.delete_workspace(text) to memory_backend, memory_operator;

create function memory.answer_retention_boundary(p_workspace_id text, p_request_id text)
  returns timestamptz
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_boundary timestamptz;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('request_id', p_request_id);
  if not exists (select 1 from memory_private.requests
                  where workspace_id = p_workspace_id and request_id = p_request_id) then
    raise exception 'request % is unknown in workspace %', p_request_id, p_workspace_id
      using errcode = 'MB002';
  end if;
  select min(case when s.body is null then memory_private.clock_now() else s.retain_until end)
    into v_boundary
    from memory_private.request_citations c
    join memory_private.messages s
      on s.workspace_id = c.workspace_id and s.message_id = c.message_id
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id;
  return v_boundary;
end
$$;
comment on function memory.answer_retention_boundary(text, text) is
  'The latest time until which the backend may keep the answer of a request: the earliest '
  'retention end among the sources it recalled (its citation set); now if one is already gone; '
  'NULL when none of them has a retention end (T2).';

revoke all on function memory.answer_retention_boundary(text, text) from public;
grant execute on function memory.answer_retention_boundary(text, text) to memory_backend;

-- The sweep runs in every maintenance tick, before stale jobs are retired (20) so that a job or
-- checkpoint built on a source erased here is superseded in the same tick (T3), and before
-- scheduling (90) so that the consolidation its deletions call for is scheduled at once.
insert into memory_private.maintenance_steps (position, name, step)
values (15, 'sweep_retention', 'memory_private.sweep_retention(text)');
