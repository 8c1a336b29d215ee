-- 40_jobs.sql: memory jobs and the worker's side of their life cycle (P1, P6-P9, P12-P20).
--
-- A job extracts one batch of a scope's conversation sources into a record, or consolidates a
-- scope's records into its index. The worker only calls the functions below; every rule lives
-- here.
--
--   maintenance ─▶ pending ─claim_job─▶ running (token, 2-minute lease)
--                    ▲                    │ start_attempt (budget check, attempt 'open', the
--                    │                    │                input's model calls + 1, at most 3)
--                    │                    │ save_checkpoint (validated, redacted output + usage,
--                    │                    │                  attempt 'ok', charge)
--                    │                    │ commit_job ─▶ succeeded
--                    │   fail_job failed: │ 1-hour backoff; 'stopped' after the third model call
--                    └────────────────────┤ fail_job unknown / lease lost with an attempt open:
--                                         │   charged at the reserve, 'stopped' (no replay)
--                                         └ input changed: 'superseded' (a fresh snapshot follows)
--
-- Claims are counted per unchanged input, and only claims that could reach the provider count
-- (graphile/worker's attempts keyed by the job's input): start_attempt counts the model call;
-- a claim that ends before it (a budget refusal, a crash, a checkpoint commit) costs nothing. A
-- job made for an input a superseded job already tried carries that job's count and backoff on
-- (memory_private.input_carryover), so no transient change in between (bot deactivated and
-- reactivated, recall off and on) gives an input more than three model calls. A job holding a
-- valid checkpoint is always claimable: committing it makes no model call.
--
-- Charges: an attempt is charged what the provider reported, never more than its reserve (a
-- check constraint on job_attempts holds it); an unknown outcome, or a reply whose cost could
-- not be read, is charged the reserve. Errors the worker reports are codes from
-- memory_private.failure_codes(), never text: no model output reaches storage or an operator
-- view through an error.
--
-- A job stores its input as ids and content hashes only (never message text): the claim payload
-- renders the current, redacted text, and a job whose sources changed is superseded instead of
-- claimed or committed. Errors change nothing (the call's transaction rolls back); what follows
-- from them (a superseded or stopped job) is applied by the next claim or maintenance from the
-- stored facts, so no rule depends on the worker reporting back.
--
-- Locking: every function here that writes locks the workspace row first (FOR NO KEY UPDATE,
-- which ingest's foreign-key checks never wait for), then the job row; claim_job skips a
-- workspace whose row is locked. No lock is held across a model call: each call is one short
-- transaction.

create table memory_private.jobs (
  workspace_id text not null,
  job_id bigint generated always as identity,
  scope_id bigint not null,
  phase text not null check (phase in ('extract', 'consolidate')),
  status text not null default 'pending'
    check (status in ('pending', 'running', 'succeeded', 'stopped', 'skipped', 'superseded')),
  input jsonb not null,
  input_hash text not null,
  origin_request_id text not null,
  model_provider text not null,
  model_id text not null,
  config_version integer not null,
  token uuid,
  worker_id text,
  lease_expires_at timestamptz,
  claims integer not null default 0 check (claims between 0 and (memory_private.policy()).max_claims),
  next_attempt_at timestamptz not null,
  last_error text,
  checkpoint jsonb,
  result jsonb,
  created_at timestamptz not null,
  updated_at timestamptz not null,
  finished_at timestamptz,
  primary key (workspace_id, job_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  foreign key (workspace_id, origin_request_id) references memory_private.requests
    on delete cascade,
  check ((status = 'running') = (lease_expires_at is not null and worker_id is not null)),
  check (status <> 'running' or token is not null),
  check (checkpoint is null or status in ('pending', 'running')),
  check ((status in ('succeeded', 'stopped', 'skipped', 'superseded')) = (finished_at is not null))
);
comment on table memory_private.jobs is
  'Memory jobs: phase, scope, input snapshot (ids and content hashes, never text) and its hash, '
  'originating request with its pinned model/provider, the workspace config version, status, '
  'ownership token, lease, claims for this input (<= 3), next attempt time, and the separate '
  'model checkpoint (validated, redacted output + usage).';
comment on column memory_private.jobs.claims is
  'The model calls made for this input: claims that reached start_attempt (a claim that ends '
  'before the call does not count), carried over from a superseded job of the same input and '
  'config version. At most 3; the third failed call stops the job.';
comment on column memory_private.jobs.token is
  'The token of the latest claim. Kept when the claim ends, so a worker that reports after '
  'maintenance retired the job is told why (MB021 input changed, MB022 config changed) rather '
  'than only that the job is no longer its own (MB020).';
comment on column memory_private.jobs.last_error is
  'Why the job last failed, stopped or was retired: a failure code '
  '(memory_private.failure_codes) or a sentence of the database naming ids, never model text.';
comment on column memory_private.jobs.status is
  'pending (claimable from next_attempt_at), running (token + lease), succeeded, stopped (no '
  'automatic replay: unknown outcome, three claims used, or config changed), skipped (a batch '
  'that cannot fit one user/assistant pair; never claimed), superseded (its input changed; a '
  'fresh snapshot replaces it).';
comment on column memory_private.jobs.input is
  'extract: {"bot_identity", "sources": [{"id", "hash"}], "existing": [record ids]}; '
  'consolidate: {"bot_identity", "candidates": [record ids]}.';

create unique index jobs_one_running_per_workspace on memory_private.jobs (workspace_id)
  where status = 'running';
create unique index jobs_one_open_per_scope_phase on memory_private.jobs
  (workspace_id, scope_id, phase) where status in ('pending', 'running');
-- claim_job reads the due jobs from here (the oldest first), then checks their workspaces: its
-- cost follows the jobs that are due, not the number of workspaces.
create index jobs_claimable_idx on memory_private.jobs (next_attempt_at, workspace_id)
  where status = 'pending';
create index jobs_input_idx on memory_private.jobs (workspace_id, scope_id, phase, input_hash);
create index jobs_origin_idx on memory_private.jobs (workspace_id, origin_request_id);

create table memory_private.job_attempts (
  workspace_id text not null,
  job_id bigint not null,
  attempt_no integer not null check (attempt_no between 1 and (memory_private.policy()).max_claims),
  token uuid not null,
  outcome text not null default 'open' check (outcome in ('open', 'ok', 'failed', 'unknown')),
  reserved_usd numeric(14, 6) not null check (reserved_usd >= 0),
  input_tokens integer check (input_tokens >= 0),
  output_tokens integer check (output_tokens >= 0),
  reported_cost_usd numeric(14, 6) check (reported_cost_usd >= 0),
  cost_usd numeric(14, 6) check (cost_usd >= 0),
  error text,
  started_at timestamptz not null,
  finished_at timestamptz,
  primary key (workspace_id, job_id, attempt_no),
  unique (workspace_id, job_id, token),
  foreign key (workspace_id, job_id) references memory_private.jobs on delete cascade,
  check ((outcome = 'open') = (finished_at is null)),
  -- A charge never exceeds what was reserved against the budgets before the call (P17).
  check (cost_usd <= reserved_usd)
);
comment on table memory_private.job_attempts is
  'Model calls of a job, at most one per claim (attempt_no = the input''s call number, 1 to 3): '
  'the dollars reserved before the call, then the outcome (ok | failed | unknown) with the '
  'usage the worker could read, the cost the provider reported, and the dollars charged '
  '(cost_usd: at most the reserve). error is a failure code, never text.';
comment on column memory_private.job_attempts.reported_cost_usd is
  'The cost the provider reported; NULL when none was reported or it could not be read.';
comment on column memory_private.job_attempts.cost_usd is
  'The dollars charged: the reported cost capped at the reserve; the reserve when the outcome '
  'is unknown or the cost could not be read; 0 when the provider answered with no usage.';

create unique index job_attempts_one_open on memory_private.job_attempts (workspace_id, job_id)
  where outcome = 'open';

create table memory_private.request_charges (
  workspace_id text not null,
  charge_id bigint generated always as identity,
  request_id text not null,
  kind text not null check (kind in ('memory_extract', 'memory_consolidate')),
  job_id bigint not null,
  attempt_no integer not null,
  outcome text not null check (outcome in ('ok', 'failed', 'unknown')),
  input_tokens integer check (input_tokens >= 0),
  output_tokens integer check (output_tokens >= 0),
  cost_usd numeric(14, 6) not null check (cost_usd >= 0),
  created_at timestamptz not null,
  primary key (workspace_id, charge_id),
  unique (workspace_id, job_id, attempt_no),
  foreign key (workspace_id, request_id) references memory_private.requests on delete cascade
);
comment on table memory_private.request_charges is
  'Every memory attempt''s usage and dollars, attached to the originating request as '
  'memory_extract or memory_consolidate (P18). An unknown outcome is charged at its reserve. '
  'Kept when the job row is deleted (job_id is a plain reference).';

create index request_charges_request_idx
  on memory_private.request_charges (workspace_id, request_id);

create function memory_private.request_memory_spent(p_workspace_id text, p_request_id text)
  returns numeric
  language sql stable
  set search_path = pg_catalog, pg_temp
  as $$
  select coalesce(sum(c.cost_usd), 0) from memory_private.request_charges c
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
$$;
comment on function memory_private.request_memory_spent(text, text) is
  'What memory jobs charged to a request: the sum of its request_charges. Derived, not stored '
  'on the request row, so charging never updates a row the backend upserts (P16); exact, since '
  'every charge is made under the workspace''s memory lock.';

create table memory_private.extracted_sources (
  workspace_id text not null,
  scope_id bigint not null,
  message_id text not null,
  content_hash text not null,
  outcome text not null check (outcome in ('extracted', 'skipped')),
  job_id bigint not null,
  created_at timestamptz not null,
  primary key (workspace_id, scope_id, message_id, content_hash),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.extracted_sources is
  'Sources already handled at this content: extracted by a committed job (also by an empty '
  'no-op output) or skipped with a batch that could not fit one user/assistant pair. An edit '
  'changes the hash, so the new text is eligible again.';

create index extracted_sources_message_idx
  on memory_private.extracted_sources (workspace_id, message_id);

-- State transitions -------------------------------------------------------------------------

create function memory_private.jobs_check_transition() returns trigger
  language plpgsql
  set search_path = pg_catalog, pg_temp
  as $$
begin
  if new.status is distinct from old.status
     and (old.status, new.status) not in (
       ('pending', 'running'), ('pending', 'superseded'), ('pending', 'stopped'),
       ('running', 'pending'), ('running', 'succeeded'), ('running', 'stopped'),
       ('running', 'superseded')) then
    raise exception 'job % cannot go from % to %', old.job_id, old.status, new.status
      using errcode = 'MB025';
  end if;
  return new;
end
$$;
comment on function memory_private.jobs_check_transition() is
  'Raises MB025 on an illegal job status transition: succeeded, stopped, skipped and '
  'superseded are final (an operator''s retry of a stopped job makes a new job).';

create trigger jobs_check_transition before update of status on memory_private.jobs
  for each row execute function memory_private.jobs_check_transition();

-- Helpers -----------------------------------------------------------------------------------

create function memory_private.failure_codes()
  returns table (code text, meaning text)
  language sql immutable
  set search_path = pg_catalog, pg_temp
  as $$
  select * from (values
    ('provider_unreachable', 'the call never reached the provider (nothing was billed)'),
    ('provider_error', 'the provider answered with an error (an HTTP error status, a stop '
                       'reason of error)'),
    ('reply_cut_off', 'the reply stopped at the output token limit'),
    ('reply_unreadable', 'the provider''s response could not be read: not JSON, no reply, '
                         'usage that is missing or not numbers, or usage the database refused '
                         'at the checkpoint (MB001: a negative, fractional or out-of-range '
                         'count or cost); charged at the reserve'),
    ('reply_not_json', 'the model''s reply is not one JSON object (also: not valid Unicode, '
                       'NaN or Infinity, nested deeper than the worker reads)'),
    ('reply_invalid', 'the model asked for a tool, and the worker''s model calls offer none'),
    ('output_refused', 'the database refused the reply''s JSON object as the output: MB023 '
                       '(keys, types, byte limits, ids), or a value PostgreSQL cannot hold (a '
                       'NUL character, a lone surrogate)'),
    ('not_priced', 'the worker cannot price the model, so no call was made'),
    ('budget_exceeded', 'the reserve did not fit the budgets (MB024), so no call was made'),
    ('runtime_failed', 'the model runtime (the Pi CLI) failed or exited'),
    ('call_aborted', 'the worker stopped during the call'),
    ('deadline_exceeded', 'the call did not finish before the tick''s deadline'),
    ('lease_lost', 'the worker lost the lease during the call'),
    ('lease_expired', 'the lease expired while the model call was open (written by '
                      'maintenance)'),
    ('input_changed', 'a source of the batch changed during the call (MB021 at the checkpoint): '
                      'nothing was stored'),
    ('database_error', 'a database call of the tick failed unexpectedly'),
    ('worker_error', 'an unexpected error in the worker')) as c(code, meaning)
$$;
comment on function memory_private.failure_codes() is
  'The codes a failed or unknown attempt is recorded with (fail_job''s error, job_attempts.error, '
  'jobs.last_error). Coded and content-free: a model''s text never reaches storage or an '
  'operator view through an error. docs/errors.md lists them.';

create function memory_private.check_token(p_token text) returns uuid
  language plpgsql immutable
  set search_path = pg_catalog, pg_temp
  as $$
begin
  if p_token is null
     or p_token !~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' then
    raise exception 'token must be the job token claim_job returned (a UUID)'
      using errcode = 'MB001';
  end if;
  return p_token::uuid;
end
$$;
comment on function memory_private.check_token(text) is
  'A job token as the worker sends it (text, so a malformed one is MB001 here rather than a '
  'cast error before the function runs), as a uuid.';

create function memory_private.job_limits() returns jsonb
  language sql immutable
  as $$
  select jsonb_build_object('summary_bytes', p.summary_bytes, 'title_bytes', p.title_bytes,
                            'index_bytes', p.index_bytes, 'index_ids', p.index_ids,
                            'batch_bytes', p.batch_bytes, 'candidates', p.candidates)
    from memory_private.policy() as p
$$;
comment on function memory_private.job_limits() is
  'The limits of model work as the claim payload tells them to the worker (from '
  'memory_private.policy()): summary, title and index bytes (UTF-8), index ids, source batch '
  'bytes, consolidation candidates.';

create function memory_private.mark_consolidation_due(p_workspace_id text, p_scope_id bigint)
  returns void
  language sql volatile
  set search_path = pg_catalog, pg_temp
  as $$
  update memory_private.scopes
     set consolidation_due_at = coalesce(consolidation_due_at, memory_private.clock_now())
   where workspace_id = p_workspace_id and scope_id = p_scope_id
$$;
comment on function memory_private.mark_consolidation_due(text, bigint) is
  'Marks a scope''s index as out of date (a new record, a note, a prune, a forget): the next '
  'maintenance schedules a consolidation (P10). Keeps the earliest due time.';

create function memory_private.recent_valid_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text default null,
  p_query text default null, p_record_id bigint default null
) returns bigint[]
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_size integer := p_limit + 4;
  v_offset integer := 0;
  v_query text := lower(p_query);
begin
  -- Newest first, a page at a time (limit + 4, then four times more), each page validated as
  -- one set: a scope whose newest records are valid costs one short index scan and one
  -- validation, never a read of the whole scope. One snapshot throughout (stable).
  loop
    v_chunk := array(
      select r.record_id from memory_private.records r
       where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
         and (p_record_id is null or r.record_id = p_record_id)
         -- search_text is the folded title and summary; the re-check on title and summary
         -- apart only runs for its matches (a query spanning the newline is no match).
         and (v_query is null
              or (strpos(r.search_text, v_query) > 0
                  and (strpos(lower(r.title), v_query) > 0
                       or strpos(lower(r.summary), v_query) > 0)))
       order by r.created_at desc, r.record_id desc
       limit v_size offset v_offset);
    v_valid := v_valid || memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_chunk, p_limit - cardinality(v_valid),
                 p_requester);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid;
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Validated set-wise a page at a time.';

create function memory_private.job_stale_reason(p_job memory_private.jobs) returns text
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_scope memory_private.scopes;
  v_identity text;
  v_reason text;
  v_now timestamptz := memory_private.clock_now();
begin
  select * into v_scope from memory_private.scopes
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id;
  if not v_scope.recall_enabled then
    return 'recall is disabled in the scope';
  end if;
  select case when b.active then b.identity end into v_identity from memory_private.bots b
   where b.workspace_id = v_scope.workspace_id and b.bot_id = v_scope.bot_id;
  if v_identity is distinct from p_job.input ->> 'bot_identity' then
    return 'the bot was replaced or deactivated';
  end if;

  if p_job.phase = 'extract' then
    -- Each source of the batch must be current at the hash the snapshot took (the rule's
    -- memory_private.dependency_state).
    select format('source %s %s', x.id,
             case x.state when 'source_removed' then 'was removed'
                          when 'source_expired' then 'is past its retention'
                          when 'source_edited' then 'was edited'
                          else 'was forgotten' end)
      into v_reason
      from (select s.id, memory_private.dependency_state(
                           m.removed_at, m.body is not null, m.retain_until, m.content_hash,
                           s.hash,
                           exists (select 1 from memory_private.tombstones t
                                    where t.workspace_id = p_job.workspace_id
                                      and t.scope_id = p_job.scope_id and t.message_id = s.id),
                           v_now) as state
              from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
              left join memory_private.messages m
                on m.workspace_id = p_job.workspace_id and m.message_id = s.id) x
     where x.state is not null
     limit 1;
    if v_reason is not null then
      return v_reason;
    end if;
  end if;

  -- Records the model sees (existing memories of an extraction, candidates of a consolidation)
  -- must still exist in the scope and be valid (validated as one set).
  select format('memory %s %s', e.id,
           coalesce('is no longer valid (' || v.reason || ')', 'is gone'))
    into v_reason
    from jsonb_array_elements_text(
           coalesce(p_job.input -> 'existing', p_job.input -> 'candidates'))
         with ordinality as e(id, pos)
    left join memory_private.invalid_records(
                p_job.workspace_id, p_job.scope_id,
                array(select x::bigint from jsonb_array_elements_text(
                        coalesce(p_job.input -> 'existing', p_job.input -> 'candidates')) x),
                null) v
      on v.record_id = e.id::bigint
   where v.record_id is null or v.reason is not null
   order by e.pos
   limit 1;
  return v_reason;
end
$$;
comment on function memory_private.job_stale_reason(memory_private.jobs) is
  'Why a job''s input snapshot is no longer current, or NULL: recall disabled, bot replaced, '
  'a source gone, removed, expired, edited or tombstoned, or a record it shows the model no '
  'longer valid.';

create function memory_private.check_usage(p_usage jsonb, p_complete boolean default true)
  returns jsonb
  language plpgsql immutable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_key text;
  v_value jsonb;
  v_number numeric;
  v_result jsonb := '{}';
begin
  if p_usage is null or jsonb_typeof(p_usage) <> 'object' then
    raise exception 'usage must be a JSON object {"input_tokens", "output_tokens", "cost_usd"}'
      using errcode = 'MB001';
  end if;
  for v_key in select jsonb_object_keys(p_usage) loop
    if v_key not in ('input_tokens', 'output_tokens', 'cost_usd') then
      raise exception 'usage has an unknown key' using errcode = 'MB001',
        hint = 'usage is {"input_tokens": int, "output_tokens": int, "cost_usd": number}.';
    end if;
  end loop;
  foreach v_key in array array['input_tokens', 'output_tokens', 'cost_usd'] loop
    v_value := p_usage -> v_key;
    if v_value is null then
      raise exception 'usage lacks %', v_key using errcode = 'MB001';
    end if;
    if jsonb_typeof(v_value) = 'null' and not p_complete then
      v_result := v_result || jsonb_build_object(v_key, null);  -- not known
      continue;
    end if;
    if jsonb_typeof(v_value) <> 'number' then
      raise exception 'usage.% must be a number%', v_key,
        case when p_complete then '' else ' or null (not known)' end using errcode = 'MB001';
    end if;
    v_number := (v_value #>> '{}')::numeric;
    if v_key = 'cost_usd' then
      perform memory_private.check_money('usage.cost_usd', v_number);
      v_result := v_result || jsonb_build_object(v_key, round(v_number, 6));
    else
      if v_number <> trunc(v_number) or v_number < 0 or v_number > 2147483647 then
        raise exception 'usage.% must be an integer from 0 to 2147483647', v_key
          using errcode = 'MB001';
      end if;
      v_result := v_result || jsonb_build_object(v_key, v_number::integer);
    end if;
  end loop;
  return v_result;
end
$$;
comment on function memory_private.check_usage(jsonb, boolean) is
  'Validates a model call''s usage {"input_tokens": 0..2147483647, "output_tokens": same, '
  '"cost_usd": 0..1000000} (all three keys, no other) and returns it normalized; raises MB001. '
  'With p_complete false (fail_job) a value may be null: the worker could not read it (a '
  'provider''s NaN, negative or oversized count), and a null cost is charged at the reserve.';

create function memory_private.is_id_array(p_value jsonb) returns boolean
  language sql immutable parallel safe
  as $$
  -- An id is an integer literal between 1 and the bigint maximum (1.0 is not: it would not cast
  -- to bigint, and a model that writes it has not copied the id).
  select jsonb_typeof(p_value) = 'array'
     and not exists (select 1 from jsonb_array_elements(p_value) e
                      where jsonb_typeof(e) <> 'number' or (e #>> '{}') !~ '^[0-9]{1,19}$'
                         or (e #>> '{}')::numeric not between 1 and 9223372036854775807)
$$;
comment on function memory_private.is_id_array(jsonb) is
  'Whether a JSON value is an array of record ids (integer literals, 1 .. 2^63-1).';

create function memory_private.check_output_keys(
  p_phase text, p_output jsonb, p_expected text[], p_optional text[]
) returns void
  language plpgsql immutable
  as $$
declare
  v_keys text[];
  v_bad text;
begin
  if p_output is null or jsonb_typeof(p_output) <> 'object' then
    raise exception 'the % output must be a JSON object with keys %', p_phase,
      array_to_string(p_expected, ', ') using errcode = 'MB023';
  end if;
  v_keys := array(select k from jsonb_object_keys(p_output) as k order by k);
  -- Messages name the contract, never what the model wrote (its keys, ids or text): they reach
  -- the worker's logs, and a model's output is hostile input.
  select count(*)::text into v_bad from unnest(v_keys) as k
   where k <> all (p_expected || p_optional);
  if v_bad <> '0' then
    raise exception 'the % output has % unknown key(s); the keys are exactly %', p_phase,
      v_bad, array_to_string(p_expected, ', ') using errcode = 'MB023';
  end if;
  select string_agg(k, ', ') into v_bad from unnest(p_expected) as k where k <> all (v_keys);
  if v_bad is not null then
    raise exception 'the % output lacks keys: %', p_phase, v_bad using errcode = 'MB023';
  end if;
end
$$;
comment on function memory_private.check_output_keys(text, jsonb, text[], text[]) is
  'Raises MB023 unless a model output is a JSON object with exactly the expected keys (and '
  'perhaps the optional ones).';

create function memory_private.validate_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
declare
  v_title text;
  v_summary text;
  v_ids text[];
  v_reused bigint[];
  v_bad text;
  v_policy memory_private.policy_values := memory_private.policy();
begin
  -- reused_ids is optional: an output that declares no reuse may leave it out.
  perform memory_private.check_output_keys('extract', p_output,
                                           array['source_ids', 'summary', 'title'],
                                           array['reused_ids']);
  if jsonb_typeof(p_output -> 'title') <> 'string'
     or jsonb_typeof(p_output -> 'summary') <> 'string' then
    raise exception 'title and summary must be strings' using errcode = 'MB023';
  end if;
  if jsonb_typeof(p_output -> 'source_ids') <> 'array'
     or exists (select 1 from jsonb_array_elements(p_output -> 'source_ids') e
                 where jsonb_typeof(e) <> 'string') then
    raise exception 'source_ids must be an array of message id strings' using errcode = 'MB023';
  end if;
  if not memory_private.is_id_array(coalesce(p_output -> 'reused_ids', '[]')) then
    raise exception 'reused_ids must be an array of memory ids (positive integers)'
      using errcode = 'MB023';
  end if;
  v_title := p_output ->> 'title';
  v_summary := p_output ->> 'summary';
  -- The sources in the order the output lists them (the order the summary uses them), each
  -- once, at its first place; the same for the memories it reused.
  v_ids := array(select e.id
                   from jsonb_array_elements_text(p_output -> 'source_ids')
                        with ordinality as e(id, n)
                  group by e.id order by min(e.n));
  v_reused := array(select e.id::bigint
                      from jsonb_array_elements_text(coalesce(p_output -> 'reused_ids', '[]'))
                           with ordinality as e(id, n)
                     group by e.id order by min(e.n));
  if v_title = '' and v_summary = '' and cardinality(v_ids) = 0 then
    if cardinality(v_reused) > 0 then
      raise exception 'an empty (no-op) output reuses no memory: reused_ids must be empty'
        using errcode = 'MB023';
    end if;
    return jsonb_build_object('title', '', 'summary', '', 'source_ids', '[]'::jsonb,
                              'reused_ids', '[]'::jsonb);
  end if;
  if v_title ~ '^\s*$' or v_summary ~ '^\s*$' or cardinality(v_ids) = 0 then
    raise exception 'title, summary and source_ids must be all empty (no-op) or all present'
      using errcode = 'MB023';
  end if;
  if octet_length(v_title) > v_policy.title_bytes then
    raise exception 'title is % bytes; the limit is % UTF-8 bytes', octet_length(v_title),
      v_policy.title_bytes using errcode = 'MB023';
  end if;
  if octet_length(v_summary) > v_policy.summary_bytes then
    raise exception 'summary is % bytes; the limit is % UTF-8 bytes', octet_length(v_summary),
      v_policy.summary_bytes using errcode = 'MB023';
  end if;
  select count(*)::text into v_bad from unnest(v_ids) as i
   where not exists (select 1 from jsonb_array_elements(p_job.input -> 'sources') s
                      where s ->> 'id' = i);
  if v_bad <> '0' then
    raise exception '% source id(s) are not messages of the job''s batch', v_bad
      using errcode = 'MB023';
  end if;
  -- Reuse can only be declared of a memory the model was shown with the batch (P5).
  select count(*)::text into v_bad from unnest(v_reused) as x
   where not exists (select 1 from jsonb_array_elements_text(p_job.input -> 'existing') e
                      where e::bigint = x);
  if v_bad <> '0' then
    raise exception '% reused id(s) are not memories shown with the batch', v_bad
      using errcode = 'MB023';
  end if;
  v_title := memory_private.redact(v_title);
  v_summary := memory_private.redact(v_summary);
  if octet_length(v_title) > v_policy.title_bytes
     or octet_length(v_summary) > v_policy.summary_bytes then
    raise exception 'title or summary is over its byte limit once credentials are redacted'
      using errcode = 'MB023';
  end if;
  return jsonb_build_object('title', v_title, 'summary', v_summary,
                            'source_ids', to_jsonb(v_ids), 'reused_ids', to_jsonb(v_reused));
end
$$;
comment on function memory_private.validate_extraction(memory_private.jobs, jsonb) is
  'Validates an extraction output and returns it redacted and normalized; raises MB023. '
  '{"title", "summary", "source_ids", "reused_ids"?}: all empty = no-op; title and summary '
  'within their byte limits (also after redaction); source ids within the batch, kept in the '
  'order given, each once; reused ids among the memories shown with the batch (P6, P8).';

create function memory_private.validate_index(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
declare
  v_index text;
  v_record_ids bigint[];
  v_bad text;
  v_policy memory_private.policy_values := memory_private.policy();
begin
  perform memory_private.check_output_keys('consolidate', p_output,
                                           array['index', 'record_ids'], '{}');
  if jsonb_typeof(p_output -> 'index') <> 'string' then
    raise exception 'index must be a string' using errcode = 'MB023';
  end if;
  if not memory_private.is_id_array(p_output -> 'record_ids') then
    raise exception 'record_ids must be an array of record ids (positive integers)'
      using errcode = 'MB023';
  end if;
  v_index := p_output ->> 'index';
  if v_index ~ '^\s*$' then
    raise exception 'index must not be empty' using errcode = 'MB023';
  end if;
  if octet_length(v_index) > v_policy.index_bytes then
    raise exception 'index is % bytes; the limit is % UTF-8 bytes', octet_length(v_index),
      v_policy.index_bytes using errcode = 'MB023';
  end if;
  v_record_ids := array(select (e #>> '{}')::bigint
                          from jsonb_array_elements(p_output -> 'record_ids')
                               with ordinality as a(e, n) order by n);
  if cardinality(v_record_ids) = 0 then
    raise exception 'record_ids must name at least one memory' using errcode = 'MB023';
  end if;
  if cardinality(v_record_ids) > v_policy.index_ids then
    raise exception 'record_ids has % ids; the limit is %', cardinality(v_record_ids),
      v_policy.index_ids using errcode = 'MB023';
  end if;
  if cardinality(v_record_ids)
     <> (select count(distinct x) from unnest(v_record_ids) as x) then
    raise exception 'record_ids has duplicates' using errcode = 'MB023';
  end if;
  select count(*)::text into v_bad from unnest(v_record_ids) as x
   where not exists (select 1 from jsonb_array_elements_text(p_job.input -> 'candidates') c
                      where c::bigint = x);
  if v_bad <> '0' then
    raise exception '% record id(s) are not among the job''s candidates', v_bad
      using errcode = 'MB023';
  end if;
  v_index := memory_private.redact(v_index);
  if octet_length(v_index) > v_policy.index_bytes then
    raise exception 'index is over its byte limit once credentials are redacted'
      using errcode = 'MB023';
  end if;
  return jsonb_build_object('index', v_index, 'record_ids', to_jsonb(v_record_ids));
end
$$;
comment on function memory_private.validate_index(memory_private.jobs, jsonb) is
  'Validates a consolidation output and returns it redacted and normalized; raises MB023. '
  '{"index", "record_ids"}: index non-empty, within its byte limit (also after redaction); 1 to '
  'the limit of distinct record ids, all among the candidates (P8, P9).';

create function memory_private.validate_output(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language sql stable
  as $$
  select case p_job.phase when 'extract'
              then memory_private.validate_extraction(p_job, p_output)
              else memory_private.validate_index(p_job, p_output) end
$$;
comment on function memory_private.validate_output(memory_private.jobs, jsonb) is
  'Validates a model output for a job and returns it redacted and normalized; raises MB023. '
  'extract: {"title", "summary", "source_ids", "reused_ids"?} (all empty = no-op; title <= 300 '
  'and summary <= 4,000 UTF-8 bytes; source ids within the batch, kept in the order given; '
  'reused ids among the memories shown with the batch). consolidate: {"index", "record_ids"} (index '
  'non-empty, <= 4,500 bytes; 1 to 12 distinct ids among the candidates). No other keys.';

create function memory_private.job_payload(p_job memory_private.jobs) returns jsonb
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_scope memory_private.scopes;
  v_request memory_private.requests;
  v_ws memory_private.workspaces;
  v_workspace_spent numeric;
  v_input jsonb;
begin
  select * into v_scope from memory_private.scopes
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id;
  select * into v_request from memory_private.requests
   where workspace_id = p_job.workspace_id and request_id = p_job.origin_request_id;
  select * into v_ws from memory_private.workspaces where workspace_id = p_job.workspace_id;
  select memory_spent_usd into v_workspace_spent from memory_private.workspace_memory
   where workspace_id = p_job.workspace_id;

  -- Inputs are redacted before they are serialized (P8).
  if p_job.phase = 'extract' then
    v_input := jsonb_build_object(
      'sources', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', m.message_id, 'role', m.role, 'speaker_id', m.speaker_id,
                 'thread_id', r.thread_id, 'created_at', m.created_at,
                 'text', memory_private.redact(m.body))
               order by m.created_at, m.message_id)
          from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
          join memory_private.messages m
            on m.workspace_id = p_job.workspace_id and m.message_id = s.id
          join memory_private.requests r
            on r.workspace_id = m.workspace_id and r.request_id = m.request_id), '[]'::jsonb),
      'existing', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', rec.record_id, 'title', memory_private.redact(rec.title),
                 'summary', memory_private.redact(rec.summary))
               order by rec.created_at, rec.record_id)
          from jsonb_array_elements_text(p_job.input -> 'existing') as e(id)
          join memory_private.records rec
            on rec.workspace_id = p_job.workspace_id and rec.record_id = e.id::bigint),
        '[]'::jsonb));
  else
    v_input := jsonb_build_object(
      'candidates', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', rec.record_id, 'kind', rec.kind, 'title', memory_private.redact(rec.title),
                 'summary', memory_private.redact(rec.summary),
                 'speaker_ids', to_jsonb(rec.speaker_ids), 'created_at', rec.created_at)
               order by rec.created_at desc, rec.record_id desc)
          from jsonb_array_elements_text(p_job.input -> 'candidates') as c(id)
          join memory_private.records rec
            on rec.workspace_id = p_job.workspace_id and rec.record_id = c.id::bigint),
        '[]'::jsonb));
  end if;

  return jsonb_build_object(
    'job_id', p_job.job_id,
    'workspace_id', p_job.workspace_id,
    'token', p_job.token::text,
    'phase', p_job.phase,
    -- The number this claim's model call gets (claims count calls); none with a checkpoint.
    'attempt', case when p_job.checkpoint is null then p_job.claims + 1 end,
    'lease_expires_at', p_job.lease_expires_at,
    'scope', jsonb_build_object('scope_id', v_scope.scope_id, 'kind', v_scope.kind,
                                'bot_id', v_scope.bot_id, 'chat_id', v_scope.chat_id,
                                'user_id', v_scope.user_id, 'topic_id', v_scope.topic_id),
    'origin_request_id', p_job.origin_request_id,
    'model', jsonb_build_object('provider', p_job.model_provider, 'id', p_job.model_id),
    -- Dollars as exact decimal strings, as the rest of the API takes them (a JSON number is a
    -- float in most clients).
    'budget', jsonb_build_object(
       'request_left_usd', (v_request.budget_usd - v_request.spent_usd
                            - memory_private.request_memory_spent(p_job.workspace_id,
                                                                   p_job.origin_request_id))::text,
       'workspace_left_usd', (v_ws.budget_usd - v_ws.spent_usd - v_workspace_spent)::text),
    'limits', memory_private.job_limits(),
    'input', v_input,
    'checkpoint', case when p_job.checkpoint is not null
                       then jsonb_build_object('output', p_job.checkpoint -> 'output',
                                               'usage', p_job.checkpoint -> 'usage') end);
