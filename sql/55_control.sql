-- 55_control.sql: what the user may tell the memory to do (C1-C9, T7, T8).
--
-- memory.manage_memory is the manage_memory tool: remember, forget, enable-memory and
-- disable-memory. The model only proposes the call; the database decides. The call must point at
-- the request's current human message (sourceId), and that message itself must directly ask for
-- the action, in English or Chinese (memory_private.classify_request). Quoted history, tool output,
-- assistant text, questions about the feature and negative requests are refused. Permissions:
-- private scope, its user (C5); group topic, a participant adds notes and forgets when every
-- record the forget removes holds only their own statements (C6); everything else in a group
-- needs an active owner/admin (C7).
-- A change is committed with the call (C4); a replayed tool call id is never applied again: after
-- re-checking that the caller still has the standing it needed, it answers the stored outcome
-- while that still holds, and says what changed when it does not (C9). The recogniser reads the
-- first 300 characters and the end of a message, so it is linear in its length.

-- Standing and outcomes ------------------------------------------------------------------------

create function memory_private.control_refusal(
  p_request memory_private.requests, p_scope memory_private.scopes, p_needed text
) returns text
  language plpgsql stable
  as $$
declare
  v_member memory_private.members;
begin
  select * into v_member from memory_private.members
   where workspace_id = p_request.workspace_id and user_id = p_request.user_id;
  if not found or not v_member.active then
    return 'you are not an active member of this workspace';
  end if;
  if not exists (select 1 from memory_private.bots
                  where workspace_id = p_scope.workspace_id and bot_id = p_scope.bot_id
                    and active) then
    return 'this bot is inactive';
  end if;
  if p_scope.kind = 'shared'
     and not exists (select 1 from memory_private.chats
                      where workspace_id = p_scope.workspace_id and chat_id = p_scope.chat_id
                        and linked) then
    return 'this group is not linked to the workspace';
  end if;
  if p_scope.kind = 'private' and p_scope.user_id <> p_request.user_id then
    return 'this private memory belongs to another user';
  end if;
  if p_needed = 'admin' and v_member.role not in ('owner', 'admin') then
    return 'only an active workspace owner or admin may do this in a group';
  end if;
  return null;
end
$$;
comment on function memory_private.control_refusal(memory_private.requests, memory_private.scopes,
                                                   text) is
  'Why the request''s user may not make a memory change that needs the given standing '
  '(scope_user, participant, admin) now, or NULL when they may: active membership, active bot, '
  'linked group, own private scope, owner/admin role (C5-C7).';

create function memory_private.control_outcome(
  p_status text, p_action text, p_code text, p_reason text, p_memory_id bigint default null,
  p_extra jsonb default '{}'
) returns jsonb
  language sql immutable
  as $$
  select jsonb_build_object('status', p_status, 'action', p_action, 'code', p_code,
                            'reason', p_reason, 'memory_id', p_memory_id) || p_extra
$$;
comment on function memory_private.control_outcome(text, text, text, text, bigint, jsonb) is
  'The answer of manage_memory: status done/refused, the action, a machine code, a plain '
  'sentence saying what happened or why not, and the memory id concerned.';

create function memory_private.note_redact(p_text text) returns text
  language plpgsql stable
  as $$
begin
  -- memory_private.redact comes from sql/30_redaction.sql (resolved when called).
  return memory_private.redact(p_text);
end
$$;
comment on function memory_private.note_redact(text) is
  'Credential redaction applied to a note''s title and text before they are stored: common '
  'credential patterns are replaced (defense in depth, T9).';

create function memory_private.clip_bytes(p_text text, p_max_bytes integer) returns text
  language sql immutable strict parallel safe
  as $$
  -- The longest prefix of whole characters within the byte limit, in one pass.
  select coalesce(string_agg(x.c, '' order by x.n), '')
    from (select c, n, sum(octet_length(c)) over (order by n) as bytes
            from regexp_split_to_table(p_text, '') with ordinality as t(c, n)) x
   where x.bytes <= p_max_bytes
$$;
comment on function memory_private.clip_bytes(text, integer) is
  'The text cut to at most p_max_bytes UTF-8 bytes, never inside a character.';

