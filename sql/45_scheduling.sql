-- 45_scheduling.sql: turning facts into jobs (P2-P5, P10, P15, V5, V10).
--
-- memory_private.schedule_jobs is the last step of every maintenance tick (70_maintenance.sql):
-- it schedules extraction in the scopes a change touched and a consolidation for every scope
-- whose index is due.
--
-- What may be extracted has one home, the verdict (memory_private.extraction_verdict): every
-- conversation (one request: its user and assistant messages) with something not yet handled,
-- with the first reason it waits, in the order of memory_private.waiting_reasons, or none. The
-- scheduler takes those without one (schedule_extraction); memory.waiting_status counts them by
-- reason. A conversation qualifies when the scope gate is open (the workspace not paused, recall
-- on, the bot active: memory_private.scope_gate), the request is interactive and succeeded, it
-- has retained directed user and assistant messages not tombstoned in the scope, one of which
-- is not yet extracted at its content hash, and its own last activity (the request's update or
-- finish, its messages' creation, edit or removal) is older than the workspace's idle window.
-- The window is per conversation, not per scope: in a busy group topic, someone always talking
-- must not hold back everyone's finished conversations. Scheduled requests have no scope (V5);
-- group messages not directed at the bot are never stored (V10). The batch takes the most
-- recent qualifying conversations whose texts fit 24,000 bytes and 200 messages together (what
-- the record it makes depends on); a conversation that cannot fit alone is recorded as a
-- 'skipped' job and its messages marked skipped, so it is never retried. Then the scope's open
-- job decides (renew_open_job): a running one finishes first, a pending one with the same input
-- or a valid checkpoint stays, an input that stopped is not replayed.
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
                              and memory_private.calls_left(j.claims) <= 0)), false),
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

create function memory_private.extraction_candidates(
  p_workspace_id text, p_scope_ids bigint[], p_now timestamptz
) returns table (
  scope_id bigint, request_id text, reason text, bot_identity text, finished_at timestamptz,
  created_at timestamptz, messages bigint, bytes integer, sources jsonb,
  last_activity timestamptz, idle_until timestamptz
)
  language sql stable
  as $$
  -- Every conversation of the scopes with something not yet handled: an interactive request
  -- with a message its scope may use (retained, directed or private, not tombstoned there) that
  -- is not yet extracted or skipped at its content hash; with the first reason in the order of
  -- waiting_reasons that keeps it from qualifying (the scope gate, its request, its messages,
  -- its idle window), or none. Each scope's requests are read through requests_scope_idx, then
  -- the messages of each (messages_request_idx).
  -- The changed scopes by their key, each with its gate, first and once (materialized: joined
  -- in one plan, a cached plan read the workspace's every scope for the gate of each scope,
  -- and the requests of each again: a tick after 10,000 conversations in 100 topics took 16 s).
  with gated as materialized (
    select s.scope_id, s.kind, s.bot_id, s.chat_id, s.topic_id, g.reason, g.bot_identity
      from memory_private.scopes s
     cross join lateral memory_private.scope_gate(p_workspace_id, s.scope_id) g
     where s.workspace_id = p_workspace_id and s.scope_id = any(p_scope_ids)
  )
  select s.scope_id, r.request_id,
         (select w.reason from memory_private.waiting_reasons w
           where w.reason = s.reason
              or (w.reason = 'request_not_finished' and r.status not in ('succeeded', 'failed'))
              or (w.reason = 'request_failed' and r.status = 'failed')
              or (w.reason = 'no_user_message' and u.users = 0)
              or (w.reason = 'no_assistant_message' and u.assistants = 0)
              or (w.reason = 'idle_window' and a.last_activity + ws.idle_window > p_now)
           order by w.rank limit 1),
         s.bot_identity, r.finished_at, r.created_at, u.fresh, u.bytes, u.sources,
         a.last_activity, a.last_activity + ws.idle_window
    from gated s
    join memory_private.workspaces ws on ws.workspace_id = p_workspace_id
    join memory_private.requests r
      on r.workspace_id = p_workspace_id and r.bot_id = s.bot_id and r.chat_id = s.chat_id
     -- a topic scope's own topic, a private scope (no topic) every topic of its chat: a range
     -- the index reads, where an OR would read the chat's every request for each scope
     and r.topic_id between coalesce(s.topic_id, 0) and coalesce(s.topic_id, 9223372036854775807)
     and r.kind = 'interactive'
   cross join lateral (
     select count(*) filter (where m.role = 'user') as users,
            count(*) filter (where m.role = 'assistant') as assistants,
            count(*) filter (where e.message_id is null) as fresh,
            coalesce(sum(octet_length(m.body)), 0)::integer as bytes,
            jsonb_agg(jsonb_build_object('id', m.message_id, 'hash', m.content_hash)
                      order by m.created_at, m.message_id) as sources
       from memory_private.messages m
       left join memory_private.extracted_sources e
         on e.workspace_id = m.workspace_id and e.scope_id = s.scope_id
        and e.message_id = m.message_id and e.content_hash = m.content_hash
      where m.workspace_id = p_workspace_id and m.request_id = r.request_id
        and memory_private.is_retained(m.body is not null, m.retain_until, p_now)
        and (m.directed or s.kind = 'private')
        and not exists (select from memory_private.tombstone(p_workspace_id, s.scope_id,
                                                             m.message_id))
   ) u
   cross join lateral (
     -- The idle window's clock, per conversation: its own last activity (the request's update
     -- or finish, its messages' creation, edit or removal).
     select greatest(r.updated_at, r.finished_at,
                     max(greatest(m.created_at, m.edited_at, m.removed_at))) as last_activity
       from memory_private.messages m
      where m.workspace_id = p_workspace_id and m.request_id = r.request_id
   ) a
   where u.fresh > 0
