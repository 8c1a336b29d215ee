-- 45_scheduling.sql: turning facts into jobs (P2-P5, P10, P15, V5, V10).
--
-- memory_private.schedule_jobs is the last step of every maintenance tick (70_maintenance.sql):
-- it schedules an extraction for every scope with qualifying conversations and a consolidation
-- for every scope whose index is due.
--
-- Extraction: a conversation (one request: its user and assistant messages) qualifies when the
-- request is interactive and succeeded, the conversation's own last activity (the request's
-- update or finish, its messages' creation or edit) is older than the workspace's idle window,
-- the scope has recall on, the workspace is not paused, and it has retained directed user and
-- assistant messages, not tombstoned in the scope, at least one of which is not yet extracted
-- at its current content hash. The window is per conversation, not per scope: in a busy group
-- topic, someone always talking must not hold back everyone's finished conversations. Scheduled requests have no scope (V5); group
-- messages not directed at the bot are never stored (V10). The batch takes the most recent
-- conversations whose texts fit 24,000 bytes and 200 messages together (what the record it
-- makes depends on); a conversation that cannot fit alone is recorded as a 'skipped' job and
-- its messages marked skipped, so it is never retried.
-- Consolidation: a scope whose index is due gets a job over its 48 most recent valid records,
-- or, with no valid record, just loses its index.

create function memory_private.add_counts(p_total jsonb, p_more jsonb) returns jsonb
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