create function memory_private.note_title(p_text text) returns text
  language sql immutable
  as $$
  select case when char_length(t) <= p.note_title_chars then t
              else coalesce(substring(left(t, p.note_title_chars) from '^(.*\S) '),
                            left(t, p.note_title_chars)) || '…' end
    from btrim(regexp_replace(p_text, '\s+', ' ', 'g')) as t, memory_private.policy() as p
$$;
comment on function memory_private.note_title(text) is
  'The default title of a note: the first words of the message (at most 60 characters).';

-- Removing records -------------------------------------------------------------------------

create function memory_private.with_dependencies(
  p_workspace_id text, p_kept text[], p_shown bigint[], p_deleted bigint[]
) returns text[]
  language plpgsql stable
  as $$
begin
  return (
    select array(select x from unnest(p_kept) as x
                 union
                 select d.message_id from memory_private.record_dependencies d
                  where d.workspace_id = p_workspace_id
                    and d.record_id = any(p_shown) and d.record_id = any(p_deleted)
                 order by 1)
  );
end
$$;
comment on function memory_private.with_dependencies(text, text[], bigint[], bigint[]) is
  'p_kept plus the dependencies (message ids) of the shown records that are being deleted: the '
  'provenance delete_records keeps for a request.';


create function memory_private.delete_records(
  p_workspace_id text, p_record_ids bigint[]
) returns integer
  language plpgsql volatile
  as $$
declare
  v_deleted integer;
  v_scopes bigint[];
  v_key text;
  v_call text;
  v_ids text[];
  v_now timestamptz := memory_private.clock_now();
begin
  -- The provenance of the answers that were shown these records outlives them: their
  -- dependencies (ids only) are copied to those requests first (T2, T3). And a frozen index
  -- text made from a deleted record goes with it (T7).
  -- The new dependencies are computed first and then written by key: Citus refuses a
  -- function of the row's columns in an UPDATE.
  for v_key, v_ids in
    select f.request_id,
           memory_private.with_dependencies(p_workspace_id, f.dependency_ids,
                                            f.basis_record_ids, gone.ids)
      from memory_private.request_recall f
      join (select r.scope_id, array_agg(r.record_id) as ids
              from memory_private.records r
             where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
             group by r.scope_id) gone
        on f.scope_id = gone.scope_id and f.basis_record_ids && gone.ids
     where f.workspace_id = p_workspace_id
  loop
    update memory_private.request_recall
       set dependency_ids = v_ids,
           index_text = case when mode = 'index' then null end,
           index_withdrawn = index_withdrawn or mode = 'index'
     where workspace_id = p_workspace_id and request_id = v_key;
  end loop;
  for v_key, v_call, v_ids in
    select c.request_id, c.tool_call_id,
           memory_private.with_dependencies(p_workspace_id, c.dependency_ids,
                                            c.record_ids, gone.ids)
      from memory_private.tool_calls c
      join (select r.scope_id, array_agg(r.record_id) as ids
              from memory_private.records r
             where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
             group by r.scope_id) gone
        on c.scope_id = gone.scope_id and c.record_ids && gone.ids
     where c.workspace_id = p_workspace_id and c.tool = 'query_memories'
  loop
    update memory_private.tool_calls set dependency_ids = v_ids
     where workspace_id = p_workspace_id and request_id = v_key and tool_call_id = v_call;
  end loop;

  with gone as (
    delete from memory_private.records
     where workspace_id = p_workspace_id and record_id = any(p_record_ids)
    returning scope_id, record_id
  ), touched as (
    select scope_id, array_agg(record_id) as ids from gone group by scope_id
  ), marked as (
    update memory_private.scopes s
       set consolidation_due_at = coalesce(s.consolidation_due_at, v_now)
      from touched t
     where s.workspace_id = p_workspace_id and s.scope_id = t.scope_id
    returning 1
  ), dropped as (
    -- An index depends on every candidate it was built from: losing one drops it (its
    -- dependencies go with its row).
    delete from memory_private.scope_indexes i
     using touched t
     where i.workspace_id = p_workspace_id and i.scope_id = t.scope_id
       and i.candidate_ids && t.ids
    returning 1
  )
  select count(*), array_agg(distinct g.scope_id) into v_deleted, v_scopes from gone g;
  -- Their scopes changed (a consolidation is due; the memories a batch is shown may be gone):
  -- noted for the tick.
  perform memory_private.note_change(p_workspace_id, 'updated', null, x)
     from unnest(v_scopes) as x;
  return v_deleted;