end
$$;
comment on function memory_private.job_payload(memory_private.jobs) is
  'The claim payload of a running job: ids, token, phase, attempt (the number its model call '
  'gets; null with a checkpoint), lease, scope, origin request, pinned model, budget left (exact '
  'decimal strings), limits, the redacted input rendered from current facts, and the '
  'checkpoint when one exists.';

create function memory_private.owned_job(
  p_workspace_id text, p_job_id bigint, p_token text
) returns memory_private.jobs
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_token uuid;
  v_config integer;
begin
  perform memory_private.require_workspace(p_workspace_id);
  if p_job_id is null then
    raise exception 'job_id is required' using errcode = 'MB001';
  end if;
  v_token := memory_private.check_token(p_token);
  perform memory_private.lock_workspace(p_workspace_id);
  select * into v_job from memory_private.jobs
   where workspace_id = p_workspace_id and job_id = p_job_id
     for update;
  if not found then
    raise exception 'job % is unknown in workspace %', p_job_id, p_workspace_id
      using errcode = 'MB002';
  end if;
  if v_job.token is distinct from v_token then
    raise exception 'job % is not held by this token (it is %)', p_job_id, v_job.status
      using errcode = 'MB020', hint = 'Drop the work: the lease was lost or another worker owns the job.';
  end if;
  -- The caller's claim was ended by maintenance: say why, as commit_job would have.
  if v_job.status = 'superseded' then
    raise exception 'the input of job % changed and maintenance superseded it: %', p_job_id,
      coalesce(v_job.last_error, 'input changed') using errcode = 'MB021',
      hint = 'Drop the work: maintenance schedules a fresh snapshot.';
  end if;
  if v_job.status = 'stopped' then
    select config_version into v_config from memory_private.workspaces
     where workspace_id = p_workspace_id;
    if v_job.config_version <> v_config then
      raise exception 'the model/provider configuration of workspace % changed (version % -> %)',
        p_workspace_id, v_job.config_version, v_config using errcode = 'MB022',
        hint = 'Drop the work: maintenance stopped the job.';
    end if;
  end if;
  if v_job.status <> 'running' then
    raise exception 'job % is not held by this token (it is %)', p_job_id, v_job.status
      using errcode = 'MB020', hint = 'Drop the work: the lease was lost or another worker owns the job.';
  end if;
  if v_job.lease_expires_at <= memory_private.clock_now() then
    raise exception 'the lease of job % expired at %', p_job_id, v_job.lease_expires_at
      using errcode = 'MB020', hint = 'Drop the work: the job will be released by maintenance.';
  end if;
  return v_job;
