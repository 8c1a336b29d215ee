-- 10_ingest.sql: the facts the host application owns, mirrored into the database.
--
-- The bot backend reports workspaces, members, bots, chats, topics, repository grants, requests
-- and messages through idempotent upserts keyed by its own identifiers. Every upsert validates
-- every argument (MB001/MB003/MB004) before it writes, and answers 'inserted', 'updated' or
-- 'unchanged'. Content hashes are computed here, never trusted from the caller.
--
-- Locking: memory writes take the workspace's memory lock (memory_private.lock_workspace: its
-- workspace_memory row), a row ingest never touches, and memory work never updates a row that
-- ingest upserts (workspaces, requests), so ingest never waits on memory work (P16).

create table memory_private.workspaces (
  workspace_id text primary key,
  config_version integer not null check (config_version >= 0),
  budget_usd numeric(14, 6) not null check (budget_usd >= 0),
  spent_usd numeric(14, 6) not null check (spent_usd >= 0),
  idle_window interval not null
    default make_interval(mins => memory_private.policy_limit('default_idle_minutes'))
    check (idle_window >= interval '0'
           and idle_window <= make_interval(mins => memory_private.policy_limit('max_idle_minutes'))),
  paused boolean not null default false,
  created_at timestamptz not null,
  updated_at timestamptz not null
);
comment on table memory_private.workspaces is
  'Tenants, as the backend reports them. config_version is the model/provider configuration '
  'version; spent_usd is what the backend reports it spent. paused is the operator''s switch '
  '(memory.set_workspace_paused). What the memory itself writes per workspace lives in '
  'workspace_memory, so that the backend''s own writes never wait on memory work.';

-- The memory's own row per workspace. Every memory write (claim, checkpoint, commit, fail,
-- maintenance, query_memories usage, manage_memory, retention, retry) locks this row, never the
-- workspaces row: upsert_workspace's ON CONFLICT DO UPDATE takes the same row lock as FOR NO KEY
-- UPDATE, so a memory lock on the workspaces row made the backend's own upsert wait on a job
-- transaction (and on a whole run_maintenance() transaction). The memory spend is kept here for
-- the same reason: charging an attempt must not update a row the backend upserts.
create table memory_private.workspace_memory (
  workspace_id text primary key references memory_private.workspaces on delete cascade,
  memory_spent_usd numeric(14, 6) not null default 0 check (memory_spent_usd >= 0),
  maintained_at timestamptz
);
comment on table memory_private.workspace_memory is
  'What the memory writes per workspace, apart from the backend''s row: the row every memory '
  'write locks (memory_private.lock_workspace), memory_spent_usd (the sum of the workspace''s '
  'request_charges, kept as a running total for exact budget checks) and maintained_at (when '
  'maintenance last ran for it). Created with the workspace by a trigger.';

create function memory_private.workspaces_add_memory_row() returns trigger
  language plpgsql
  as $$
begin
  insert into memory_private.workspace_memory (workspace_id) values (new.workspace_id)
  on conflict do nothing;
  return null;
end
$$;
comment on function memory_private.workspaces_add_memory_row() is
  'Trigger: every new workspace gets its workspace_memory row in the same transaction, so the '
  'memory lock always has a row to lock.';

create trigger workspaces_add_memory_row after insert on memory_private.workspaces
  for each row execute function memory_private.workspaces_add_memory_row();

-- When a workspace next needs maintenance (70_maintenance.sql). A pass visits only the
-- workspaces with a row due here (and those with an expired lease), so its cost follows what
-- changed, not how many workspaces exist. A change inserts a row (ingest, memory writes, a job
-- leaving 'running'), and only ever inserts: ingest never updates a row another transaction
-- may hold, so it never waits on maintenance (P16), which is why this is not a column of
-- workspace_memory. A tick deletes the rows it consumes, and keeps the events it foresees as
-- rows of its own (foreseen): one per conversation for its idle end, one for the workspace's
-- next time-based event, each moved by the next plan instead of added to.
create table memory_private.maintenance_due (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  due_at timestamptz not null,
  due_id bigint generated always as identity,
  request_id text,
  scope_id bigint,
  foreseen boolean not null default false,
  primary key (workspace_id, due_at, due_id)
);
comment on table memory_private.maintenance_due is
  'When each workspace next needs a maintenance tick: due_at (now for a change; a later time '
  'for an event a tick foresaw: a conversation''s idle window ending, a message''s retention '
  'end, a record''s pruning horizon). request_id, scope_id: what the change was confined to (a '
  'request or its message, a scope''s job, tool call or records), so that the tick derives '
  'only the scopes it may have changed; both NULL: anything in the workspace may have changed, '
  'unless foreseen (a time-based event a tick planned: what it changes, the tick''s own steps '
  'find). A foreseen row with a request is that conversation''s idle end (one per request); '
  'without, the workspace''s next event (one per workspace). A row is deleted by the tick that '
  'runs at or after due_at.';
