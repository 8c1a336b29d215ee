-- manage_memory: direct requests only, group ownership rules, disable/enable, replays.
begin;
select plan(25);

-- Recognition of direct requests (the full table of phrasings is in tests/data).
select is(memory_private.classify_request(t), e, format('%s -> %s', t, coalesce(e, 'refused')))
  from (values ('remember that I prefer tea', 'remember'),
               ('请记住：我对花生过敏', 'remember'),
               ('please forget what I said', 'forget'),
               ('忘掉这件事', 'forget'),
               ('turn off memory', 'disable-memory'),
               ('关闭记忆', 'disable-memory'),
               ('打开记忆', 'enable-memory'),
               ('> remember that I prefer tea', null),
               ('what does remember do?', null),
               ('记住是什么意思？', null),
               ('don''t remember this', null),
               ('不要记住', null)) as c(t, e);

select memory.upsert_workspace('wa', 1, 10, 0, 30);
select memory.upsert_member('wa', 'owner', 'owner', true);
select memory.upsert_member('wa', 'bob', 'member', true);
select memory.upsert_member('wa', 'carol', 'member', true);
select memory.upsert_bot('wa', 'bot', 'bot-id', true);
select memory.upsert_chat('wa', 'grp', 'group', null, true);

create function pg_temp.say(p_request text, p_user text, p_text text) returns text
  language sql as $$
  select memory.upsert_request('wa', p_request, 'bot', 'grp', 0, p_user, 'interactive',
                               'running', 'p', 'm', 1, 0, null);
  select memory.upsert_message('wa', p_request || '-u', p_request, 'user', p_user, p_text, true,
                               null, '{}');
  select p_request || '-u';
$$;

-- Bob and Carol each add a note; both are attributed to their speaker.
select pg_temp.say('b1', 'bob', 'remember that bob reviews on tuesdays');
select pg_temp.say('c1', 'carol', 'remember that carol deploys on fridays');
select is(memory.manage_memory('wa', 'b1', 't1', '{"action": "remember", "sourceId": "b1-u"}')
            ->> 'status', 'done', 'a participant adds a note');
select is(memory.manage_memory('wa', 'c1', 't1', '{"action": "remember", "sourceId": "c1-u"}')
            ->> 'status', 'done', 'another participant adds a note');
select is((select speaker_ids from memory_private.records where origin_request_id = 'b1'),
          array['bob'], 'the note is attributed to its speaker');
select is(memory.manage_memory('wa', 'b1', 't1', '{"action": "remember", "sourceId": "b1-u"}')
            ->> 'replayed', 'true', 'a replay is recognised');
select is((select count(*)::int from memory_private.records), 2,
  'and not applied twice');

-- Bob may not forget Carol's note; the owner may. Bob may forget his own.
select pg_temp.say('b2', 'bob', 'forget carol''s note');
select is(memory.manage_memory('wa', 'b2', 't1', jsonb_build_object(
            'action', 'forget', 'sourceId', 'b2-u', 'memoryId',
            (select record_id from memory_private.records where origin_request_id = 'c1')))
            ->> 'code', 'not_allowed', 'a participant cannot forget another''s record');
select pg_temp.say('o1', 'owner', 'forget carol''s note');
select is(memory.manage_memory('wa', 'o1', 't1', jsonb_build_object(
            'action', 'forget', 'sourceId', 'o1-u', 'memoryId',
            (select record_id from memory_private.records where origin_request_id = 'c1')))
            ->> 'status', 'done', 'the owner can');
select is((select count(*)::int from memory_private.tombstones where message_id = 'c1-u'), 1,
  'forgetting leaves a content-free tombstone');
select pg_temp.say('b3', 'bob', 'please forget my note');
select is(memory.manage_memory('wa', 'b3', 't1', jsonb_build_object(
            'action', 'forget', 'sourceId', 'b3-u', 'memoryId',
            (select record_id from memory_private.records where origin_request_id = 'b1')))
            ->> 'status', 'done', 'a participant forgets their own record');

-- Toggling group recall needs an owner/admin; records are kept while off.
select pg_temp.say('c2', 'carol', 'remember that carol likes tea');
select memory.manage_memory('wa', 'c2', 't1', '{"action": "remember", "sourceId": "c2-u"}');
select pg_temp.say('b4', 'bob', 'turn off memory');
select is(memory.manage_memory('wa', 'b4', 't1', '{"action": "disable-memory", "sourceId": "b4-u"}')
            ->> 'status', 'refused', 'a participant cannot turn group memory off');
select pg_temp.say('o2', 'owner', 'turn off memory');
select is(memory.manage_memory('wa', 'o2', 't1', '{"action": "disable-memory", "sourceId": "o2-u"}')
            ->> 'status', 'done', 'the owner can');
select is(memory.recall('wa', 'b4'), '{"mode": "disabled"}'::jsonb,
  'nothing is recalled while off');
select is((select count(*)::int from memory_private.records), 1, 'records are kept while off');

select * from finish();
rollback;
