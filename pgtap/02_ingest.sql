-- Ingest validation errors carry our codes, and nothing crosses workspaces.
begin;
select plan(12);

select memory.upsert_workspace('wa', 1, 10, 0, 30);
select memory.upsert_workspace('wb', 1, 10, 0, 30);
select memory.upsert_member('wa', 'alice', 'owner', true);
select memory.upsert_bot('wa', 'bot', 'bot-id', true);
select memory.upsert_chat('wa', 'dm', 'private', 'alice', true);
select memory.upsert_request('wa', 'r1', 'bot', 'dm', 0, 'alice', 'interactive', 'succeeded',
                             'p', 'm', 1, 0, null);
select memory.upsert_message('wa', 'm1', 'r1', 'user', 'alice', 'secret plan', true, null, '{}');

select throws_ok($$ select memory.upsert_workspace(null, 1, 10, 0, 30) $$, 'MB001', null,
  'a missing workspace id is MB001');
select throws_ok($$ select memory.upsert_member('nowhere', 'u', 'member', true) $$, 'MB002', null,
  'an unknown workspace is MB002');
select throws_ok($$ select memory.upsert_chat('wa', 'dm', 'group', null, true) $$, 'MB003', null,
  'a chat changing kind is MB003');
select throws_ok($$ select memory.upsert_message('wa', 'big', 'r1', 'user', 'alice',
                      repeat('x', 64001), true, null, '{}') $$, 'MB004', null,
  'an oversized message is MB004');

-- Workspace B uses the same ids and sees none of A's facts.
select throws_ok($$ select memory.upsert_request('wb', 'r1', 'bot', 'dm', 0, 'alice',
                      'interactive', 'succeeded', 'p', 'm', 1, 0, null) $$, 'MB002', null,
  'a bot of workspace A is unknown in workspace B');
select throws_ok($$ select memory.upsert_message('wb', 'm1', 'r1', 'user', 'alice', 'x', true,
                      null, '{}') $$, 'MB002', null,
  'a request of workspace A is unknown in workspace B');
select throws_ok($$ select memory.remove_message('wb', 'm1') $$, 'MB002', null,
  'a message of workspace A cannot be removed through workspace B');
select throws_ok($$ select * from memory.resolve_scope('wb', 'r1') $$, 'MB002', null,
  'a request of workspace A does not resolve in workspace B');
select is((select body from memory_private.messages where workspace_id = 'wa' and message_id = 'm1'),
  'secret plan', 'workspace A''s message is intact');

select memory.upsert_bot('wb', 'bot', 'bot-id', true);
select memory.upsert_chat('wb', 'dm', 'private', 'alice', true);
select memory.upsert_request('wb', 'r1', 'bot', 'dm', 0, 'alice', 'interactive', 'succeeded',
                             'p', 'm', 1, 0, null);
select is(memory.upsert_message('wb', 'm1', 'r1', 'user', 'alice', 'other', true, null, '{}'),
  'inserted', 'the same message id in workspace B is a new message');
select isnt((select scope_id from memory.resolve_scope('wa', 'r1')),
            (select scope_id from memory.resolve_scope('wb', 'r1')),
  'the same ids resolve to different scopes in different workspaces');
select is((select count(*)::int from memory_private.messages where workspace_id = 'wa'), 1,
  'workspace A still has exactly its one message');

select * from finish();
rollback;