create index maintenance_due_at_idx on memory_private.maintenance_due (due_at);
create unique index maintenance_due_idle_key on memory_private.maintenance_due
  (workspace_id, request_id) where foreseen and request_id is not null;
create unique index maintenance_due_next_key on memory_private.maintenance_due (workspace_id)
  where foreseen and request_id is null;

create function memory_private.note_change(
  p_workspace_id text, p_outcome text, p_request_id text default null,
  p_scope_id bigint default null
) returns text
  language plpgsql volatile
  as $$
begin
  -- Always a new row, never a lookup of an existing one: a row seen here could be consumed by
  -- a tick that started before this transaction commits, and the change would be missed.
  if p_outcome in ('inserted', 'updated') then
    insert into memory_private.maintenance_due (workspace_id, due_at, request_id, scope_id)
    values (p_workspace_id, memory_private.clock_now(), p_request_id, p_scope_id);
  end if;
  return p_outcome;
end
$$;
comment on function memory_private.note_change(text, text, text, bigint) is
  'Makes a workspace due for maintenance now when p_outcome says something changed (inserted, '
  'updated). p_request_id or p_scope_id: the change touched only that request (a request, its '
  'message: its conversation, whose idle end the tick then plans) or scope; neither: anything '
  'may have changed. Returns p_outcome, so an upsert can return through it.';

create table memory_private.members (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  user_id text not null,
  role text not null check (role in ('owner', 'admin', 'member')),
  active boolean not null,
  updated_at timestamptz not null,
  primary key (workspace_id, user_id)
);
comment on table memory_private.members is 'Workspace members, their role and whether they are active.';

create table memory_private.bots (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  bot_id text not null,
  identity text not null,
  active boolean not null,
  updated_at timestamptz not null,
  primary key (workspace_id, bot_id)
);
comment on table memory_private.bots is
  'Bots of a workspace. identity is the platform identity (a replaced bot gets a new one, and '
  'memories made under the old identity stop being recalled).';

create table memory_private.chats (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  chat_id text not null,
  kind text not null check (kind in ('private', 'group')),
  private_user_id text,
  linked boolean not null,
  updated_at timestamptz not null,
  primary key (workspace_id, chat_id),
  check ((kind = 'private') = (private_user_id is not null))
);
comment on table memory_private.chats is
  'Chats: private (with exactly one user) or group (linked to the workspace or not).';

create table memory_private.topics (
  workspace_id text not null,
  chat_id text not null,
  topic_id bigint not null check (topic_id >= 0),
  title text,
  primary key (workspace_id, chat_id, topic_id),
  foreign key (workspace_id, chat_id) references memory_private.chats on delete cascade
);
comment on table memory_private.topics is 'Topics of a chat; topic 0 (the general topic) always exists.';

create table memory_private.repository_grants (
  workspace_id text not null references memory_private.workspaces on delete cascade,
  user_id text not null,
  repository_id text not null,
  granted_at timestamptz not null,
  primary key (workspace_id, user_id, repository_id)
);
comment on table memory_private.repository_grants is
  'Current repository read grants: a row means the user may read the repository now.';

create table memory_private.requests (
  workspace_id text not null,
  request_id text not null,
  bot_id text not null,
  chat_id text not null,
  topic_id bigint not null,
  user_id text not null,
  kind text not null check (kind in ('interactive', 'scheduled')),
  status text not null
    check (status in ('queued', 'running', 'awaiting_approval', 'succeeded', 'failed')),
  model_provider text not null,
  model_id text not null,
  budget_usd numeric(14, 6) not null check (budget_usd >= 0),
  spent_usd numeric(14, 6) not null check (spent_usd >= 0),
  thread_id text not null,
  created_at timestamptz not null,
  updated_at timestamptz not null,
  finished_at timestamptz,
  primary key (workspace_id, request_id),
  foreign key (workspace_id, bot_id) references memory_private.bots on delete cascade,
  foreign key (workspace_id, chat_id, topic_id) references memory_private.topics on delete cascade,
  check ((status in ('succeeded', 'failed')) = (finished_at is not null))
);
comment on table memory_private.requests is
  'Bot requests (one conversation turn or scheduled run) with their pinned model, budget and '
  'the spend the backend reports. What memory jobs charged to a request is the sum of its '
  'request_charges (memory_private.request_memory_spent): charging never updates this row, '
  'which the backend upserts.';

-- A scope's conversations (memory_private.extraction_candidates). Partial: a lookup of one
-- request by its id (upsert_request, known_request) can only take the primary key, whatever
-- the planner believes of the table's size (a generic plan made while a workspace was small
-- read all of its requests through this index for each lookup after a bulk import).
create index requests_scope_idx
  on memory_private.requests (workspace_id, bot_id, chat_id, topic_id, user_id)
  where kind = 'interactive';

