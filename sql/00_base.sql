-- 00_base.sql: schemas, roles, the clock, errors and argument checks.
--
-- Everything in this directory is the canonical definition of the memory database. The files are
-- applied in name order. `memory` is the public API (functions and views only); `memory_private`
-- holds the tables and the helpers, and no role but the owner touches it.
--
-- Error codes (SQLSTATE class MB, see docs/errors.md):
--   MB001 invalid_argument      an argument is missing, malformed or out of range
--   MB002 not_found             the named workspace, chat, request, message, record or job is unknown
--   MB003 conflict              the call contradicts stored facts (a chat changing kind, ...)
--   MB004 too_large             a text or list is over its byte or count limit
--   MB005 no_scope              the request has no memory scope (scheduled, or not interactive)
--   MB020 job_lost              the job's ownership token is not current or its lease expired
--   MB021 job_stale             the job's input changed since it was claimed
--   MB022 job_config_changed    the workspace's model/provider configuration changed
--   MB023 bad_model_output      the model output fails validation
--   MB024 budget_exceeded       the call does not fit the request's or the workspace's budget
--   MB025 job_state             the job is not in a state that allows this
--
-- What a caller may not do is refused by PostgreSQL's own grants (42501); what a user may not ask
-- of manage_memory is a refused outcome, not an error. Values PostgreSQL cannot hold (a NUL
-- character, a malformed literal of a parameter's type, an integer out of range, JSON nested
-- deeper than the server's stack) are refused by PostgreSQL before a function runs (22P05,
-- 22P02, 22003, 54001): docs/errors.md. Tokens are taken as text, so a malformed one is MB001.

create schema memory;
create schema memory_private;

comment on schema memory is 'Long-term conversation memory: the public API (functions and views).';
comment on schema memory_private is 'Tables and internal helpers of the memory. No grants to anyone.';

revoke all on schema memory_private from public;
revoke all on schema memory from public;

-- Roles are cluster-wide, so they may exist already (another database, an earlier install).
do $roles$
declare
  r text;
begin
  foreach r in array array['memory_backend', 'memory_worker', 'memory_operator'] loop
    if not exists (select 1 from pg_catalog.pg_roles where rolname = r) then
      execute format('create role %I nologin', r);
    end if;
  end loop;
end
$roles$;

grant usage on schema memory to memory_backend, memory_worker, memory_operator;

-- The clock. Every time-dependent rule reads memory_private.clock_now(), so tests move time by
-- changing the offset instead of sleeping. In production the offset stays zero.
create table memory_private.clock (
  singleton boolean primary key default true check (singleton),
  time_offset interval not null default interval '0'
);
comment on table memory_private.clock is
  'One row: the offset added to now() by clock_now(). Tests move time here; production keeps 0.';
insert into memory_private.clock default values;

create function memory_private.clock_now() returns timestamptz
  language sql stable
  as $$ select now() + (select time_offset from memory_private.clock) $$;
comment on function memory_private.clock_now() is
  'The time every memory rule reads: transaction start plus the test offset.';

create function memory_private.advance_clock(p_by interval) returns timestamptz
  language plpgsql volatile
  as $$
begin
  update memory_private.clock set time_offset = time_offset + p_by;
  return memory_private.clock_now();
end
$$;
comment on function memory_private.advance_clock(interval) is
  'Moves the memory clock forward (tests only; granted to nobody).';