$$;
comment on function memory_private.extraction_candidates(text, bigint[], timestamptz) is
  'The conversations of the given scopes not yet handled (an interactive request with a '
  'message its scope may use that is not yet extracted or skipped at its content), each with '
  'the first reason it cannot be extracted yet (waiting_reasons: the scope gate, the request '
  'not finished or failed, no user or no assistant message, the idle window) or NULL, its '
  'messages not yet handled, the bytes and the sources ({id, hash}) of every message the '
  'scope may use, its last activity and the idle window''s end. The first half of '
  'memory_private.extraction_verdict.';

create function memory_private.extraction_input(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_batch jsonb
) returns jsonb
  language plpgsql stable
  as $$
begin
  -- The batch's sources in id order, and the memories that accompany it (P5).
  return jsonb_build_object(
           'bot_identity', p_bot_identity,
           'sources', (select jsonb_agg(e order by e ->> 'id')
                         from jsonb_array_elements(p_batch) as e),
           'existing', to_jsonb(memory_private.batch_memories(
                         p_workspace_id, p_scope_id, p_batch,
                         (memory_private.policy()).existing_with_batch)));
end
$$;
comment on function memory_private.extraction_input(text, bigint, text, jsonb) is
  'The input of an extraction job over a batch of sources ({id, hash}): the bot identity, the '
  'sources in id order and the memories chosen to accompany them (memory_private.'
  'batch_memories). What the verdict compares the open job with, and what the scheduler '
  'creates.';

-- Long: one pass over the candidates, then each scope's batch, open job and input history,
-- and its rows' reasons in one statement: the verdict's parts read best together.
create function memory_private.extraction_verdict(
  p_workspace_id text, p_scope_ids bigint[], p_now timestamptz
) returns table (
  scope_id bigint, request_id text, reason text, skip boolean, place bigint,
  bot_identity text, messages bigint, bytes integer, sources jsonb,
  last_activity timestamptz, next_change_at timestamptz
)
  language plpgsql stable
  as $$
