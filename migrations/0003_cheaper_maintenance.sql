-- 0003_cheaper_maintenance: maintenance does less work per tick, with the same results.
-- - The retention sweep asks the validity rule once per scope that has records, not once per
--   scope of the workspace (memory_private.purge_permanently_invalid).
-- - Scheduling reads a scope's conversations from its requests, then each conversation's
--   messages, instead of the workspace's every message for every scope
--   (memory_private.extraction_units).
-- - Adding counts returns at once when there is nothing to add (memory_private.add_counts).

create or replace function memory_private.purge_permanently_invalid(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_ids bigint[];
begin
  -- A record with a permanent reason (memory_private.invalid_reasons: the bot replaced, a
  -- dependency removed, expired, edited or forgotten) never comes back, whatever else holds now
  -- (recall off, a lost grant): it is deleted, so neither it nor the hashes it kept outlive what
  -- it was made from.
  -- The rule is asked once per scope that has records (a scope without any has nothing to
  -- purge: the sweep runs every tick, and most scopes of a workspace may hold no record).
  v_ids := array(
    select distinct x.record_id
      from (select r.scope_id, array_agg(r.record_id) as record_ids
              from memory_private.records r
             where r.workspace_id = p_workspace_id
             group by r.scope_id) s
     cross join lateral memory_private.record_reasons(p_workspace_id, s.scope_id,
                                                      s.record_ids) x
      join memory_private.invalid_reasons ir on ir.reason = x.reason
     where ir.permanent);
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.purge_permanently_invalid(text) is
  'Deletes the records that can never be valid again: a dependency removed, expired, edited or '
  'forgotten, or the bot replaced, also while a reversible reason (recall off, membership, '
  'link, grants) hides them. Reversible reasons alone keep the record.';

create or replace function memory_private.extraction_units(
  p_workspace_id text, p_scope memory_private.scopes, p_now timestamptz, p_cutoff timestamptz
) returns table (request_id text, bytes integer, sources jsonb)
  language sql stable
  as $$
  -- The qualifying conversations of the scope (P2, P3, V10), newest first: one request each,
  -- with its retained, directed, untombstoned messages as {id, hash}, when it has a user and an
  -- assistant message, something not yet extracted at its hash, and has been idle itself.
  -- The scope's finished requests are read first (requests_scope_idx), then the messages of
  -- each (messages_request_idx): never every message of the workspace for one scope, whatever
  -- the planner believes of the tables' sizes (a plan for a small tenant read the workspace's
  -- every message for every scope).
  select r.request_id, u.bytes, u.sources
    from memory_private.requests r
   cross join lateral (
     select sum(octet_length(m.body))::integer as bytes,
            jsonb_agg(jsonb_build_object('id', m.message_id, 'hash', m.content_hash)
                      order by m.created_at, m.message_id) as sources,
            bool_or(m.role = 'user') and bool_or(m.role = 'assistant')
              and bool_or(e.message_id is null) as qualifies
       from memory_private.messages m
       left join memory_private.extracted_sources e
         on e.workspace_id = m.workspace_id and e.scope_id = p_scope.scope_id
        and e.message_id = m.message_id and e.content_hash = m.content_hash
      where m.workspace_id = p_workspace_id and m.request_id = r.request_id
        and memory_private.is_retained(m.body is not null, m.retain_until, p_now)
        and (m.directed or p_scope.kind = 'private')
        and not exists (select 1 from memory_private.tombstones t
                         where t.workspace_id = m.workspace_id
                           and t.scope_id = p_scope.scope_id and t.message_id = m.message_id)
   ) u
   where r.workspace_id = p_workspace_id and r.bot_id = p_scope.bot_id
     and r.chat_id = p_scope.chat_id
     and (p_scope.kind = 'private' or r.topic_id = p_scope.topic_id)
     and r.kind = 'interactive' and r.status = 'succeeded' and r.finished_at <= p_cutoff
     and u.qualifies
     -- Idle window, per conversation: its own last activity (the request's update or finish,
     -- its messages' creation or edit; removed messages count too).
     and greatest(r.updated_at, r.finished_at,
                  (select max(greatest(a.created_at, a.edited_at, a.removed_at))
                     from memory_private.messages a
                    where a.workspace_id = p_workspace_id and a.request_id = r.request_id))
         <= p_cutoff
   order by r.finished_at desc, r.created_at desc, r.request_id desc
$$;
comment on function memory_private.extraction_units(text, memory_private.scopes, timestamptz,
                                                    timestamptz) is
  'The conversations of a scope that qualify for extraction now, newest first, each with its '
  'byte size and its sources ({id, hash}).';

create or replace function memory_private.add_counts(p_total jsonb, p_more jsonb) returns jsonb
  language plpgsql immutable
  as $$
declare
  v_key text;
  v_value jsonb;
  v_total jsonb := coalesce(p_total, '{}'::jsonb);
begin
  if p_more is null or p_more = '{}'::jsonb then
    return v_total;  -- most steps of most ticks count nothing
  end if;
  for v_key, v_value in select key, value from jsonb_each(p_more) loop
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

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 3 $$;