create function memory_private.input_carryover(
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
declare
  -- The clock read here, not in the statement: on Citus a statement goes to the workspace's
  -- node, whose transaction (and so its now()) began later than this one's.
  v_now timestamptz := memory_private.clock_now();
begin
  select coalesce(bool_or(j.status = 'stopped'
                          or (j.status = 'superseded'
                              and j.claims >= (memory_private.policy()).max_claims)), false),
         coalesce(max(j.claims) filter (where j.status = 'superseded'), 0),
         greatest(v_now, max(j.next_attempt_at) filter (where j.status = 'superseded'))
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

create function memory_private.create_job(
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

create function memory_private.renew_open_job(
  p_workspace_id text, p_scope_id bigint, p_phase text, p_input jsonb, p_origin_request_id text,
  p_config_version integer
) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_hash text := memory_private.content_hash(p_input::text);
  v_open memory_private.jobs;
  v_result jsonb := '{}';
begin
  -- One open job per scope and phase. A running one finishes first; a pending one is replaced
  -- by the newer snapshot (P15) unless it is the same input or already holds a valid checkpoint
  -- to commit.
  select * into v_open from memory_private.jobs
   where workspace_id = p_workspace_id and scope_id = p_scope_id and phase = p_phase
     and status in ('pending', 'running')
     for update;
  if found then
    if v_open.status = 'running' or v_open.input_hash = v_hash
       or (v_open.checkpoint is not null and memory_private.job_stale_reason(v_open) is null) then
      return v_result;
    end if;
    perform memory_private.release_job(v_open, 'superseded',
      'the input changed: a newer snapshot replaces this one');
    v_result := jsonb_build_object('jobs_superseded_new_input', 1);
  end if;
  -- An input that was stopped (unknown outcome, three failed calls) under this configuration,
  -- or superseded after its three calls, is not replayed automatically (P13).
  if (memory_private.input_carryover(p_workspace_id, p_scope_id, p_phase, v_hash,
                                     p_config_version)).blocked then
    return v_result || jsonb_build_object('replays_blocked', 1);
  end if;
  perform memory_private.create_job(p_workspace_id, p_scope_id, p_phase, p_input, v_hash,
                                    p_origin_request_id, p_config_version);
  return v_result || jsonb_build_object(p_phase || '_jobs_created', 1);
end
$$;
comment on function memory_private.renew_open_job(text, bigint, text, jsonb, text, integer) is
  'The scheduling of both phases ends here: keeps the scope''s open job of the phase when it is '
  'running, has the same input or a valid checkpoint; otherwise supersedes it, and creates the '
  'job of the new input unless that input is blocked (P13, P15). Returns counts.';

create function memory_private.extraction_units(
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

create function memory_private.batch_memories(
  p_workspace_id text, p_scope_id bigint, p_sources jsonb, p_limit integer
) returns bigint[]
  language plpgsql stable
  as $$
begin
  -- The memories that accompany a batch (P5), chosen by what the batch is about: the scope's
  -- valid records sharing the most distinct words (four characters or more, case-folded) with
  -- the batch's messages, the newest first among equals. Each one shown makes every message it
  -- rests on a dependency of the record the batch makes (write_extraction), so the policy
  -- shows none unless measured otherwise (docs/retention.md).
  if p_limit <= 0 then
    return '{}';
  end if;
  return array(
    with batch_words as (
      select distinct w
        from jsonb_to_recordset(p_sources) as s(id text)
        join memory_private.messages m
          on m.workspace_id = p_workspace_id and m.message_id = s.id
       cross join regexp_split_to_table(memory_private.fold(m.body), '[^[:alnum:]]+') as w
       where char_length(w) >= 4
    ), scored as (
      select t.record_id, t.created_at,
             (select count(*) from batch_words b
               where b.w in (select regexp_split_to_table(t.search_text, '[^[:alnum:]]+')))
               as shared
        from memory_private.record_texts t
       where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
    ), ranked as (
      select s.record_id, s.shared, s.created_at from scored s where s.shared > 0
       order by s.shared desc, s.created_at desc, s.record_id desc
       limit 4 * p_limit
    )
    select r.record_id
      from ranked r
      join memory_private.invalid_records(p_workspace_id, p_scope_id,
                                          array(select record_id from ranked), null) v
        on v.record_id = r.record_id and v.reason is null
     order by r.shared desc, r.created_at desc, r.record_id desc
     limit p_limit);
end
$$;
comment on function memory_private.batch_memories(text, bigint, jsonb, integer) is
  'The valid memories of a scope shown with an extraction batch (P5): at most p_limit, those '
  'sharing the most distinct words with the batch''s messages, newest first among equals; '
  'none when p_limit is 0 (the policy''s existing_with_batch).';

create function memory_private.schedule_extraction(p_workspace_id text, p_scope_id bigint)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_ws memory_private.workspaces;
  v_scope memory_private.scopes;
  v_now timestamptz := memory_private.clock_now();
  v_identity text;
  v_unit record;
  v_ceiling integer := (memory_private.policy()).batch_bytes;
  v_most integer := (memory_private.policy()).batch_messages;
  v_bytes integer := 0;
  v_count integer := 0;
  v_batch jsonb := '[]';
  v_origin text;
  v_skipped jsonb := '[]';
  v_skip_origin text;
  v_skip_reason text;
  v_input jsonb;
  v_skip_job bigint;
  v_result jsonb := '{}';
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if v_ws.paused or not v_scope.recall_enabled then
    return v_result;
  end if;
  select identity into v_identity from memory_private.bots
   where workspace_id = p_workspace_id and bot_id = v_scope.bot_id and active;
  if v_identity is null then
    return v_result;
  end if;

  -- The most recent conversations that fit the ceiling together (P4); one that cannot fit alone
  -- is recorded as skipped, never retried.
  for v_unit in select * from memory_private.extraction_units(p_workspace_id, v_scope, v_now,
                                                              v_now - v_ws.idle_window) loop
    if v_unit.bytes > v_ceiling or jsonb_array_length(v_unit.sources) > v_most then
      v_skipped := v_skipped || v_unit.sources;
      v_skip_origin := coalesce(v_skip_origin, v_unit.request_id);
      v_skip_reason := coalesce(v_skip_reason, format(
        'the conversation of request %s is %s bytes in %s messages: not even one '
        'user/assistant pair fits the batch ceiling of %s bytes and %s messages',
        v_unit.request_id, v_unit.bytes, jsonb_array_length(v_unit.sources), v_ceiling,
        v_most));
    elsif v_bytes + v_unit.bytes <= v_ceiling
          and v_count + jsonb_array_length(v_unit.sources) <= v_most then
      v_batch := v_batch || v_unit.sources;
      v_bytes := v_bytes + v_unit.bytes;
      v_count := v_count + jsonb_array_length(v_unit.sources);
      v_origin := coalesce(v_origin, v_unit.request_id);
    else
      exit;   -- older conversations wait for the next batch
    end if;
  end loop;

  if jsonb_array_length(v_skipped) > 0 then
    v_input := jsonb_build_object('bot_identity', v_identity, 'sources', v_skipped,
                                  'existing', '[]'::jsonb);
    v_skip_job := memory_private.create_job(p_workspace_id, p_scope_id, 'extract', v_input,
                    memory_private.content_hash(v_input::text), v_skip_origin,
                    v_ws.config_version, v_skip_reason);
    insert into memory_private.extracted_sources
      (workspace_id, scope_id, message_id, content_hash, outcome, job_id, created_at)
    select p_workspace_id, p_scope_id, s.id, s.hash, 'skipped', v_skip_job, v_now
      from jsonb_to_recordset(v_skipped) as s(id text, hash text)
    on conflict do nothing;
    v_result := v_result || jsonb_build_object('batches_skipped', 1);
  end if;

  if jsonb_array_length(v_batch) = 0 then
    return v_result;
  end if;
  -- The batch, with the memories chosen to accompany it (P5: none by the policy's choice).
  v_input := jsonb_build_object(
    'bot_identity', v_identity,
    'sources', (select jsonb_agg(s order by s ->> 'id') from jsonb_array_elements(v_batch) s),
    'existing', to_jsonb(memory_private.batch_memories(
                  p_workspace_id, p_scope_id, v_batch,
                  (memory_private.policy()).existing_with_batch)));
  return v_result || memory_private.renew_open_job(p_workspace_id, p_scope_id, 'extract',
                                                   v_input, v_origin, v_ws.config_version);
end
$$;
comment on function memory_private.schedule_extraction(text, bigint) is
  'Creates (or renews) the extraction job of one scope when it has qualifying conversations: '
  'the most recent ones up to 24,000 bytes and 200 messages, with the memories chosen to '
  'accompany them (memory_private.batch_memories); records a skipped job for a conversation '
  'that cannot fit alone. Returns counts.';

create function memory_private.schedule_consolidation(p_workspace_id text, p_scope_id bigint)
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

create function memory_private.schedule_jobs(
  p_workspace_id text, p_changed_requests text[] default null,
  p_changed_scopes bigint[] default null
) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_ws memory_private.workspaces;
  v_now timestamptz := memory_private.clock_now();
  v_request text;
  v_requests text[];
  v_scope memory_private.scopes;
  v_scope_id bigint;
  v_counts jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                       'batches_skipped', 0);
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  if v_ws.paused then
    return v_counts;
  end if;
  -- After a change confined to some requests and scopes, only their scopes can have a new
  -- extraction input: every other scope's input is what the last tick derived (a job made,
  -- an input found blocked, P13, a running job, nothing to extract), and what would change it
  -- comes as a change of its own (a job leaving running names its scope; a conversation's
  -- idle end, its request). So a tick costs what the change touched, not the workspace's
  -- history or its stopped inputs; with p_changed_requests NULL, every scope is derived.
  if p_changed_requests is not null then
    v_requests := p_changed_requests || array(
      select r.request_id
        from memory_private.scopes s
        join memory_private.requests r
          on r.workspace_id = s.workspace_id and r.bot_id = s.bot_id and r.chat_id = s.chat_id
         and (case when s.kind = 'private' then r.user_id = s.user_id
                   else r.topic_id = s.topic_id end)
       where s.workspace_id = p_workspace_id and s.scope_id = any (p_changed_scopes));
  end if;
  -- One representative request per scope that has something new to extract.
  for v_request in
    select min(r.request_id)
      from memory_private.requests r
      join memory_private.chats c on c.workspace_id = r.workspace_id and c.chat_id = r.chat_id
     where r.workspace_id = p_workspace_id and r.kind = 'interactive'
       and (v_requests is null or r.request_id = any (v_requests))
       and r.status = 'succeeded' and r.finished_at <= v_now - v_ws.idle_window
       and exists (select 1 from memory_private.messages m
                    where m.workspace_id = r.workspace_id and m.request_id = r.request_id
                      and memory_private.is_retained(m.body is not null, m.retain_until,
                                                     v_now)
                      and not exists (select 1 from memory_private.extracted_sources e
                                       where e.workspace_id = m.workspace_id
                                         and e.message_id = m.message_id
                                         and e.content_hash = m.content_hash))
     group by r.bot_id, r.chat_id, case when c.kind = 'group' then r.topic_id end
     order by 1
  loop
    v_scope := memory_private.scope_of_request(p_workspace_id, v_request);
    v_counts := memory_private.add_counts(v_counts,
                  memory_private.schedule_extraction(p_workspace_id, v_scope.scope_id));
  end loop;
  for v_scope_id in
    select scope_id from memory_private.scopes
     where workspace_id = p_workspace_id and consolidation_due_at is not null
     order by scope_id
  loop
    v_counts := memory_private.add_counts(v_counts,
                  memory_private.schedule_consolidation(p_workspace_id, v_scope_id));
  end loop;
  return v_counts;
end
$$;
comment on function memory_private.schedule_jobs(text, text[], bigint[]) is
  'Maintenance step: schedules extraction for every scope with qualifying conversations and '
  'consolidation for every scope whose index is due (nothing while the workspace is paused). '
  'With p_changed_requests (and p_changed_scopes), only the scopes of those requests and those '
  'scopes are derived: what changed since the last tick; every scope when NULL. Returns '
  'counts.';