end
$$;
comment on function memory_private.delete_records(text, bigint[]) is
  'Deletes records of one workspace (forget, retention, pruning): first copies their '
  'dependencies (ids) to the requests that were shown them, so those answers keep their '
  'provenance, and erases the frozen index texts built with them; then drops every scope index '
  'built with one of them and marks their scopes for consolidation. Returns how many records '
  'were deleted.';

create function memory_private.forget_set(
  p_workspace_id text, p_scope_id bigint, p_record_id bigint
) returns bigint[]
  language plpgsql stable
  as $$
  -- The selected record and every record of the scope that shares a dependency with it (T7).
  -- One step only: a record that shares a message with such a neighbour but not with the
  -- selected record stays.
begin
  return (
    select array(
      select r.record_id from memory_private.records r
       where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
         and (r.record_id = p_record_id
              or exists (select 1
                           from memory_private.record_dependencies mine
                           join memory_private.record_dependencies d
                             on d.workspace_id = mine.workspace_id
                            and d.message_id = mine.message_id
                          where mine.workspace_id = p_workspace_id
                            and mine.record_id = p_record_id
                            and d.record_id = r.record_id))
       order by r.record_id)
  );
end
$$;
comment on function memory_private.forget_set(text, bigint, bigint) is
  'The records a forget of one record removes: it and every record of its scope that shares a '
  'dependency with it (T7).';

