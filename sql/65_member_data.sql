-- 65_member_data.sql: what the memory holds of one member, and its erasure.
--
-- A member asks "what do you remember about me?" or "delete everything about me". A memory holds
-- a member's data when it rests on their statements: a user message they spoke, or the bot's
-- answer in a request of theirs (memory_private.record_owners, the rule forget's authority is
-- decided on). Every record depends on everything its model call was shown (20_memory_state),
-- so that set is exactly the memories that may hold something the member said.
--
-- memory.member_memories lists them for an operator to export; memory.erase_member erases the
-- member's messages in every scope and, in the same transaction, everything made from them
-- (the retention sweep's steps, 60_retention): the answers derived from them, the records
-- resting on them (their batches are extracted again without them), frozen index texts, job
-- inputs' hashes, checkpoints and extraction markers. The message rows stay, content-free (id,
-- request, speaker, no text, no hash), as the tombstones that keep anything from coming back: a
-- removed message cannot be reported again (upsert_message refuses it, MB003).

create function memory_private.member_messages(p_workspace_id text, p_user_id text)
  returns table (message_id text)
  language sql stable
  as $$
  -- Their statements: what they said, anywhere, and the bot's answers in their requests.
  select m.message_id from memory_private.messages m
   where m.workspace_id = p_workspace_id and m.role = 'user' and m.speaker_id = p_user_id
  union
  select m.message_id
    from memory_private.requests q
    join memory_private.messages m
      on m.workspace_id = q.workspace_id and m.request_id = q.request_id
   where q.workspace_id = p_workspace_id and q.user_id = p_user_id
$$;
comment on function memory_private.member_messages(text, text) is
  'The messages that are one member''s statements: the user messages they spoke and every '
  'message of their requests (the bot''s answers to them), as record_owners reads them.';

create function memory_private.require_member_data(p_workspace_id text, p_user_id text)
  returns void
  language plpgsql stable
  as $$
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('user_id', p_user_id);
  if not exists (select 1 from memory_private.members
                  where workspace_id = p_workspace_id and user_id = p_user_id)
     and not exists (select 1 from memory_private.requests
                      where workspace_id = p_workspace_id and user_id = p_user_id)
     and not exists (select 1 from memory_private.messages
                      where workspace_id = p_workspace_id and speaker_id = p_user_id
                        and role = 'user') then
    raise exception 'user % is unknown in workspace %', p_user_id, p_workspace_id
      using errcode = 'MB002',
            hint = 'No member, request or message of this user was ever reported.';
  end if;
end
$$;
comment on function memory_private.require_member_data(text, text) is
  'Raises MB001/MB002 unless the workspace is known and the user is a member or ever made a '
  'request or spoke a message in it.';

create function memory.member_memories(p_workspace_id text, p_user_id text) returns jsonb
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ids bigint[];
begin
  perform memory_private.require_member_data(p_workspace_id, p_user_id);
  v_ids := array(select distinct o.record_id
                   from memory_private.record_owners(
                          p_workspace_id,
                          array(select r.record_id from memory_private.records r
                                 where r.workspace_id = p_workspace_id)) o
                  where o.owner_id = p_user_id);
  return jsonb_build_object(
    'workspace_id', p_workspace_id,
    'user_id', p_user_id,
    'count', cardinality(v_ids),
    'memories', coalesce((
      select jsonb_agg(jsonb_build_object(
               'id', r.record_id,
               'kind', r.kind,
               'scope', jsonb_build_object('kind', s.kind, 'bot_id', s.bot_id,
                                           'chat_id', s.chat_id, 'user_id', s.user_id,
                                           'topic_id', s.topic_id),
               'title', r.title,
               'summary', r.summary,
               'speaker_ids', to_jsonb(r.speaker_ids),
               'created_at', r.created_at,
               -- the member's messages it rests on (ids only)
               'member_message_ids', to_jsonb(array(
                  select d.message_id from memory_private.record_dependencies d
                   where d.workspace_id = p_workspace_id and d.record_id = r.record_id
                     and d.message_id in (select mm.message_id
                                            from memory_private.member_messages(
                                                   p_workspace_id, p_user_id) mm)
                   order by d.message_id)),
               -- whether the member may recall it now, and if not, why
               'hidden_because', v.reason)
             order by r.created_at, r.record_id)
        from memory_private.records r
        join memory_private.scopes s
          on s.workspace_id = r.workspace_id and s.scope_id = r.scope_id
        left join lateral memory_private.invalid_records(p_workspace_id, r.scope_id,
                                                         array[r.record_id], p_user_id) v
          on true
       where r.workspace_id = p_workspace_id and r.record_id = any (v_ids)), '[]'::jsonb));
end
$$;
comment on function memory.member_memories(text, text) is
  'Every memory of the workspace that holds a member''s statements (memory_private.record_owners: '
  'rests on a message they spoke or on the bot''s answer in a request of theirs), for an '
  'operator to export: id, kind, scope, title and summary as stored, speakers, date, the '
  'member''s message ids it rests on, and why the member could not recall it now (NULL: they '
  'can). MB001/MB002 for a bad or unknown workspace or user.';

create function memory.erase_member(p_workspace_id text, p_user_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_erased integer;
  v_derived integer;
  v_records integer;
  v_scrubbed integer;
  v_tombstones integer;
  v_now timestamptz := memory_private.clock_now();
begin
  perform memory_private.require_member_data(p_workspace_id, p_user_id);
  perform memory_private.lock_workspace(p_workspace_id);
  update memory_private.messages m
     set body = null, content_hash = null, removed_at = v_now,
         removal_reason = 'member_erased', scrub_pending = true
   where m.workspace_id = p_workspace_id and m.body is not null
     and m.message_id in (select e.message_id
                            from memory_private.member_messages(p_workspace_id, p_user_id) e);
  get diagnostics v_erased = row_count;
  -- What was made from them goes now, not at the next tick: the retention sweep's steps.
  v_derived := memory_private.erase_derived_answers(p_workspace_id);
  v_records := memory_private.purge_permanently_invalid(p_workspace_id);
  v_scrubbed := memory_private.scrub_erased(p_workspace_id);
  v_tombstones := memory_private.drop_stale_tombstones(p_workspace_id);
  if v_erased > 0 then
    -- what the erasure leaves of their conversations has no text to extract again; the
    -- batches it invalidated are due now (their other conversations are idle already)
    perform memory_private.note_change(p_workspace_id, 'updated');
  end if;
  return jsonb_build_object('workspace_id', p_workspace_id, 'user_id', p_user_id,
                            'messages_erased', v_erased, 'answers_erased', v_derived,
                            'records_deleted', v_records, 'messages_scrubbed', v_scrubbed,
                            'tombstones_dropped', v_tombstones);
end
$$;
comment on function memory.erase_member(text, text) is
  'Erases a member''s statements (the user messages they spoke and every message of their '
  'requests) in every scope of the workspace, and in the same transaction everything made from '
  'them: derived answers (transitively), the records resting on them (their batches are '
  'extracted again without them), frozen index texts, job inputs'' hashes, checkpoints and '
  'extraction markers. The message rows stay without text or hash (removal_reason '
  'member_erased) and cannot be reported again. Idempotent. MB001/MB002 for a bad or unknown '
  'workspace or user. Returns counts.';

revoke all on function memory.member_memories(text, text), memory.erase_member(text, text)
  from public;
grant execute on function memory.member_memories(text, text), memory.erase_member(text, text)
  to memory_backend, memory_operator;
