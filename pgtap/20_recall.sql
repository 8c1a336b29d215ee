-- Recall and query_memories: scopes never leak, the directory fallback, freezing, usage once per
-- tool call, argument validation, and the backend role can call them.
begin;
select plan(16);

select memory.upsert_workspace('wa', 1, 10, 0, 30);
select memory.upsert_workspace('wb', 1, 10, 0, 30);
select memory.upsert_member(ws, u, 'member', true)
  from (values ('wa'), ('wb')) w(ws), (values ('alice'), ('bob')) m(u);
select memory.upsert_bot(ws, 'bot', 'bot-id', true) from (values ('wa'), ('wb')) w(ws);
select memory.upsert_chat('wa', 'dm-alice', 'private', 'alice', true);
select memory.upsert_chat('wa', 'dm-bob', 'private', 'bob', true);
select memory.upsert_chat('wb', 'dm-alice', 'private', 'alice', true);
select memory.upsert_chat('wa', 'grp', 'group', null, true);
select memory.upsert_topic('wa', 'grp', 7, 'planning');

-- One finished conversation and one record per scope (as the pipeline would leave them).
create temporary table made (name text primary key, ws text, record_id bigint);
create function pg_temp.remember(p_name text, p_ws text, p_chat text, p_user text,
                                 p_topic bigint, p_text text) returns bigint
  language plpgsql as $$
declare
  v_scope bigint;
  v_id bigint;
begin
  perform memory.upsert_request(p_ws, 'h-' || p_name, 'bot', p_chat, p_topic, p_user,
                                'interactive', 'succeeded', 'p', 'm', 1, 0, null);
  perform memory.upsert_message(p_ws, 'u-' || p_name, 'h-' || p_name, 'user', p_user, p_text,
                                true, null, '{}');
  select scope_id into v_scope from memory.resolve_scope(p_ws, 'h-' || p_name);
  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, bot_identity,
     created_at)
  values (p_ws, v_scope, 'extracted', p_name, p_text, array[p_user], array['h-' || p_name],
          'bot-id', memory_private.clock_now())
  returning record_id into v_id;
  insert into memory_private.record_dependencies
  select p_ws, v_id, message_id, content_hash, 'cited', 1 from memory_private.messages
   where workspace_id = p_ws and message_id = 'u-' || p_name;
  perform memory_private.advance_clock('1 second');
  insert into made values (p_name, p_ws, v_id);
  perform memory.upsert_request(p_ws, 'new-' || p_name, 'bot', p_chat, p_topic, p_user,
                                'interactive', 'running', 'p', 'm', 1, 0, null);
  return v_id;
end
$$;
select pg_temp.remember('alice', 'wa', 'dm-alice', 'alice', 0, 'alice likes tea');
select pg_temp.remember('bob', 'wa', 'dm-bob', 'bob', 0, 'bob likes jazz');
select pg_temp.remember('topic0', 'wa', 'grp', 'alice', 0, 'topic zero plan');
select pg_temp.remember('topic7', 'wa', 'grp', 'bob', 7, 'topic seven plan');
select pg_temp.remember('other_ws', 'wb', 'dm-alice', 'alice', 0, 'other workspace');

create temporary view seen as
  select m.name, (r ->> 'id')::bigint as record_id
    from made m
   cross join lateral jsonb_array_elements(
     memory.query_memories(m.ws, 'new-' || m.name, 'probe', '{}') -> 'records') r;

select set_eq($$ select name, record_id from seen $$,
              $$ select name, record_id from made $$,
  'every scope browses exactly its own record (private, group topics, workspaces)');
select is(memory.query_memories('wa', 'new-bob', 'c1',
            jsonb_build_object('id', (select record_id from made where name = 'alice'))) -> 'records',
          '[]'::jsonb, 'another user''s private record is not found by id');
select is(memory.query_memories('wa', 'new-topic7', 'c1', '{"query": "zero"}') -> 'records',
          '[]'::jsonb, 'another topic''s record is not found by search');

-- Directory fallback while consolidation is pending; index when consolidated.
select is(memory.recall('wa', 'new-alice') ->> 'mode', 'directory',
  'no consolidated index: a directory');
select memory_private.install_index('wa', s.scope_id, 'tea', array[m.record_id],
                                    array[m.record_id], 'bot-id')
  from made m, memory.resolve_scope('wa', 'h-alice') s where m.name = 'alice';
update memory_private.scopes set consolidation_due_at = null
 where workspace_id = 'wa' and scope_id = (select scope_id from memory.resolve_scope('wa', 'h-alice'));
select memory.upsert_request('wa', 'new2-alice', 'bot', 'dm-alice', 0, 'alice', 'interactive',
                             'running', 'p', 'm', 1, 0, null);
select is(memory.recall('wa', 'new2-alice') ->> 'index', 'tea', 'a consolidated index');
select ok(memory.recall('wa', 'new2-alice') ->> 'label' like '%approves nothing%',
  'recall is labelled as historical data that approves nothing');
select is(memory.recall('wa', 'new-alice') ->> 'mode', 'directory',
  'the first request keeps its frozen directory');

-- A source edited mid-request: dropped from recall, the index withdrawn.
select memory.upsert_message('wa', 'u-alice', 'h-alice', 'user', 'alice', 'alice likes coffee',
                             true, null, '{}');
select is(jsonb_array_length(memory.recall('wa', 'new2-alice') -> 'records'), 0,
  'an edited source drops its record from frozen recall');
select ok(memory.recall('wa', 'new2-alice') -> 'index' = 'null'::jsonb,
  'and the frozen index naming it is withheld');

-- Usage once per tool call id.
select memory.query_memories('wa', 'new-bob', 'u1', '{}');
select memory.query_memories('wa', 'new-bob', 'u1', '{}');
select is((select usage_count from memory_private.record_usage r join made m using (record_id)
            where m.name = 'bob'), 2, 'the probe and u1 counted once each; the replay did not');
select is((select count(*)::int from memory.request_citations('wa', 'new-bob')), 1,
  'returned sources are in the citation set');

-- Validation and scheduled requests.
select throws_ok($$ select memory.query_memories('wa', 'new-bob', 'v1', '{"limit": 13}') $$,
  'MB001', null, 'limit above 12 is MB001');
select throws_ok($$ select memory.query_memories('wa', 'new-bob', 'v1', '{"size": 1}') $$,
  'MB001', null, 'an unknown key is MB001');
select memory.upsert_request('wa', 'sched', 'bot', 'dm-alice', 0, 'alice', 'scheduled',
                             'running', 'p', 'm', 1, 0, null);
select is(memory.recall('wa', 'sched'), '{"mode": "none"}'::jsonb,
  'a scheduled request recalls nothing');

-- The backend role may call recall; nobody else.
create role pimem_test_recall login in role memory_backend;
set role pimem_test_recall;
select lives_ok($$ select memory.recall('wa', 'new-bob') $$, 'the backend role can recall');
reset role;
create role pimem_test_nobody login;
set role pimem_test_nobody;
select throws_ok($$ select memory.query_memories('wa', 'new-bob', 'x', '{}') $$, '42501', null,
  'a role without memory_backend cannot query memories');
reset role;

select * from finish();
rollback;
