-- Each role can call exactly what its job needs, and is refused everything else.
begin;
select plan(13);

create temporary view role_functions as
  select r.rolname, p.proname
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
    cross join (values ('memory_backend'), ('memory_worker'), ('memory_operator')) r(rolname)
   where n.nspname = 'memory' and has_function_privilege(r.rolname, p.oid, 'execute');
grant select on role_functions to public;

select set_eq(
  $$ select proname from role_functions where rolname = 'memory_backend' $$,
  array['upsert_workspace', 'upsert_member', 'upsert_bot', 'upsert_chat', 'upsert_topic',
        'set_repository_grant', 'upsert_request', 'finish_request', 'upsert_message',
        'remove_message',
        'recall', 'query_memories', 'manage_memory', 'request_citations',
        'resolve_scope', 'delete_workspace', 'answer_retention_boundary', 'schema_version',
        'tool_definitions', 'member_memories', 'erase_member', 'workspace_node'],
  'memory_backend executes the ingest API and scope resolution');

select set_eq(
  $$ select proname from role_functions where rolname = 'memory_worker' $$,
  array['claim_job', 'extend_lease', 'start_attempt', 'save_checkpoint', 'commit_job',
        'fail_job', 'run_maintenance', 'maintain_next_workspace', 'schema_version',
        'waiting_status', 'workspace_node', 'workspace_nodes'],
  'memory_worker executes only the job functions (and reads what waits)');

select set_eq(
  $$ select proname from role_functions where rolname = 'memory_operator' $$,
  array['resolve_scope', 'delete_workspace', 'run_maintenance', 'maintain_next_workspace',
        'retry_job', 'set_workspace_paused', 'explain_record', 'schema_version',
        'workspace_status', 'scope_status', 'record_status', 'job_status',
        'request_memory_charges', 'waiting_status',
        'member_memories', 'erase_member', 'workspace_node',
        'workspace_nodes'],
  'memory_operator executes the operator functions');

create role pimem_test_backend login in role memory_backend;
create role pimem_test_worker login in role memory_worker;

set role pimem_test_backend;
select throws_ok($$ select * from memory_private.workspaces $$, '42501', null,
  'the backend cannot read a private table');
select throws_ok($$ insert into memory_private.workspaces values ('x') $$, '42501', null,
  'the backend cannot write a private table');
select throws_ok($$ select memory_private.advance_clock('1 day') $$, '42501', null,
  'the backend cannot call a private helper');
select lives_ok($$ select memory.upsert_workspace('rw', 1, 10, 0, 30) $$,
  'the backend can report a workspace');
reset role;

set role pimem_test_worker;
select throws_ok($$ select memory.upsert_workspace('rw2', 1, 10, 0, 30) $$, '42501', null,
  'the worker cannot report facts');
select throws_ok($$ select * from memory_private.messages $$, '42501', null,
  'the worker cannot read messages directly');
select throws_ok($$ select memory.remove_message('rw', 'm') $$, '42501', null,
  'the worker cannot remove messages');
reset role;

-- A role with no grants at all, even one given USAGE on the private schema by mistake, calls
-- no private function: each has lost PUBLIC's EXECUTE (sql/90_privileges.sql).
create role pimem_test_nobody login;
grant usage on schema memory_private to pimem_test_nobody;
set role pimem_test_nobody;
select throws_ok($$ select memory_private.advance_clock('1 day') $$, '42501', null,
  'a role with no grants cannot move the memory clock, even with USAGE on memory_private');
select throws_ok($$ select memory_private.lock_workspace('rw') $$, '42501', null,
  'nor take a workspace''s memory lock');
reset role;
select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname = 'memory_private'
     and has_function_privilege('pimem_test_nobody', p.oid, 'execute')
$$, 'a role with no grants may execute no memory_private function');

select * from finish();
rollback;