create function memory_private.record_owners(p_workspace_id text, p_record_ids bigint[])
  returns table (record_id bigint, owner_id text)
  language sql stable
  as $$
  -- Whose statements a record holds: the speaker of every user message it depends on, and for
  -- an assistant message the user whose request it answered (the bot's answer is part of that
  -- person's conversation).
  select distinct d.record_id, case when m.role = 'user' then m.speaker_id else q.user_id end
    from memory_private.record_dependencies d
    join memory_private.messages m
      on m.workspace_id = d.workspace_id and m.message_id = d.message_id
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
$$;
comment on function memory_private.record_owners(text, bigint[]) is
  'The people whose statements each record holds (user messages it depends on by speaker, '
  'assistant messages by the user of the request they answered): the participant rule of '
  'forget (C6, C7) is decided on these.';

create function memory_private.forget_records(
  p_workspace_id text, p_scope_id bigint, p_record_id bigint, p_record_ids bigint[]
) returns bigint[]
  language plpgsql volatile
  as $$
declare
  v_ids bigint[];
  v_now timestamptz := memory_private.clock_now();
begin
  perform memory_private.lock_workspace(p_workspace_id);
  v_ids := array(select record_id from memory_private.records
                  where workspace_id = p_workspace_id and scope_id = p_scope_id
                    and record_id = any(p_record_ids) order by record_id);
  if cardinality(v_ids) = 0 then
    return v_ids;
  end if;
  -- Content-free tombstones for what the selected record was made from, while those messages
  -- are retained, so extraction cannot restore the forgotten information (T8). The other
  -- removed records' other messages are not tombstoned: they may be extracted again, without
  -- what was forgotten. The original messages stay.
  insert into memory_private.tombstones (workspace_id, scope_id, message_id, created_at)
  select p_workspace_id, p_scope_id, m.message_id, v_now
    from memory_private.record_dependencies d
    join memory_private.messages m
      on m.workspace_id = d.workspace_id and m.message_id = d.message_id
   where d.workspace_id = p_workspace_id and d.record_id = p_record_id and m.body is not null
  on conflict do nothing;
  perform memory_private.delete_records(p_workspace_id, v_ids);
  return v_ids;
end
$$;
comment on function memory_private.forget_records(text, bigint, bigint, bigint[]) is
  'Forgets records of one scope: tombstones the retained dependencies of the selected record '
  'p_record_id, then deletes p_record_ids (memory_private.forget_set: it and its neighbours), '
  'which drops and withdraws the indexes built with them (T7, T8). Takes the workspace lock. '
  'Returns the ids deleted.';

-- manage_memory --------------------------------------------------------------------------------

create function memory_private.replay_outcome(
  p_call memory_private.tool_calls, p_request memory_private.requests,
  p_scope memory_private.scopes
) returns jsonb
  language plpgsql stable
  as $$
declare
  v_action text := p_call.outcome ->> 'action';
  v_memory_id bigint := (p_call.outcome ->> 'memory_id')::bigint;
  v_record memory_private.records;
  v_reason text;
begin
  -- A replay is never applied again, and never reports a state that no longer holds (C9): the
  -- stored outcome is answered only while what it says is still true now.
  if v_action = 'remember' then
    select * into v_record from memory_private.records
     where workspace_id = p_request.workspace_id and record_id = v_memory_id
       and scope_id = p_scope.scope_id;
    if not found then
      v_reason := format('An earlier call saved this message as memory %s; it has since been '
                         'forgotten or removed, so it is not remembered now.', v_memory_id);
    else
      v_reason := memory_private.record_invalid_reason(v_record, p_request.user_id);
      if v_reason is not null then
        v_reason := format('An earlier call saved this message as memory %s; it is not '
                           'recalled now (%s).', v_memory_id, v_reason);
      end if;
    end if;
  elsif v_action = 'disable-memory' and p_scope.recall_enabled then
    v_reason := 'An earlier call turned memory off in this chat; it is on again now.';
  elsif v_action = 'enable-memory' and not p_scope.recall_enabled then
    v_reason := 'An earlier call turned memory on in this chat; it is off again now.';
  end if;
  -- forget holds for good: a forgotten record never comes back and ids are never reused.
  if v_reason is not null then
    return memory_private.control_outcome('done', v_action, 'no_longer_holds', v_reason,
                                          v_memory_id, jsonb_build_object('holds', false));
  end if;
  return p_call.outcome || jsonb_build_object('holds', true);
end
$$;
comment on function memory_private.replay_outcome(memory_private.tool_calls,
                                                  memory_private.requests,
                                                  memory_private.scopes) is
  'The answer to a replayed manage_memory call that was done: its stored outcome while it still '
  'holds (the note exists and is recalled, memory is still off or on), otherwise '
  'code no_longer_holds saying what changed since (C9). holds says which.';

create function memory_private.source_refusal(
  p_request memory_private.requests, p_action text, p_source_id text
) returns jsonb
  language plpgsql stable
  as $$
declare
  v_ws text := p_request.workspace_id;
  v_current memory_private.messages;
  v_source memory_private.messages;
  v_form text;
begin
  -- The source must be the request's current human message ...
  select * into v_current from memory_private.messages
   where workspace_id = v_ws and request_id = p_request.request_id and role = 'user'
     and speaker_id = p_request.user_id
   order by created_at desc, message_id desc
   limit 1;
  select * into v_source from memory_private.messages
   where workspace_id = v_ws and message_id = p_source_id;
  if not found or v_source.request_id <> p_request.request_id then
    return memory_private.control_outcome('refused', p_action, 'not_current_message',
      format('Message %s is not a message of this request; only the user''s current message can '
             'ask for this.', p_source_id));
  end if;
  if v_source.role <> 'user' then
    return memory_private.control_outcome('refused', p_action, 'not_human_message',
      format('Message %s is assistant text; only the user''s own current message can ask for '
             'this.', p_source_id));
  end if;
  if v_source.speaker_id <> p_request.user_id
     or v_current.message_id is distinct from v_source.message_id then
    return memory_private.control_outcome('refused', p_action, 'not_current_message',
      format('Message %s is not the current message of the user of this request.',
             p_source_id));
  end if;
  if not memory_private.is_retained(v_source.body is not null, v_source.retain_until,
                                    memory_private.clock_now()) then
    return memory_private.control_outcome('refused', p_action, 'source_gone',
      format('Message %s was removed or is past its retention.', p_source_id));
  end if;
  -- ... and that message must itself directly ask for this action (C1, C2).
  v_form := memory_private.request_form(v_source.body);
  if v_form is distinct from p_action then
    return memory_private.control_outcome('refused', p_action, 'not_direct_request',
      case v_form
        when 'quoted' then 'The message quotes other text (history, code, tool output or '
                           'someone else''s words); only a direct request of the user counts.'
        when 'question' then 'The message asks a question; it is not a request to '
                             || p_action || '. The user can ask for it directly.'
        when 'negative' then 'The message asks not to do this.'
        when 'empty' then 'The message asks to remember but says nothing to remember.'
        when 'none' then 'The message does not directly ask to ' || p_action || '.'
        else 'The message asks for ' || v_form || ', not ' || p_action || '.'
      end);
  end if;
  return null;
end
$$;
comment on function memory_private.source_refusal(memory_private.requests, text, text) is
  'Why the message p_source_id cannot ask for p_action, as a refused manage_memory outcome, or '
  'NULL when it can: it must be the request''s current human message (the newest user message '
  'of the request''s user), still retained, and directly ask for the action (C1, C2).';

create function memory_private.control_remember(
  p_request memory_private.requests, p_scope memory_private.scopes, p_source_id text,
  p_title text, out outcome jsonb, out authority text
)
  language plpgsql volatile
  as $$
declare
  v_ws text := p_request.workspace_id;
  v_now timestamptz := memory_private.clock_now();
  v_source memory_private.messages;
  v_refusal text;
  v_record memory_private.records;
  v_summary text;
  v_title text;
  c_action constant text := 'remember';
begin
  select * into strict v_source from memory_private.messages
   where workspace_id = v_ws and message_id = p_source_id;
  authority := case when p_scope.kind = 'private' then 'scope_user' else 'participant' end;
  v_refusal := memory_private.control_refusal(p_request, p_scope, authority);
  if v_refusal is not null then
    outcome := memory_private.control_outcome('refused', c_action, 'not_allowed',
      'Not remembered: ' || v_refusal || '.');
    return;
  end if;
  if not p_scope.recall_enabled then
    outcome := memory_private.control_outcome('refused', c_action, 'recall_disabled',
      'Memory is turned off in this chat, so nothing is stored; turn it on first.');
    return;
  end if;
  if exists (select from memory_private.tombstone(v_ws, p_scope.scope_id,
                                                  v_source.message_id)) then
    outcome := memory_private.control_outcome('refused', c_action, 'forgotten',
      'This message was forgotten in this chat and is not stored again.');
    return;
  end if;
  select r.* into v_record from memory_private.records r
    join memory_private.record_dependencies d
      on d.workspace_id = r.workspace_id and d.record_id = r.record_id
   where r.workspace_id = v_ws and r.scope_id = p_scope.scope_id and r.kind = 'note'
     and d.message_id = v_source.message_id and d.content_hash = v_source.content_hash
   limit 1;
  if found then
    outcome := memory_private.control_outcome('done', c_action, 'already_remembered',
      format('This message is already remembered as memory %s.', v_record.record_id),
      v_record.record_id);
    return;
  end if;
  v_summary := memory_private.note_redact(v_source.body);
  if octet_length(v_summary) > (memory_private.policy()).summary_bytes then
    outcome := memory_private.control_outcome('refused', c_action, 'too_long',
      format('The message is %s bytes; a note holds at most %s bytes (UTF-8). Ask the user '
             'for a shorter message to remember.', octet_length(v_summary),
             (memory_private.policy()).summary_bytes));
    return;
  end if;
  -- A note carries nothing its message did not say (C3): a title the model gives must be a
  -- part of the message as stored (redacted, spaces collapsed), letter for letter; otherwise
  -- the message's first words are the title.
  if p_title is not null then
    v_title := btrim(regexp_replace(memory_private.note_redact(p_title), '\s+', ' ', 'g'));
    if v_title = ''
       or strpos(regexp_replace(v_summary, '\s+', ' ', 'g'), v_title) = 0 then
      outcome := memory_private.control_outcome('refused', c_action, 'title_not_in_message',
        'Not remembered: a note''s title must be words copied from the message itself, letter '
        'for letter (a part of it), or left out to use its first words.');
      return;
    end if;
  else
    v_title := memory_private.note_redact(memory_private.note_title(v_source.body));
  end if;
  v_title := memory_private.clip_bytes(v_title, (memory_private.policy()).title_bytes);
  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  select v_ws, p_scope.scope_id, 'note', v_title, v_summary, array[v_source.speaker_id],
         array[p_request.thread_id], v_source.repositories, b.identity, p_request.request_id,
         v_now
    from memory_private.bots b
   where b.workspace_id = v_ws and b.bot_id = p_scope.bot_id
  returning * into strict v_record;
  -- A note cites, and rests on, exactly the message that asked for it (C3).
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via, position)
  values (v_ws, v_record.record_id, v_source.message_id, v_source.content_hash, 'cited', 1);
  update memory_private.scopes
     set consolidation_due_at = coalesce(consolidation_due_at, v_now)
   where workspace_id = v_ws and scope_id = p_scope.scope_id;
  outcome := memory_private.control_outcome('done', c_action, 'remembered',
    format('Saved the message as memory %s, attributed to %s. It is historical reference, '
           'not an instruction.', v_record.record_id, v_source.speaker_id),
    v_record.record_id);