#variable_conflict use_column
declare
  v_ceiling integer := (memory_private.policy()).batch_bytes;
  v_most integer := (memory_private.policy()).batch_messages;
  v_config integer;
  v_scope record;
  v_input jsonb;
  v_job memory_private.jobs;
  v_kept boolean;
  v_blocked boolean;
  v_budget numeric;
begin
  -- After the candidates' own reasons, scope by scope: the qualifying conversations newest
  -- first (P4: the batch takes them while bytes and messages fit; one that cannot fit alone is
  -- skipped; the rest wait for a later batch), the batch's input, and what the scope's open
  -- extraction job or the input's history does with it (renew_open_job: a running job
  -- finishes first; a pending one with the same input or a valid checkpoint stays; an input
  -- that stopped or used its calls is not replayed, P13). Each conversation gets the first
  -- reason in the order of waiting_reasons, or none: the scheduler takes those
  -- (schedule_extraction). One pass over the candidates, then one step per scope: its cost
  -- grows with them, whatever the planner believes of their number.
  select w.config_version into v_config from memory_private.workspaces w
   where w.workspace_id = p_workspace_id;
  for v_scope in
    select f.scope_id, min(f.bot_identity) as bot_identity,
           jsonb_agg(to_jsonb(f)) as rows,
           bool_or(f.in_batch) as has_batch
      from (select q.*,
                   q.pos is not null and not q.skip
                   and sum(case when q.skip then 0 else q.bytes end)
                         over (partition by q.scope_id, q.pos is null order by q.pos)
                       <= v_ceiling
                   and sum(case when q.skip then 0 else jsonb_array_length(q.sources) end)
                         over (partition by q.scope_id, q.pos is null order by q.pos)
                       <= v_most as in_batch
              from (select c.*,
                           case when c.reason is null then row_number() over (
                             partition by c.scope_id, c.reason is null
                             order by c.finished_at desc, c.created_at desc, c.request_id desc)
                           end as pos,
                           c.reason is null
                           and (c.bytes > v_ceiling
                                or jsonb_array_length(c.sources) > v_most) as skip
                      from memory_private.extraction_candidates(p_workspace_id, p_scope_ids,
                                                                p_now) c) q) f
     group by f.scope_id
  loop
    v_job := null;
    v_kept := false;
    v_blocked := false;
    v_budget := null;
    if v_scope.has_batch then
      v_input := memory_private.extraction_input(
        p_workspace_id, v_scope.scope_id, v_scope.bot_identity,
        (select jsonb_agg(e order by (x ->> 'pos')::bigint, n)
           from jsonb_array_elements(v_scope.rows) as x
          cross join jsonb_array_elements(x -> 'sources') with ordinality as s(e, n)
          where (x ->> 'in_batch')::boolean));
      select * into v_job from memory_private.jobs j
       where j.workspace_id = p_workspace_id and j.scope_id = v_scope.scope_id
         and j.phase = 'extract' and j.status in ('pending', 'running');
      v_kept := coalesce(v_job.status = 'pending'
                         and (v_job.input_hash = memory_private.content_hash(v_input::text)
                              or (v_job.checkpoint is not null
                                  and memory_private.job_stale_reason(v_job) is null)), false);
      v_blocked := (memory_private.input_carryover(
                      p_workspace_id, v_scope.scope_id, 'extract',
                      memory_private.content_hash(v_input::text), v_config)).blocked;
      select least(l.request_left, l.workspace_left) into v_budget
        from memory_private.budget_left(p_workspace_id, v_job.origin_request_id) l;
    end if;
    return query
    select y.scope_id, y.request_id, y.verdict, coalesce(y.skip, false), y.pos, y.bot_identity,
           y.messages, y.bytes, y.sources, y.last_activity,
           case when y.verdict = 'idle_window' then y.idle_until
                when y.verdict in ('no_budget', 'not_priced', 'job_backoff')
                  then v_job.next_attempt_at end
      from (
    select x.*,
           coalesce(x.reason, (
             select w.reason from memory_private.waiting_reasons w
              cross join (select coalesce(v_job.input -> 'sources' @> x.sources, false)
                                   as held) h
              where not x.skip
                and ((w.reason = 'job_running' and v_job.status = 'running' and h.held)
                  or (w.reason = 'no_budget' and v_kept and h.held
                      and (v_job.last_error = 'budget_exceeded' or v_budget <= 0))
                  or (w.reason = 'not_priced' and v_kept and h.held
                      and v_job.last_error = 'not_priced')
                  or (w.reason = 'job_backoff' and v_kept and h.held
                      and v_job.next_attempt_at > p_now)
                  or (w.reason = 'job_due' and v_kept and h.held)
                  or (w.reason = 'next_batch'
                      and (v_job.status = 'running' or v_kept or not x.in_batch))
                  or (w.reason = 'job_stopped' and x.in_batch and v_blocked
                      and v_job.status is distinct from 'running' and not v_kept))
              order by w.rank limit 1)) as verdict
      from jsonb_to_recordset(v_scope.rows) as x(
             scope_id bigint, request_id text, reason text, skip boolean, pos bigint,
             in_batch boolean, bot_identity text, messages bigint, bytes integer,
             sources jsonb, last_activity timestamptz, idle_until timestamptz)) y;
  end loop;
