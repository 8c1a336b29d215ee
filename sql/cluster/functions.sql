-- sql/cluster/functions.sql: what runs on a Citus cluster in place of sql/'s SQL functions.
--
-- Written by `pimem cluster-code` from sql/ (pyworker/lab/cluster_code.py); never edit it: edit
-- sql/ and run the command again (tests/test_cluster_code.py checks the file is its output).
-- `pimem migrate` applies it on a Citus coordinator in the transaction of the migrations, so no
-- migration leaves the one-server form running on the cluster (docs/scaling.md).
--
-- On one server these helpers are SQL, inlined into their callers' plans. On Citus an inlined
-- helper reads the tables' empty shells on a shard, and a statement of a SQL function with
-- parameters cannot be planned: each is PL/pgSQL here, with its header exactly as sql/ writes
-- it but for the language, and its one statement returned as it is (columns win over variables
-- of the same name, as in SQL). `create or replace` keeps each function's owner, comment and
-- grants. Then the functions that pin generic plans on one server get the default back: Citus
-- routes a statement by its parameters' values, which a generic plan lacks.

-- memory_private.clock_now (00_base.sql:60)
create or replace function memory_private.clock_now() returns timestamptz
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return ( select now() + (select time_offset from memory_private.clock));
end
$$;

-- memory_private.tombstone (20_memory_state.sql:437)
create or replace function memory_private.tombstone(
  p_workspace_id text, p_scope_id bigint, p_message_id text
) returns setof memory_private.tombstones
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Inlined (no SET clause) wherever it is asked: exists (select from tombstone(...)).
  select t.* from memory_private.tombstones t
   where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
     and t.message_id = p_message_id;
end
$$;

-- memory_private.retention_ends (20_memory_state.sql:677)
create or replace function memory_private.retention_ends(p_workspace_id text)
  returns table (message_id text, request_id text, retain_until timestamptz)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Inlined (no SET clause): read from messages_retention_idx, earliest first when the caller
  -- orders by retain_until; whether one is still retained is memory_private.is_retained.
  select m.message_id, m.request_id, m.retain_until from memory_private.messages m
   where m.workspace_id = p_workspace_id and m.body is not null
     and m.retain_until is not null;
end
$$;