create table memory_private.messages (
  workspace_id text not null,
  message_id text not null,
  request_id text not null,
  role text not null check (role in ('user', 'assistant')),
  speaker_id text not null,
  body text check (octet_length(body) <= memory_private.policy_limit('message_bytes')),
  content_hash text,
  directed boolean not null,
  retain_until timestamptz,
  repositories text[] not null default '{}',
  created_at timestamptz not null,
  edited_at timestamptz,
  removed_at timestamptz,
  removal_reason text check (removal_reason in ('removed', 'derived_from_removed',
                                                 'member_erased')),
  scrub_pending boolean not null default false,
  primary key (workspace_id, message_id),
  foreign key (workspace_id, request_id) references memory_private.requests on delete cascade,
  check ((body is null) = (content_hash is null)),
  check (removed_at is null or body is null),
  check ((removed_at is null) = (removal_reason is null)),
  check (not scrub_pending or body is null)
);
comment on table memory_private.messages is
  'Messages of requests. body is erased (NULL) when the message is removed or its retention '
  'ends; content_hash is computed here. Non-directed group messages are never stored (V10).';
comment on column memory_private.messages.removal_reason is
  'removed: the backend reported the removal; derived_from_removed: a privacy sweep erased an '
  'answer derived from recalled sources that are gone (T3); member_erased: '
  'memory.erase_member erased the statements of the member who spoke or asked it.';
comment on column memory_private.messages.retain_until is
  'End of the original retention; NULL means retained until removed.';
comment on column memory_private.messages.scrub_pending is
  'Set when the text is erased (removed, past retention, derived from a removed source); the '
  'next retention sweep erases what was made from it (derived answers, frozen index texts, job '
  'inputs and checkpoints, extraction markers) and clears the flag.';

