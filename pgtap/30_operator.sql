-- The operator's views and admin functions: only memory_operator reaches them, they show no
-- text, and they answer what a DBA asks.
begin;
select plan(33);

-- A workspace with one private conversation and a record made from it.
select memory.upsert_workspace('ops', 1, 10, 0, 30);
select memory.upsert_member('ops', 'alice', 'owner', true);
select memory.upsert_bot('ops', 'bot1', 'bot1-identity', true);
select memory.upsert_chat('ops', 'dm-alice', 'private', 'alice', true);
select memory.upsert_request('ops', 'r1', 'bot1', 'dm-alice', 0, 'alice', 'interactive',
                             'succeeded', 'fake', 'm', 1.0, 0, null);
select memory.upsert_message('ops', 'r1-u', 'r1', 'user', 'alice', 'I prefer tea', true, null,
                             '{}');
select memory.upsert_message('ops', 'r1-a', 'r1', 'assistant', 'bot1', 'Noted.', true, null, '{}');
select scope_id from memory.resolve_scope('ops', 'r1');
insert into memory_private.records (workspace_id, scope_id, kind, title, summary, speaker_ids,
                                    thread_ids, bot_identity, origin_request_id, created_at)
select 'ops', scope_id, 'extracted', 'Tea', 'Alice prefers tea.', '{alice}', '{r1}',
       'bot1-identity', 'r1', memory_private.clock_now()
  from memory.resolve_scope('ops', 'r1');
insert into memory_private.record_dependencies
  (workspace_id, record_id, message_id, content_hash, via, position)
select 'ops', r.record_id, m.message_id, m.content_hash, 'cited',
       row_number() over (partition by r.record_id order by m.message_id)
  from memory_private.records r, memory_private.messages m
 where r.workspace_id = 'ops' and m.workspace_id = 'ops';

-- Grants --------------------------------------------------------------------------------------

create temporary view operator_views(view_name) as
  values ('record_status'), ('scope_status'), ('workspace_status'), ('job_status'),
         ('request_memory_charges');
grant select on operator_views to public;

select is_empty($$
  select view_name from operator_views
   where not has_table_privilege('memory_operator', 'memory.' || view_name, 'select')
$$, 'the operator can read every operator view');

select is_empty($$
  select r || ' reads ' || view_name from operator_views,
         unnest(array['memory_backend', 'memory_worker', 'public']) r
   where has_table_privilege(r, 'memory.' || view_name, 'select, insert, update, delete')
$$, 'neither the backend, the worker nor PUBLIC can read an operator view');

select is_empty($$
  select c.relname || '.' || a.attname
    from pg_class c join pg_namespace n on n.oid = c.relnamespace
    join pg_attribute a on a.attrelid = c.oid and a.attnum > 0
   where n.nspname = 'memory' and c.relkind = 'v'
     and a.attname in ('title', 'summary', 'body', 'text', 'index_text', 'input', 'checkpoint',
                       'output')
$$, 'no view has a text, title, summary, index, input or checkpoint column');

create role pimem_test_operator login in role memory_operator;
create role pimem_test_backend2 login in role memory_backend;
create role pimem_test_worker2 login in role memory_worker;

-- What the operator sees --------------------------------------------------------------------

set role pimem_test_operator;
select is((select records_valid from memory.workspace_status where workspace_id = 'ops'),
          1::bigint, 'workspace_status counts the valid record');
select is((select recall_enabled from memory.scope_status where workspace_id = 'ops'), true,
          'scope_status shows recall on');
select is((select valid from memory.record_status where workspace_id = 'ops'), true,
          'record_status shows the record valid');
select is((memory.explain_record('ops', (select record_id from memory.record_status
                                          where workspace_id = 'ops')) ->> 'valid'), 'true',
          'explain_record says the record is valid');
select throws_ok($$ select memory.explain_record('ops', -1) $$, 'MB002', null,
                 'explain_record of an unknown record is MB002');
select throws_ok($$ select memory.retry_job('ops', -1) $$, 'MB002', null,
                 'retry_job of an unknown job is MB002');