end
$$;
comment on function memory_private.extraction_verdict(text, bigint[], timestamptz) is
  'The scheduling verdict of extraction for the given scopes: every conversation not yet '
  'handled (memory_private.extraction_candidates) with the first reason it waits, in the order '
  'of memory_private.waiting_reasons, or NULL when the next tick takes it (skip: it is recorded '
  'skipped, too large for any batch; place: its place among the scope''s qualifying '
  'conversations, newest first). '
  'With its messages not yet handled, sources, last activity and when it moves on by itself '
  '(the idle window''s end, the job''s next attempt). The scheduler takes the rows without a '
  'reason (memory_private.schedule_extraction); memory.waiting_status counts them by reason.';

create function memory_private.schedule_batch(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_batch jsonb, p_origin text,
  p_skipped jsonb, p_skip_origin text, p_skip_reason text
) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_config integer;
  v_input jsonb;
  v_skip_job bigint;
  v_now timestamptz := memory_private.clock_now();
  v_result jsonb := '{}';
begin
  select config_version into v_config from memory_private.workspaces
   where workspace_id = p_workspace_id;
  if jsonb_array_length(p_skipped) > 0 then
    -- Conversations that cannot fit alone: recorded as a skipped job, never retried (P4).
    v_input := jsonb_build_object('bot_identity', p_bot_identity, 'sources', p_skipped,
                                  'existing', '[]'::jsonb);
    v_skip_job := memory_private.create_job(p_workspace_id, p_scope_id, 'extract', v_input,
                    memory_private.content_hash(v_input::text), p_skip_origin, v_config,
                    p_skip_reason);
    insert into memory_private.extracted_sources
      (workspace_id, scope_id, message_id, content_hash, outcome, job_id, created_at)
    select p_workspace_id, p_scope_id, s.id, s.hash, 'skipped', v_skip_job, v_now
      from jsonb_to_recordset(p_skipped) as s(id text, hash text)
    on conflict do nothing;
    v_result := jsonb_build_object('batches_skipped', 1);
  end if;
  if jsonb_array_length(p_batch) = 0 then
    return v_result;
  end if;
  return v_result || memory_private.renew_open_job(
    p_workspace_id, p_scope_id, 'extract',
    memory_private.extraction_input(p_workspace_id, p_scope_id, p_bot_identity, p_batch),
    p_origin, v_config);
end
$$;
comment on function memory_private.schedule_batch(text, bigint, text, jsonb, text, jsonb, text,
                                                  text) is
  'What the scheduler does with a scope''s conversations the verdict left without a reason: '
  'records those that cannot fit alone as a skipped job (their sources marked skipped, never '
  'retried, P4), and creates or renews the extraction job of the batch (memory_private.'
  'renew_open_job), charged to its newest conversation''s request. Returns counts.';