create index messages_request_idx on memory_private.messages (workspace_id, request_id);
-- What the validity rule reads of a message a record or an index depends on (its hash, removal
-- and retention; content_hash is NULL exactly when the text is gone, by the table's check), so
-- that validating a record reads the messages from this index alone, a few pages per scope
-- instead of a heap page per message (memory_private.record_reasons, index_holds).
create index messages_state_idx on memory_private.messages (workspace_id, message_id)
  include (content_hash, removed_at, retain_until);
-- A workspace's next retention end, and its expired messages a batch at a time (60_retention).
create index messages_retention_idx on memory_private.messages (workspace_id, retain_until)
  where body is not null and retain_until is not null;
create index messages_scrub_idx on memory_private.messages (workspace_id)
  where scrub_pending;

-- Where a message's id is kept inside an array or a job input, an index on its keys finds the
-- rows that name it, so that erasing a message reads what names it, not a workspace's history
-- (request_recall, tool_calls, jobs: 50_recall.sql, 40_jobs.sql; the sweep, 60_retention.sql).
create function memory_private.message_keys(p_workspace_id text, p_message_ids text[])
  returns text[]
  language plpgsql immutable parallel safe
  as $$
begin
  -- The workspace and the id, apart by a newline, which no identifier holds (check_id).
  return array(select p_workspace_id || e'\n' || x from unnest(p_message_ids) as x);
end
$$;
comment on function memory_private.message_keys(text, text[]) is
  'Each message id of p_message_ids keyed with its workspace: what the indexes on the message '
  'ids rows name are built on (ids repeat across workspaces; a key does not).';

-- Internal: the statement result of an upsert, as the API reports it.
create function memory_private.upsert_outcome(p_inserted boolean) returns text
  language sql immutable
  as $$ select case when p_inserted is null then 'unchanged'
                     when p_inserted then 'inserted' else 'updated' end $$;
comment on function memory_private.upsert_outcome(boolean) is
  'Maps an upsert''s (xmax = 0) flag to inserted/updated/unchanged.';

create function memory_private.require_workspace(p_workspace_id text) returns void
  language plpgsql stable
  as $$
begin
  perform memory_private.check_id('workspace_id', p_workspace_id);
  if not exists (select 1 from memory_private.workspaces where workspace_id = p_workspace_id) then
    raise exception 'workspace % is unknown', p_workspace_id using errcode = 'MB002',
      hint = 'Report it first with memory.upsert_workspace.';
  end if;
end
$$;
comment on function memory_private.require_workspace(text) is
  'Raises MB001/MB002 unless the workspace identifier is valid and known.';

create function memory_private.known_request(p_workspace_id text, p_request_id text)
  returns memory_private.requests
  language plpgsql stable
  as $$
declare
  v_request memory_private.requests;
begin
  -- A request found has a known workspace and a valid id (both were checked when it was
  -- stored), so the lookup comes first; the errors, only when it finds nothing, come in the
  -- order the checks name them: the workspace's id, the workspace, the request's id.
  perform memory_private.check_id('workspace_id', p_workspace_id);
  select * into v_request from memory_private.requests
   where workspace_id = p_workspace_id and request_id = p_request_id;
  if not found then
    perform memory_private.require_workspace(p_workspace_id);
    perform memory_private.check_id('request_id', p_request_id);
    raise exception 'request % is unknown in workspace %', p_request_id, p_workspace_id
      using errcode = 'MB002', hint = 'Report it first with memory.upsert_request.';
  end if;
  return v_request;
end
$$;
comment on function memory_private.known_request(text, text) is
  'The request row after validating the workspace and request ids (MB001/MB002). The caller '
  'decides what a scheduled request gets.';

create function memory_private.check_request_ends_once(
  p_request memory_private.requests, p_status text
) returns void
  language plpgsql immutable
  as $$
begin
  if p_request.status in ('succeeded', 'failed') and p_status <> p_request.status then
    raise exception 'request % already finished as %; it cannot become %',
      p_request.request_id, p_request.status, p_status using errcode = 'MB003';
  end if;
end
$$;
comment on function memory_private.check_request_ends_once(memory_private.requests, text) is
  'Raises MB003 when a request that finished (succeeded or failed) would get another status: a '
  'request ends once. The caller holds the request''s row lock, so the status it checks is the '
  'one committed last.';

create function memory_private.lock_workspace(p_workspace_id text) returns void
  language plpgsql volatile
  as $$
begin
  perform 1 from memory_private.workspace_memory where workspace_id = p_workspace_id
     for no key update;
end
$$;
comment on function memory_private.lock_workspace(text) is
  'The memory lock of a workspace: locks its workspace_memory row until the transaction ends. '
  'Every memory write takes it first, so memory writes of one workspace run one at a time; the '
  'backend''s ingest never touches that row, so it never waits on them (P16).';

create function memory_private.try_lock_workspace(p_workspace_id text) returns boolean
  language plpgsql volatile
  as $$
begin
  perform 1 from memory_private.workspace_memory where workspace_id = p_workspace_id
     for no key update skip locked;
  return found;
end
$$;
comment on function memory_private.try_lock_workspace(text) is
  'memory_private.lock_workspace without waiting: false when another transaction holds the '
  'workspace''s memory lock (claim_job and maintain_next_workspace skip it).';

create function memory.upsert_workspace(
  p_workspace_id text,
  p_config_version integer,
  p_budget_usd numeric,
  p_spent_usd numeric default 0,
  p_idle_minutes integer default null
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_inserted boolean;
  -- Not given (NULL): the policy's default idle window (P3).
  v_idle integer := coalesce(p_idle_minutes, (memory_private.policy()).default_idle_minutes);
begin
  perform memory_private.check_id('workspace_id', p_workspace_id);
  if p_config_version is null or p_config_version < 0 then
    raise exception 'config_version must be a non-negative integer' using errcode = 'MB001';
  end if;
  perform memory_private.check_money('budget_usd', p_budget_usd);
  perform memory_private.check_money('spent_usd', p_spent_usd);
  if v_idle < 0 or v_idle > (memory_private.policy()).max_idle_minutes then
    raise exception 'idle_minutes must be between 0 and %',
      (memory_private.policy()).max_idle_minutes using errcode = 'MB001';
  end if;
  insert into memory_private.workspaces as w
    (workspace_id, config_version, budget_usd, spent_usd, idle_window, created_at, updated_at)
  values (p_workspace_id, p_config_version, p_budget_usd, p_spent_usd,
          make_interval(mins => v_idle),
          memory_private.clock_now(), memory_private.clock_now())
  on conflict (workspace_id) do update
    set config_version = excluded.config_version, budget_usd = excluded.budget_usd,
        spent_usd = excluded.spent_usd, idle_window = excluded.idle_window,
        updated_at = excluded.updated_at
    where (w.config_version, w.budget_usd, w.spent_usd, w.idle_window)
          is distinct from (excluded.config_version, excluded.budget_usd, excluded.spent_usd,
                            excluded.idle_window)
  returning (xmax = 0) into v_inserted;
  return memory_private.note_change(p_workspace_id, memory_private.upsert_outcome(v_inserted));
end
$$;
comment on function memory.upsert_workspace(text, integer, numeric, numeric, integer) is
  'Creates or updates a workspace: model/provider config version, dollar budget, spend the '
  'backend reports, and the idle window in minutes before a conversation is extracted (NULL or '
  'left out: the default, 30).';

create function memory.upsert_member(
  p_workspace_id text, p_user_id text, p_role text, p_active boolean default true
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_inserted boolean;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('user_id', p_user_id);
  perform memory_private.check_choice('role', p_role, array['owner', 'admin', 'member']);
  if p_active is null then
    raise exception 'active is required' using errcode = 'MB001';
  end if;
  insert into memory_private.members as m (workspace_id, user_id, role, active, updated_at)
  values (p_workspace_id, p_user_id, p_role, p_active, memory_private.clock_now())
  on conflict (workspace_id, user_id) do update
    set role = excluded.role, active = excluded.active, updated_at = excluded.updated_at
    where (m.role, m.active) is distinct from (excluded.role, excluded.active)
  returning (xmax = 0) into v_inserted;
  return memory_private.note_change(p_workspace_id, memory_private.upsert_outcome(v_inserted));
end
$$;
comment on function memory.upsert_member(text, text, text, boolean) is
  'Creates or updates a workspace member with role owner/admin/member and an active flag.';

create function memory.upsert_bot(
  p_workspace_id text, p_bot_id text, p_identity text, p_active boolean default true
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_inserted boolean;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('bot_id', p_bot_id);
  perform memory_private.check_id('identity', p_identity);
  if p_active is null then
    raise exception 'active is required' using errcode = 'MB001';
  end if;
  insert into memory_private.bots as b (workspace_id, bot_id, identity, active, updated_at)
  values (p_workspace_id, p_bot_id, p_identity, p_active, memory_private.clock_now())
  on conflict (workspace_id, bot_id) do update
    set identity = excluded.identity, active = excluded.active, updated_at = excluded.updated_at
    where (b.identity, b.active) is distinct from (excluded.identity, excluded.active)
  returning (xmax = 0) into v_inserted;
  return memory_private.note_change(p_workspace_id, memory_private.upsert_outcome(v_inserted));
end
$$;
comment on function memory.upsert_bot(text, text, text, boolean) is
  'Creates or updates a bot: its platform identity (a new identity means a replaced bot) and '
  'whether it is active.';

create function memory.upsert_chat(
  p_workspace_id text, p_chat_id text, p_kind text,
  p_private_user_id text default null, p_linked boolean default true
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_inserted boolean;
  v_old memory_private.chats;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('chat_id', p_chat_id);
  perform memory_private.check_choice('kind', p_kind, array['private', 'group']);
  if p_kind = 'private' then
    perform memory_private.check_id('private_user_id', p_private_user_id);
  elsif p_private_user_id is not null then
    raise exception 'a group chat has no private_user_id' using errcode = 'MB001';
  end if;
  if p_linked is null then
    raise exception 'linked is required' using errcode = 'MB001';
  end if;
  select * into v_old from memory_private.chats
   where workspace_id = p_workspace_id and chat_id = p_chat_id;
  if found and (v_old.kind, v_old.private_user_id)
               is distinct from (p_kind, p_private_user_id) then
    raise exception 'chat % is a % chat%; its kind and user cannot change', p_chat_id, v_old.kind,
      coalesce(' with user ' || v_old.private_user_id, '') using errcode = 'MB003';
  end if;
  insert into memory_private.chats as c
    (workspace_id, chat_id, kind, private_user_id, linked, updated_at)
  values (p_workspace_id, p_chat_id, p_kind, p_private_user_id, p_linked,
          memory_private.clock_now())
  on conflict (workspace_id, chat_id) do update
    set linked = excluded.linked, updated_at = excluded.updated_at
    where c.linked is distinct from excluded.linked
  returning (xmax = 0) into v_inserted;
  insert into memory_private.topics (workspace_id, chat_id, topic_id)
  values (p_workspace_id, p_chat_id, 0) on conflict do nothing;
  return memory_private.note_change(p_workspace_id, memory_private.upsert_outcome(v_inserted));
end
$$;
comment on function memory.upsert_chat(text, text, text, text, boolean) is
  'Creates or updates a chat: private (with its user) or group (with its linked flag). Topic 0 '
  'is created with it. A chat''s kind and private user never change (MB003).';

create function memory.upsert_topic(
  p_workspace_id text, p_chat_id text, p_topic_id bigint, p_title text default null
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_inserted boolean;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('chat_id', p_chat_id);
  if p_topic_id is null or p_topic_id < 0 then
    raise exception 'topic_id must be 0 or a positive integer' using errcode = 'MB001';
  end if;
  if p_title is not null then
    perform memory_private.check_text('title', p_title, 400);
  end if;
  if not exists (select 1 from memory_private.chats
                  where workspace_id = p_workspace_id and chat_id = p_chat_id) then
    raise exception 'chat % is unknown in workspace %', p_chat_id, p_workspace_id
      using errcode = 'MB002', hint = 'Report it first with memory.upsert_chat.';
  end if;
  insert into memory_private.topics as t (workspace_id, chat_id, topic_id, title)
  values (p_workspace_id, p_chat_id, p_topic_id, p_title)
  on conflict (workspace_id, chat_id, topic_id) do update
    set title = excluded.title
    where t.title is distinct from excluded.title
  returning (xmax = 0) into v_inserted;
  return memory_private.note_change(p_workspace_id, memory_private.upsert_outcome(v_inserted));
end
$$;
comment on function memory.upsert_topic(text, text, bigint, text) is
  'Creates or renames a topic of a chat (topic 0 exists with every chat).';

create function memory.set_repository_grant(
  p_workspace_id text, p_user_id text, p_repository_id text, p_granted boolean
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('user_id', p_user_id);
  perform memory_private.check_id('repository_id', p_repository_id);
  if p_granted is null then
    raise exception 'granted is required' using errcode = 'MB001';
  end if;
  if p_granted then
    insert into memory_private.repository_grants
      (workspace_id, user_id, repository_id, granted_at)
    values (p_workspace_id, p_user_id, p_repository_id, memory_private.clock_now())
    on conflict do nothing;
    return memory_private.note_change(p_workspace_id,
                                      case when found then 'inserted' else 'unchanged' end);
  end if;
  delete from memory_private.repository_grants
   where workspace_id = p_workspace_id and user_id = p_user_id
     and repository_id = p_repository_id;
  return memory_private.note_change(p_workspace_id,
                                    case when found then 'updated' else 'unchanged' end);
end
$$;
comment on function memory.set_repository_grant(text, text, text, boolean) is
  'Grants (true) or revokes (false) a user''s read access to a repository. Memories that drew '
  'on a repository are recalled only for users who can read it now.';

create function memory.upsert_request(
  p_workspace_id text,
  p_request_id text,
  p_bot_id text,
  p_chat_id text,
  p_topic_id bigint,
  p_user_id text,
  p_kind text,
  p_status text,
  p_model_provider text,
  p_model_id text,
  p_budget_usd numeric,
  p_spent_usd numeric default 0,
  p_thread_id text default null
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_old memory_private.requests;
  v_now timestamptz := memory_private.clock_now();
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('request_id', p_request_id);
  perform memory_private.check_id('bot_id', p_bot_id);
  perform memory_private.check_id('chat_id', p_chat_id);
  perform memory_private.check_id('user_id', p_user_id);
  perform memory_private.check_id('model_provider', p_model_provider);
  perform memory_private.check_id('model_id', p_model_id);
  if p_thread_id is not null then
    perform memory_private.check_id('thread_id', p_thread_id);
  end if;
  if p_topic_id is null or p_topic_id < 0 then
    raise exception 'topic_id must be 0 or a positive integer' using errcode = 'MB001';
  end if;
  perform memory_private.check_choice('kind', p_kind, array['interactive', 'scheduled']);
  perform memory_private.check_choice('status', p_status,
    array['queued', 'running', 'awaiting_approval', 'succeeded', 'failed']);
  perform memory_private.check_money('budget_usd', p_budget_usd);
  perform memory_private.check_money('spent_usd', p_spent_usd);
  if not exists (select 1 from memory_private.bots
                  where workspace_id = p_workspace_id and bot_id = p_bot_id) then
    raise exception 'bot % is unknown in workspace %', p_bot_id, p_workspace_id
      using errcode = 'MB002', hint = 'Report it first with memory.upsert_bot.';
  end if;
  if not exists (select 1 from memory_private.topics
                  where workspace_id = p_workspace_id and chat_id = p_chat_id
                    and topic_id = p_topic_id) then
    raise exception 'topic % of chat % is unknown in workspace %', p_topic_id, p_chat_id,
      p_workspace_id using errcode = 'MB002',
      hint = 'Report the chat with memory.upsert_chat and the topic with memory.upsert_topic.';
  end if;
  if exists (select 1 from memory_private.chats
              where workspace_id = p_workspace_id and chat_id = p_chat_id
                and kind = 'private' and private_user_id <> p_user_id) then
    raise exception 'user % is not the user of private chat %', p_user_id, p_chat_id
      using errcode = 'MB003';
  end if;

  -- A stored request is checked and written under its row lock, against what a concurrent
  -- report committed (a request ends once, MB003); an insert that meets one takes that path.
  loop
    select * into v_old from memory_private.requests
     where workspace_id = p_workspace_id and request_id = p_request_id
       for no key update;
    exit when found;
    insert into memory_private.requests
      (workspace_id, request_id, bot_id, chat_id, topic_id, user_id, kind, status,
       model_provider, model_id, budget_usd, spent_usd, thread_id, created_at, updated_at,
       finished_at)
    values (p_workspace_id, p_request_id, p_bot_id, p_chat_id, p_topic_id, p_user_id, p_kind,
            p_status, p_model_provider, p_model_id, p_budget_usd, p_spent_usd,
            coalesce(p_thread_id, p_request_id), v_now, v_now,
            case when p_status in ('succeeded', 'failed') then v_now end)
    on conflict (workspace_id, request_id) do nothing;
    if found then  -- a new interactive request has its scope (trigger requests_scope)
      return memory_private.note_change(p_workspace_id, 'inserted', p_request_id);
    end if;
  end loop;
  if (v_old.bot_id, v_old.chat_id, v_old.topic_id, v_old.user_id, v_old.kind)
     is distinct from (p_bot_id, p_chat_id, p_topic_id, p_user_id, p_kind) then
    raise exception 'request % cannot move to another bot, chat, topic, user or kind',
      p_request_id using errcode = 'MB003';
  end if;
  perform memory_private.check_request_ends_once(v_old, p_status);
  update memory_private.requests r
     set status = p_status, model_provider = p_model_provider, model_id = p_model_id,
         budget_usd = p_budget_usd, spent_usd = p_spent_usd,
         thread_id = coalesce(p_thread_id, p_request_id), updated_at = v_now,
         finished_at = coalesce(r.finished_at,
                                case when p_status in ('succeeded', 'failed') then v_now end)
   where r.workspace_id = p_workspace_id and r.request_id = p_request_id
     and (r.status, r.model_provider, r.model_id, r.budget_usd, r.spent_usd, r.thread_id)
         is distinct from (p_status, p_model_provider, p_model_id, p_budget_usd, p_spent_usd,
                           coalesce(p_thread_id, p_request_id));
  return memory_private.note_change(p_workspace_id,
                                    case when found then 'updated' else 'unchanged' end,
                                    p_request_id);
end
$$;
comment on function memory.upsert_request(text, text, text, text, bigint, text, text, text, text,
                                          text, numeric, numeric, text) is
  'Creates or updates a request: where it runs (bot, chat, topic, user), interactive or '
  'scheduled, its status, pinned model/provider, budget and spend, and its thread. A finished '
  'request keeps its status; where it runs never changes (MB003). A new interactive request''s '
  'memory scope is created with it.';

create function memory.finish_request(
  p_workspace_id text,
  p_request_id text,
  p_status text default 'succeeded',
  p_spent_usd numeric default null
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The end of a request, without repeating where it ran: the status it ended with, and its
  -- spend when given (NULL keeps the spend reported before). The same rules as upsert_request:
  -- a finished request keeps its status (MB003).
  v_request := memory_private.known_request(p_workspace_id, p_request_id);
  perform memory_private.check_choice('status', p_status, array['succeeded', 'failed']);
  if p_spent_usd is not null then
    perform memory_private.check_money('spent_usd', p_spent_usd);
  end if;
  -- Checked and written under the request's row lock, as upsert_request does.
  select * into v_request from memory_private.requests
   where workspace_id = p_workspace_id and request_id = p_request_id
     for no key update;
  perform memory_private.check_request_ends_once(v_request, p_status);
  update memory_private.requests r
     set status = p_status, spent_usd = coalesce(p_spent_usd, r.spent_usd),
         updated_at = v_now, finished_at = coalesce(r.finished_at, v_now)
   where r.workspace_id = p_workspace_id and r.request_id = p_request_id
     and (r.status, r.spent_usd) is distinct from (p_status, coalesce(p_spent_usd, r.spent_usd));
  return memory_private.note_change(p_workspace_id,
                                    case when found then 'updated' else 'unchanged' end,
                                    p_request_id);
end
$$;
comment on function memory.finish_request(text, text, text, numeric) is
  'Marks a request finished: succeeded (the default) or failed, with its final spend when given '
  '(NULL keeps the spend reported before), without repeating the fields of upsert_request. A '
  'succeeded interactive request becomes a memory once it has a user and an assistant message '
  'and the workspace''s idle window has passed. Answers updated or unchanged (finishing again '
  'with the same status). MB001 (ids, status, spend), MB002 (request unknown), MB003 (it already '
  'finished with the other status).';

create function memory.upsert_message(
  p_workspace_id text,
  p_message_id text,
  p_request_id text,
  p_role text,
  p_speaker_id text,
  p_text text,
  p_directed boolean default true,
  p_retain_until timestamptz default null,
  p_repositories text[] default '{}'
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_chat_kind text;
  v_old memory_private.messages;
  v_repos text[];
  v_hash text;
  v_now timestamptz := memory_private.clock_now();
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('message_id', p_message_id);
  perform memory_private.check_id('request_id', p_request_id);
  perform memory_private.check_id('speaker_id', p_speaker_id);
  perform memory_private.check_choice('role', p_role, array['user', 'assistant']);
  perform memory_private.check_text('text', p_text, (memory_private.policy()).message_bytes);
  if p_directed is null then
    raise exception 'directed is required' using errcode = 'MB001';
  end if;
  v_repos := memory_private.check_ids('repositories', p_repositories);

  v_request := memory_private.known_request(p_workspace_id, p_request_id);
  select kind into v_chat_kind from memory_private.chats
   where workspace_id = p_workspace_id and chat_id = v_request.chat_id;

  v_hash := memory_private.content_hash(p_text);
  select * into v_old from memory_private.messages
   where workspace_id = p_workspace_id and message_id = p_message_id;
  if found then
    if (v_old.request_id, v_old.role, v_old.speaker_id)
       is distinct from (p_request_id, p_role, p_speaker_id) then
      raise exception 'message % cannot move to another request, role or speaker', p_message_id
        using errcode = 'MB003';
    end if;
  end if;
  -- V10: ordinary group traffic is never collected. A message first reported as directed and
  -- now as not directed loses its stored copy, exactly as remove_message would erase it: its
  -- text and hash go, and every memory built on it stops being recalled.
  if v_chat_kind = 'group' and not p_directed then
    if v_old.message_id is null then
      return 'ignored';
    end if;
    update memory_private.messages
       set body = null, content_hash = null, removed_at = v_now, removal_reason = 'removed',
           scrub_pending = true
     where workspace_id = p_workspace_id and message_id = p_message_id and removed_at is null;
    return memory_private.note_change(p_workspace_id,
                                      case when found then 'updated' else 'unchanged' end,
                                      v_old.request_id);
  end if;
  if v_old.message_id is not null then
    if v_old.removed_at is not null then
      raise exception 'message % was removed; a removed message cannot be edited', p_message_id
        using errcode = 'MB003';
    end if;
    if v_old.body is null then
      raise exception 'message % is past its retention; it cannot be edited', p_message_id
        using errcode = 'MB003';
    end if;
    if (v_old.content_hash, v_old.directed, v_old.retain_until, v_old.repositories)
       is not distinct from (v_hash, p_directed, p_retain_until, v_repos) then
      return 'unchanged';
    end if;
    update memory_private.messages
       set body = p_text, content_hash = v_hash, directed = p_directed,
           retain_until = p_retain_until, repositories = v_repos,
           edited_at = case when content_hash <> v_hash then v_now else edited_at end
     where workspace_id = p_workspace_id and message_id = p_message_id;
    -- An edit changes its conversation (extracted again once idle) and what records anywhere
    -- rest on (the tick's sweep finds those).
    return memory_private.note_change(p_workspace_id, 'updated', p_request_id);
  end if;

  insert into memory_private.messages
    (workspace_id, message_id, request_id, role, speaker_id, body, content_hash, directed,
     retain_until, repositories, created_at)
  values (p_workspace_id, p_message_id, p_request_id, p_role, p_speaker_id, p_text, v_hash,
          p_directed, p_retain_until, v_repos, v_now);
  -- A new message changes its own request's conversation only; an edit or a removal may
  -- change what records anywhere rest on.
  return memory_private.note_change(p_workspace_id, 'inserted', p_request_id);
end
$$;
comment on function memory.upsert_message(text, text, text, text, text, text, boolean,
                                          timestamptz, text[]) is
  'Creates or edits a message of a request (text <= 64,000 bytes). The content hash is computed '
  'here; an edit changes it, which invalidates memories built on the old text. A group message '
  'that is not directed at the bot is not stored and the call answers ''ignored'' (V10); one '
  'stored earlier as directed is removed as remove_message would remove it (''updated'').';

create function memory.remove_message(p_workspace_id text, p_message_id text) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request text;
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('message_id', p_message_id);
  update memory_private.messages
     set body = null, content_hash = null, removed_at = memory_private.clock_now(),
         removal_reason = 'removed', scrub_pending = true
   where workspace_id = p_workspace_id and message_id = p_message_id and removed_at is null
  returning request_id into v_request;
  if found then
    -- Its conversation changed (what is left of it is extracted again once idle); what records
    -- anywhere rest on it, the tick's sweep finds.
    return memory_private.note_change(p_workspace_id, 'updated', v_request);
  end if;
  if not exists (select 1 from memory_private.messages
                  where workspace_id = p_workspace_id and message_id = p_message_id) then
    raise exception 'message % is unknown in workspace %', p_message_id, p_workspace_id
      using errcode = 'MB002';
  end if;
  return 'unchanged';
end
$$;
comment on function memory.remove_message(text, text) is
  'Records that a message was removed: its text and hash are erased at once, every memory '
  'that depends on it stops being recalled, and the next retention sweep erases what was made '
  'from it.';

-- Grants: the backend reports facts; nobody else may.
revoke all on function
  memory.upsert_workspace(text, integer, numeric, numeric, integer),
  memory.upsert_member(text, text, text, boolean),
  memory.upsert_bot(text, text, text, boolean),
  memory.upsert_chat(text, text, text, text, boolean),
  memory.upsert_topic(text, text, bigint, text),
  memory.set_repository_grant(text, text, text, boolean),
  memory.upsert_request(text, text, text, text, bigint, text, text, text, text, text, numeric,
                        numeric, text),
  memory.finish_request(text, text, text, numeric),
  memory.upsert_message(text, text, text, text, text, text, boolean, timestamptz, text[]),
  memory.remove_message(text, text)
from public;
grant execute on function
  memory.upsert_workspace(text, integer, numeric, numeric, integer),
  memory.upsert_member(text, text, text, boolean),
  memory.upsert_bot(text, text, text, boolean),
  memory.upsert_chat(text, text, text, text, boolean),
  memory.upsert_topic(text, text, bigint, text),
  memory.set_repository_grant(text, text, text, boolean),
  memory.upsert_request(text, text, text, text, bigint, text, text, text, text, text, numeric,
                        numeric, text),
  memory.finish_request(text, text, text, numeric),
  memory.upsert_message(text, text, text, text, text, text, boolean, timestamptz, text[]),
  memory.remove_message(text, text)
to memory_backend;