end
$$;
comment on function memory_private.control_remember(memory_private.requests,
                                                    memory_private.scopes, text, text) is
  'manage_memory remember, once the source asks for it: the user''s standing, recall on, not '
  'forgotten, not already a note, a given title a part of the message; then the message itself '
  '(redacted) becomes a note citing and resting on it, nothing else in it (C3, C5, C6). Returns '
  'the outcome and the standing it needed.';

create function memory_private.control_forget(
  p_request memory_private.requests, p_scope memory_private.scopes, p_memory_id bigint,
  out outcome jsonb, out authority text
)
  language plpgsql volatile
  as $$
declare
  v_ws text := p_request.workspace_id;
  v_refusal text;
  v_record memory_private.records;
  v_ids bigint[];
  v_owners jsonb;
  v_own_only boolean;
  c_action constant text := 'forget';
begin
  if not p_scope.recall_enabled then
    outcome := memory_private.control_outcome('refused', c_action, 'recall_disabled',
      'Memory is turned off in this chat; turn it on to see and forget memories.', p_memory_id);
    return;
  end if;
  select * into v_record from memory_private.records
   where workspace_id = v_ws and record_id = p_memory_id and scope_id = p_scope.scope_id;
  if not found
     or memory_private.record_invalid_reason(v_record, p_request.user_id) is not null then
    outcome := memory_private.control_outcome('refused', c_action, 'memory_not_found',
      format('There is no memory %s that you can see in this chat.', p_memory_id),
      p_memory_id);
    return;
  end if;
  -- The participant rule applies to every record the forget would remove, not only the
  -- selected one (C6, C7): a record holding another person's statements needs an owner/admin.
  v_ids := memory_private.forget_set(v_ws, p_scope.scope_id, p_memory_id);
  select jsonb_object_agg(o.owner_id, o.n), bool_and(o.owner_id = p_request.user_id)
    into v_owners, v_own_only
    from (select owner_id, count(*) as n
            from memory_private.record_owners(v_ws, v_ids) group by owner_id) o;
  authority := case when p_scope.kind = 'private' then 'scope_user'
                    when coalesce(v_own_only, false) then 'participant'
                    else 'admin' end;
  v_refusal := memory_private.control_refusal(p_request, p_scope, authority);
  if v_refusal is not null then
    outcome := memory_private.control_outcome('refused', c_action, 'not_allowed',
      case when authority = 'admin' and cardinality(v_ids) > 1
             then format('Forgetting memory %s would also remove %s related memories built on '
                         'the same messages, and together they hold statements of other '
                         'participants; nothing was forgotten. Only an active workspace owner '
                         'or admin can forget them.', p_memory_id, cardinality(v_ids) - 1)
           when authority = 'admin'
             then format('Memory %s holds statements of other participants; nothing was '
                         'forgotten. Only an active workspace owner or admin can forget it.',
                         p_memory_id)
           else 'Not forgotten: ' || v_refusal || '.' end,
      p_memory_id);
    return;
  end if;
  v_ids := memory_private.forget_records(v_ws, p_scope.scope_id, p_memory_id, v_ids);
  outcome := memory_private.control_outcome('done', c_action, 'forgotten',
    format('Forgot memory %s%s (statements of %s). Its messages will not be remembered again; '
           'the original chat messages are kept.', p_memory_id,
           case when cardinality(v_ids) > 1
                then format(' and %s related memories built on the same messages',
                            cardinality(v_ids) - 1)
                else '' end,
           coalesce((select string_agg(format('%s: %s', key, value), ', ' order by key)
                       from jsonb_each_text(v_owners)), 'nobody')),
    p_memory_id, jsonb_build_object('forgotten_ids', to_jsonb(v_ids),
                                    'forgotten_by_person', coalesce(v_owners, '{}')));
