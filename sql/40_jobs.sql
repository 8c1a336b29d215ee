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
-- Claims are counted per unchanged input (graphile/worker's attempts keyed by the job's input):
-- start_attempt counts the model call. A claim that ends before it counts too when the worker
-- broke on the job (fail_job worker_error, or no report at all: the lease expired), so a job
-- whose content kills every worker stops after three claims; a refusal before any model call
-- (budget_exceeded, not_priced) and a checkpoint commit cost nothing. A
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
  claims integer not null default 0 check (claims between 0 and memory_private.policy_limit('max_claims')),
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
  'The claims this input has used: those that reached start_attempt (a model call), and those '
  'the worker broke on before it (fail_job worker_error, or a lease that expired with no '
  'report); a refusal before the call (budget_exceeded, not_priced) does not count. Carried over '
  'from a superseded job of the same input and config version. At most 3; the third failed or '
  'lost claim stops the job.';
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

create function memory_private.job_source_keys(p_workspace_id text, p_input jsonb)
  returns text[]
  language plpgsql immutable parallel safe
  as $$
begin
  return memory_private.message_keys(
           p_workspace_id,
           array(select e ->> 'id' from jsonb_array_elements(p_input -> 'sources') as e));
end
$$;
comment on function memory_private.job_source_keys(text, jsonb) is
  'The keys (memory_private.message_keys) of the messages an extraction job''s input names; '
  'none for a consolidation.';

-- The jobs whose input names a message, read when it is erased (60_retention: its hash goes
-- from every job that kept it): what changed, not every job the workspace ever had. Without a
-- pending list (fastupdate off), which every search would read whole.
create index jobs_sources_idx on memory_private.jobs
  using gin (memory_private.job_source_keys(workspace_id, input)) with (fastupdate = off);

-- A job's model calls: an input makes at most max_claims (P13). Asked here only.
create function memory_private.calls_left(p_claims integer) returns integer
  language sql immutable parallel safe
  as $$ select (memory_private.policy()).max_claims - p_claims $$;
comment on function memory_private.calls_left(integer) is
  'The model calls an input that has used p_claims claims may still make (P13: three per '
  'unchanged input); 0 or less: none.';

create function memory_private.job_claimable(p_claims integer, p_checkpoint jsonb)
  returns boolean
  language sql immutable parallel safe
  as $$ select memory_private.calls_left(p_claims) > 0 or p_checkpoint is not null $$;
comment on function memory_private.job_claimable(integer, jsonb) is
  'Whether a pending job may be claimed once due: its input has a model call left, or it holds '
  'a checkpoint (whose commit makes none). The claim (memory.claim_job) and the scheduling '
  'verdict ask it here.';

