-- 60_retention.sql: what makes memories go away and stay away (T1-T9).
--
-- Reads already refuse a record whose dependencies changed (invalid_records). The sweep
-- here makes that permanent and erases what must not outlive its sources:
--   1. message text past its retention is erased (memory limits never extend retention, T6);
--   2. answers derived from recalled records that rest on an erased message are erased too,
--      transitively (T3); the records a request was shown, and the dependencies of those deleted
--      since, are its provenance (request_recall, tool_calls);
--   3. records that can never be valid again are deleted, with every index built with them;
--   4. what was made from an erased message is erased: frozen recall index texts, job inputs'
--      content hashes, job checkpoints and extraction markers (messages.scrub_pending);
--   5. tombstones whose original message is no longer retained are dropped (T8);
--   6. records unused for 30 days are pruned, and a workspace keeps at most 256 (T5).
-- Deleting a workspace purges every row it owns (T4).

create function memory_private.erase_expired_messages(
  p_workspace_id text, out erased integer, out request_ids text[]
)
  language plpgsql volatile
  as $$
declare
  -- A batch per tick, so that a tick holds the workspace's memory lock for tens of
  -- milliseconds, not for the whole of a large backlog (the steps after this one handle what
  -- it erased, so they are bounded by it too); the tick leaves the workspace due while
  -- expired text remains (memory_private.next_maintenance_at), so the walk comes back.
  v_batch constant integer := 50;
  v_ids text[];
  v_now timestamptz := memory_private.clock_now();  -- the coordinator's clock on Citus
begin
  select coalesce(array_agg(e.message_id), '{}'),
         coalesce(array_agg(distinct e.request_id), '{}')
    into v_ids, request_ids
    from (select r.message_id, r.request_id
            from memory_private.retention_ends(p_workspace_id) r
           where not memory_private.is_retained(true, r.retain_until, v_now)
           order by r.retain_until
           limit v_batch) e;
  update memory_private.messages
     set body = null, content_hash = null, scrub_pending = true
   where workspace_id = p_workspace_id and message_id = any (v_ids);
  erased := cardinality(v_ids);
  -- Their conversations changed: the tick derives them again (memory_private.schedule_jobs).
  perform memory_private.note_change(p_workspace_id, 'updated', r)
     from unnest(request_ids) as r;
end
$$;
comment on function memory_private.erase_expired_messages(text) is
  'Erases the text and hash of the workspace''s messages past their retention (T6), the 50 '
  'longest expired at a time, and marks them for scrubbing. Answers how many, and the '
  'requests they belong to (whose conversations changed: each is noted for the tick).';

create function memory_private.request_provenance(p_workspace_id text, p_request_id text)
  returns setof text
  language sql stable
  as $$
  select unnest(f.dependency_ids)
    from memory_private.request_recall f
   where f.workspace_id = p_workspace_id and f.request_id = p_request_id
  union
  select d.message_id
    from memory_private.request_recall f
    join memory_private.record_dependencies d
      on d.workspace_id = f.workspace_id and d.record_id = any(f.basis_record_ids)
   where f.workspace_id = p_workspace_id and f.request_id = p_request_id
  union
  select unnest(c.dependency_ids)
    from memory_private.tool_calls c
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
     and c.tool = 'query_memories'
  union
  select d.message_id
    from memory_private.tool_calls c
    join memory_private.record_dependencies d
      on d.workspace_id = c.workspace_id and d.record_id = any(c.record_ids)
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
     and c.tool = 'query_memories'
$$;
comment on function memory_private.request_provenance(text, text) is
  'The ids of every message one request''s answer rests on: the dependencies of every record '
  'it was shown, by recall or by query_memories, including records deleted since (T2).';