end
$$;
comment on function memory_private.control_forget(memory_private.requests,
                                                  memory_private.scopes, bigint) is
  'manage_memory forget, once the source asks for it: the record must be visible to the user in '
  'the scope; the participant rule holds for every record the forget removes (C6, C7); then '
  'memory_private.forget_records (T7, T8). Returns the outcome and the standing it needed.';

create function memory_private.control_toggle(
  p_request memory_private.requests, p_scope memory_private.scopes, p_action text,
  out outcome jsonb, out authority text
)
  language plpgsql volatile
  as $$
declare
  v_refusal text;
  v_changed boolean;
  v_ws text := p_request.workspace_id;
begin
  authority := case when p_scope.kind = 'private' then 'scope_user' else 'admin' end;
  v_refusal := memory_private.control_refusal(p_request, p_scope, authority);
  if v_refusal is not null then
    outcome := memory_private.control_outcome('refused', p_action, 'not_allowed',
      case when authority = 'admin'
             then 'Only an active workspace owner or admin can turn group memory on or off.'
           else 'Not changed: ' || v_refusal || '.' end);
    return;
  end if;
  update memory_private.scopes
     set recall_enabled = (p_action = 'enable-memory')
   where workspace_id = v_ws and scope_id = p_scope.scope_id
     and recall_enabled <> (p_action = 'enable-memory');
  v_changed := found;
  outcome := memory_private.control_outcome('done', p_action,
    case when p_action = 'enable-memory' then 'enabled' else 'disabled' end,
    case when p_action = 'enable-memory' and v_changed
           then 'Memory is on again in this chat; stored memories are recalled again.'
         when p_action = 'enable-memory' then 'Memory was already on in this chat.'
         when v_changed
           then 'Memory is off in this chat: stored memories are kept but nothing is recalled '
                'or made until it is turned on again.'
         else 'Memory was already off in this chat.' end,
    null, jsonb_build_object('changed', v_changed));
