-- 20_memory_state.sql: scopes, records, what each record rests on, tombstones, and the one
-- rule that decides at read time whether a record may be recalled.
--
-- A scope is private (workspace, bot, private chat, user) or shared (workspace, bot, group,
-- topic). Neither imports the other (V2-V4). A record belongs to exactly one scope and keeps two
-- sets of messages (V7):
--   sources       the messages its output cites, in the order the summary uses them: what
--                 query_memories shows (20 at most) and what enters a request's citation set;
--   dependencies  what its content was made from, each message with the content hash it had:
--                 the cited messages, plus every dependency of the memories the output declared
--                 it reused, plus any uncited message whose words the summary repeats (the
--                 defence in depth of commit_job). Never the rest of what the model saw.
-- Validity, forgetting, retention and grants act on the dependencies (T1, T7, T8), so a record
-- outlives every message it was not made from.

create table memory_private.scopes (
  workspace_id text not null,
  scope_id bigint generated always as identity,
  kind text not null check (kind in ('private', 'shared')),
  bot_id text not null,
  chat_id text not null,
  user_id text,
  topic_id bigint,
  recall_enabled boolean not null default true,
  index_text text check (octet_length(index_text) <= 4500),
  index_record_ids bigint[] check (cardinality(index_record_ids) <= 12),
  index_candidate_ids bigint[] check (cardinality(index_candidate_ids) <= 48),
  index_built_at timestamptz,
  consolidation_due_at timestamptz,
  created_at timestamptz not null,
  primary key (workspace_id, scope_id),
  foreign key (workspace_id, bot_id) references memory_private.bots on delete cascade,
  foreign key (workspace_id, chat_id) references memory_private.chats on delete cascade,
  check ((kind = 'private' and user_id is not null and topic_id is null)
      or (kind = 'shared' and user_id is null and topic_id is not null)),
  check ((index_text is null) = (index_record_ids is null)),
  check ((index_text is null) = (index_candidate_ids is null)),
  check (index_record_ids <@ index_candidate_ids)
);
comment on table memory_private.scopes is
  'Memory scopes: private (bot, private chat, user) or shared (bot, group, topic). Carries recall '
  'on/off, the consolidated index (<= 4,500 bytes, <= 12 record ids, and the <= 48 candidates '
  'it was built from) and whether a consolidation is due.';
comment on column memory_private.scopes.index_candidate_ids is
  'Every record the consolidation model saw when it wrote index_text. The text may speak of any '
  'of them, so the index depends on all of them: a reader gets it only while every candidate is '
  'valid for that reader, and deleting any candidate drops it.';
comment on column memory_private.scopes.consolidation_due_at is
  'Set when the index no longer reflects the records (an extraction, a note, a prune, a '
  'forget); NULL when the index is current.';

create unique index scopes_private_key on memory_private.scopes (workspace_id, bot_id, chat_id, user_id)
  where kind = 'private';
create unique index scopes_shared_key on memory_private.scopes (workspace_id, bot_id, chat_id, topic_id)
  where kind = 'shared';

