-- 0003_cheaper_maintenance: maintenance does less work per tick, with the same results.
-- - The retention sweep asks the validity rule once per scope that has records, not once per
--   scope of the workspace (memory_private.purge_permanently_invalid).

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

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 3 $$;