end
$$;
comment on function memory_private.control_toggle(memory_private.requests,
                                                  memory_private.scopes, text) is
  'manage_memory enable-memory / disable-memory, once the source asks for it: the scope''s user '
  'in a private chat, an owner/admin in a group (C5, C7); recall of the scope is switched, '
  'records kept (C8). Returns the outcome and the standing it needed.';

create function memory_private.apply_control(
  p_request memory_private.requests, p_scope memory_private.scopes, p_action text,
  p_source_id text, p_memory_id bigint, p_title text,
  out outcome jsonb, out authority text
)
  language plpgsql volatile
  as $$
begin
  outcome := memory_private.source_refusal(p_request, p_action, p_source_id);
  if outcome is not null then
    return;
  end if;
  if p_action = 'remember' then
    select c.outcome, c.authority into outcome, authority
      from memory_private.control_remember(p_request, p_scope, p_source_id, p_title) c;
  elsif p_action = 'forget' then
    select c.outcome, c.authority into outcome, authority
      from memory_private.control_forget(p_request, p_scope, p_memory_id) c;
  else
    select c.outcome, c.authority into outcome, authority
      from memory_private.control_toggle(p_request, p_scope, p_action) c;
  end if;
end
$$;
comment on function memory_private.apply_control(memory_private.requests, memory_private.scopes,
                                                 text, text, bigint, text) is
  'Checks and applies one manage_memory action (the caller holds the workspace lock): the source '
  'asks for it (memory_private.source_refusal), then the action''s own function decides the '
  'standing and the state (control_remember, control_forget, control_toggle). Returns the '
  'outcome and the standing it needed.';