create table memory_private.records (
  workspace_id text not null,
  record_id bigint generated always as identity,
  scope_id bigint not null,
  kind text not null check (kind in ('extracted', 'note')),
  title text not null check (octet_length(title) between 1 and 300),
  summary text not null check (octet_length(summary) between 1 and 4000),
  speaker_ids text[] not null,
  thread_ids text[] not null,
  repositories text[] not null default '{}',
  bot_identity text not null,
  origin_request_id text,
  created_at timestamptz not null,
  last_used_at timestamptz,
  usage_count integer not null default 0 check (usage_count >= 0),
  search_text text not null
    generated always as (lower(title) || e'\n' || lower(summary)) stored,
  primary key (workspace_id, record_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade
);
comment on table memory_private.records is
  'Memories: a title and a historical summary (<= 4,000 bytes) with the speakers, threads and '
  'repositories they came from and the bot identity that made them. Validity is decided from '
  'current facts on every read; the retention sweep deletes records that can never be valid '
  'again.';

comment on column memory_private.records.search_text is
  'Title and summary case-folded at write time (lower(title), a newline, lower(summary)), so '
  'query_memories'' literal search does not fold every record of the scope on each call.';

create index records_scope_idx on memory_private.records (workspace_id, scope_id, created_at desc);

create table memory_private.record_sources (
  workspace_id text not null,
  record_id bigint not null,
  message_id text not null,
  position integer not null check (position >= 1),
  primary key (workspace_id, record_id, message_id),
  unique (workspace_id, record_id, position),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.record_sources is
  'The messages a record cites, numbered in the order its summary uses them (position 1 first): '
  'what query_memories shows and what enters the citation set (R5, R6). Every source is also a '
  'dependency (memory_private.record_dependencies holds its content hash).';

create table memory_private.record_dependencies (
  workspace_id text not null,
  record_id bigint not null,
  message_id text not null,
  content_hash text not null,
  via text not null check (via in ('cited', 'reused', 'repeated')),
  primary key (workspace_id, record_id, message_id),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.record_dependencies is
  'What a record''s content was made from: each message with the content hash it had when used, '
  'and why it counts: cited (a source of the record), reused (a dependency of a memory the '
  'output declared it reused) or repeated (an uncited message whose words the summary repeats). '
  'Validity, forgetting, retention and grants act on these (T1, T7, T8).';

create index record_dependencies_message_idx
  on memory_private.record_dependencies (workspace_id, message_id);

create table memory_private.tombstones (
  workspace_id text not null,
  scope_id bigint not null,
  message_id text not null,
  created_at timestamptz not null,
  primary key (workspace_id, scope_id, message_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.tombstones is
  'Content-free marks of forgotten sources. While the original message is retained, no record '
  'of the scope may depend on it and extraction never takes it again (T8).';

-- Scope resolution -------------------------------------------------------------------------

create function memory_private.scope_of_request(
  p_workspace_id text, p_request_id text
) returns memory_private.scopes
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_chat memory_private.chats;
  v_scope memory_private.scopes;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('request_id', p_request_id);
  select * into v_request from memory_private.requests
   where workspace_id = p_workspace_id and request_id = p_request_id;
  if not found then
    raise exception 'request % is unknown in workspace %', p_request_id, p_workspace_id
      using errcode = 'MB002';
  end if;
  if v_request.kind <> 'interactive' then
    raise exception 'request % is scheduled; scheduled work neither feeds nor reads memories',
      p_request_id using errcode = 'MB005';
  end if;
  select * into v_chat from memory_private.chats
   where workspace_id = p_workspace_id and chat_id = v_request.chat_id;

  if v_chat.kind = 'private' then
    select * into v_scope from memory_private.scopes
     where workspace_id = p_workspace_id and kind = 'private' and bot_id = v_request.bot_id
       and chat_id = v_chat.chat_id and user_id = v_chat.private_user_id;
    if not found then
      insert into memory_private.scopes (workspace_id, kind, bot_id, chat_id, user_id, created_at)
      values (p_workspace_id, 'private', v_request.bot_id, v_chat.chat_id,
              v_chat.private_user_id, memory_private.clock_now())
      on conflict do nothing;
      select * into strict v_scope from memory_private.scopes
       where workspace_id = p_workspace_id and kind = 'private' and bot_id = v_request.bot_id
         and chat_id = v_chat.chat_id and user_id = v_chat.private_user_id;
    end if;
  else
    select * into v_scope from memory_private.scopes
     where workspace_id = p_workspace_id and kind = 'shared' and bot_id = v_request.bot_id
       and chat_id = v_chat.chat_id and topic_id = v_request.topic_id;
    if not found then
      insert into memory_private.scopes (workspace_id, kind, bot_id, chat_id, topic_id, created_at)
      values (p_workspace_id, 'shared', v_request.bot_id, v_chat.chat_id, v_request.topic_id,
              memory_private.clock_now())
      on conflict do nothing;
      select * into strict v_scope from memory_private.scopes
       where workspace_id = p_workspace_id and kind = 'shared' and bot_id = v_request.bot_id
         and chat_id = v_chat.chat_id and topic_id = v_request.topic_id;
    end if;
  end if;
  return v_scope;
end
$$;
comment on function memory_private.scope_of_request(text, text) is
  'The one scope of an interactive request, created on first use: private for a private chat, '
  'shared (group + topic) for a group. Raises MB005 for scheduled requests (V5).';

create function memory.resolve_scope(p_workspace_id text, p_request_id text)
  returns table (scope_kind text, scope_id bigint, bot_id text, chat_id text, user_id text,
                 topic_id bigint)
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_scope memory_private.scopes;
begin
  begin
    v_scope := memory_private.scope_of_request(p_workspace_id, p_request_id);
  exception when sqlstate 'MB005' then
    return query select 'none'::text, null::bigint, null::text, null::text, null::text,
                        null::bigint;
    return;
  end;
  return query select v_scope.kind, v_scope.scope_id, v_scope.bot_id, v_scope.chat_id,
                      v_scope.user_id, v_scope.topic_id;
end
$$;
comment on function memory.resolve_scope(text, text) is
  'The memory scope a request belongs to: private (bot, chat, user), shared (bot, group, topic) '
  'or none for a scheduled request.';

-- Validity at read time ----------------------------------------------------------------------

create function memory_private.record_invalid_reason(
  p_record memory_private.records, p_requester text
) returns text
  language sql stable
  set search_path = pg_catalog, pg_temp
  as $$
  select coalesce(
    (select case
              when not s.recall_enabled then 'recall_disabled'
              when b.bot_id is null or not b.active then 'bot_inactive'
              when b.identity <> p_record.bot_identity then 'bot_replaced'
              when s.kind = 'shared' and not c.linked then 'group_unlinked'
              when coalesce(s.user_id, p_requester) is not null
                   and not exists (select 1 from memory_private.members m
                                where m.workspace_id = s.workspace_id
                                  and m.user_id = coalesce(s.user_id, p_requester)
                                  and m.active) then 'membership'
              when p_requester is not null and s.kind = 'private'
                   and p_requester <> s.user_id then 'membership'
            end
       from memory_private.scopes s
       left join memory_private.bots b
         on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
       join memory_private.chats c
         on c.workspace_id = s.workspace_id and c.chat_id = s.chat_id
      where s.workspace_id = p_record.workspace_id and s.scope_id = p_record.scope_id),
    (select case
              when m.removed_at is not null then 'source_removed'
              when m.body is null or m.retain_until <= memory_private.clock_now()
                then 'source_expired'
              when m.content_hash <> rs.content_hash then 'source_edited'
              when exists (select 1 from memory_private.tombstones t
                            where t.workspace_id = rs.workspace_id
                              and t.scope_id = p_record.scope_id
                              and t.message_id = rs.message_id) then 'forgotten'
            end
       from memory_private.record_dependencies rs
       join memory_private.messages m
         on m.workspace_id = rs.workspace_id and m.message_id = rs.message_id
      where rs.workspace_id = p_record.workspace_id and rs.record_id = p_record.record_id
        and (m.removed_at is not null or m.body is null
             or m.retain_until <= memory_private.clock_now()
             or m.content_hash <> rs.content_hash
             or exists (select 1 from memory_private.tombstones t
                         where t.workspace_id = rs.workspace_id
                           and t.scope_id = p_record.scope_id
                           and t.message_id = rs.message_id))
      -- Several bad sources: the first reason in the order above wins (removed, expired,
      -- edited, forgotten), so the answer is deterministic and the set form agrees.
      order by case when m.removed_at is not null then 1
                    when m.body is null or m.retain_until <= memory_private.clock_now() then 2
                    when m.content_hash <> rs.content_hash then 3
                    else 4 end
      limit 1),
    (select 'grant_revoked'
       from memory_private.scopes s
       cross join lateral unnest(p_record.repositories) as repo(repository_id)
      where s.workspace_id = p_record.workspace_id and s.scope_id = p_record.scope_id
        and coalesce(s.user_id, p_requester) is not null
        and not exists (select 1 from memory_private.repository_grants g
                         where g.workspace_id = s.workspace_id
                           and g.user_id = coalesce(s.user_id, p_requester)
                           and g.repository_id = repo.repository_id)
      limit 1)
  )
$$;
comment on function memory_private.record_invalid_reason(memory_private.records, text) is
  'Why a record may not be recalled now for the requesting user, or NULL when it may: recall '
  'off, bot inactive or replaced, group unlinked, membership, a '
  'dependency removed, expired, edited or forgotten, or a repository grant revoked. Decided from '
  'current facts on every read (V6, T1). With no requester (background work on a shared scope) '
  'the requester''s membership and grants are not checked.';

create function memory_private.invalid_records(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[], p_requester text
) returns table (record_id bigint, reason text)
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_kind text;
  v_user_id text;
  v_recall_enabled boolean;
  v_bot_ok boolean;
  v_identity text; -- the bot identity a record must carry
  v_linked boolean;
  v_reader text;
  v_before text;   -- the scope's reasons that come before bot_replaced in the rule's order
  v_after text;    -- and those after it
  v_now timestamptz := memory_private.clock_now();
begin
  -- The set form of record_invalid_reason: the same reasons in the same order. The facts of
  -- the scope (scope, bot, chat, membership) are read once, then one query decides every
  -- record, found by primary key, with index probes of its sources and grants. plpgsql so
  -- that the plans are cached for the session (a SQL function with SET is planned on every
  -- call). Ids that are not records of the scope are not returned. A test keeps the two forms
  -- equal for every reason (tests/test_validity_set.py).
  select s.kind, s.user_id, s.recall_enabled, b.bot_id is not null and b.active, b.identity,
         c.linked
    into v_kind, v_user_id, v_recall_enabled, v_bot_ok, v_identity, v_linked
    from memory_private.scopes s
    left join memory_private.bots b
      on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
    left join memory_private.chats c
      on c.workspace_id = s.workspace_id and c.chat_id = s.chat_id
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id;
  if not found then
    return;  -- no scope, no records of it
  end if;
  v_reader := coalesce(v_user_id, p_requester);
  if v_linked is not null then  -- the rule reads the scope joined to its chat (a foreign key)
    v_before := case
                  when not v_recall_enabled then 'recall_disabled'
                  when not v_bot_ok then 'bot_inactive'
                end;
    v_after := case
                 when v_kind = 'shared' and not v_linked then 'group_unlinked'
                 when v_reader is not null
                      and not exists (select 1 from memory_private.members m
                                       where m.workspace_id = p_workspace_id
                                         and m.user_id = v_reader and m.active)
                   then 'membership'
                 when p_requester is not null and v_kind = 'private'
                      and p_requester <> v_user_id then 'membership'
               end;
  else
    v_identity := null;
  end if;
  return query
    with recs as materialized (
      -- By primary key; the scope is checked after the lookup.
      select r.record_id, r.scope_id, r.bot_identity, r.repositories
        from memory_private.records r
       where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
    )
    select recs.record_id,
           coalesce(
             v_before,
             case when v_identity <> recs.bot_identity then 'bot_replaced' end,
             v_after,
             -- The first bad source in the rule's order: removed, expired, edited, forgotten.
             (select (array['source_removed', 'source_expired', 'source_edited',
                            'forgotten'])[min(
                       case when m.removed_at is not null then 1
                            when m.body is null or m.retain_until <= v_now then 2
                            when m.content_hash <> rs.content_hash then 3
                            when exists (select 1 from memory_private.tombstones t
                                          where t.workspace_id = rs.workspace_id
                                            and t.scope_id = p_scope_id
                                            and t.message_id = rs.message_id) then 4
                       end)]
                from memory_private.record_dependencies rs
                join memory_private.messages m
                  on m.workspace_id = rs.workspace_id and m.message_id = rs.message_id
               where rs.workspace_id = p_workspace_id and rs.record_id = recs.record_id),
             (select 'grant_revoked'
                from unnest(recs.repositories) as repo(repository_id)
               where v_reader is not null
                 and not exists (select 1 from memory_private.repository_grants g
                                  where g.workspace_id = p_workspace_id
                                    and g.user_id = v_reader
                                    and g.repository_id = repo.repository_id)
               limit 1))
      from recs
     where recs.scope_id = p_scope_id;
end
$$;
comment on function memory_private.invalid_records(text, bigint, bigint[], text) is
  'The set form of record_invalid_reason for records of one scope: each given id that is a '
  'record of the scope, with why it may not be recalled now for the requester (NULL when it '
  'may). Same reasons, same order, same semantics; one query for the whole set.';

create function memory_private.first_valid_records(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[], p_limit integer,
  p_requester text
) returns bigint[]
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_from integer := 1;
  v_size integer := p_limit + 4;
begin
  -- Candidates are validated in growing chunks (limit + 4, then four times more each round),
  -- so a scope whose newest records are valid costs one set validation of a few records.
  while v_from <= coalesce(cardinality(p_record_ids), 0) and cardinality(v_valid) < p_limit loop
    v_chunk := p_record_ids[v_from:v_from + v_size - 1];
    v_valid := v_valid || array(
      select c.record_id
        from unnest(v_chunk) with ordinality as c(record_id, pos)
        join memory_private.invalid_records(p_workspace_id, p_scope_id, v_chunk, p_requester) v
          on v.record_id = c.record_id and v.reason is null
       order by c.pos);
    v_from := v_from + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid[1:p_limit];
end
$$;
comment on function memory_private.first_valid_records(text, bigint, bigint[], integer, text) is
  'The first p_limit of the given record ids (in their order) that are records of the scope '
  'and valid now for the requester (memory_private.invalid_records).';

revoke all on function memory.resolve_scope(text, text) from public;
grant execute on function memory.resolve_scope(text, text) to memory_backend, memory_operator;