create table memory_private.job_attempts (
  workspace_id text not null,
  job_id bigint not null,
  attempt_no integer not null check (attempt_no between 1 and memory_private.policy_limit('max_claims')),
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
  language plpgsql stable
  as $$
begin
  return (
    select coalesce(sum(c.cost_usd), 0) from memory_private.request_charges c
     where c.workspace_id = p_workspace_id and c.request_id = p_request_id
  );
end
$$;
comment on function memory_private.request_memory_spent(text, text) is
  'What memory jobs charged to a request: the sum of its request_charges. Derived, not stored '
  'on the request row, so charging never updates a row the backend upserts (P16); exact, since '
  'every charge is made under the workspace''s memory lock.';

create function memory_private.budget_left(p_workspace_id text, p_request_id text)
  returns table (request_left numeric, workspace_left numeric)
  language sql stable
  as $$
  -- What a model call may still spend (P17): the request's budget less what the backend spent
  -- and what memory work charged to it; the workspace's likewise.
  select (select q.budget_usd - q.spent_usd
                 - memory_private.request_memory_spent(q.workspace_id, q.request_id)
            from memory_private.requests q
           where q.workspace_id = p_workspace_id and q.request_id = p_request_id),
         (select w.budget_usd - w.spent_usd - m.memory_spent_usd
            from memory_private.workspaces w
            join memory_private.workspace_memory m on m.workspace_id = w.workspace_id
           where w.workspace_id = p_workspace_id)
$$;
comment on function memory_private.budget_left(text, text) is
  'The dollars left (P17): of the request (budget - spent - memory charges; NULL without '
  'p_request_id) and of the workspace (budget - spent - memory spend). What a reserve must fit '
  '(start_attempt), what a claim shows (job_payload), what waits for budget (the scheduling '
  'verdict) and what the operator sees.';

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

-- Where memory work may happen, and why work waits ------------------------------------------
-- The scheduling verdict (45_scheduling.sql: memory_private.extraction_verdict) gives every
-- conversation not yet extracted the first reason it waits, in the order of this table, or none
-- (the next tick schedules it); memory.waiting_status counts them. The first three are the
-- scope gate's (memory_private.scope_gate), which the scheduler, the claim's staleness check
-- and the verdict all ask.

create table memory_private.waiting_reasons (
  reason text primary key,
  rank integer not null unique,
  explanation text not null
);
comment on table memory_private.waiting_reasons is
  'Why a conversation not yet extracted waits, in the order the scheduling verdict tries them '
  '(the first that holds is the answer), each with what it means; awaiting_maintenance is the '
  'verdict''s none: the next tick schedules it. Not per workspace.';

insert into memory_private.waiting_reasons (reason, rank, explanation) values
  ('workspace_paused', 1, 'the workspace is paused (memory.set_workspace_paused resumes it)'),
  ('recall_off', 2, 'memory is turned off in the scope (recall disabled by a user or admin)'),
  ('bot_inactive', 3, 'the bot is inactive'),
  ('request_not_finished', 4, 'the request is not finished: it waits until the backend '
                              'reports it succeeded (upsert_request, finish_request)'),
  ('request_failed', 5, 'the request failed: only succeeded requests become memories'),
  ('no_user_message', 6, 'the conversation has no user message'),
  ('no_assistant_message', 7, 'the conversation has no assistant message: the backend reports '
                              'the bot''s answer (upsert_message, role assistant)'),
  ('idle_window', 8, 'the workspace''s idle window has not passed since the conversation''s '
                     'last activity (next_change_at); that tick schedules it'),
  ('job_running', 9, 'a worker is extracting it now'),
  ('no_budget', 10, 'its extraction job waits for budget: the request''s or the workspace''s is '
                    'spent'),
  ('not_priced', 11, 'its extraction job waits: the worker cannot price the pinned model'),
  ('job_backoff', 12, 'its extraction job failed and backs off until next_change_at'),
  ('job_due', 13, 'its extraction job is due: it waits for a worker'),
  ('next_batch', 14, 'the scope''s open job, or the batch the next one takes (the newest '
                     'conversations up to the batch''s bytes and messages), does not hold it: it '
                     'goes into a later batch once that job ends'),
  ('job_stopped', 15, 'its batch''s input stopped (an unknown outcome, or its model calls used '
                      'up) and is not replayed (memory.job_status, memory.retry_job)'),
  ('awaiting_maintenance', 16, 'none: it qualifies, and the next maintenance tick schedules its '
                               'extraction (or records it skipped, too large for any batch)');

create function memory_private.scope_gate(p_workspace_id text, p_scope_id bigint)
  returns table (reason text, recall_enabled boolean, bot_identity text)
  language sql stable
  as $$
  -- Inlined (no SET clause). The first gate that is closed, in the order of waiting_reasons.
  select (select r.reason from memory_private.waiting_reasons r
           where (r.reason = 'workspace_paused' and w.paused)
              or (r.reason = 'recall_off' and not s.recall_enabled)
              or (r.reason = 'bot_inactive' and b.identity is null)
           order by r.rank limit 1),
         s.recall_enabled, b.identity
    from memory_private.scopes s
    join memory_private.workspaces w on w.workspace_id = s.workspace_id
    left join memory_private.bots b
      on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id and b.active
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id
$$;
comment on function memory_private.scope_gate(text, bigint) is
  'Whether memory work may happen in a scope now: the first closed gate (workspace_paused, '
  'recall_off, bot_inactive) or NULL, with the scope''s recall switch and the identity of its '
  'bot while active (NULL when inactive). A job is stale when recall is off or the identity is '
  'not its input''s (job_stale_reason); nothing is scheduled while a gate is closed.';

-- State transitions -------------------------------------------------------------------------

create function memory_private.jobs_check_transition() returns trigger
  language plpgsql
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

create function memory_private.jobs_note_finished_run() returns trigger
  language plpgsql
  as $$
begin
  -- What a run ends with is maintenance's to follow up: a commit's records call for a
  -- consolidation, a scope whose job was running may have newer input to schedule.
  perform memory_private.note_change(new.workspace_id, 'updated', null, new.scope_id);
  return null;
end
$$;
comment on function memory_private.jobs_note_finished_run() is
  'Trigger: a job leaving running (committed, failed, stopped, released) makes its workspace '
  'due for maintenance (memory_private.maintenance_due).';

create trigger jobs_note_finished_run after update of status on memory_private.jobs
  for each row when (old.status = 'running' and new.status <> 'running')
  execute function memory_private.jobs_note_finished_run();

-- Helpers -----------------------------------------------------------------------------------

create function memory_private.check_token(p_token text) returns uuid
  language plpgsql immutable
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

create function memory_private.mark_consolidation_due(p_workspace_id text, p_scope_id bigint)
  returns void
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
begin
  update memory_private.scopes
     set consolidation_due_at = coalesce(consolidation_due_at, v_now)
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
end
$$;
comment on function memory_private.mark_consolidation_due(text, bigint) is
  'Marks a scope''s index as out of date (a new record, a note, a prune, a forget): the next '
  'maintenance schedules a consolidation (P10). Keeps the earliest due time.';

create function memory_private.job_stale_reason(p_job memory_private.jobs) returns text
  language plpgsql stable
  as $$
declare
  v_gate record;
  v_reason text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The scope gate, but for the pause: a paused workspace's jobs wait, they are not stale.
  select * into v_gate from memory_private.scope_gate(p_job.workspace_id, p_job.scope_id);
  if not v_gate.recall_enabled then
    return 'recall is disabled in the scope';
  end if;
  if v_gate.bot_identity is distinct from p_job.input ->> 'bot_identity' then
    return 'the bot was replaced or deactivated';
  end if;

  if p_job.phase = 'extract' then
    -- Each source of the batch must be current at the hash the snapshot took (the rule's
    -- memory_private.dependency_state).
    select format('source %s %s', x.id,
             case when x.state = 'source_removed' then 'was removed'
                  when x.state = 'source_expired' then 'is past its retention'
                  when x.state = 'source_edited' then 'was edited'
                  else 'was forgotten' end)
      into v_reason
      from (select s.id, memory_private.dependency_state(
                           m.removed_at, m.body is not null, m.retain_until, m.content_hash,
                           s.hash,
                           exists (select from memory_private.tombstone(
                                                 p_job.workspace_id, p_job.scope_id, s.id)),
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

create function memory_private.owned_job(
  p_workspace_id text, p_job_id bigint, p_token text
) returns memory_private.jobs
  language plpgsql volatile
  as $$
declare
  v_job memory_private.jobs;
  v_token uuid;
  v_config integer;
begin
  -- The memory lock first (memory_private.lock_workspace's statement): a known workspace always
  -- has the row it locks, so the workspace's checks run only when it finds none, and raise
  -- there what they would have raised first.
  perform 1 from memory_private.workspace_memory where workspace_id = p_workspace_id
     for no key update;
  if not found then
    perform memory_private.require_workspace(p_workspace_id);
    perform memory_private.lock_workspace(p_workspace_id);
  end if;
  if p_job_id is null then
    raise exception 'job_id is required' using errcode = 'MB001';
  end if;
  v_token := memory_private.check_token(p_token);
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
          -- searched CASE: Citus deparses a simple one (CASE x WHEN) into text = boolean
          case when p_job.phase = 'extract' then 'memory_extract' else 'memory_consolidate' end,
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
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
begin
  update memory_private.jobs
     set status = p_status, worker_id = null, lease_expires_at = null,
         last_error = coalesce(left(p_error, (memory_private.policy()).error_chars), last_error),
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
    -- The open jobs alone, read from their partial index (jobs_one_open_per_scope_phase): a
    -- workspace's finished and stopped jobs are history a tick does not read. (No OR of the
    -- two statuses: a plan would read each from its own partial index, the pending ones from
    -- the claimable jobs' index, by due time, whose every entry it would then walk.)
    select j.* from memory_private.jobs j
     where j.workspace_id = p_workspace_id and j.status in ('pending', 'running')
       and not (j.status = 'running'
                and exists (select 1 from memory_private.job_attempts a
                             where a.workspace_id = p_workspace_id and a.job_id = j.job_id
                               and a.outcome = 'open'))
     order by j.job_id
       for update
  loop
    if v_job.config_version <> v_config then
      perform memory_private.release_job(v_job, 'stopped',
        format('the model/provider configuration changed (version %s -> %s)',
               v_job.config_version, v_config));
      v_stopped := v_stopped + 1;
    else
      v_reason := memory_private.job_stale_reason(v_job);
      continue when v_reason is null;
      perform memory_private.release_job(v_job, 'superseded', 'input changed: ' || v_reason);
      v_superseded := v_superseded + 1;
    end if;
    -- Its scope gets a new snapshot: noted for the tick (a job leaving running notes itself).
    if v_job.status = 'pending' then
      perform memory_private.note_change(p_workspace_id, 'updated', null, v_job.scope_id);
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
  as $$
declare
  v_job memory_private.jobs;
  v_expired integer := 0;
  v_unknown integer := 0;
  v_lost integer := 0;
  v_now timestamptz := memory_private.clock_now();  -- the coordinator's clock on Citus
begin
  for v_job in
    select * from memory_private.jobs
     where workspace_id = p_workspace_id and status = 'running'
       and lease_expires_at <= v_now
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
        'the lease expired after the checkpoint; the next claim commits it', v_now);
    elsif memory_private.calls_left(v_job.claims + 1) <= 0 then
      -- No report and no model call: the worker died or hung holding the job, perhaps on its
      -- content. That claim counts, so a job that kills every worker stops (issue 31).
      v_lost := v_lost + 1;
      update memory_private.jobs set claims = claims + memory_private.calls_left(claims)
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      perform memory_private.release_job(v_job, 'stopped', format(
        'the lease expired without a report on claim %s of %s (a worker died or hung holding '
        'the job, perhaps on its content): not replayed', v_job.claims, v_job.claims));
    else
      v_lost := v_lost + 1;
      update memory_private.jobs set claims = claims + 1
       where workspace_id = v_job.workspace_id and job_id = v_job.job_id
      returning * into v_job;
      perform memory_private.release_job(v_job, 'pending', format(
        'the lease expired without a report on claim %s of %s (the claim counts)',
        v_job.claims, v_job.claims + memory_private.calls_left(v_job.claims)), v_now);
    end if;
  end loop;
  return jsonb_build_object('leases_expired', v_expired, 'attempts_unknown', v_unknown,
                            'claims_lost', v_lost);
end
$$;
comment on function memory_private.expire_leases(text) is
  'Maintenance step: a running job whose lease passed is stopped when a model call was open '
  '(the attempt becomes unknown and is charged at its reserve; no automatic replay), goes back '
  'to pending due now with its checkpoint when it has one (committed by the next claim without '
  'a model call, even after the third call), and otherwise counts the lost claim (the worker '
  'died or hung holding it, perhaps on its content: claims_lost) and goes back to pending due '
  'now, or stops, not replayed, when that was the input''s third claim. Returns counts.';