select throws_ok($$ select memory.retry_job('nope', 1) $$, 'MB002', null,
                 'retry_job in an unknown workspace is MB002');
select is((memory.set_workspace_paused('ops', true) ->> 'changed'), 'true',
          'the operator pauses a workspace');
select is((select paused from memory.workspace_status where workspace_id = 'ops'), true,
          'workspace_status shows it paused');
select is((memory.set_workspace_paused('ops', true) ->> 'changed'), 'false',
          'pausing again changes nothing');
select throws_ok($$ select memory.set_workspace_paused('ops', null) $$, 'MB001', null,
                 'paused must be given');
reset role;

-- Each view is its function of the workspace over every workspace; a workspace given is read
-- alone, and must exist.
set role pimem_test_operator;
select is_empty($$
  select v.view_name from operator_views v
   where (select count(*) from pg_proc p
           where p.pronamespace = 'memory'::regnamespace and p.proname = v.view_name) <> 1
$$, 'every operator view has its function of the workspace');
select results_eq($$ select * from memory.scope_status('ops') $$,
                  $$ select * from memory.scope_status where workspace_id = 'ops' $$,
                  'scope_status(workspace) is the view''s rows of the workspace');
select results_eq($$ select * from memory.record_status('ops') $$,
                  $$ select * from memory.record_status where workspace_id = 'ops' $$,
                  'record_status(workspace) is the view''s rows of the workspace');
select is((select records_valid from memory.workspace_status('ops', false)), null::bigint,
          'workspace_status without counting records leaves the counts out');
select is((select jobs_pending from memory.workspace_status('ops', false)),
          (select jobs_pending from memory.workspace_status('ops')),
          '... and gives the rest of the row');
select throws_ok($$ select * from memory.job_status('nope') $$, 'MB002', null,
                 'the status of an unknown workspace is MB002');
select throws_ok($$ select * from memory.waiting_status('') $$, 'MB001', null,
                 'the status of a malformed workspace id is MB001');
reset role;

-- The record's source is edited: the explanation names the source and the reason.
select memory.upsert_message('ops', 'r1-u', 'r1', 'user', 'alice', 'I prefer coffee', true,
                             null, '{}');
set role pimem_test_operator;
select is((select invalid_reason from memory.record_status where workspace_id = 'ops'),
          'source_edited', 'record_status shows why the record is invalid');
select is((select invalid_by_reason from memory.scope_status where workspace_id = 'ops'),
          '{"source_edited": 1}'::jsonb, 'scope_status counts invalid records by reason');
select is((memory.explain_record('ops', (select record_id from memory.record_status
                                          where workspace_id = 'ops')) ->> 'invalid_reason'),
          'source_edited', 'explain_record gives the same reason');
select ok(position('I prefer' in memory.explain_record('ops', (select record_id
            from memory.record_status where workspace_id = 'ops'))::text) = 0,
          'the explanation carries no message text');
reset role;

-- The backend and the worker are refused.
set role pimem_test_backend2;
select throws_ok($$ select * from memory.job_status $$, '42501', null,
                 'the backend cannot read the job view');
select throws_ok($$ select memory.retry_job('ops', 1) $$, '42501', null,
                 'the backend cannot retry a job');
select throws_ok($$ select memory.explain_record('ops', 1) $$, '42501', null,
                 'the backend cannot explain a record');
reset role;
set role pimem_test_worker2;
select throws_ok($$ select * from memory.workspace_status $$, '42501', null,
                 'the worker cannot read the workspace view');
select throws_ok($$ select memory.set_workspace_paused('ops', false) $$, '42501', null,
                 'the worker cannot pause or resume a workspace');
select throws_ok($$ select memory.retry_job('ops', 1) $$, '42501', null,
                 'the worker cannot retry a job');
select throws_ok($$ select * from memory.record_status('ops') $$, '42501', null,
                 'the worker cannot read the records'' status');
select lives_ok($$ select * from memory.waiting_status('ops') $$,
                'the worker reads what waits in a workspace');
reset role;

select * from finish();
rollback;