end
$$;
comment on function memory_private.owned_job(text, bigint, text) is
  'Takes the workspace''s memory lock, locks the job and returns it when the token is its '
  'current one and the lease has not expired; raises MB001, MB002 or MB020, and MB021/MB022 '
  'when maintenance ended this claim because the input or the configuration changed.';

create function memory_private.close_attempt(
  p_job memory_private.jobs, p_outcome text, p_usage jsonb, p_error text
) returns boolean
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_attempt memory_private.job_attempts;
  v_reported numeric := (p_usage ->> 'cost_usd')::numeric;
  v_cost numeric;
begin
  select * into v_attempt from memory_private.job_attempts
   where workspace_id = p_job.workspace_id and job_id = p_job.job_id and outcome = 'open'
     for update;
  if not found then
    return false;
  end if;
  -- What is charged (never more than the reserve: job_attempts' check constraint holds it):
  v_cost := case
              -- the provider may have run and charged anything up to what was reserved
              when p_outcome = 'unknown' then v_attempt.reserved_usd
              -- the provider answered with no usage (an error status): nothing was billed
              when p_usage is null then 0
              -- it answered, but its cost could not be read: assume the reserve
              when v_reported is null then v_attempt.reserved_usd
              else least(v_reported, v_attempt.reserved_usd)
            end;
  update memory_private.job_attempts
     set outcome = p_outcome,
         input_tokens = (p_usage ->> 'input_tokens')::integer,
         output_tokens = (p_usage ->> 'output_tokens')::integer,
         reported_cost_usd = v_reported, cost_usd = v_cost, error = p_error,
         finished_at = memory_private.clock_now()
   where workspace_id = p_job.workspace_id and job_id = p_job.job_id
     and attempt_no = v_attempt.attempt_no;
  insert into memory_private.request_charges
    (workspace_id, request_id, kind, job_id, attempt_no, outcome, input_tokens, output_tokens,
     cost_usd, created_at)
  values (p_job.workspace_id, p_job.origin_request_id,
          case p_job.phase when 'extract' then 'memory_extract' else 'memory_consolidate' end,
          p_job.job_id, v_attempt.attempt_no, p_outcome, (p_usage ->> 'input_tokens')::integer,
          (p_usage ->> 'output_tokens')::integer, v_cost, memory_private.clock_now());
  update memory_private.workspace_memory
     set memory_spent_usd = memory_spent_usd + v_cost
   where workspace_id = p_job.workspace_id;
  return true;
end
$$;
comment on function memory_private.close_attempt(memory_private.jobs, text, jsonb, text) is
  'Closes the job''s open attempt, if any, as ok, failed or unknown with the usage the worker '
  'could read (memory_private.check_usage) and a failure code, and charges it to the '
  'originating request (memory_extract or memory_consolidate) and the workspace''s memory '
  'spend: the reported cost capped at the reserve; the reserve for an unknown outcome or an '
  'unreadable cost; 0 when no usage came back. Returns whether there was an open attempt.';

create function memory_private.release_job(
  p_job memory_private.jobs, p_status text, p_error text,
  p_next_attempt_at timestamptz default null
) returns void
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
begin
  update memory_private.jobs
     set status = p_status, worker_id = null, lease_expires_at = null,
         last_error = coalesce(left(p_error, (memory_private.policy()).error_bytes), last_error),
         next_attempt_at = coalesce(p_next_attempt_at, next_attempt_at),
         checkpoint = case when p_status = 'pending' then checkpoint end,
         finished_at = case when p_status in ('stopped', 'superseded') then v_now end,
         updated_at = v_now
   where workspace_id = p_job.workspace_id and job_id = p_job.job_id;
end
$$;
comment on function memory_private.release_job(memory_private.jobs, text, text, timestamptz) is
  'Moves a job out of running (or out of pending) to pending, stopped or superseded: clears '
  'the lease (the token stays, so the old claim is told why, see owned_job); keeps the '
  'checkpoint only when the job stays pending.';

create function memory_private.retire_stale_jobs(p_workspace_id text) returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
  v_stopped integer := 0;
  v_superseded integer := 0;
begin
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id;
  for v_job in
    select j.* from memory_private.jobs j
     where j.workspace_id = p_workspace_id
       and (j.status = 'pending'
            or (j.status = 'running'
                and not exists (select 1 from memory_private.job_attempts a
                                 where a.workspace_id = j.workspace_id and a.job_id = j.job_id
                                   and a.outcome = 'open')))
     order by j.job_id
       for update
  loop
    if v_job.config_version <> v_config then
      perform memory_private.release_job(v_job, 'stopped',
        format('the model/provider configuration changed (version %s -> %s)',
               v_job.config_version, v_config));
      v_stopped := v_stopped + 1;
      continue;
    end if;
    v_reason := memory_private.job_stale_reason(v_job);
    if v_reason is not null then
      perform memory_private.release_job(v_job, 'superseded', 'input changed: ' || v_reason);
      v_superseded := v_superseded + 1;
    end if;
  end loop;
  return jsonb_build_object('jobs_stopped_config_changed', v_stopped,
                            'jobs_superseded_stale', v_superseded);
end
$$;
comment on function memory_private.retire_stale_jobs(text) is
  'Maintenance step: stops pending jobs and running jobs with no open attempt whose workspace '
  'config version changed (P20), and supersedes those whose input is no longer current (a '
  'fresh snapshot is scheduled). Returns counts.';

create function memory_private.expire_leases(p_workspace_id text) returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_expired integer := 0;
  v_unknown integer := 0;
begin
  for v_job in
    select * from memory_private.jobs
     where workspace_id = p_workspace_id and status = 'running'
       and lease_expires_at <= memory_private.clock_now()
     order by job_id
       for update
  loop
    v_expired := v_expired + 1;
    if memory_private.close_attempt(v_job, 'unknown', null, 'lease_expired') then
      v_unknown := v_unknown + 1;
      perform memory_private.release_job(v_job, 'stopped',
        'the lease expired while a model call was open: outcome unknown, not replayed');
    elsif v_job.checkpoint is not null then
      -- A valid answer was paid for: the next claim commits it without a model call, whatever
      -- the number of calls the input has made.
      perform memory_private.release_job(v_job, 'pending',
        'the lease expired after the checkpoint; the next claim commits it',
        memory_private.clock_now());
    elsif v_job.claims >= (memory_private.policy()).max_claims then
      perform memory_private.release_job(v_job, 'stopped',
        'the lease expired and the input has made its three model calls');
    else
      perform memory_private.release_job(v_job, 'pending', 'the lease expired',
                                         memory_private.clock_now());
    end if;
  end loop;
  return jsonb_build_object('leases_expired', v_expired, 'attempts_unknown', v_unknown);
end
$$;
comment on function memory_private.expire_leases(text) is
  'Maintenance step: a running job whose lease passed is stopped when a model call was open '
  '(the attempt becomes unknown and is charged at its reserve; no automatic replay), goes back '
  'to pending due now with its checkpoint when it has one (committed by the next claim without '
  'a model call, even after the third call), is stopped when its input made its three calls, '
  'and otherwise goes back to pending. Returns counts.';

-- The worker's API ----------------------------------------------------------------------------

create function memory.claim_job(p_worker_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_ws record;
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
begin
  perform memory_private.check_id('worker_id', p_worker_id);
  -- Candidates come from the due jobs (jobs_claimable_idx), not from every workspace. A job
  -- with calls left is claimable, and so is one holding a checkpoint whatever its count: its
  -- claim only commits.
  for v_ws in
    select d.workspace_id
      from (select j.workspace_id, min(j.next_attempt_at) as due
              from memory_private.jobs j
             where j.status = 'pending' and j.next_attempt_at <= v_now
               and (j.claims < (memory_private.policy()).max_claims or j.checkpoint is not null)
             group by j.workspace_id) d
      join memory_private.workspaces w on w.workspace_id = d.workspace_id
     where not w.paused
       and not exists (select 1 from memory_private.jobs r
                        where r.workspace_id = d.workspace_id and r.status = 'running')
     order by d.due, d.workspace_id
  loop
    -- The workspace's memory lock, without waiting: another claim or a memory write holds it
    -- briefly.
    continue when not memory_private.try_lock_workspace(v_ws.workspace_id);
    select config_version into v_config from memory_private.workspaces
     where workspace_id = v_ws.workspace_id and not paused;
    continue when not found;
    -- Re-read under the lock: a concurrent claim may have committed a running job meanwhile.
    continue when exists (select 1 from memory_private.jobs j
                           where j.workspace_id = v_ws.workspace_id and j.status = 'running');
    loop
      select * into v_job from memory_private.jobs j
       where j.workspace_id = v_ws.workspace_id and j.status = 'pending'
         and j.next_attempt_at <= v_now
         and (j.claims < (memory_private.policy()).max_claims or j.checkpoint is not null)
       order by j.next_attempt_at, j.job_id
       limit 1
         for update skip locked;
      exit when not found;
      if v_job.config_version <> v_config then
        perform memory_private.release_job(v_job, 'stopped',
          format('the model/provider configuration changed (version %s -> %s)',
                 v_job.config_version, v_config));
        continue;
      end if;
      v_reason := memory_private.job_stale_reason(v_job);
      if v_reason is not null then
        perform memory_private.release_job(v_job, 'superseded', 'input changed: ' || v_reason);
        continue;
      end if;
      -- The claim is counted by start_attempt, when it can reach the provider.
      update memory_private.jobs
         set status = 'running', token = gen_random_uuid(), worker_id = p_worker_id,
             lease_expires_at = v_now + (memory_private.policy()).lease, updated_at = v_now
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      return memory_private.job_payload(v_job);
    end loop;
  end loop;
  return null;
end
$$;
comment on function memory.claim_job(text) is
  'Claims at most one memory job (NULL when there is none): pending, due, with a model call '
  'left for its input (fewer than three) or a checkpoint to commit, workspace not paused and '
  'with no running job. Issues a fresh token and a two-minute lease and returns the payload: '
  'phase, scope, origin request, pinned model, budget left (decimal strings), limits, redacted '
  'input, and the checkpoint when one exists (then commit without calling the model). Jobs '
  'found stale on the way are superseded or stopped. The claim counts only once start_attempt '
  'opens its model call.';

create function memory.extend_lease(p_workspace_id text, p_job_id bigint, p_token text)
  returns timestamptz
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_until timestamptz := memory_private.clock_now() + (memory_private.policy()).lease;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  update memory_private.jobs
     set lease_expires_at = v_until, updated_at = memory_private.clock_now()
   where workspace_id = v_job.workspace_id and job_id = v_job.job_id;
  return v_until;
end
$$;
comment on function memory.extend_lease(text, bigint, text) is
  'Extends the lease of a job the caller holds to two minutes from now and returns the new '
  'expiry; MB020 when the token is not current or the lease already expired.';

create function memory.start_attempt(
  p_workspace_id text, p_job_id bigint, p_token text, p_reserve_usd numeric
) returns integer
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_request_left numeric;
  v_workspace_left numeric;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  perform memory_private.check_money('reserve_usd', p_reserve_usd);
  if v_job.checkpoint is not null then
    raise exception 'job % already has a checkpoint: commit it without calling the model',
      p_job_id using errcode = 'MB025';
  end if;
  if exists (select 1 from memory_private.job_attempts
              where workspace_id = p_workspace_id and job_id = p_job_id
                and (token = v_job.token or outcome = 'open')) then
    raise exception 'job % already made its attempt for this claim', p_job_id
      using errcode = 'MB025', hint = 'One model call per claim; report its outcome instead.';
  end if;
  if v_job.claims >= (memory_private.policy()).max_claims then
    raise exception 'the input of job % has made its three model calls', p_job_id
      using errcode = 'MB025', hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  select budget_usd - spent_usd
         - memory_private.request_memory_spent(p_workspace_id, v_job.origin_request_id)
    into v_request_left
    from memory_private.requests
   where workspace_id = p_workspace_id and request_id = v_job.origin_request_id;
  if p_reserve_usd > v_request_left then
    raise exception 'a reserve of $% does not fit the $% left of request %', p_reserve_usd,
      greatest(v_request_left, 0), v_job.origin_request_id using errcode = 'MB024',
      hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  select w.budget_usd - w.spent_usd - m.memory_spent_usd into v_workspace_left
    from memory_private.workspaces w
    join memory_private.workspace_memory m on m.workspace_id = w.workspace_id
   where w.workspace_id = p_workspace_id;
  if p_reserve_usd > v_workspace_left then
    raise exception 'a reserve of $% does not fit the $% left of workspace %', p_reserve_usd,
      greatest(v_workspace_left, 0), p_workspace_id using errcode = 'MB024',
      hint = 'No model call is made; report fail_job(..., ''failed'', ...).';
  end if;
  -- This claim can reach the provider now: it counts against the input's three calls.
  update memory_private.jobs set claims = claims + 1, updated_at = memory_private.clock_now()
   where workspace_id = p_workspace_id and job_id = p_job_id;
  insert into memory_private.job_attempts
    (workspace_id, job_id, attempt_no, token, reserved_usd, started_at)
  values (p_workspace_id, p_job_id, v_job.claims + 1, v_job.token, p_reserve_usd,
          memory_private.clock_now());
  return v_job.claims + 1;
end
$$;
comment on function memory.start_attempt(text, bigint, text, numeric) is
  'Opens the model call of the current claim after checking that the input has a call left (at '
  'most three per unchanged input, MB025) and that the reserved dollars fit both the '
  'originating request''s remaining budget (budget - spent - memory charges) and the '
  'workspace''s; MB024 otherwise, before any call is made (P17). Only here does a claim count. '
  'Returns the attempt number (the input''s call number, 1 to 3).';

create function memory.save_checkpoint(
  p_workspace_id text, p_job_id bigint, p_token text, p_output jsonb, p_usage jsonb
) returns void
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_attempt memory_private.job_attempts;
  v_usage jsonb;
  v_output jsonb;
  v_reason text;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  select * into v_attempt from memory_private.job_attempts
   where workspace_id = p_workspace_id and job_id = p_job_id and token = v_job.token
     and outcome = 'open';
  if not found then
    raise exception 'job % has no open attempt for this claim', p_job_id
      using errcode = 'MB025', hint = 'Call memory.start_attempt before the model call.';
  end if;
  v_usage := memory_private.check_usage(p_usage);
  v_output := memory_private.validate_output(v_job, p_output);
  -- An output made from an input that changed meanwhile (a source removed, edited, expired or
  -- forgotten) could never be committed, and it may carry the text that went: store nothing.
  v_reason := memory_private.job_stale_reason(v_job);
  if v_reason is not null then
    raise exception 'the input of job % changed: %', p_job_id, v_reason using errcode = 'MB021',
      hint = 'Report the attempt with fail_job(..., ''failed'', error, usage); maintenance '
             'supersedes the job.';
  end if;
  perform memory_private.close_attempt(v_job, 'ok', v_usage, null);
  update memory_private.jobs
     set checkpoint = jsonb_build_object('output', v_output, 'usage', v_usage),
         updated_at = memory_private.clock_now()
   where workspace_id = p_workspace_id and job_id = p_job_id;
end
$$;
comment on function memory.save_checkpoint(text, bigint, text, jsonb, jsonb) is
  'Stores the model output of the open attempt as the job''s checkpoint, separate from the '
  'transcript (P19): validated (MB023) and redacted, with its usage (every value known); closes '
  'the attempt as ok and charges the originating request the reported cost, at most the '
  'attempt''s reserve. An invalid output (MB023) or an input that changed since the claim '
  '(MB021: the output could never be committed and may carry the text that changed) changes '
  'nothing: report it with fail_job(..., ''failed'', code, usage).';

create function memory_private.passages(p_text text) returns text[]
  language sql immutable strict parallel safe
  set search_path = pg_catalog, pg_temp
  as $$
  -- Words are runs of letters and digits; a Chinese, Japanese or Korean character is a word of
  -- its own (those scripts do not separate words with spaces). They are spaced apart first: a
  -- regular expression takes the longest match, so a run of them would otherwise be one word.
  -- One pass with a window over the words (linear in the text).
  select coalesce(array_agg(distinct x.p), '{}')
    from (select concat_ws(' ', w.t, lead(w.t, 1) over o, lead(w.t, 2) over o,
                           lead(w.t, 3) over o, lead(w.t, 4) over o, lead(w.t, 5) over o,
                           lead(w.t, 6) over o, lead(w.t, 7) over o) as p,
                 lead(w.t, 7) over o as eighth
            from (select m.t[1] as t, m.n
                    from regexp_matches(
                           regexp_replace(lower(p_text), '([぀-ヿ㐀-䶿一-鿿가-힯豈-﫿])',
                                          ' \1 ', 'g'),
                           '[぀-ヿ㐀-䶿一-鿿가-힯豈-﫿]|[[:alnum:]]+', 'g')
                         with ordinality as m(t, n)) w
          window o as (order by w.n)) x
   where x.eighth is not null
$$;
comment on function memory_private.passages(text) is
  'Every run of eight consecutive words of a text (lower case; a CJK character counts as a '
  'word): what commit_job compares to find a summary that repeats an uncited message.';

create function memory_private.repeated_sources(
  p_job memory_private.jobs, p_summary text, p_cited text[]
) returns table (message_id text, content_hash text)
  language plpgsql stable
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_said text[];
begin
  -- Defence in depth for provenance: a model may lean on a batch message without citing it. A
  -- summary that repeats eight consecutive words of an uncited message depends on that message
  -- too. Paraphrase passes unseen; docs/retention.md says what this trades. Nothing to compare
  -- when the output cites the whole batch or the summary is shorter than eight words.
  if not exists (select 1 from jsonb_array_elements(p_job.input -> 'sources') s
                  where s ->> 'id' <> all (p_cited)) then
    return;
  end if;
  v_said := memory_private.passages(p_summary);
  if cardinality(v_said) = 0 then
    return;
  end if;
  return query
    with said as (
      select unnest(v_said) as p
    ), uncited as (
      select s.id, s.hash, m.body
        from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
        join memory_private.messages m
          on m.workspace_id = p_job.workspace_id and m.message_id = s.id
       where s.id <> all (p_cited) and m.content_hash = s.hash
    )
    select distinct u.id, u.hash
      from uncited u
     cross join lateral unnest(memory_private.passages(u.body)) as q(p)
      join said on said.p = q.p;
end
$$;
comment on function memory_private.repeated_sources(memory_private.jobs, text, text[]) is
  'The uncited messages of an extraction batch whose words the summary repeats (eight '
  'consecutive words, memory_private.passages), with the hash the job saw: commit_job adds them '
  'to the record''s dependencies (via = repeated).';

create function memory_private.write_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_cited text[] := array(select jsonb_array_elements_text(p_output -> 'source_ids'));
  v_reused bigint[] := array(select jsonb_array_elements_text(p_output -> 'reused_ids')::bigint);
  v_dep_ids text[];
  v_dep_hashes text[];
  v_dep_via text[];
  v_record_id bigint;
begin
  -- The dependencies: the cited messages at the hash the job saw, every dependency of the
  -- memories the output declared it reused (P5: existing memory accompanies the batch; what it
  -- rests on stays tracked without resending it), and uncited messages the summary repeats.
  -- A message that counts twice is kept once, under its first reason in that order.
  select array_agg(d.message_id order by d.message_id),
         array_agg(d.content_hash order by d.message_id),
         array_agg(d.via order by d.message_id)
    into v_dep_ids, v_dep_hashes, v_dep_via
    from (select distinct on (u.message_id) u.message_id, u.content_hash, u.via
            from (select s.id as message_id, s.hash as content_hash, 'cited' as via, 1 as rank
                    from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
                   where s.id = any (v_cited)
                  union all
                  select rd.message_id, rd.content_hash, 'reused', 2
                    from memory_private.record_dependencies rd
                   where rd.workspace_id = p_job.workspace_id and rd.record_id = any (v_reused)
                  union all
                  select r.message_id, r.content_hash, 'repeated', 3
                    from memory_private.repeated_sources(p_job, p_output ->> 'summary', v_cited) r
                 ) u
           order by u.message_id, u.rank) d;

  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  select p_job.workspace_id, p_job.scope_id, 'extracted', p_output ->> 'title',
         p_output ->> 'summary',
         -- Statements are attributed to the people whose messages the record rests on (V9);
         -- grants follow every repository those messages drew on (V6).
         coalesce(array_agg(distinct m.speaker_id order by m.speaker_id)
                    filter (where m.role = 'user'), '{}'),
         coalesce(array_agg(distinct q.thread_id order by q.thread_id), '{}'),
         coalesce(array(select distinct x from memory_private.messages mm,
                                              unnest(mm.repositories) as x
                         where mm.workspace_id = p_job.workspace_id
                           and mm.message_id = any (v_dep_ids) order by 1), '{}'),
         p_job.input ->> 'bot_identity', p_job.origin_request_id, v_now
    from memory_private.messages m
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where m.workspace_id = p_job.workspace_id and m.message_id = any (v_dep_ids)
  returning record_id into v_record_id;
  insert into memory_private.record_sources (workspace_id, record_id, message_id, position)
  select p_job.workspace_id, v_record_id, c.id, c.n::integer
    from unnest(v_cited) with ordinality as c(id, n);
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via)
  select p_job.workspace_id, v_record_id, d.id, d.hash, d.via
    from unnest(v_dep_ids, v_dep_hashes, v_dep_via) as d(id, hash, via);
  perform memory_private.mark_consolidation_due(p_job.workspace_id, p_job.scope_id);
  return jsonb_build_object('record_id', v_record_id,
                            'sources', cardinality(v_cited),
                            'dependencies', cardinality(v_dep_ids),
                            'repeated', (select count(*) from unnest(v_dep_via) v
                                          where v = 'repeated'));
end
$$;
comment on function memory_private.write_extraction(memory_private.jobs, jsonb) is
  'Writes the record of a validated, non-empty extraction output: its sources (the cited '
  'messages in the order given), its dependencies (cited, reused, repeated) with the hashes '
  'the job saw, speakers, threads and repositories taken from the dependencies; marks the '
  'scope due for consolidation. Returns the record id and the counts.';

create function memory_private.write_index(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_ids bigint[] := array(select jsonb_array_elements_text(p_output -> 'record_ids')::bigint);
  v_candidates bigint[] := array(select x::bigint
                                   from jsonb_array_elements_text(p_job.input -> 'candidates') x);
  v_still_due boolean;
begin
  -- A record made after the snapshot changes the candidates: the index is still written, and
  -- the scope stays due for another consolidation.
  v_still_due := array(select x from unnest(memory_private.recent_valid_records(
                                p_job.workspace_id, p_job.scope_id, (memory_private.policy()).candidates)) x
                      order by x)
                 <> array(select x from unnest(v_candidates) x order by x);
  -- The index text may speak of any candidate the model saw: it depends on all of them.
  update memory_private.scopes
     set index_text = p_output ->> 'index', index_record_ids = v_ids,
         index_candidate_ids = v_candidates, index_built_at = v_now,
         consolidation_due_at = case when v_still_due
                                     then coalesce(consolidation_due_at, v_now) end
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id;
  return jsonb_build_object('index_record_ids', to_jsonb(v_ids),
                            'index_candidates', cardinality(v_candidates),
                            'consolidation_still_due', v_still_due);
end
$$;
comment on function memory_private.write_index(memory_private.jobs, jsonb) is
  'Writes a validated consolidation output as the scope index, with every candidate the model '
  'saw as its dependencies (index_candidate_ids); the scope stays due when its valid records '
  'changed since the snapshot.';

create function memory.commit_job(p_workspace_id text, p_job_id bigint, p_token text)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
  v_output jsonb;
  v_now timestamptz := memory_private.clock_now();
  v_result jsonb;
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id;
  if v_job.config_version <> v_config then
    raise exception 'the model/provider configuration of workspace % changed (version % -> %)',
      p_workspace_id, v_job.config_version, v_config using errcode = 'MB022',
      hint = 'Drop the work: maintenance stops the job.';
  end if;
  v_reason := memory_private.job_stale_reason(v_job);
  if v_reason is not null then
    raise exception 'the input of job % changed: %', p_job_id, v_reason using errcode = 'MB021',
      hint = 'Drop the work: maintenance supersedes the job and schedules a fresh snapshot.';
  end if;
  if v_job.checkpoint is null then
    raise exception 'job % has no checkpoint to commit', p_job_id using errcode = 'MB025',
      hint = 'Call memory.save_checkpoint with the model output first.';
  end if;
  v_output := memory_private.validate_output(v_job, v_job.checkpoint -> 'output');

  if v_job.phase = 'extract' then
    v_result := jsonb_build_object('record_id', null);
    if v_output ->> 'title' <> '' then
      v_result := memory_private.write_extraction(v_job, v_output);
    end if;
    -- The batch is handled at these hashes, also by an empty (no-op) output.
    insert into memory_private.extracted_sources
      (workspace_id, scope_id, message_id, content_hash, outcome, job_id, created_at)
    select p_workspace_id, v_job.scope_id, s.id, s.hash, 'extracted', v_job.job_id, v_now
      from jsonb_to_recordset(v_job.input -> 'sources') as s(id text, hash text)
    on conflict do nothing;
    v_result := v_result || jsonb_build_object('status', 'committed', 'phase', 'extract',
                                               'noop', v_result ->> 'record_id' is null);
  else
    v_result := memory_private.write_index(v_job, v_output)
                || jsonb_build_object('status', 'committed', 'phase', 'consolidate');
  end if;

  update memory_private.jobs
     set status = 'succeeded', token = null, worker_id = null, lease_expires_at = null,
         checkpoint = null, result = v_result, finished_at = v_now, updated_at = v_now
   where workspace_id = p_workspace_id and job_id = p_job_id;
  return v_result || jsonb_build_object('job_id', p_job_id);
end
$$;
comment on function memory.commit_job(text, bigint, text) is
  'Writes a job''s checkpointed output and marks the job succeeded, after re-checking '
  'ownership (MB020), the config version (MB022) and that the input snapshot is still current '
  '(MB021). extract: one record whose sources are the cited messages and whose dependencies '
  'are what it was made from (cited, reused, repeated), the batch marked extracted, the scope '
  'due for consolidation; an empty output only marks the batch. consolidate: the scope index, '
  'depending on every candidate. All or nothing.';

create function memory.fail_job(
  p_workspace_id text, p_job_id bigint, p_token text, p_outcome text, p_error text,
  p_usage jsonb default null
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_job memory_private.jobs;
  v_open boolean;
  v_usage jsonb;
  v_now timestamptz := memory_private.clock_now();
begin
  v_job := memory_private.owned_job(p_workspace_id, p_job_id, p_token);
  if p_outcome is null or p_outcome not in ('failed', 'unknown') then
    raise exception 'outcome must be failed or unknown' using errcode = 'MB001';
  end if;
  -- A code, never text: what a worker would write here can carry the model's output.
  if p_error is null
     or not exists (select 1 from memory_private.failure_codes() c where c.code = p_error) then
    raise exception 'error must be a failure code (see docs/errors.md), not a message'
      using errcode = 'MB001',
      hint = 'e.g. provider_error, reply_not_json, reply_invalid, output_refused, worker_error.';
  end if;
  if p_usage is not null then
    v_usage := memory_private.check_usage(p_usage, false);
  end if;
  v_open := exists (select 1 from memory_private.job_attempts
                     where workspace_id = p_workspace_id and job_id = p_job_id
                       and outcome = 'open');
  if not v_open and p_outcome = 'unknown' then
    raise exception 'job % has no open model call whose outcome could be unknown', p_job_id
      using errcode = 'MB025', hint = 'Report failed instead.';
  end if;
  if not v_open and v_usage is not null then
    raise exception 'job % has no open model call to charge the usage to', p_job_id
      using errcode = 'MB025';
  end if;

  if p_outcome = 'unknown' then
    perform memory_private.close_attempt(v_job, 'unknown', v_usage, p_error);
    perform memory_private.release_job(v_job, 'stopped',
      'outcome unknown, not replayed: ' || p_error);
    return jsonb_build_object('job_id', p_job_id, 'status', 'stopped',
                              'why', 'unknown_outcome');
  end if;

  perform memory_private.close_attempt(v_job, 'failed', v_usage, p_error);
  -- A paid, valid checkpoint is never dropped: the job waits with it and commits it later.
  if v_job.checkpoint is null and v_job.claims >= (memory_private.policy()).max_claims then
    perform memory_private.release_job(v_job, 'stopped',
      'failed on its third model call, not replayed: ' || p_error);
    return jsonb_build_object('job_id', p_job_id, 'status', 'stopped', 'why', 'third_claim');
  end if;
  perform memory_private.release_job(v_job, 'pending', p_error,
                                     v_now + (memory_private.policy()).failure_backoff);
  return jsonb_build_object('job_id', p_job_id, 'status', 'pending',
                            'next_attempt_at', v_now + (memory_private.policy()).failure_backoff);
end
$$;
comment on function memory.fail_job(text, bigint, text, text, text, jsonb) is
  'Reports that the current claim failed, with a failure code (memory_private.failure_codes; '
  'MB001 for anything else, so no text reaches storage) and the usage the worker could read '
  '(null values for what it could not). failed: the open attempt (if any) closes as failed and '
  'is charged (the reported cost, at most the reserve; the reserve when the cost could not be '
  'read; nothing without usage), and the job backs off one hour, or stops after the input''s '
  'third model call; a job holding a checkpoint keeps it and stays pending. unknown: the '
  'provider may have run, so the open attempt is charged at its reserve and the job stops '
  'without automatic replay (P13). Answers the job''s new status: {"status": "pending", '
  '"next_attempt_at"} or {"status": "stopped", "why": "unknown_outcome" | "third_claim"}.';

revoke all on function
  memory.claim_job(text),
  memory.extend_lease(text, bigint, text),
  memory.start_attempt(text, bigint, text, numeric),
  memory.save_checkpoint(text, bigint, text, jsonb, jsonb),
  memory.commit_job(text, bigint, text),
  memory.fail_job(text, bigint, text, text, text, jsonb)
from public;
grant execute on function
  memory.claim_job(text),
  memory.extend_lease(text, bigint, text),
  memory.start_attempt(text, bigint, text, numeric),
  memory.save_checkpoint(text, bigint, text, jsonb, jsonb),
  memory.commit_job(text, bigint, text),
  memory.fail_job(text, bigint, text, text, text, jsonb)
to memory_worker;