create function memory_private.erase_derived_answers(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_total integer := 0;
  v_round integer;
  v_gone text[];
  v_hit bigint[];
begin
  -- An assistant answer is derived from every message the records its request was shown depend
  -- on (memory_private.request_provenance). When one of them is erased (scrub_pending: erased
  -- since the last sweep), the answer is erased too; an answer derived from *that* answer goes
  -- next, and so on until nothing changes (T3). Only newly erased messages are looked at: older
  -- ones were handled by earlier sweeps.
  loop
    v_gone := array(select message_id from memory_private.messages
                     where workspace_id = p_workspace_id and scrub_pending);
    exit when cardinality(v_gone) = 0;
    -- The records resting on them (not yet purged: the purge runs after this step).
    v_hit := array(select distinct record_id from memory_private.record_dependencies
                    where workspace_id = p_workspace_id and message_id = any(v_gone));
    -- Read through the indexes on what they name (request_recall_dependencies_idx, ...).
    with derived as (
      select f.request_id from memory_private.request_recall f
       where f.workspace_id = p_workspace_id
         and memory_private.message_keys(f.workspace_id, f.dependency_ids)
             && memory_private.message_keys(p_workspace_id, v_gone)
      union
      select f.request_id from memory_private.request_recall f
       where f.workspace_id = p_workspace_id and f.basis_record_ids && v_hit
      union
      select c.request_id from memory_private.tool_calls c
       where c.workspace_id = p_workspace_id and c.tool = 'query_memories'
         and memory_private.message_keys(c.workspace_id, c.dependency_ids)
             && memory_private.message_keys(p_workspace_id, v_gone)
      union
      select c.request_id from memory_private.tool_calls c
       where c.workspace_id = p_workspace_id and c.tool = 'query_memories'
         and c.record_ids && v_hit
    ), erased as (
      update memory_private.messages a
         set body = null, content_hash = null, removed_at = memory_private.clock_now(),
             removal_reason = 'derived_from_removed', scrub_pending = true
        from derived
       where a.workspace_id = p_workspace_id and a.request_id = derived.request_id
         and a.role = 'assistant' and a.body is not null
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
  'Erases, transitively, the assistant answers of requests that were shown a record depending on '
  'a message erased since the last sweep (by recall or query_memories, also records deleted '
  'since); records built on those answers then fail validation in turn (T3).';

create function memory_private.purge_permanently_invalid(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_ids bigint[];
  v_changed bigint[];
  v_requests text[];
begin
  -- A record with a permanent reason (memory_private.invalid_reasons: the bot replaced, a
  -- dependency removed, expired, edited or forgotten) never comes back, whatever else holds now
  -- (recall off, a lost grant): it is deleted, so neither it nor the hashes it kept outlive what
  -- it was made from.
  -- The rule is asked once per scope that has records (a scope without any has nothing to
  -- purge: the sweep runs every tick, and most scopes of a workspace may hold no record).
  select coalesce(array_agg(distinct x.record_id), '{}'),
         coalesce(array_agg(distinct x.record_id)
                    filter (where x.reason in ('source_removed', 'source_expired',
                                               'source_edited')), '{}')
    into v_ids, v_changed
    from (select r.scope_id, array_agg(r.record_id) as record_ids
            from memory_private.records r
           where r.workspace_id = p_workspace_id
           group by r.scope_id) s
   cross join lateral memory_private.record_reasons(p_workspace_id, s.scope_id,
                                                    s.record_ids) x
    join memory_private.invalid_reasons ir on ir.reason = x.reason
   where ir.permanent;
  -- What such a record took away comes back where it can: the rest of its batch (its cited and
  -- shown messages) is extracted again from what remains, without the removed, expired or
  -- edited text (an edit's new text is new anyway) and without tombstoned messages
  -- (extraction_units leaves those out). A message another kept record rests on stays handled.
  -- Not after a forget (its messages are tombstoned) or a bot replaced (the memory was that
  -- identity's).
  -- Their conversations are noted, so the tick derives them again.
  with cleared as (
    delete from memory_private.extracted_sources e
     using memory_private.record_dependencies d, memory_private.records r
     where d.workspace_id = p_workspace_id and d.record_id = any (v_changed)
       and d.via in ('cited', 'shown')
       and r.workspace_id = d.workspace_id and r.record_id = d.record_id
       and e.workspace_id = p_workspace_id and e.scope_id = r.scope_id
       and e.message_id = d.message_id and e.outcome = 'extracted'
       and not exists (select 1 from memory_private.record_dependencies k
                        where k.workspace_id = p_workspace_id and k.message_id = d.message_id
                          and k.via in ('cited', 'shown') and not k.record_id = any (v_ids))
    returning e.message_id
  )
  select array_agg(distinct m.request_id) into v_requests
    from cleared c
    join memory_private.messages m
      on m.workspace_id = p_workspace_id and m.message_id = c.message_id;
  perform memory_private.note_change(p_workspace_id, 'updated', q)
     from unnest(v_requests) as q;
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.purge_permanently_invalid(text) is
  'Deletes the records that can never be valid again: a dependency removed, expired, edited or '
  'forgotten, or the bot replaced, also while a reversible reason (recall off, membership, '
  'link, grants) hides them. Reversible reasons alone keep the record. The batch of a record '
  'that went for a removed, expired or edited message is marked for extraction again (its '
  'extraction markers cleared, its conversations noted for the tick), so what did not rest on '
  'that message comes back.';

create function memory_private.scrub_erased(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_gone text[];
  v_job_id bigint;
  v_input jsonb;
begin
  v_gone := array(select message_id from memory_private.messages
                   where workspace_id = p_workspace_id and scrub_pending);
  if cardinality(v_gone) = 0 then
    return 0;
  end if;
  -- Frozen recall index texts built from records resting on them (records are deleted by the
  -- purge, which withdraws those texts already; this catches the rest).
  update memory_private.request_recall
     set index_text = null, index_withdrawn = true
   where workspace_id = p_workspace_id and index_text is not null
     and memory_private.message_keys(workspace_id, dependency_ids)
         && memory_private.message_keys(p_workspace_id, v_gone);
  -- Job inputs keep ids and content hashes: the hashes of erased messages go, and so does any
  -- checkpoint made from them (such a job is stale and is superseded, never committed).
  -- Computed first, then written by key: Citus takes no stable function of a column in an
  -- UPDATE of a distributed table.
  for v_job_id, v_input in
    select j.job_id, j.input || jsonb_build_object('sources', (
             select jsonb_agg(case when e ->> 'id' = any (v_gone) then e - 'hash' else e end
                              order by n)
               from jsonb_array_elements(j.input -> 'sources') with ordinality as a(e, n)))
      from memory_private.jobs j
     where j.workspace_id = p_workspace_id
       -- the jobs naming them, from jobs_sources_idx: not every job the workspace ever had
       and memory_private.job_source_keys(j.workspace_id, j.input)
           && memory_private.message_keys(p_workspace_id, v_gone)
       and exists (select 1 from jsonb_array_elements(j.input -> 'sources') e
                    where e ->> 'id' = any (v_gone) and e ? 'hash')
  loop
    update memory_private.jobs set input = v_input, checkpoint = null
     where workspace_id = p_workspace_id and job_id = v_job_id;
  end loop;
  -- Extraction markers record the hash the message had; so does an index's list of what it
  -- rests on (the purge has dropped such an index already, with its candidates).
  delete from memory_private.extracted_sources
   where workspace_id = p_workspace_id and message_id = any (v_gone);
  delete from memory_private.index_dependencies
   where workspace_id = p_workspace_id and message_id = any (v_gone);
  update memory_private.messages set scrub_pending = false
   where workspace_id = p_workspace_id and message_id = any (v_gone);
  return cardinality(v_gone);
end
$$;
comment on function memory_private.scrub_erased(text) is
  'Erases what was made from messages erased since the last sweep: frozen recall index texts '
  'resting on them, their content hashes in job inputs, checkpoints of jobs that read them, and '
  'their extraction markers; then clears scrub_pending. Returns how many messages it handled.';

create function memory_private.drop_stale_tombstones(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_count integer;
begin
  delete from memory_private.tombstones t
   using memory_private.messages m
   where t.workspace_id = p_workspace_id and m.workspace_id = t.workspace_id
     and m.message_id = t.message_id and m.body is null;
  get diagnostics v_count = row_count;
  return v_count;
end
$$;
comment on function memory_private.drop_stale_tombstones(text) is
  'Drops tombstones whose original message is no longer retained: nothing is left to restore.';

create function memory_private.prune_records(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_ids bigint[];
  v_now timestamptz := memory_private.clock_now();  -- the coordinator's clock on Citus
begin
  select coalesce(array_agg(record_id), '{}') into v_ids
    from (select r.record_id,
                 memory_private.prune_at(u.last_used_at, r.created_at) as prune_at,
                 row_number() over (order by coalesce(u.last_used_at, r.created_at) desc,
                                             r.record_id desc) as rank
            from memory_private.records r
            left join memory_private.record_usage u
              on u.workspace_id = r.workspace_id and u.record_id = r.record_id
           where r.workspace_id = p_workspace_id) r
   where r.prune_at <= v_now
      or r.rank > (memory_private.policy()).workspace_records;
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.prune_records(text) is
  'Prunes records unused for 30 days and, beyond 256 records in the workspace, the least '
  'recently used; their scopes are marked for consolidation (T5).';

create function memory_private.sweep_retention(p_workspace_id text) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_expired integer;
  v_derived integer;
  v_invalid integer;
  v_scrubbed integer;
  v_tombstones integer;
  v_pruned integer;
begin
  perform memory_private.lock_workspace(p_workspace_id);
  select e.erased into v_expired from memory_private.erase_expired_messages(p_workspace_id) e;
  v_derived := memory_private.erase_derived_answers(p_workspace_id);
  v_invalid := memory_private.purge_permanently_invalid(p_workspace_id);
  v_scrubbed := memory_private.scrub_erased(p_workspace_id);
  v_tombstones := memory_private.drop_stale_tombstones(p_workspace_id);
  v_pruned := memory_private.prune_records(p_workspace_id);
  return jsonb_build_object('messages_expired', v_expired, 'answers_erased', v_derived,
                            'records_invalidated', v_invalid, 'messages_scrubbed', v_scrubbed,
                            'tombstones_dropped', v_tombstones, 'records_pruned', v_pruned);
end
$$;
comment on function memory_private.sweep_retention(text) is
  'The retention sweep of one workspace, run by maintenance: erase expired text, erase derived '
  'answers, delete permanently invalid records, scrub what was made from erased messages, drop '
  'stale tombstones, prune. What it changes is noted for the tick (the conversations of '
  'erased text, the scopes of deleted records). Returns counts.';

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
  v_now timestamptz := memory_private.clock_now();  -- the coordinator's clock on Citus
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('request_id', p_request_id);
  if not exists (select 1 from memory_private.requests
                  where workspace_id = p_workspace_id and request_id = p_request_id) then
    raise exception 'request % is unknown in workspace %', p_request_id, p_workspace_id
      using errcode = 'MB002';
  end if;
  select min(case when memory_private.is_retained(m.body is not null, m.retain_until, v_now)
                  then m.retain_until else v_now end)
    into v_boundary
    from memory_private.request_provenance(p_workspace_id, p_request_id) as d(message_id)
    join memory_private.messages m
      on m.workspace_id = p_workspace_id and m.message_id = d.message_id;
  return v_boundary;
end
$$;
comment on function memory.answer_retention_boundary(text, text) is
  'The latest time until which the backend may keep the answer of a request: the earliest '
  'retention end among every message the records it was shown depend on (by recall and by '
  'query_memories, not only the sources shown); now if one is already gone; NULL when none of '
  'them has a retention end (T2).';

revoke all on function memory.answer_retention_boundary(text, text) from public;
grant execute on function memory.answer_retention_boundary(text, text) to memory_backend;