-- memory_private.scope_checks (20_memory_state.sql:724)
create or replace function memory_private.scope_checks(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns table (rank integer, check_name text, reason text, ok boolean, detail text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- One query (inlined into its callers' plans): the scope, its bot, its chat's link and the
  -- reader's membership. The reader: the private scope's user, or the requester of a shared
  -- scope (none for background work, which then checks no membership). No scope, no rows.
  select c.rank, c.check_name, c.reason, c.ok, c.detail
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
    left join memory_private.chats ch
      on ch.workspace_id = s.workspace_id and ch.chat_id = s.chat_id
    left join memory_private.members m
      on m.workspace_id = s.workspace_id and m.user_id = coalesce(s.user_id, p_requester)
   cross join lateral (values
    (1, 'recall_enabled', 'recall_disabled', s.recall_enabled,
     case when s.recall_enabled then 'recall is on in the scope'
          else 'recall is off in the scope (records kept, not read)' end),
    (2, 'bot_active', 'bot_inactive', coalesce(b.active, false),
     case when b.bot_id is null then format('bot %s is unknown', s.bot_id)
          when b.active then format('bot %s is active', b.bot_id)
          else format('bot %s is inactive', b.bot_id) end),
    (3, 'group_linked', 'group_unlinked', s.kind = 'private' or coalesce(ch.linked, false),
     case when s.kind = 'private' then 'private scope: no group link needed'
          when ch.linked then format('group %s is linked', s.chat_id)
          else format('group %s is not linked', s.chat_id) end),
    (4, 'membership', 'membership',
     coalesce(s.user_id, p_requester) is null or coalesce(m.active, false),
     case when coalesce(s.user_id, p_requester) is null
            then 'shared scope and no requester: per-requester membership not checked'
          when m.user_id is null
            then format('user %s is not a member of the workspace',
                        coalesce(s.user_id, p_requester))
          when m.active then format('user %s is an active %s', m.user_id, m.role)
          else format('user %s is an inactive member', m.user_id) end),
    (4, 'requester_is_scope_user', 'membership',
     p_requester is null or s.kind <> 'private' or p_requester = s.user_id,
     case when p_requester is null then 'no requester given'
          when s.kind <> 'private' then 'shared scope: any active member'
          when p_requester = s.user_id then 'the requester owns the private scope'
          else format('the private scope belongs to %s, not %s', s.user_id,
                      p_requester) end)
   ) as c(rank, check_name, reason, ok, detail)
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id;
end
$$;

-- memory_private.own_reasons (20_memory_state.sql:791)
create or replace function memory_private.own_reasons(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_now timestamptz
) returns table (reason text, message_id text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Inlined (no SET clause), from columns a reader of the record has in hand: no read of the
  -- record itself. The bot replaced since the record was made (p_bot_identity: the scope's bot
  -- now; p_record_identity: the record's) ...
  select 'bot_replaced', null::text
   where p_record_identity <> p_bot_identity
  union all
  -- ... and every dependency that is not current (the record's copy of its dependencies, with
  -- the hashes they had when it was made).
  select x.state, d.message_id
    from unnest(p_dependency_ids, p_dependency_hashes) as d(message_id, content_hash)
   cross join lateral (
     -- each message by its key (kept apart: joined, a planner that takes the dependencies for
     -- ten may read every message of the workspace for them)
     select m.removed_at, m.content_hash, m.retain_until from memory_private.messages m
      where m.workspace_id = p_workspace_id and m.message_id = d.message_id
     offset 0) m
   cross join lateral (
     -- content_hash, not body: NULL exactly when the text is gone, and in messages_state_idx
     select memory_private.dependency_state(
              m.removed_at, m.content_hash is not null, m.retain_until, m.content_hash,
              d.content_hash,
              exists (select from memory_private.tombstone(p_workspace_id, p_scope_id,
                                                           d.message_id)),
              p_now) as state) x
   where x.state is not null;
end
$$;

-- memory_private.record_reasons (20_memory_state.sql:830)
create or replace function memory_private.record_reasons(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[],
  p_now timestamptz default memory_private.clock_now()
) returns table (record_id bigint, reason text, message_id text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- memory_private.own_reasons of each record, read from its own page (its copy of its
  -- dependencies), which every reader of the record reads anyway; the scope's bot identity
  -- once.
  select r.record_id, x.reason, x.message_id
    from (select (select b.identity
                    from memory_private.scopes s
                    join memory_private.bots b
                      on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
                   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id) as identity
          offset 0) sb  -- a column, not a subquery: own_reasons is then inlined
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
   cross join lateral memory_private.own_reasons(p_workspace_id, p_scope_id, sb.identity,
                                                 r.bot_identity, r.dependency_ids,
                                                 r.dependency_hashes, p_now) x;
end
$$;

-- memory_private.missing_grants (20_memory_state.sql:858)
create or replace function memory_private.missing_grants(
  p_workspace_id text, p_reader text, p_repositories text[]
) returns table (repository_id text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Inlined (no SET clause). No reader (background work on a shared scope): nothing is checked.
  select repo.repository_id
    from unnest(p_repositories) as repo(repository_id)
   where p_reader is not null
     and not exists (select 1 from memory_private.repository_grants g
                      where g.workspace_id = p_workspace_id and g.user_id = p_reader
                        and g.repository_id = repo.repository_id);
end
$$;

-- memory_private.record_invalid_reason (20_memory_state.sql:990)
create or replace function memory_private.record_invalid_reason(
  p_record memory_private.records, p_requester text
) returns text
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return (
  select v.reason
    from memory_private.invalid_records(p_record.workspace_id, p_record.scope_id,
                                        array[p_record.record_id], p_requester) v
   limit 1  -- one row at most (one id); the cluster's form depends on it (cluster_code.py)
  );
end
$$;

-- memory_private.record_failures (20_memory_state.sql:1118)
create or replace function memory_private.record_failures(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_repositories text[], p_reader text,
  p_now timestamptz
) returns table (reason text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Inlined (no SET clause), with own_reasons and missing_grants inside it: the checks of one
  -- record for a reader, from the record's columns, as a reader walking records one by one
  -- asks them.
  select x.reason
    from memory_private.own_reasons(p_workspace_id, p_scope_id, p_bot_identity,
                                    p_record_identity, p_dependency_ids, p_dependency_hashes,
                                    p_now) x
  union all
  select 'grant_revoked'
    from memory_private.missing_grants(p_workspace_id, p_reader, p_repositories)
   where cardinality(p_repositories) > 0  -- no call without repositories (planned on Citus)
  ;
end
$$;

-- memory_private.budget_left (40_jobs.sql:228)
create or replace function memory_private.budget_left(p_workspace_id text, p_request_id text)
  returns table (request_left numeric, workspace_left numeric)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- What a model call may still spend (P17): the request's budget less what the backend spent
  -- and what memory work charged to it; the workspace's likewise.
  select (select q.budget_usd - q.spent_usd
                 - memory_private.request_memory_spent(q.workspace_id, q.request_id)
            from memory_private.requests q
           where q.workspace_id = p_workspace_id and q.request_id = p_request_id),
         (select w.budget_usd - w.spent_usd - m.memory_spent_usd
            from memory_private.workspaces w
            join memory_private.workspace_memory m on m.workspace_id = w.workspace_id
           where w.workspace_id = p_workspace_id);
end
$$;

-- memory_private.scope_gate (40_jobs.sql:312)
create or replace function memory_private.scope_gate(p_workspace_id text, p_scope_id bigint)
  returns table (reason text, recall_enabled boolean, bot_identity text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
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
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id;
end
$$;

-- memory_private.extraction_candidates (45_scheduling.sql:216)
create or replace function memory_private.extraction_candidates(
  p_workspace_id text, p_scope_ids bigint[], p_now timestamptz
) returns table (
  scope_id bigint, request_id text, reason text, bot_identity text, finished_at timestamptz,
  created_at timestamptz, messages bigint, bytes integer, sources jsonb,
  last_activity timestamptz, idle_until timestamptz
)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
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
   where u.fresh > 0;
end
$$;

-- memory_private.fuzzy_candidates (48_search.sql:506)
create or replace function memory_private.fuzzy_candidates(
  p_workspace_id text, p_scope_id bigint, p_words text[]
) returns table (query_word text, word text, similarity real)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- For each query word, the scope's words that start with its first three characters and are
  -- nearest to it in spelling (byte) order: up to fuzzy_neighbours at or after it and as many
  -- before it, each read from scope_words' primary key in order (two bounded index scans).
  -- Typos after the third character and partial words sort near the word they miss. So a
  -- query word costs at most 2 x fuzzy_neighbours index entries and similarities, whatever the
  -- scope holds.
  select q.w, n.word, memory_private.trgm_word_similarity(q.w, n.word)
    from unnest(p_words) q(w)
   cross join lateral (
     select c.word
       from ((select r.word from memory_private.scope_words r
               where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
                 and r.word >= q.w collate "C"
                 and r.word < left(q.w, 3) || chr(1114111) collate "C"
               order by r.word
               limit (memory_private.policy()).fuzzy_neighbours)
             union all
             (select r.word from memory_private.scope_words r
               where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
                 and r.word < q.w collate "C"
                 and r.word >= left(q.w, 3) collate "C"
               order by r.word desc
               limit (memory_private.policy()).fuzzy_neighbours)) c
      where left(c.word, 3) = left(q.w, 3)) n;
end
$$;

-- memory_private.record_detail (50_recall.sql:307)
create or replace function memory_private.record_detail(
  p_record memory_private.records, p_source_ids text[], p_source_count bigint,
  p_last_used_at timestamptz, p_match text, p_rank integer
) returns memory_private.record_answer
  language plpgsql stable
  -- One expression, so that it is inlined into answer_records' statement.
  as $$
#variable_conflict use_column
begin
  return (
  select row(p_record.record_id, p_record.kind, p_record.title, p_record.summary,
             p_record.speaker_ids[1:(memory_private.policy()).shown_ids],
             p_record.thread_ids[1:(memory_private.policy()).shown_ids], p_source_ids,
             p_source_count,
             greatest(p_source_count - (memory_private.policy()).shown_sources, 0),
             p_record.created_at, p_last_used_at, p_match, p_rank,
             cardinality(p_record.speaker_ids),
             greatest(cardinality(p_record.speaker_ids) - (memory_private.policy()).shown_ids, 0),
             cardinality(p_record.thread_ids),
             greatest(cardinality(p_record.thread_ids) - (memory_private.policy()).shown_ids, 0)
            )::memory_private.record_answer);
end
$$;

-- memory_private.record_owners (55_control.sql:246)
create or replace function memory_private.record_owners(p_workspace_id text, p_record_ids bigint[])
  returns table (record_id bigint, owner_id text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Whose statements a record holds: the speaker of every user message it depends on, and for
  -- an assistant message the user whose request it answered (the bot's answer is part of that
  -- person's conversation).
  select distinct d.record_id, case when m.role = 'user' then m.speaker_id else q.user_id end
    from memory_private.record_dependencies d
    join memory_private.messages m
      on m.workspace_id = d.workspace_id and m.message_id = d.message_id
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where d.workspace_id = p_workspace_id and d.record_id = any(p_record_ids);
end
$$;

-- memory_private.request_provenance (60_retention.sql:52)
create or replace function memory_private.request_provenance(p_workspace_id text, p_request_id text)
  returns setof text
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  select unnest(f.dependency_ids)
    from memory_private.request_recall f
   where f.workspace_id = p_workspace_id and f.request_id = p_request_id
  union
  select d.message_id
    from memory_private.request_recall f
    join memory_private.record_dependencies d
      on d.workspace_id = f.workspace_id and d.record_id = any(f.basis_record_ids)
   where f.workspace_id = p_workspace_id and f.request_id = p_request_id
  union
  select unnest(c.dependency_ids)
    from memory_private.tool_calls c
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
     and c.tool = 'query_memories'
  union
  select d.message_id
    from memory_private.tool_calls c
    join memory_private.record_dependencies d
      on d.workspace_id = c.workspace_id and d.record_id = any(c.record_ids)
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
     and c.tool = 'query_memories';
end
$$;

-- memory_private.member_messages (65_member_data.sql:17)
create or replace function memory_private.member_messages(p_workspace_id text, p_user_id text)
  returns table (message_id text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- Their statements: what they said, anywhere, and the bot's answers in their requests.
  select m.message_id from memory_private.messages m
   where m.workspace_id = p_workspace_id and m.role = 'user' and m.speaker_id = p_user_id
  union
  select m.message_id
    from memory_private.requests q
    join memory_private.messages m
      on m.workspace_id = q.workspace_id and m.request_id = q.request_id
   where q.workspace_id = p_workspace_id and q.user_id = p_user_id;
end
$$;

-- memory_private.due_workspaces (70_maintenance.sql:57)
create or replace function memory_private.due_workspaces(
  p_after_workspace_id text, p_limit integer, p_now timestamptz
) returns setof text
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- From the indexes alone: the rows due at p_now, and the running jobs (one per workspace at
  -- most) whose lease has expired. (The caller reads the clock: on Citus this statement runs
  -- on every node, each with its own.)
  select d.workspace_id
    from (select workspace_id from memory_private.maintenance_due
           where due_at <= p_now
          union
          select workspace_id from memory_private.jobs
           where status = 'running' and lease_expires_at <= p_now) d
   where p_after_workspace_id is null or d.workspace_id > p_after_workspace_id
   order by d.workspace_id
   limit p_limit;
end
$$;

-- memory_private.scope_validity (80_operator.sql:48)
create or replace function memory_private.scope_validity(p_workspace_id text, p_scope_id bigint)
  returns table (record_id bigint, reason text)
  language plpgsql stable
  as $$
#variable_conflict use_column
begin
  return query
  -- The validity rule without a requester for every record of one scope, in one set.
  select v.record_id, v.reason
    from memory_private.invalid_records(
           p_workspace_id, p_scope_id,
           array(select r.record_id from memory_private.records r
                  where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id), null) v;
end
$$;

-- The API plans its statements for each call on the cluster (docs/scaling.md, Routing).
alter function memory.upsert_workspace set plan_cache_mode = force_custom_plan;
alter function memory.upsert_member set plan_cache_mode = force_custom_plan;
alter function memory.upsert_bot set plan_cache_mode = force_custom_plan;
alter function memory.upsert_chat set plan_cache_mode = force_custom_plan;
alter function memory.upsert_topic set plan_cache_mode = force_custom_plan;
alter function memory.set_repository_grant set plan_cache_mode = force_custom_plan;
alter function memory.upsert_request set plan_cache_mode = force_custom_plan;
alter function memory.finish_request set plan_cache_mode = force_custom_plan;
alter function memory.upsert_message set plan_cache_mode = force_custom_plan;
alter function memory.remove_message set plan_cache_mode = force_custom_plan;
alter function memory.resolve_scope set plan_cache_mode = force_custom_plan;
alter function memory.claim_job set plan_cache_mode = force_custom_plan;
alter function memory.extend_lease set plan_cache_mode = force_custom_plan;
alter function memory.start_attempt set plan_cache_mode = force_custom_plan;
alter function memory.save_checkpoint set plan_cache_mode = force_custom_plan;
alter function memory.commit_job set plan_cache_mode = force_custom_plan;
alter function memory.fail_job set plan_cache_mode = force_custom_plan;
alter function memory.recall set plan_cache_mode = force_custom_plan;
alter function memory.query_memories set plan_cache_mode = force_custom_plan;
alter function memory.request_citations set plan_cache_mode = force_custom_plan;
alter function memory.manage_memory set plan_cache_mode = force_custom_plan;
alter function memory.delete_workspace set plan_cache_mode = force_custom_plan;
alter function memory.answer_retention_boundary set plan_cache_mode = force_custom_plan;
alter function memory.member_memories set plan_cache_mode = force_custom_plan;
alter function memory.erase_member set plan_cache_mode = force_custom_plan;
alter function memory.run_maintenance set plan_cache_mode = force_custom_plan;
alter function memory.maintain_next_workspace set plan_cache_mode = force_custom_plan;
alter function memory.record_status set plan_cache_mode = force_custom_plan;
alter function memory.scope_status set plan_cache_mode = force_custom_plan;
alter function memory.workspace_status set plan_cache_mode = force_custom_plan;
alter function memory.waiting_status set plan_cache_mode = force_custom_plan;
alter function memory.job_status set plan_cache_mode = force_custom_plan;
alter function memory.request_memory_charges set plan_cache_mode = force_custom_plan;
alter function memory.retry_job set plan_cache_mode = force_custom_plan;
alter function memory.set_workspace_paused set plan_cache_mode = force_custom_plan;
alter function memory.explain_record set plan_cache_mode = force_custom_plan;
alter function memory.workspace_node set plan_cache_mode = force_custom_plan;
alter function memory.workspace_nodes set plan_cache_mode = force_custom_plan;