create function memory_private.plan_idle_end(
  p_workspace_id text, p_request_id text, p_at timestamptz
) returns void
  language plpgsql volatile
  as $$
begin
  -- One row per conversation: a newer plan replaces the one before (its last activity moved,
  -- or the idle window changed). Only a tick writes these, under the memory lock.
  insert into memory_private.maintenance_due (workspace_id, due_at, request_id, foreseen)
  values (p_workspace_id, p_at, p_request_id, true)
  on conflict (workspace_id, request_id) where foreseen and request_id is not null
  do update set due_at = excluded.due_at;
end
$$;
comment on function memory_private.plan_idle_end(text, text, timestamptz) is
  'Makes the workspace due when a conversation''s idle window ends (P3), naming its request: '
  'the foreseen row of that conversation, one at most, moved to p_at.';

create function memory_private.schedule_extraction(p_workspace_id text, p_scope_ids bigint[])
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_ceiling integer := (memory_private.policy()).batch_bytes;
  v_most integer := (memory_private.policy()).batch_messages;
  v_row record;
  v_scope bigint;
  v_identity text;
  v_batch jsonb := '[]';
  v_origin text;
  v_skipped jsonb := '[]';
  v_skip_origin text;
  v_skip_reason text;
  v_blocked bigint[] := '{}';
  v_result jsonb := '{}';
  v_now timestamptz := memory_private.clock_now();  -- the coordinator's clock on Citus
begin
  -- The verdict's rows without a reason, scope by scope (newest first): the batch, and those
  -- too large for any; a conversation whose idle window has yet to pass gets its idle end
  -- planned, so that the tick of that moment derives it again.
  for v_row in
    select * from memory_private.extraction_verdict(p_workspace_id, p_scope_ids, v_now) v
     where v.reason is null or v.reason in ('idle_window', 'job_stopped')
     order by v.scope_id, v.place
  loop
    if v_row.scope_id is distinct from v_scope then
      if v_scope is not null then
        v_result := memory_private.add_counts(v_result, memory_private.schedule_batch(
          p_workspace_id, v_scope, v_identity, v_batch, v_origin, v_skipped, v_skip_origin,
          v_skip_reason));
      end if;
      v_scope := v_row.scope_id;
      v_identity := v_row.bot_identity;
      v_batch := '[]';
      v_origin := null;
      v_skipped := '[]';
      v_skip_origin := null;
      v_skip_reason := null;
    end if;
    if v_row.reason = 'idle_window' then
      perform memory_private.plan_idle_end(p_workspace_id, v_row.request_id,
                                           v_row.next_change_at);
    elsif v_row.reason = 'job_stopped' then
      -- the batch's input stopped: not replayed (P13), counted once per scope
      v_blocked := v_blocked || v_row.scope_id;
    elsif v_row.skip then
      v_skipped := v_skipped || v_row.sources;
      v_skip_origin := coalesce(v_skip_origin, v_row.request_id);
      v_skip_reason := coalesce(v_skip_reason, format(
        'the conversation of request %s is %s bytes in %s messages: not even one '
        'user/assistant pair fits the batch ceiling of %s bytes and %s messages',
        v_row.request_id, v_row.bytes, jsonb_array_length(v_row.sources), v_ceiling, v_most));
    else
      v_batch := v_batch || v_row.sources;
      v_origin := coalesce(v_origin, v_row.request_id);
    end if;
  end loop;
  if v_scope is not null then
    v_result := memory_private.add_counts(v_result, memory_private.schedule_batch(
      p_workspace_id, v_scope, v_identity, v_batch, v_origin, v_skipped, v_skip_origin,
      v_skip_reason));
  end if;
  if cardinality(v_blocked) > 0 then
    v_result := memory_private.add_counts(v_result, jsonb_build_object(
      'replays_blocked', (select count(distinct x) from unnest(v_blocked) as x)));
  end if;
  return v_result;