-- The policy numbers: every limit, count and period a rule uses, in one place. Functions read
-- them with (memory_private.policy()).name; the CHECK constraints of the tables call it too, so a
-- constraint cannot disagree with the function that checks the same limit first. Changing one
-- is a schema change (a migration that replaces this function), never a setting.
create type memory_private.policy_values as (
  -- ingest (the backend's facts)
  id_bytes integer,            -- an external identifier
  id_list_entries integer,     -- a list of identifiers (repositories)
  message_bytes integer,       -- one message text
  max_idle_minutes integer,    -- the longest idle window a workspace may set (30 days)
  default_idle_minutes integer,  -- P3: a conversation is extracted after this idle time
  max_dollars numeric,         -- any dollar amount
  -- jobs (P4, P6, P9, P12, P13)
  batch_bytes integer,         -- P4: one extraction batch
  existing_with_batch integer, -- P5: valid memories that accompany a batch (chosen by what the
                               -- batch is about; every record depends on what they rest on)
  title_bytes integer,         -- P6
  summary_bytes integer,       -- P6
  candidates integer,          -- P9: records a consolidation sees
  index_bytes integer,         -- P9
  index_ids integer,           -- P9
  max_claims integer,          -- P13: model calls per unchanged input
  lease interval,              -- P12
  failure_backoff interval,    -- P13
  error_chars integer,         -- the bound of a stored failure text, in characters
  -- recall and tools (R2, R4, R5)
  directory_records integer,   -- R2
  directory_summary_chars integer,  -- a directory entry shows this much of a summary
  query_limit integer,         -- R4
  query_bytes integer,         -- R4: a query_memories query
  shown_sources integer,       -- R5: source ids shown per record
  note_title_chars integer,    -- C3: a note's default title
  -- retention (T5)
  unused_days integer,         -- T5: records unused this long are pruned
  workspace_records integer,   -- T5: the most records a workspace keeps
  -- bounded search (R4): what one query_memories call may make the search do
  query_terms integer,         -- words and CJK pairs the word stage searches for
  fuzzy_words integer,         -- query words the fuzzy stage compares
  fuzzy_neighbours integer,    -- scope words a fuzzy query word is compared with, on each side
  shown_ids integer,           -- R5: thread and speaker ids shown per record, as source ids
  -- jobs, continued
  batch_messages integer,      -- P4: the most messages one extraction batch holds (what a
                               -- record may depend on, bounded however short the messages)
  -- maintenance
  analyze_after integer        -- a tick that finds this many conversations changed (a bulk
                               -- import) refreshes the planner's statistics of their tables
);
comment on type memory_private.policy_values is
  'The policy numbers of the memory (memory_private.policy() holds their values).';

create function memory_private.policy() returns memory_private.policy_values
  language sql immutable parallel safe security definer
  -- Definer only so that the operator views may read it (their callers have no usage on this
  -- schema); immutable, so every query folds it to constants when it is planned.
  set search_path = pg_catalog, pg_temp
  as $$
  select row(
    200,                    -- id_bytes
    100,                    -- id_list_entries
    64000,                  -- message_bytes
    43200,                  -- max_idle_minutes
    30,                     -- default_idle_minutes
    1000000,                -- max_dollars
    24000,                  -- batch_bytes
    0,                      -- existing_with_batch
    300,                    -- title_bytes
    4000,                   -- summary_bytes
    48,                     -- candidates
    4500,                   -- index_bytes
    12,                     -- index_ids
    3,                      -- max_claims
    interval '2 minutes',   -- lease
    interval '1 hour',      -- failure_backoff
    2000,                   -- error_chars
    8,                      -- directory_records
    300,                    -- directory_summary_chars
    12,                     -- query_limit
    1000,                   -- query_bytes
    20,                     -- shown_sources
    60,                     -- note_title_chars
    30,                     -- unused_days
    256,                    -- workspace_records
    32,                     -- query_terms
    8,                      -- fuzzy_words
    16,                     -- fuzzy_neighbours
    20,                     -- shown_ids
    200,                    -- batch_messages
    1000                    -- analyze_after
  )::memory_private.policy_values
$$;
comment on function memory_private.policy() is
  'Every limit, count and period of the memory''s rules (memory_private.policy_values names '
  'them): byte and count limits of ingest, model output, recall and tools; three model calls per '
  'unchanged input, the two-minute lease, the one-hour backoff; 30 days unused and 256 records '
  'per workspace; a batch of at most 24,000 bytes and 200 messages, shown with no earlier '
  'memory (docs/retention.md: what that choice measured); the bounds of one search (32 query '
  'terms, 8 fuzzy words, 16 neighbours a side) and of the id lists of its answer (20 source, '
  'thread and speaker ids a record); the statistics a tick refreshes after 1,000 changed '
  'conversations. Immutable: changing one is a migration.';

-- The tables' CHECK constraints and defaults read an integer policy number through this accessor
-- rather than as `(memory_private.policy()).name`: a field of the composite type makes the
-- constraint depend on the type's column, and Citus then counts every such table as a
-- dependency of policy() itself, a circle it refuses to distribute (docs/scaling.md).
create function memory_private.policy_limit(p_name text) returns integer
  language plpgsql immutable parallel safe
  as $$
declare
  v_value integer := (to_jsonb(memory_private.policy()) ->> p_name)::integer;
begin
  if v_value is null then
    raise exception 'memory_private.policy() has no integer named %', p_name
      using errcode = 'MB001';
  end if;
  return v_value;
end
$$;
comment on function memory_private.policy_limit(text) is
  'One integer policy number by name (memory_private.policy_values), for CHECK constraints and '
  'defaults; MB001 for a name the policy does not have. Immutable: folded when planned.';

create function memory_private.sorted_set(p_values anyarray) returns anyarray
  language sql immutable parallel safe
  as $$ select array(select distinct x from unnest(p_values) as x order by 1) $$;
comment on function memory_private.sorted_set(anyarray) is
  'The distinct elements of an array, in order (what a tool call keeps of the ids it returned; '
  'a function, so that Citus sees no subquery in the upsert that writes it).';

-- Argument checks. Each raises MB001 naming the argument, so a bad call says what to fix.
create function memory_private.check_id(p_name text, p_value text) returns text
  language plpgsql immutable
  as $$
begin
  if p_value is null or p_value = '' then
    raise exception '% is required', p_name using errcode = 'MB001',
      hint = 'Pass the identifier your application uses for it.';
  end if;
  if octet_length(p_value) > (memory_private.policy()).id_bytes then
    raise exception '% is longer than % bytes', p_name, (memory_private.policy()).id_bytes
      using errcode = 'MB001';
  end if;
  if p_value ~ '[[:cntrl:]]' or p_value <> btrim(p_value) then
    raise exception '% must not contain control characters or surrounding blanks', p_name
      using errcode = 'MB001';
  end if;
  return p_value;
end
$$;
comment on function memory_private.check_id(text, text) is
  'Validates an external identifier (non-empty, at most policy id_bytes, printable); raises '
  'MB001.';

create function memory_private.check_ids(p_name text, p_values text[]) returns text[]
  language plpgsql immutable
  as $$
declare
  v text;
begin
  if p_values is null then
    return '{}';
  end if;
  if cardinality(p_values) > (memory_private.policy()).id_list_entries then
    raise exception '% has more than % entries', p_name,
      (memory_private.policy()).id_list_entries using errcode = 'MB004';
  end if;
  foreach v in array p_values loop
    perform memory_private.check_id(p_name, v);
  end loop;
  return array(select distinct x from unnest(p_values) as x order by x);
end
$$;
comment on function memory_private.check_ids(text, text[]) is
  'Validates a list of identifiers and returns it sorted and de-duplicated; raises MB001/MB004.';

create function memory_private.check_text(p_name text, p_value text, p_max_bytes integer)
  returns text
  language plpgsql immutable
  as $$
begin
  if p_value is null then
    raise exception '% is required', p_name using errcode = 'MB001';
  end if;
  if octet_length(p_value) > p_max_bytes then
    raise exception '% is % bytes; the limit is % bytes (UTF-8)',
      p_name, octet_length(p_value), p_max_bytes using errcode = 'MB004';
  end if;
  return p_value;
end
$$;
comment on function memory_private.check_text(text, text, integer) is
  'Validates a required text against a UTF-8 byte limit; raises MB001/MB004.';

create function memory_private.check_choice(p_name text, p_value text, p_allowed text[])
  returns text
  language plpgsql immutable
  as $$
begin
  if p_value is null or not p_value = any(p_allowed) then
    raise exception '% must be %', p_name,
      array_to_string(p_allowed[1:cardinality(p_allowed) - 1], ', ')
      || case when cardinality(p_allowed) > 1 then ' or ' else '' end
      || p_allowed[cardinality(p_allowed)]
      using errcode = 'MB001';
  end if;
  return p_value;
end
$$;
comment on function memory_private.check_choice(text, text, text[]) is
  'Validates a required value that must be one of p_allowed; raises MB001 naming the choices.';

create function memory_private.check_money(p_name text, p_value numeric) returns numeric
  language plpgsql immutable
  as $$
begin
  if p_value is null or p_value < 0 or p_value > (memory_private.policy()).max_dollars then
    raise exception '% must be a dollar amount between 0 and %', p_name,
      (memory_private.policy()).max_dollars
      using errcode = 'MB001';
  end if;
  return p_value;
end
$$;
comment on function memory_private.check_money(text, numeric) is
  'Validates a dollar amount (0 to policy max_dollars); raises MB001.';

create function memory_private.content_hash(p_text text) returns text
  language sql immutable strict parallel safe
  as $$ select encode(sha256(convert_to(p_text, 'UTF8')), 'hex') $$;
comment on function memory_private.content_hash(text) is
  'The content hash of a message text: hex SHA-256 of its UTF-8 bytes.';

-- The schema version: the number of the last migration that built this schema (0001 = 1).
-- Every migration after the first replaces this function with its own number, and sql/ says the
-- same number, so `pimem migrate` can check that a database ends where the package expects
-- (docs/migrations.md). Readable by every memory role: a deploy script or a worker may ask it.
create function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 2 $$;
comment on function memory.schema_version() is
  'The schema version of this database: the number of the last migration applied (0001 = 1). '
  'pimem migrate fails when it differs from the version the package expects.';

revoke all on function memory.schema_version() from public;
grant execute on function memory.schema_version()
  to memory_backend, memory_worker, memory_operator;
