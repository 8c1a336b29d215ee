-- The schema stays distributable by workspace (docs/scaling.md).
begin;
select plan(2);

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname = 'memory'
     and p.proname not in ('claim_job', 'run_maintenance', 'maintain_next_workspace',
                           'schema_version', 'tool_definitions', 'workspace_nodes')
     and (p.proargnames is null or p.proargnames[1] <> 'p_workspace_id')
$$, 'every public function but the worker''s cross-workspace pick, the two constants (schema version, tool definitions) and the list of nodes takes the workspace first');

select is_empty($$
  select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
   where n.nspname = 'memory_private' and c.relkind = 'r' and c.relname not in ('clock', 'redaction_patterns', 'invalid_reasons', 'waiting_reasons')
     and not exists (select 1 from pg_constraint con
                      where con.conrelid = c.oid and con.contype = 'f')
     and c.relname <> 'workspaces'
$$, 'every workspace-keyed table hangs off a foreign key, so deleting a workspace reaches it');

select * from finish();
rollback;