end
$$;
comment on function memory_private.schedule_extraction(text, bigint[]) is
  'Schedules extraction in the given scopes as their verdict says (memory_private.'
  'extraction_verdict): for each, the conversations without a reason become its batch (the '
  'most recent ones up to 24,000 bytes and 200 messages) or a skipped job (too large alone); '
  'the idle end of each conversation still in its idle window is planned. Returns counts.';

create function memory_private.schedule_consolidation(p_workspace_id text, p_scope_id bigint)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_ws memory_private.workspaces;
  v_gate record;
  v_candidates bigint[];
  v_origin text;
  v_job memory_private.jobs;
begin
  select * into v_ws from memory_private.workspaces where workspace_id = p_workspace_id;
  select * into v_gate from memory_private.scope_gate(p_workspace_id, p_scope_id);
  if v_gate.reason is not null
     or not exists (select 1 from memory_private.scopes
                     where workspace_id = p_workspace_id and scope_id = p_scope_id
                       and consolidation_due_at is not null)
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
    update memory_private.scopes set consolidation_due_at = null
     where workspace_id = p_workspace_id and scope_id = p_scope_id;
    delete from memory_private.scope_indexes
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
    jsonb_build_object('bot_identity', v_gate.bot_identity, 'candidates', to_jsonb(v_candidates)),
    v_origin, v_ws.config_version);
end
$$;
comment on function memory_private.schedule_consolidation(text, bigint) is
  'Creates (or renews) the consolidation job of a scope whose index is due and whose gate is '
  'open (memory_private.scope_gate), over its 48 most recent valid records, charged to the '
  'most recent candidate''s originating request; with no valid record, drops the index (its '
  'row) and the due flag instead. Returns counts.';

create function memory_private.schedule_jobs(
  p_workspace_id text, p_changed_requests text[] default null,
  p_changed_scopes bigint[] default null
) returns jsonb
  language plpgsql volatile
  as $$
declare
  v_scopes bigint[];
  v_scope_id bigint;
  v_counts jsonb := jsonb_build_object('extract_jobs_created', 0, 'consolidate_jobs_created', 0,
                                       'batches_skipped', 0);
begin
  if (select paused from memory_private.workspaces where workspace_id = p_workspace_id) then
    return v_counts;
  end if;
  -- After a change confined to some requests and scopes, only their scopes can have a new
  -- verdict: every other scope's is what the last tick derived, and what would change it comes
  -- as a change of its own (a job leaving running, a record deleted, a tool call name their
  -- scope; a message, its request; a conversation's idle end, its request). So a tick costs
  -- what the change touched, not the workspace's history or what waits elsewhere; with
  -- p_changed_requests NULL, every scope is derived.
  if p_changed_requests is null then
    v_scopes := array(select s.scope_id from memory_private.scopes s
                       where s.workspace_id = p_workspace_id order by 1);
  else
    v_scopes := array(
      select distinct x.scope_id
        from (select unnest(p_changed_scopes) as scope_id
              union all
              select s.scope_id
                from unnest(p_changed_requests) as q(request_id)
                join memory_private.requests r
                  on r.workspace_id = p_workspace_id and r.request_id = q.request_id
                join memory_private.scopes s
                  on s.workspace_id = r.workspace_id and s.bot_id = r.bot_id
                 and s.chat_id = r.chat_id
                 and ((s.kind = 'private' and s.user_id = r.user_id)
                      or (s.kind = 'shared' and s.topic_id = r.topic_id))
               where r.kind = 'interactive') x
       where x.scope_id is not null
       order by 1);
  end if;
  v_counts := memory_private.add_counts(v_counts,
                memory_private.schedule_extraction(p_workspace_id, v_scopes));
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
  'Maintenance step: schedules extraction in the scopes a change touched as their verdict says '
  '(memory_private.schedule_extraction), and consolidation for every scope whose index is due '
  '(nothing while the workspace is paused). With p_changed_requests (and p_changed_scopes), '
  'the scopes of those requests and those scopes: what changed since the last tick; every '
  'scope when NULL. Returns counts.';
