-- 0009_citus: the schema distributable on a Citus cluster (docs/scaling.md).
-- - memory_private.policy_limit(name): the tables' CHECK constraints and defaults read their
--   policy numbers through it, not as fields of policy()'s composite type, which Citus took for a
--   circular dependency of policy() and refused to distribute.
-- - SQL-language functions that write, or read with their arguments in a way Citus cannot plan
--   without values, are PL/pgSQL (Citus plans those with the arguments' values).
-- - The cross-workspace functions pick without locks and leave the claim or the tick to a
--   function of one workspace (claim_workspace_job, maintain_workspace_unless_busy), which
--   Citus runs on the node holding it: a multi-shard FOR UPDATE SKIP LOCKED does not exist.
-- - The operator views read one workspace at a time (memory_private.<view>_of), each on its node.
-- - memory_private.distribute() (85_distribution.sql): what `pimem migrate` calls on a Citus
--   coordinator.

create or replace function memory_private.policy_limit(p_name text) returns integer
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
create or replace function memory_private.sorted_set(p_values anyarray) returns anyarray
  language sql immutable parallel safe
  as $$ select array(select distinct x from unnest(p_values) as x order by 1) $$;
comment on function memory_private.sorted_set(anyarray) is
  'The distinct elements of an array, in order (what a tool call keeps of the ids it returned; '
  'a function, so that Citus sees no subquery in the upsert that writes it).';

alter table memory_private.workspaces
  alter column idle_window
    set default make_interval(mins => memory_private.policy_limit('default_idle_minutes')),
  drop constraint workspaces_idle_window_check,
  add constraint workspaces_idle_window_check
    check (idle_window >= interval '0'
           and idle_window <= make_interval(mins => memory_private.policy_limit('max_idle_minutes')));
alter table memory_private.job_attempts
  drop constraint job_attempts_attempt_no_check,
  add constraint job_attempts_attempt_no_check check (((attempt_no >= 1) and (attempt_no <= memory_private.policy_limit('max_claims'::text))));
alter table memory_private.jobs
  drop constraint jobs_claims_check,
  add constraint jobs_claims_check check (((claims >= 0) and (claims <= memory_private.policy_limit('max_claims'::text))));
alter table memory_private.messages
  drop constraint messages_body_check,
  add constraint messages_body_check check ((octet_length(body) <= memory_private.policy_limit('message_bytes'::text)));
alter table memory_private.records
  drop constraint records_summary_check,
  add constraint records_summary_check check (((octet_length(summary) >= 1) and (octet_length(summary) <= memory_private.policy_limit('summary_bytes'::text))));
alter table memory_private.records
  drop constraint records_title_check,
  add constraint records_title_check check (((octet_length(title) >= 1) and (octet_length(title) <= memory_private.policy_limit('title_bytes'::text))));
alter table memory_private.request_recall
  drop constraint request_recall_basis_record_ids_check,
  add constraint request_recall_basis_record_ids_check check ((cardinality(basis_record_ids) <= memory_private.policy_limit('candidates'::text)));
alter table memory_private.request_recall
  drop constraint request_recall_index_text_check,
  add constraint request_recall_index_text_check check ((octet_length(index_text) <= memory_private.policy_limit('index_bytes'::text)));
alter table memory_private.request_recall
  drop constraint request_recall_record_ids_check,
  add constraint request_recall_record_ids_check check ((cardinality(record_ids) <= memory_private.policy_limit('index_ids'::text)));
alter table memory_private.scopes
  drop constraint scopes_index_candidate_ids_check,
  add constraint scopes_index_candidate_ids_check check ((cardinality(index_candidate_ids) <= memory_private.policy_limit('candidates'::text)));
alter table memory_private.scopes
  drop constraint scopes_index_record_ids_check,
  add constraint scopes_index_record_ids_check check ((cardinality(index_record_ids) <= memory_private.policy_limit('index_ids'::text)));
alter table memory_private.scopes
  drop constraint scopes_index_text_check,
  add constraint scopes_index_text_check check ((octet_length(index_text) <= memory_private.policy_limit('index_bytes'::text)));

create or replace function memory_private.advance_clock(p_by interval) returns timestamptz
  language plpgsql volatile
  as $$
begin
  update memory_private.clock set time_offset = time_offset + p_by;
  return memory_private.clock_now();
end
$$;
comment on function memory_private.advance_clock(interval) is
  'Moves the memory clock forward (tests only; granted to nobody).';

create or replace function memory_private.request_memory_spent(p_workspace_id text, p_request_id text)
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

create or replace function memory_private.with_dependencies(
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

create or replace function memory_private.forget_set(
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

create or replace function memory_private.mark_consolidation_due(p_workspace_id text, p_scope_id bigint)
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

create or replace function memory_private.index_records(
  p_workspace_id text, p_record_ids bigint[], p_lines boolean
) returns void
  language plpgsql volatile
  as $$
begin
  -- What the searches read of the given records, derived from their title and summary: the
  -- word search's document, the fuzzy search's words, the literal search's folded text and,
  -- with p_lines, the documents of the summary's lines.
  insert into memory_private.record_documents
    (workspace_id, record_id, scope_id, created_at, document)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         memory_private.search_document(r.title, r.summary)
    from memory_private.records r
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        document = excluded.document;
  insert into memory_private.record_texts
    (workspace_id, record_id, scope_id, created_at, search_text, grams)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         f.title || e'\n' || f.summary,
         memory_private.text_grams(f.title) | memory_private.text_grams(f.summary)
    from memory_private.records r
   cross join lateral (select memory_private.fold(r.title) as title,
                              memory_private.fold(r.summary) as summary) f
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        search_text = excluded.search_text, grams = excluded.grams;
  delete from memory_private.record_words
   where workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_words (workspace_id, scope_id, word, record_id)
  select d.workspace_id, d.scope_id, l.word, d.record_id
    from memory_private.record_documents d
   cross join lateral unnest(tsvector_to_array(d.document)) l(word)
   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids)
     and char_length(l.word) >= 3;
  delete from memory_private.record_lines
   where p_lines and workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_lines (workspace_id, record_id, line_no, document)
  select r.workspace_id, r.record_id, l.line_no, memory_private.text_document(l.line)
    from memory_private.records r
   cross join lateral memory_private.summary_lines(r.summary) l
   where p_lines and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids);
end
$$;
comment on function memory_private.index_records(text, bigint[], boolean) is
  'Writes what the searches read of the given records: their documents (record_documents) and '
  'words (record_words), their folded texts and three-character runs (record_texts) and, with p_lines, their lines'' '
  'documents (record_lines). The records trigger calls it for one record; a bulk load with '
  'triggers off calls it for all it loaded.';

create or replace function memory_private.erase_expired_messages(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_count integer;
begin
  update memory_private.messages
     set body = null, content_hash = null, scrub_pending = true
   where workspace_id = p_workspace_id and body is not null
     and retain_until <= memory_private.clock_now();
  get diagnostics v_count = row_count;
  return v_count;
end
$$;
comment on function memory_private.erase_expired_messages(text) is
  'Erases the text and hash of every message of the workspace past its retention (T6) and '
  'marks it for scrubbing.';

create or replace function memory_private.drop_stale_tombstones(p_workspace_id text) returns integer
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

create or replace function memory_private.input_carryover(
  p_workspace_id text, p_scope_id bigint, p_phase text, p_input_hash text,
  p_config_version integer,
  out blocked boolean, out claims integer, out next_attempt_at timestamptz
)
  language plpgsql stable
  as $$
  -- The most recent earlier job of the same input (scope, phase, input hash) under the same
  -- configuration decides: stopped (unknown outcome, three failed calls; an operator retry is a
  -- newer job) blocks the input (P13); superseded (a transient change: bot or recall off and on,
  -- a source edited and edited back) hands its model calls and its backoff on, so the count is
  -- per unchanged input whatever happened in between; anything else starts afresh.
begin
  select coalesce(bool_or(j.status = 'stopped'
                          or (j.status = 'superseded'
                              and j.claims >= (memory_private.policy()).max_claims)), false),
         coalesce(max(j.claims) filter (where j.status = 'superseded'), 0),
         greatest(memory_private.clock_now(),
                  max(j.next_attempt_at) filter (where j.status = 'superseded'))
    into blocked, claims, next_attempt_at
    from (select * from memory_private.jobs j
           where j.workspace_id = p_workspace_id and j.scope_id = p_scope_id
             and j.phase = p_phase and j.input_hash = p_input_hash
             and j.config_version = p_config_version and j.status <> 'skipped'
           order by j.job_id desc
           limit 1) j;
end
$$;
comment on function memory_private.input_carryover(text, bigint, text, text, integer) is
  'What an input (scope, phase, input hash, config version) carries into a new job from its '
  'most recent earlier job: blocked (it stopped, or was superseded after its three model '
  'calls), and otherwise the model calls already made and the backoff of a superseded job. '
  'This keeps "at most three model calls per unchanged input" across transient supersedes.';

create or replace function memory_private.create_job(
  p_workspace_id text, p_scope_id bigint, p_phase text, p_input jsonb, p_input_hash text,
  p_origin_request_id text, p_config_version integer, p_skipped_because text default null
) returns bigint
  language plpgsql volatile
  as $$
declare
  v_job_id bigint;
  v_now timestamptz := memory_private.clock_now();
begin
  insert into memory_private.jobs
    (workspace_id, scope_id, phase, status, input, input_hash, origin_request_id,
     model_provider, model_id, config_version, claims, next_attempt_at, last_error, created_at,
     updated_at, finished_at)
  select p_workspace_id, p_scope_id, p_phase,
         case when p_skipped_because is null then 'pending' else 'skipped' end, p_input,
         p_input_hash, r.request_id, r.model_provider, r.model_id, p_config_version, c.claims,
         c.next_attempt_at, p_skipped_because, v_now, v_now,
         case when p_skipped_because is not null then v_now end
    from memory_private.requests r
   cross join memory_private.input_carryover(p_workspace_id, p_scope_id, p_phase, p_input_hash,
                                             p_config_version) c
   where r.workspace_id = p_workspace_id and r.request_id = p_origin_request_id
  returning job_id into v_job_id;
  return v_job_id;
end
$$;
comment on function memory_private.create_job(text, bigint, text, jsonb, text, text, integer,
                                              text) is
  'Creates a pending job pinned to the originating request''s model/provider and the workspace '
  'configuration version it was made under (P17, P20), carrying over the model calls and '
  'backoff its input already had (memory_private.input_carryover): due now otherwise. The '
  'caller checks that the input is not blocked. With p_skipped_because, the job is recorded as '
  'skipped instead (a batch that cannot fit one user/assistant pair, P4), never claimed.';

create or replace function memory_private.copy_dependencies(p_workspace_ids text[], p_record_ids bigint[])
  returns void
  language plpgsql volatile
  as $$
declare
  v_ws text;
begin
  -- One workspace at a time: each update stays on the node holding the workspace (Citus).
  foreach v_ws in array array(select distinct w from unnest(p_workspace_ids) w) loop
    update memory_private.records r
       set dependency_ids = x.ids, dependency_hashes = x.hashes, source_ids = x.sources
      from (select k.workspace_id, k.record_id,
                   coalesce(array_agg(d.message_id order by d.message_id collate "C")
                              filter (where d.message_id is not null), '{}') as ids,
                   coalesce(array_agg(d.content_hash order by d.message_id collate "C")
                              filter (where d.message_id is not null), '{}') as hashes,
                   coalesce(array_agg(d.message_id order by d.position)
                              filter (where d.position is not null), '{}') as sources
              from (select distinct u.w, u.id
                      from unnest(p_workspace_ids, p_record_ids) as u(w, id)
                     where u.w = v_ws) as k(workspace_id, record_id)
              left join memory_private.record_dependencies d
                on d.workspace_id = v_ws and d.workspace_id = k.workspace_id
               and d.record_id = k.record_id
             group by k.workspace_id, k.record_id) x
     where r.workspace_id = v_ws and r.workspace_id = x.workspace_id
       and r.record_id = x.record_id
       and (r.dependency_ids, r.dependency_hashes, r.source_ids)
           is distinct from (x.ids, x.hashes, x.sources);
  end loop;
end
$$;
comment on function memory_private.copy_dependencies(text[], bigint[]) is
  'Sets the given records'' dependency_ids, dependency_hashes (in bytewise message id order) '
  'and source_ids (in source order) to what record_dependencies holds for them now.';

create or replace function memory_private.claim_workspace_job(p_workspace_id text, p_worker_id text)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_job memory_private.jobs;
  v_config integer;
  v_reason text;
begin
  -- The workspace's memory lock, without waiting: another claim or a memory write holds it
  -- briefly.
  if not memory_private.try_lock_workspace(p_workspace_id) then
    return null;
  end if;
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id and not paused;
  if not found then
    return null;
  end if;
  -- Re-read under the lock: a concurrent claim may have committed a running job meanwhile.
  if exists (select 1 from memory_private.jobs j
              where j.workspace_id = p_workspace_id and j.status = 'running') then
    return null;
  end if;
  loop
    select * into v_job from memory_private.jobs j
     where j.workspace_id = p_workspace_id and j.status = 'pending'
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
  return null;
end
$$;
comment on function memory_private.claim_workspace_job(text, text) is
  'Claims the next due job of one workspace under its memory lock (not waiting for it): NULL '
  'when the lock is busy, the workspace is paused, a job of it is running, or none is due. '
  'Jobs found stale on the way are superseded or stopped. memory.claim_job calls it for the '
  'workspaces it picks; on Citus the call runs on the node holding the workspace.';

create or replace function memory.claim_job(p_worker_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_ws text;
  v_payload jsonb;
begin
  perform memory_private.check_id('worker_id', p_worker_id);
  -- The pick reads the due jobs of every workspace (jobs_claimable_idx) without locking them:
  -- on Citus a multi-shard FOR UPDATE SKIP LOCKED does not exist, and the candidates may be
  -- stale by the time they are tried. A job with calls left is claimable, and so is one holding
  -- a checkpoint whatever its count: its claim only commits. The claim itself is one
  -- workspace's business (claim_workspace_job), which re-checks everything under the
  -- workspace's lock; the FROM form lets Citus run it on the workspace's node.
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
    select c into v_payload from memory_private.claim_workspace_job(v_ws, p_worker_id) c;
    if v_payload is not null then
      return v_payload;
    end if;
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

create or replace function memory.run_maintenance(p_workspace_id text default null) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
  v_total jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                      'leases_expired', 0);
  v_workspaces integer := 0;
begin
  if p_workspace_id is not null then
    perform memory_private.require_workspace(p_workspace_id);
  end if;
  for v_ws in
    select workspace_id from memory_private.workspaces
     where p_workspace_id is null or workspace_id = p_workspace_id
     order by workspace_id
  loop
    -- The FROM form: on Citus each workspace's tick runs on the node holding it.
    select memory_private.add_counts(v_total, m) into v_total
      from memory_private.maintain_workspace(v_ws) m;
    v_workspaces := v_workspaces + 1;
  end loop;
  return v_total || jsonb_build_object('workspaces', v_workspaces);
end
$$;
comment on function memory.run_maintenance(text) is
  'One maintenance tick for one workspace (or all when NULL, in one transaction: for small '
  'installs, tests and psql; the worker uses maintain_next_workspace so that no workspace lock '
  'is held longer than its own steps): expires leases, sweeps retention, retires jobs whose '
  'config or input changed, schedules extraction and consolidation jobs. Returns summed '
  'counts: extract_jobs_created, consolidate_jobs_created, leases_expired, batches_skipped, ...';

create or replace function memory_private.maintain_workspace_unless_busy(p_workspace_id text)
  returns jsonb
  language plpgsql volatile
  as $$
begin
  if not memory_private.try_lock_workspace(p_workspace_id) then
    return null;
  end if;
  return memory_private.maintain_workspace(p_workspace_id)
         || jsonb_build_object('workspace_id', p_workspace_id);
end
$$;
comment on function memory_private.maintain_workspace_unless_busy(text) is
  'One maintenance tick of the workspace with its workspace_id, or NULL without waiting when '
  'another transaction holds its memory lock (another worker maintaining it, a claim, a '
  'memory write).';

create or replace function memory.maintain_next_workspace(p_after_workspace_id text default null)
  returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
  v_result jsonb;
  v_after text := p_after_workspace_id;
begin
  -- The workspaces after p_after_workspace_id in id order, a batch at a time, read without
  -- locks (on Citus a multi-shard FOR UPDATE SKIP LOCKED does not exist); each is tried under
  -- its own lock, on its own node, and one that is busy is passed over.
  loop
    v_ws := null;
    for v_ws in
      select workspace_id from memory_private.workspaces
       where v_after is null or workspace_id > v_after
       order by workspace_id
       limit 16
    loop
      select m into v_result from memory_private.maintain_workspace_unless_busy(v_ws) m;
      if v_result is not null then
        return v_result;
      end if;
      v_after := v_ws;
    end loop;
    exit when v_ws is null;
  end loop;
  return null;
end
$$;
comment on function memory.maintain_next_workspace(text) is
  'Maintains the next workspace after p_after_workspace_id in id order (the first when NULL), '
  'skipping one another worker is maintaining right now, and answers its counts with its '
  'workspace_id; NULL when there is none left. The worker walks all workspaces with it, one '
  'short transaction each, so no lock is held across workspaces (P16).';

create or replace function memory_private.delete_records(
  p_workspace_id text, p_record_ids bigint[]
) returns integer
  language plpgsql volatile
  as $$
declare
  v_deleted integer;
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
    -- An index depends on every candidate it was built from: losing one drops it.
    update memory_private.scopes s
       set consolidation_due_at = coalesce(s.consolidation_due_at, v_now),
           index_text = case when s.index_candidate_ids && t.ids then null else s.index_text end,
           index_record_ids = case when s.index_candidate_ids && t.ids then null
                                   else s.index_record_ids end,
           index_candidate_ids = case when s.index_candidate_ids && t.ids then null
                                      else s.index_candidate_ids end,
           index_built_at = case when s.index_candidate_ids && t.ids then null
                                 else s.index_built_at end,
           index_bot_identity = case when s.index_candidate_ids && t.ids then null
                                     else s.index_bot_identity end,
           index_repositories = case when s.index_candidate_ids && t.ids then null
                                     else s.index_repositories end
      from touched t
     where s.workspace_id = p_workspace_id and s.scope_id = t.scope_id
    returning s.scope_id, s.index_text is null as dropped
  ), unkept as (
    delete from memory_private.index_dependencies d
     using marked
     where d.workspace_id = p_workspace_id and d.scope_id = marked.scope_id and marked.dropped
    returning 1
  )
  select count(*) into v_deleted from gone;
  return v_deleted;
end
$$;
comment on function memory_private.delete_records(text, bigint[]) is
  'Deletes records of one workspace (forget, retention, pruning): first copies their '
  'dependencies (ids) to the requests that were shown them, so those answers keep their '
  'provenance, and erases the frozen index texts built with them; then drops every scope index '
  'built with one of them and marks their scopes for consolidation. Returns how many records '
  'were deleted.';

create or replace function memory_private.retire_stale_jobs(p_workspace_id text) returns jsonb
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
    select j.* from memory_private.jobs j
     where j.workspace_id = p_workspace_id
       and (j.status = 'pending'
            or (j.status = 'running'
                and not exists (select 1 from memory_private.job_attempts a
                                 where a.workspace_id = p_workspace_id and a.job_id = j.job_id
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

create or replace function memory_private.records_add_usage_row() returns trigger
  language plpgsql
  as $$
declare
  v_new record;
begin
  -- A row at a time: on Citus a statement may not join the transition table with a
  -- distributed table (and a statement adds one record, or a few).
  for v_new in select n.workspace_id, n.record_id from added n loop
    insert into memory_private.record_usage (workspace_id, record_id, last_used_at, usage_count)
    values (v_new.workspace_id, v_new.record_id, null, 0)
    on conflict do nothing;
  end loop;
  return null;
end
$$;
comment on function memory_private.records_add_usage_row() is
  'Trigger: every new record gets its record_usage row (never used) in the same statement, so '
  'that query_memories counts a use by updating it and never touches the records table.';

create or replace function memory_private.recent_valid_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text default null,
  p_query text default null, p_record_id bigint default null
) returns bigint[]
  language plpgsql stable
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_size integer := p_limit;
  v_offset integer := 0;
  v_query text := memory_private.fold(p_query);
  v_grams bit(1024);
  v_scope_reason text;
  v_reader text;
  v_identity text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- Newest first, a page at a time (limit, then four times more); a page's records checked
  -- in one statement (record_failures: invalid_records' verdict, tests/test_validity_set.py)
  -- after the scope's checks (scope_reason), asked with the reader and the bot's identity. A
  -- scope whose newest records are valid costs one short index scan and one pass over just
  -- those, never a read of the whole scope. One snapshot throughout (stable).
  v_scope_reason := memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester);
  select s.user_id, b.identity into v_reader, v_identity
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id;
  v_reader := coalesce(v_reader, p_requester);
  if v_scope_reason is not null then
    return '{}';
  end if;
  if char_length(v_query) >= 3 then
    v_grams := memory_private.text_grams(v_query);
  end if;
  loop
    if v_query is null then
      v_chunk := array(
        select r.record_id from memory_private.records r
         where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
           and (p_record_id is null or r.record_id = p_record_id)
         order by r.created_at desc, r.record_id desc
         limit v_size offset v_offset);
    elsif v_grams is null then
      -- Too short for a three-character run (a two-character Chinese word): every folded text
      -- of the scope newest first (narrow rows).
      v_chunk := array(
        select t.record_id from memory_private.record_texts t
         where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
           and (p_record_id is null or t.record_id = p_record_id)
           and strpos(t.search_text, v_query) > 0
           and (strpos(v_query, e'\n') = 0
                or exists (select 1 from memory_private.records r
                            where r.workspace_id = t.workspace_id and r.record_id = t.record_id
                              and memory_private.within_a_part(r.title, r.summary, v_query)))
         order by t.created_at desc, t.record_id desc
         limit v_size offset v_offset);
    else
      -- The scope's grams newest first from the index alone; then, of the records holding
      -- every three-character run of the query, the record: the query as typed in its title or
      -- summary matches; else the folded text decides (search_text; a query holding a newline
      -- is re-checked in each part, within_a_part: across the title's end is no match).
      v_chunk := array(
        select g.record_id
          from (select g.record_id, g.created_at from memory_private.record_texts g
                 where g.workspace_id = p_workspace_id and g.scope_id = p_scope_id
                   and (p_record_id is null or g.record_id = p_record_id)
                   and g.grams & v_grams = v_grams
                 order by g.created_at desc, g.record_id desc
                 offset 0) g  -- kept apart: PostgreSQL 18 would merge it into a full read
          join memory_private.records r
            on r.workspace_id = p_workspace_id and r.record_id = g.record_id
         where strpos(r.title, v_query) > 0 or strpos(r.summary, v_query) > 0
            or exists (select 1 from memory_private.record_texts t
                        where t.workspace_id = r.workspace_id and t.record_id = r.record_id
                          and strpos(t.search_text, v_query) > 0
                          and memory_private.within_a_part(r.title, r.summary, v_query))
         order by g.created_at desc, g.record_id desc
         limit v_size offset v_offset);
    end if;
    v_valid := v_valid || array(
      select c.record_id
        from unnest(v_chunk) with ordinality as c(record_id, pos)
        join memory_private.records r
          on r.workspace_id = p_workspace_id and r.record_id = c.record_id
       where r.scope_id = p_scope_id
         and not exists (select 1 from memory_private.record_failures(
                           p_workspace_id, p_scope_id, v_identity, r.bot_identity,
                           r.dependency_ids, r.dependency_hashes, r.repositories, v_reader,
                           v_now))
       order by c.pos);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid[1:p_limit];
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Read a page at a time; the scope''s checks once, then each record of '
  'a page (memory_private.record_failures).';

create or replace function memory_private.recall_payload(
  p_frozen memory_private.request_recall, p_requester text, p_valid_ids bigint[] default null
) returns jsonb
  language plpgsql stable
  as $$
declare
  v_scope memory_private.scopes;
  v_valid bigint[] := p_valid_ids;
  v_records jsonb;
  v_shown integer;
  v_withdrawn boolean;
begin
  select * into strict v_scope from memory_private.scopes
   where workspace_id = p_frozen.workspace_id and scope_id = p_frozen.scope_id;
  -- Recall turned off since: nothing is read, whatever was frozen (C8).
  if p_frozen.mode = 'disabled' or not v_scope.recall_enabled then
    return jsonb_build_object('mode', 'disabled');
  end if;
  if p_frozen.mode = 'none' then
    return jsonb_build_object('mode', 'none');
  end if;
  -- Re-check every record the frozen content was made from against current facts (R3). The
  -- first call has just validated them (p_valid_ids) and does not do it twice.
  if v_valid is null then
    v_valid := array(select v.record_id
                       from memory_private.invalid_records(p_frozen.workspace_id,
                              p_frozen.scope_id, p_frozen.basis_record_ids, p_requester) v
                      where v.reason is null);
  end if;
  select coalesce(jsonb_agg(memory_private.record_brief(row(r.*)::memory_private.records,
                                                         p_frozen.mode = 'directory')
                            order by f.pos), '[]'::jsonb),
         count(*)
    into v_records, v_shown
    from unnest(p_frozen.record_ids) with ordinality as f(record_id, pos)
    join memory_private.records r
      on r.workspace_id = p_frozen.workspace_id and r.record_id = f.record_id
   where f.record_id = any(v_valid);
  -- The index text may speak of any record it was built from: it is shown only while every one
  -- of them is valid for this reader.
  v_withdrawn := p_frozen.mode = 'index'
                 and (p_frozen.index_withdrawn or p_frozen.index_text is null
                      or not p_frozen.basis_record_ids <@ v_valid);
  return jsonb_build_object(
           'mode', p_frozen.mode,
           'label', memory_private.recall_label(v_scope.kind),
           'scope', v_scope.kind,
           'frozen_at', p_frozen.created_at,
           'records', v_records,
           'dropped', cardinality(p_frozen.record_ids) - v_shown)
      || case when p_frozen.mode = 'index'
              then jsonb_build_object(
                     'index', case when v_withdrawn then null else p_frozen.index_text end,
                     'index_withdrawn', v_withdrawn)
              else '{}'::jsonb end;
end
$$;
comment on function memory_private.recall_payload(memory_private.request_recall, text, bigint[]) is
  'Builds the recall answer from the frozen content, re-checking now, in one set '
  '(memory_private.invalid_records), every record it was made from, unless the caller has just '
  'validated them (p_valid_ids): invalid records are dropped, and the index text is withheld '
  'once any record it was built from (any candidate, named or not) is not valid for the reader '
  'or is gone. Recall turned off since shows nothing.';

create or replace function memory_private.answer_records(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_matches text[] default null
) returns memory_private.record_answer[]
  language plpgsql stable
  as $$
declare
  v_folded text := memory_private.fold(p_query);
  v_terms tsquery[];
begin
  -- The given records, in their order, as query_memories returns them (R5): each with its
  -- sources in the order its summary uses them, those cited on the lines a search finds first
  -- (memory_private.found_lines; a line's citations are the record's line_sources, derived
  -- from its summary by memory_private.cited_ids when it was written), the first shown_sources
  -- of them; how it matched (p_matches, at the records' positions: literal, words, fuzzy); its
  -- last use before the call. The words are looked for only in the records found by them. One
  -- statement, each record read once; its plan kept for the session (plpgsql).
  if p_query is not null and ('words' = any(p_matches) or 'fuzzy' = any(p_matches)) then
    v_terms := memory_private.search_terms(p_query);
  end if;
  return array(
    select memory_private.record_detail(row(r.*)::memory_private.records,
                                        coalesce(src.ids, '{}'), src.total, u.last_used_at,
                                        p_matches[f.pos])
      from unnest(p_record_ids) with ordinality as f(record_id, pos)
      join memory_private.records r
        on r.workspace_id = p_workspace_id and r.record_id = f.record_id
      left join memory_private.record_usage u
        on u.workspace_id = p_workspace_id and u.record_id = f.record_id
     cross join lateral (
       -- the record's copy of its sources, in order (memory_private.copy_dependencies)
       select (array_agg(s.message_id order by h.line_no nulls last, s.position))
                [1:(memory_private.policy()).shown_sources] as ids,
              count(*) as total
         from unnest(r.source_ids) with ordinality as s(message_id, position)
         left join (select c.id, min(l.line_no) as line_no
                      from memory_private.found_lines(
                             p_workspace_id, r.record_id, r.summary, v_folded,
                             case when p_matches[f.pos] <> 'literal' then v_terms end) l
                     cross join lateral unnest(string_to_array(r.line_sources[l.line_no], ' '))
                                          as c(id)
                     where v_folded is not null
                     group by c.id) h on h.id = s.message_id) src
     order by f.pos);
end
$$;
comment on function memory_private.answer_records(text, bigint[], text, text[]) is
  'The records a query_memories call shows, in the given order, as it shows them '
  '(memory_private.record_detail): the source ids (at most policy shown_sources) in the order '
  'the summary uses them, those cited on the lines a search query finds first '
  '(memory_private.found_lines: literally in every record, by its words in those p_matches '
  '(at the same positions) says were found by words or fuzzy), how many sources there are, and '
  'the last use before the call.';

create or replace function memory_private.schedule_consolidation(p_workspace_id text, p_scope_id bigint)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_ws memory_private.workspaces;
  v_scope memory_private.scopes;
  v_identity text;
  v_candidates bigint[];
  v_origin text;
  v_job memory_private.jobs;
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if v_ws.paused or not v_scope.recall_enabled or v_scope.consolidation_due_at is null then
    return '{}';
  end if;
  select identity into v_identity from memory_private.bots
   where workspace_id = p_workspace_id and bot_id = v_scope.bot_id and active;
  if v_identity is null
     or exists (select 1 from memory_private.jobs
                 where workspace_id = p_workspace_id and scope_id = p_scope_id
                   and phase = 'consolidate' and status = 'running') then
    return '{}';
  end if;

  v_candidates := memory_private.recent_valid_records(p_workspace_id, p_scope_id,
                                                       (memory_private.policy()).candidates);
  if cardinality(v_candidates) = 0 then
    for v_job in
      select * from memory_private.jobs j
       where j.workspace_id = p_workspace_id and j.scope_id = p_scope_id
         and j.phase = 'consolidate' and j.status = 'pending'
    loop
      perform memory_private.release_job(v_job, 'superseded', 'no valid record is left');
    end loop;
    update memory_private.scopes
       set consolidation_due_at = null, index_text = null, index_record_ids = null,
           index_candidate_ids = null, index_built_at = null, index_bot_identity = null,
           index_repositories = null
     where workspace_id = p_workspace_id and scope_id = p_scope_id;
    delete from memory_private.index_dependencies
     where workspace_id = p_workspace_id and scope_id = p_scope_id;
    return jsonb_build_object('indexes_cleared', 1);
  end if;

  -- The originating request: the most recent candidate's, preferring succeeded requests.
  select rec.origin_request_id into v_origin
    from memory_private.records rec
    join memory_private.requests r
      on r.workspace_id = rec.workspace_id and r.request_id = rec.origin_request_id
   where rec.workspace_id = p_workspace_id and rec.record_id = any(v_candidates)
   order by (r.status = 'succeeded') desc, rec.created_at desc, rec.record_id desc
   limit 1;
  if v_origin is null then
    return jsonb_build_object('consolidations_without_origin', 1);
  end if;
  return memory_private.renew_open_job(
    p_workspace_id, p_scope_id, 'consolidate',
    jsonb_build_object('bot_identity', v_identity, 'candidates', to_jsonb(v_candidates)),
    v_origin, v_ws.config_version);
end
$$;
comment on function memory_private.schedule_consolidation(text, bigint) is
  'Creates (or renews) the consolidation job of a scope whose index is due, over its 48 most '
  'recent valid records, charged to the most recent candidate''s originating request; with no '
  'valid record, clears the index and the due flag instead. Returns counts.';

create or replace function memory.query_memories(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_args jsonb
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  -- One plan per statement for the session (re-planning cost ms: docs/benchmarks.md).
  set plan_cache_mode = force_generic_plan
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_query text;
  v_id bigint;
  v_limit integer;
  v_start record;
  v_first boolean;
  v_ids bigint[] := '{}';
  v_found record;
  v_records memory_private.record_answer[];
  v_matches text[];
  v_shown text[];
  v_now timestamptz := memory_private.clock_now();
begin
  v_start := memory_private.begin_tool_call(p_workspace_id, p_request_id, p_tool_call_id,
                                        'query_memories', p_args,
                                        array['query', 'id', 'limit']);
  v_request := v_start.request;
  v_scope := v_start.scope;
  v_query := nullif(btrim(memory_private.arg_text(p_args, 'query',
                                                  (memory_private.policy()).query_bytes)), '');
  v_id := memory_private.arg_integer(p_args, 'id', 1, 9223372036854775807);
  v_limit := coalesce(memory_private.arg_integer(p_args, 'limit', 1,
                                                 (memory_private.policy()).query_limit),
                      (memory_private.policy()).query_limit);
  v_first := (v_start.previous).tool_call_id is null;

  -- Recall turned off in the scope: nothing is read (C8); the call is still kept, so that a
  -- replay is recognised.
  if v_scope.recall_enabled then
    v_found := memory_private.query_records(p_workspace_id, v_scope.scope_id, v_limit,
                                            v_request.user_id, v_query, v_id);
    v_ids := v_found.ids;
    v_matches := v_found.matches;
  end if;

  -- The shown records with their sources (R5): what the call shows makes the citations it
  -- authorizes (R6, memory.request_citations).
  v_records := memory_private.answer_records(p_workspace_id, v_ids, v_query, v_matches);
  v_shown := array(select x from unnest(v_records) a, unnest(a.source_ids) x);

  -- What the call returned (the answer's provenance, T2, T3, and its citations, R6), kept with
  -- the tool call (one write: the workspace's memory lock, taken by begin_tool_call, keeps a
  -- concurrent call with the same id out); a replay adds what it returned.
  insert into memory_private.tool_calls as c
    (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, record_ids, source_ids,
     created_at, updated_at)
  values (p_workspace_id, p_request_id, p_tool_call_id, 'query_memories', v_scope.scope_id,
          memory_private.args_hash(p_args), memory_private.sorted_set(v_ids),
          memory_private.sorted_set(v_shown), v_now, v_now)
  on conflict (workspace_id, request_id, tool_call_id) do update
    set record_ids = memory_private.sorted_set(c.record_ids || v_ids),
        source_ids = memory_private.sorted_set(c.source_ids || v_shown),
        updated_at = v_now;
  -- Usage once per tool call id (R7; a replay counts nothing).
  if v_first then
    perform memory_private.count_usage(p_workspace_id, v_ids, v_now);
  end if;

  if not v_scope.recall_enabled then
    return jsonb_build_object('mode', 'disabled', 'records', '[]'::jsonb, 'count', 0,
                              'replayed', not v_first,
                              'note', 'Memory is turned off in this chat; nothing is read.');
  end if;
  return to_jsonb(row(case when v_query is not null then 'search'
                          when v_id is not null then 'id' else 'browse' end,
                     memory_private.recall_label(v_scope.kind), v_scope.kind, v_records,
                     cardinality(v_ids), not v_first)::memory_private.query_answer);
end
$$;
comment on function memory.query_memories(text, text, text, jsonb) is
  'The query_memories tool: args {query?, id?, limit?} (validated here, MB001). Browses newest '
  'first, or searches the records of the request''s scope that are valid now: literal, '
  'case-insensitive matches of the query in title or summary first, then ranked matches of its '
  'words, then typo and partial-word matches (memory_private.search_records); at most limit '
  '(1..12, default 12). Each result has title, summary, speaker ids, thread ids, up to 20 source '
  'ids (the messages its summary cites, in the order it uses them), the source count and '
  'overflow, dates, and match: how it matched (literal, words, fuzzy; null when browsing) (R4, '
  'R5). The source ids join the request''s citation set (R6); the returned records are the '
  'request''s provenance (T2). Usage is counted once per tool call id; a replay re-reads '
  'current state (R7, C9). MB003 when the id was used with other arguments; MB005 for a '
  'scheduled request.';

create or replace function memory_private.validate_output(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
begin
  if p_job.phase = 'extract' then
    return memory_private.validate_extraction(p_job, p_output);
  end if;
  return memory_private.validate_index(p_job, p_output);
end
$$;
comment on function memory_private.validate_output(memory_private.jobs, jsonb) is
  'Validates a model output for a job and returns it redacted and normalized; raises MB023. '
  'extract (memory_private.validate_extraction): {"title", "summary", "source_ids", '
  '"reused_ids"?} (all empty = no-op; title and summary within the policy''s byte limits; '
  'source ids within the batch, kept in the order given; a batch id cited in a summary line''s '
  'brackets must be among them; reused ids among the memories shown with the batch). '
  'consolidate (memory_private.validate_index): {"index", "record_ids"} (index non-empty, within '
  'the policy''s index bytes; distinct ids among the candidates, at most the policy''s index '
  'records). No other keys. The limits are memory_private.policy()''s.';

-- The operator views: one workspace at a time.
drop view memory.record_status, memory.scope_status, memory.workspace_status, memory.job_status;
drop function memory_private.operator_job_stale_reason(memory_private.jobs),
              memory_private.operator_job_retry_refusal(memory_private.jobs);

create or replace function memory_private.operator_job_stale_reason(p_workspace_id text, p_job_id bigint)
  returns text
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  return (select memory_private.job_stale_reason(row(j.*)::memory_private.jobs)
            from memory_private.jobs j
           where j.workspace_id = p_workspace_id and j.job_id = p_job_id);
end
$$;
comment on function memory_private.operator_job_stale_reason(text, bigint) is
  'memory_private.job_stale_reason of one job, for the operator views (security definer; by '
  'ids, so that no view depends on the jobs table''s row type, which Citus could not order).';

create or replace function memory_private.operator_job_retry_refusal(p_workspace_id text, p_job_id bigint)
  returns jsonb
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
begin
  return (select memory_private.job_retry_refusal(row(j.*)::memory_private.jobs)
            from memory_private.jobs j
           where j.workspace_id = p_workspace_id and j.job_id = p_job_id);
end
$$;
comment on function memory_private.operator_job_retry_refusal(text, bigint) is
  'memory_private.job_retry_refusal of one job, for the operator views (security definer; by '
  'ids, as operator_job_stale_reason).';

create or replace function memory_private.record_status_of(p_workspace_id text)
  returns table (
    workspace_id text, record_id bigint, scope_id bigint, scope_kind text, kind text,
    created_at timestamp with time zone, last_used_at timestamp with time zone, usage_count
    integer, sources bigint, dependencies bigint, title_bytes integer, summary_bytes integer,
    in_index boolean, valid boolean, invalid_reason text
  )
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  select * from (
    select r.workspace_id, r.record_id, r.scope_id, s.kind as scope_kind, r.kind,
           r.created_at, u.last_used_at, coalesce(u.usage_count, 0) as usage_count,
           (select count(*) from memory_private.record_sources rs
             where rs.workspace_id = r.workspace_id and rs.record_id = r.record_id) as sources,
           (select count(*) from memory_private.record_dependencies d
             where d.workspace_id = r.workspace_id and d.record_id = r.record_id) as dependencies,
           octet_length(r.title) as title_bytes, octet_length(r.summary) as summary_bytes,
           coalesce(r.record_id = any(s.index_record_ids), false) as in_index,
           v.reason is null as valid,
           v.reason as invalid_reason
      from memory_private.scopes s
     cross join lateral memory_private.operator_invalid_records(s.workspace_id, s.scope_id) v
      join memory_private.records r on r.workspace_id = s.workspace_id and r.record_id = v.record_id
      left join memory_private.record_usage u
        on u.workspace_id = r.workspace_id and u.record_id = r.record_id
  ) v
   where v.workspace_id = p_workspace_id;
end
$$;
comment on function memory_private.record_status_of(text) is
  'The rows of memory.record_status of one workspace (on Citus: run on the node holding it).';

create or replace function memory_private.operator_record_status()
  returns table (
    workspace_id text, record_id bigint, scope_id bigint, scope_kind text, kind text,
    created_at timestamp with time zone, last_used_at timestamp with time zone, usage_count
    integer, sources bigint, dependencies bigint, title_bytes integer, summary_bytes integer,
    in_index boolean, valid boolean, invalid_reason text
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
begin
  for v_ws in select w.workspace_id from memory_private.workspaces w order by 1 loop
    return query select * from memory_private.record_status_of(v_ws);
  end loop;
end
$$;
comment on function memory_private.operator_record_status() is
  'memory.record_status: every workspace''s rows, one workspace at a time, each on the node holding it '
  '(security definer).';

create view memory.record_status as select * from memory_private.operator_record_status();
comment on view memory.record_status is
  'One row per memory record, without its text: scope, kind, dates, usage, number of sources '
  '(messages it cites) and dependencies (messages it was made from), '
  'title/summary sizes, whether the scope index names it, and whether it may be recalled now '
  '(invalid_reason as recall decides it, for the scope''s own user; NULL when valid). '
  'memory.explain_record(workspace, record) says why.';

create or replace function memory_private.scope_status_of(p_workspace_id text)
  returns table (
    workspace_id text, scope_id bigint, kind text, bot_id text, chat_id text, user_id text,
    topic_id bigint, recall_enabled boolean, records_valid bigint, records_invalid bigint,
    invalid_by_reason jsonb, index_records integer, index_candidates integer, index_bytes
    integer, index_built_at timestamp with time zone, index_age interval,
    consolidation_pending boolean, consolidation_due_at timestamp with time zone,
    extract_job_id bigint, extract_job_status text, consolidate_job_id bigint,
    consolidate_job_status text, tombstones bigint, created_at timestamp with time zone
  )
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  select * from (
    select s.workspace_id, s.scope_id, s.kind, s.bot_id, s.chat_id, s.user_id, s.topic_id,
           s.recall_enabled,
           coalesce(rc.records_valid, 0)::bigint as records_valid,
           coalesce(rc.records_invalid, 0)::bigint as records_invalid,
           coalesce(rc.invalid_by_reason, '{}'::jsonb) as invalid_by_reason,
           coalesce(cardinality(s.index_record_ids), 0) as index_records,
           coalesce(cardinality(s.index_candidate_ids), 0) as index_candidates,
           octet_length(s.index_text) as index_bytes,
           s.index_built_at,
           memory_private.operator_now() - s.index_built_at as index_age,
           s.consolidation_due_at is not null as consolidation_pending,
           s.consolidation_due_at,
           ej.job_id as extract_job_id, ej.status as extract_job_status,
           cj.job_id as consolidate_job_id, cj.status as consolidate_job_status,
           (select count(*) from memory_private.tombstones t
             where t.workspace_id = s.workspace_id and t.scope_id = s.scope_id) as tombstones,
           s.created_at
      from memory_private.scopes s
      left join lateral (
        select sum(g.n) filter (where g.reason is null) as records_valid,
               sum(g.n) filter (where g.reason is not null) as records_invalid,
               jsonb_object_agg(g.reason, g.n) filter (where g.reason is not null)
                 as invalid_by_reason
          from (select v.reason, count(*) as n
                  from memory_private.operator_invalid_records(s.workspace_id, s.scope_id) v
                 group by 1) g
      ) rc on true
      left join memory_private.jobs ej
        on ej.workspace_id = s.workspace_id and ej.scope_id = s.scope_id and ej.phase = 'extract'
       and ej.status in ('pending', 'running')
      left join memory_private.jobs cj
        on cj.workspace_id = s.workspace_id and cj.scope_id = s.scope_id
       and cj.phase = 'consolidate' and cj.status in ('pending', 'running')
  ) v
   where v.workspace_id = p_workspace_id;
end
$$;
comment on function memory_private.scope_status_of(text) is
  'The rows of memory.scope_status of one workspace (on Citus: run on the node holding it).';

create or replace function memory_private.operator_scope_status()
  returns table (
    workspace_id text, scope_id bigint, kind text, bot_id text, chat_id text, user_id text,
    topic_id bigint, recall_enabled boolean, records_valid bigint, records_invalid bigint,
    invalid_by_reason jsonb, index_records integer, index_candidates integer, index_bytes
    integer, index_built_at timestamp with time zone, index_age interval,
    consolidation_pending boolean, consolidation_due_at timestamp with time zone,
    extract_job_id bigint, extract_job_status text, consolidate_job_id bigint,
    consolidate_job_status text, tombstones bigint, created_at timestamp with time zone
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
begin
  for v_ws in select w.workspace_id from memory_private.workspaces w order by 1 loop
    return query select * from memory_private.scope_status_of(v_ws);
  end loop;
end
$$;
comment on function memory_private.operator_scope_status() is
  'memory.scope_status: every workspace''s rows, one workspace at a time, each on the node holding it '
  '(security definer).';

create view memory.scope_status as select * from memory_private.operator_scope_status();
comment on view memory.scope_status is
  'One row per memory scope: kind and key, recall on/off, records valid and invalid (by reason), '
  'the index (how many records it names, how many candidates it was built from and depends on, '
  'bytes, when built, age), whether a consolidation is pending, the '
  'open extraction and consolidation jobs, and the tombstone count. No text.';

create or replace function memory_private.workspace_status_of(p_workspace_id text)
  returns table (
    workspace_id text, paused boolean, config_version integer, idle_window interval,
    maintained_at timestamp with time zone, budget_usd numeric, spent_usd numeric,
    memory_spent_usd numeric, budget_left_usd numeric, scopes bigint, scopes_recall_off
    bigint, records_valid bigint, records_invalid bigint, invalid_by_reason jsonb,
    consolidations_pending bigint, jobs_pending bigint, jobs_due bigint, jobs_running bigint,
    jobs_stopped bigint, jobs_succeeded bigint, oldest_pending_age interval, tombstones bigint
  )
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  select * from (
    select w.workspace_id, w.paused, w.config_version, w.idle_window, wm.maintained_at,
           w.budget_usd, w.spent_usd, wm.memory_spent_usd,
           w.budget_usd - w.spent_usd - wm.memory_spent_usd as budget_left_usd,
           (select count(*) from memory_private.scopes s
             where s.workspace_id = w.workspace_id) as scopes,
           (select count(*) from memory_private.scopes s
             where s.workspace_id = w.workspace_id and not s.recall_enabled) as scopes_recall_off,
           coalesce(rc.records_valid, 0)::bigint as records_valid,
           coalesce(rc.records_invalid, 0)::bigint as records_invalid,
           coalesce(rc.invalid_by_reason, '{}'::jsonb) as invalid_by_reason,
           (select count(*) from memory_private.scopes s
             where s.workspace_id = w.workspace_id and s.consolidation_due_at is not null)
             as consolidations_pending,
           coalesce(jc.pending, 0) as jobs_pending,
           coalesce(jc.due, 0) as jobs_due,
           coalesce(jc.running, 0) as jobs_running,
           coalesce(jc.stopped, 0) as jobs_stopped,
           coalesce(jc.succeeded, 0) as jobs_succeeded,
           jc.oldest_pending_age,
           (select count(*) from memory_private.tombstones t
             where t.workspace_id = w.workspace_id) as tombstones
      from memory_private.workspaces w
      join memory_private.workspace_memory wm on wm.workspace_id = w.workspace_id
      left join lateral (
        select sum(g.n) filter (where g.reason is null) as records_valid,
               sum(g.n) filter (where g.reason is not null) as records_invalid,
               jsonb_object_agg(g.reason, g.n) filter (where g.reason is not null)
                 as invalid_by_reason
          from (select v.reason, count(*) as n
                  from memory_private.scopes s
                 cross join lateral memory_private.operator_invalid_records(s.workspace_id,
                                                                            s.scope_id) v
                 where s.workspace_id = w.workspace_id
                 group by 1) g
      ) rc on true
      left join lateral (
        select count(*) filter (where j.status = 'pending') as pending,
               count(*) filter (where j.status = 'pending'
                                  and j.next_attempt_at <= memory_private.operator_now()) as due,
               count(*) filter (where j.status = 'running') as running,
               count(*) filter (where j.status = 'stopped'
                                  and not coalesce(j.result ? 'retried_as_job_id', false)) as stopped,
               count(*) filter (where j.status = 'succeeded') as succeeded,
               memory_private.operator_now() - min(j.created_at) filter (where j.status = 'pending')
                 as oldest_pending_age
          from memory_private.jobs j
         where j.workspace_id = w.workspace_id
      ) jc on true
  ) v
   where v.workspace_id = p_workspace_id;
end
$$;
comment on function memory_private.workspace_status_of(text) is
  'The rows of memory.workspace_status of one workspace (on Citus: run on the node holding it).';

create or replace function memory_private.operator_workspace_status()
  returns table (
    workspace_id text, paused boolean, config_version integer, idle_window interval,
    maintained_at timestamp with time zone, budget_usd numeric, spent_usd numeric,
    memory_spent_usd numeric, budget_left_usd numeric, scopes bigint, scopes_recall_off
    bigint, records_valid bigint, records_invalid bigint, invalid_by_reason jsonb,
    consolidations_pending bigint, jobs_pending bigint, jobs_due bigint, jobs_running bigint,
    jobs_stopped bigint, jobs_succeeded bigint, oldest_pending_age interval, tombstones bigint
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
begin
  for v_ws in select w.workspace_id from memory_private.workspaces w order by 1 loop
    return query select * from memory_private.workspace_status_of(v_ws);
  end loop;
end
$$;
comment on function memory_private.operator_workspace_status() is
  'memory.workspace_status: every workspace''s rows, one workspace at a time, each on the node holding it '
  '(security definer).';

create view memory.workspace_status as select * from memory_private.operator_workspace_status();
comment on view memory.workspace_status is
  'One row per workspace: paused or not, config version, when maintenance last ran for it, '
  'budget and spend (backend and memory), '
  'scopes (and how many have recall off), records valid and invalid (by reason), pending '
  'consolidations, jobs pending (and due now), running, stopped (not yet retried) and '
  'succeeded, the age of the oldest pending job, and the tombstone count. No text.';

create or replace function memory_private.job_status_of(p_workspace_id text)
  returns table (
    workspace_id text, job_id bigint, scope_id bigint, phase text, status text, age interval,
    claims integer, claims_left integer, next_attempt_at timestamp with time zone, worker_id
    text, lease_expires_at timestamp with time zone, has_checkpoint boolean, last_error text,
    last_attempt_no integer, last_attempt_outcome text, last_attempt_error text,
    last_attempt_at timestamp with time zone, cost_usd numeric, origin_request_id text,
    model_provider text, model_id text, config_version integer, config_current boolean,
    input_items integer, stale_reason text, retry_refusal text, retried_as_job_id bigint,
    created_at timestamp with time zone, updated_at timestamp with time zone, finished_at
    timestamp with time zone
  )
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  select * from (
    select j.workspace_id, j.job_id, j.scope_id, j.phase, j.status,
           memory_private.operator_now() - j.created_at as age,
           j.claims, memory_private.policy_limit('max_claims') - j.claims as claims_left,
           case when j.status = 'pending' then j.next_attempt_at end as next_attempt_at,
           j.worker_id, j.lease_expires_at,
           j.checkpoint is not null as has_checkpoint,
           j.last_error,
           a.attempt_no as last_attempt_no,
           a.outcome as last_attempt_outcome,
           a.error as last_attempt_error,
           a.started_at as last_attempt_at,
           coalesce(c.cost_usd, 0) as cost_usd,
           j.origin_request_id, j.model_provider, j.model_id, j.config_version,
           j.config_version = w.config_version as config_current,
           case j.phase when 'extract' then jsonb_array_length(j.input -> 'sources')
                        else jsonb_array_length(j.input -> 'candidates') end as input_items,
           case when j.status in ('pending', 'running', 'stopped')
                then memory_private.operator_job_stale_reason(j.workspace_id, j.job_id) end
                  as stale_reason,
           case when j.status = 'stopped'
                then memory_private.operator_job_retry_refusal(j.workspace_id, j.job_id) ->> 'reason' end
                  as retry_refusal,
           (j.result ->> 'retried_as_job_id')::bigint as retried_as_job_id,
           j.created_at, j.updated_at, j.finished_at
      from memory_private.jobs j
      join memory_private.workspaces w on w.workspace_id = j.workspace_id
      left join lateral (
        select ja.attempt_no, ja.outcome, ja.error, ja.started_at
          from memory_private.job_attempts ja
         where ja.workspace_id = j.workspace_id and ja.job_id = j.job_id
         order by ja.attempt_no desc
         limit 1
      ) a on true
      left join lateral (
        select sum(rc.cost_usd) as cost_usd from memory_private.request_charges rc
         where rc.workspace_id = j.workspace_id and rc.job_id = j.job_id
      ) c on true
  ) v
   where v.workspace_id = p_workspace_id;
end
$$;
comment on function memory_private.job_status_of(text) is
  'The rows of memory.job_status of one workspace (on Citus: run on the node holding it).';

create or replace function memory_private.operator_job_status()
  returns table (
    workspace_id text, job_id bigint, scope_id bigint, phase text, status text, age interval,
    claims integer, claims_left integer, next_attempt_at timestamp with time zone, worker_id
    text, lease_expires_at timestamp with time zone, has_checkpoint boolean, last_error text,
    last_attempt_no integer, last_attempt_outcome text, last_attempt_error text,
    last_attempt_at timestamp with time zone, cost_usd numeric, origin_request_id text,
    model_provider text, model_id text, config_version integer, config_current boolean,
    input_items integer, stale_reason text, retry_refusal text, retried_as_job_id bigint,
    created_at timestamp with time zone, updated_at timestamp with time zone, finished_at
    timestamp with time zone
  )
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_ws text;
begin
  for v_ws in select w.workspace_id from memory_private.workspaces w order by 1 loop
    return query select * from memory_private.job_status_of(v_ws);
  end loop;
end
$$;
comment on function memory_private.operator_job_status() is
  'memory.job_status: every workspace''s rows, one workspace at a time, each on the node holding it '
  '(security definer).';

create view memory.job_status as select * from memory_private.operator_job_status();
comment on view memory.job_status is
  'One row per memory job: phase, status, age, claims used and left (of 3), next attempt '
  '(pending only), the worker and lease of a running job, whether a checkpoint waits to be '
  'committed, the last error, the last attempt''s number, outcome (open | ok | failed | '
  'unknown) and error, the dollars charged, the pinned model and config version (and whether '
  'it is still current), the input size, why the input is stale (if it is), and for a stopped '
  'job why it cannot be retried (NULL: memory.retry_job will take it). No text.';

revoke all on memory.record_status, memory.scope_status, memory.workspace_status,
              memory.job_status from public;
grant select on memory.record_status, memory.scope_status, memory.workspace_status,
                memory.job_status to memory_operator;
revoke all on function
  memory_private.operator_job_stale_reason(text, bigint),
  memory_private.operator_job_retry_refusal(text, bigint),
  memory_private.operator_record_status(), memory_private.operator_scope_status(),
  memory_private.operator_workspace_status(), memory_private.operator_job_status()
from public;
grant execute on function
  memory_private.operator_job_stale_reason(text, bigint),
  memory_private.operator_job_retry_refusal(text, bigint),
  memory_private.operator_record_status(), memory_private.operator_scope_status(),
  memory_private.operator_workspace_status(), memory_private.operator_job_status()
to memory_operator;

-- On a Citus coordinator: the distribution (85_distribution.sql).
create or replace function memory_private.is_distributed() returns boolean
  language plpgsql stable
  as $$
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    return false;
  end if;
  return exists (select 1 from pg_dist_partition
                  where logicalrelid = 'memory_private.workspaces'::regclass);
end
$$;
comment on function memory_private.is_distributed() is
  'True when the schema is distributed on a Citus cluster (memory_private.workspaces is a '
  'distributed table), false on plain PostgreSQL or before memory_private.distribute().';

create or replace function memory_private.distribute_tables() returns jsonb
  language plpgsql volatile
  as $$
declare
  v_table regclass;
  v_reference integer := 0;
  v_distributed integer := 0;
begin
  for v_table in
    select c.oid::regclass from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
       and not exists (select 1 from pg_attribute a
                        where a.attrelid = c.oid and a.attname = 'workspace_id')
       and not exists (select 1 from pg_dist_partition p where p.logicalrelid = c.oid)
     order by c.relname
  loop
    perform create_reference_table(v_table);
    v_reference := v_reference + 1;
  end loop;
  -- The tables that functions without a table row type need exist now on every node: those
  -- functions next, then the workspace tables in foreign-key order (a table once every table
  -- it references is distributed), workspaces first.
  perform memory_private.distribute_functions(false);
  loop
    select c.oid::regclass into v_table from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
       and exists (select 1 from pg_attribute a
                    where a.attrelid = c.oid and a.attname = 'workspace_id')
       and not exists (select 1 from pg_dist_partition p where p.logicalrelid = c.oid)
       and not exists (select 1 from pg_constraint f
                        where f.conrelid = c.oid and f.contype = 'f' and f.confrelid <> c.oid
                          and not exists (select 1 from pg_dist_partition p
                                           where p.logicalrelid = f.confrelid))
     order by c.relname <> 'workspaces', c.relname
     limit 1;
    exit when not found;
    if v_table = 'memory_private.workspaces'::regclass then
      perform create_distributed_table(v_table, 'workspace_id');
    else
      perform create_distributed_table(v_table, 'workspace_id',
                                       colocate_with => 'memory_private.workspaces');
    end if;
    v_distributed := v_distributed + 1;
  end loop;
  if exists (select 1 from pg_class c
              where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
                and not exists (select 1 from pg_dist_partition p
                                 where p.logicalrelid = c.oid)) then
    raise exception 'a table of memory_private cannot be distributed: its foreign keys do not '
      'lead to memory_private.workspaces' using errcode = 'MB003';
  end if;
  return jsonb_build_object('reference_tables', v_reference,
                            'distributed_tables', v_distributed);
end
$$;
comment on function memory_private.distribute_tables() is
  'Makes every table of memory_private not yet on the cluster a reference table (no '
  'workspace_id) or a table distributed by workspace_id co-located with workspaces, in '
  'foreign-key order, after the functions that use no table''s row type; answers the counts.';

create or replace function memory_private.distribute_functions(p_all boolean) returns integer
  language plpgsql volatile
  as $$
declare
  v_function regprocedure;
  v_by_workspace boolean;
  v_count integer := 0;
begin
  for v_function, v_by_workspace in
    select p.oid::regprocedure, f.by_workspace
      from pg_proc p
     cross join lateral (
       select coalesce(p.proargnames[1] = 'p_workspace_id' and p.proargtypes[0] = 'text'::regtype
                       and memory_private.is_distributed(), false) as by_workspace) f
     where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
       -- not on the cluster yet, or put there before the tables were and now to be delegated
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_proc'::regclass and o.objid = p.oid
                          and (o.distribution_argument_index is not null or not f.by_workspace))
       and (p_all or not exists (
             select 1 from pg_depend d join pg_type t on t.oid = d.refobjid
               join pg_class c on c.oid = t.typrelid and c.relkind in ('r', 'v')
              where d.classid = 'pg_proc'::regclass and d.objid = p.oid
                and d.refclassid = 'pg_type'::regclass))
     order by 1::text
  loop
    if v_by_workspace then
      perform create_distributed_function(v_function, 'p_workspace_id',
                                          colocate_with => 'memory_private.workspaces',
                                          force_delegation => false);
    else
      perform create_distributed_function(v_function);
    end if;
    v_count := v_count + 1;
  end loop;
  return v_count;
end
$$;
comment on function memory_private.distribute_functions(boolean) is
  'Puts every function of memory and memory_private not yet on the cluster on every node; one '
  'whose first argument is p_workspace_id (once the tables are distributed) is distributed by '
  'it, co-located with workspaces, so that Citus delegates a call to the node holding the '
  'workspace. With p_all false, only those that use no table''s or view''s row type. Answers '
  'how many.';

create or replace function memory_private.distribute() returns jsonb
  language plpgsql volatile
  as $$
declare
  v_result jsonb;
  v_view regclass;
  v_views integer := 0;
  v_types integer := 0;
  v_type regtype;
  v_function regprocedure;
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    raise exception 'this database has no Citus extension: nothing to distribute'
      using errcode = 'MB025';
  end if;
  -- Function bodies refer to one another in any order: do not check them while the workers
  -- create them (SET LOCAL reaches the workers' connections with propagate_set_commands).
  set local citus.propagate_set_commands = 'local';
  set local check_function_bodies = off;
  set local citus.enable_unsafe_triggers = on;  -- our triggers touch one workspace's rows
  set local citus.allow_nested_distributed_execution = on;
  v_result := memory_private.distribute_tables();
  -- A composite type that only function bodies use (no signature names it) is not among any
  -- object's dependencies: a throwaway function taking it carries it to the workers.
  for v_type in
    select t.oid::regtype from pg_type t join pg_class c on c.oid = t.typrelid
     where t.typnamespace = 'memory_private'::regnamespace and c.relkind = 'c'
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_type'::regclass and o.objid = t.oid)
  loop
    execute format('create function memory_private.distribute_type_carrier(%s) returns void '
                   'language sql as %L', v_type, 'select');
    perform create_distributed_function(
      format('memory_private.distribute_type_carrier(%s)', v_type)::regprocedure);
    execute format('drop function memory_private.distribute_type_carrier(%s)', v_type);
    v_types := v_types + 1;
  end loop;
  -- The views of memory_private (what the delegated functions read): created again with DDL
  -- propagation on, which creates them on the workers. The public views stay on the
  -- coordinator, where operators query them.
  for v_view in
    select c.oid::regclass from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'v'
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_class'::regclass and o.objid = c.oid)
     order by c.oid
  loop
    execute format('create or replace view %s as %s', v_view, pg_get_viewdef(v_view));
    v_views := v_views + 1;
  end loop;
  v_result := v_result || jsonb_build_object('views', v_views, 'types', v_types,
                                             'functions',
                                             memory_private.distribute_functions(true));
  -- A function that pins generic plans for speed on one node (recall, query_memories) gets
  -- the default again: Citus routes a statement by its parameters' values, which a generic
  -- plan does not have. ALTER FUNCTION reaches the workers.
  for v_function in
    select p.oid::regprocedure from pg_proc p
     where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
       and 'plan_cache_mode=force_generic_plan' = any(p.proconfig)
  loop
    execute format('alter function %s reset plan_cache_mode', v_function);
  end loop;
  -- The functions call one another inside queries (a validity rule inside a search), which
  -- Citus counts as a distributed query nested in a query on a shard and refuses by default.
  -- Every such nested query here reads the same workspace as the query around it, so the
  -- same node: allowed for this database, on every node (ALTER DATABASE reaches the workers).
  execute format('alter database %I set citus.allow_nested_distributed_execution = on',
                 current_database());
  return v_result;
end
$$;
comment on function memory_private.distribute() is
  'Distributes the schema on a Citus coordinator (85_distribution.sql): reference tables, '
  'tables distributed by workspace and co-located, the private views and every function on '
  'every node, the workspace functions delegated by their workspace, nested distributed '
  'execution allowed for the database, no pinned generic plans. Idempotent: only what is not '
  'yet on the cluster is done. MB025 without Citus. Answers the counts.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 9 $$;