create function memory.manage_memory(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_args jsonb
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_action text;
  v_source_id text;
  v_memory_id bigint;
  v_title text;
  v_call memory_private.tool_calls;
  v_start record;
  v_outcome jsonb;
  v_authority text;
  v_refusal text;
  v_now timestamptz := memory_private.clock_now();
begin
  v_start := memory_private.begin_tool_call(p_workspace_id, p_request_id, p_tool_call_id,
                                        'manage_memory', p_args,
                                        array['action', 'sourceId', 'memoryId', 'title']);
  v_request := v_start.request;
  v_scope := v_start.scope;
  v_call := v_start.previous;
  -- Whatever the action changes (records, tombstones, recall on or off), maintenance follows.
  perform memory_private.note_change(p_workspace_id, 'updated', null, v_scope.scope_id);
  v_action := memory_private.arg_text(p_args, 'action', 40);
  if v_action is null
     or v_action not in ('remember', 'forget', 'enable-memory', 'disable-memory') then
    raise exception 'args.action must be remember, forget, enable-memory or disable-memory'
      using errcode = 'MB001';
  end if;
  v_source_id := memory_private.arg_text(p_args, 'sourceId', (memory_private.policy()).id_bytes);
  perform memory_private.check_id('args.sourceId', v_source_id);
  v_memory_id := memory_private.arg_integer(p_args, 'memoryId', 1, 9223372036854775807);
  v_title := nullif(btrim(memory_private.arg_text(p_args, 'title',
                                                  (memory_private.policy()).title_bytes)), '');
  if v_action = 'forget' and v_memory_id is null then
    raise exception 'args.memoryId is required to forget' using errcode = 'MB001';
  end if;
  if v_action <> 'forget' and v_memory_id is not null then
    raise exception 'args.memoryId is only for forget' using errcode = 'MB001';
  end if;
  if v_action <> 'remember' and v_title is not null then
    raise exception 'args.title is only for remember' using errcode = 'MB001';
  end if;

  if v_call.tool_call_id is not null then
    if v_call.outcome ->> 'status' = 'done' then
      -- A replay: never applied twice, but only confirmed to a caller who still may (C9).
      v_refusal := memory_private.control_refusal(v_request, v_scope, v_call.authority);
      if v_refusal is not null then
        return memory_private.control_outcome('refused', v_action, 'access_lost',
          'This change was made by an earlier call, but ' || v_refusal || ' now.',
          (v_call.outcome ->> 'memory_id')::bigint, jsonb_build_object('replayed', true));
      end if;
      return memory_private.replay_outcome(v_call, v_request, v_scope)
             || jsonb_build_object('replayed', true);
    end if;
    -- A refused call changed nothing; its replay is decided again on current facts.
  end if;

  select a.outcome, a.authority into v_outcome, v_authority
    from memory_private.apply_control(v_request, v_scope, v_action, v_source_id, v_memory_id,
                                      v_title) a;
  insert into memory_private.tool_calls
    (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, authority, outcome,
     record_ids, created_at, updated_at)
  values (p_workspace_id, p_request_id, p_tool_call_id, 'manage_memory', v_scope.scope_id,
          memory_private.args_hash(p_args), v_authority, v_outcome,
          -- an array literal, not a subquery: Citus takes none in an INSERT's values
          case when v_outcome ->> 'memory_id' is null then '{}'::bigint[]
               else array[(v_outcome ->> 'memory_id')::bigint] end, v_now, v_now)
  on conflict (workspace_id, request_id, tool_call_id) do update
    set authority = excluded.authority, outcome = excluded.outcome,
        record_ids = excluded.record_ids, updated_at = excluded.updated_at;
  return v_outcome || jsonb_build_object('replayed', false);
end
$$;
comment on function memory.manage_memory(text, text, text, jsonb) is
  'The manage_memory tool: args {action, sourceId, memoryId?, title?} (validated here, MB001/'
  'MB004). sourceId must be the request''s current human message and that message must directly '
  'ask for the action (English or Chinese); remember stores the message itself as a note '
  'attributed to its speaker, forget deletes the record and every record sharing a dependency '
  'with it and tombstones what the record was made from (a group participant only when all of '
  'them hold only their own statements), enable-/disable-memory toggle recall of the scope '
  '(records kept). Private '
  'scope: its user; group: a participant for notes and their own records, an owner/admin for '
  'the rest. Answers {"status":"done"|"refused", "action", "code", "reason", "memory_id", '
  '"replayed"}; a replayed tool call id is never applied again: once access is re-checked it '
  'answers the stored outcome while it still holds, or code no_longer_holds when the state '
  'changed since (the note forgotten, memory turned back on), with "holds" (C9). Committed '
  'when the call returns (C4). MB003 when the id was used with other arguments; MB005 for a '
  'scheduled request.';

revoke all on function memory.manage_memory(text, text, text, jsonb) from public;
grant execute on function memory.manage_memory(text, text, text, jsonb) to memory_backend;
