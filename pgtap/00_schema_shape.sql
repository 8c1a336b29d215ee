-- The shape every part of the schema must keep: tenancy keys, grants, comments, pinned paths.
-- Reference tables (global configuration, no tenant data; Citus reference tables, see
-- docs/scaling.md) are listed by name: clock, redaction_patterns, invalid_reasons, waiting_reasons.
begin;
select plan(10);

select is_empty($$
  select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
   where n.nspname = 'memory_private' and c.relkind = 'r' and c.relname not in ('clock', 'redaction_patterns', 'invalid_reasons', 'waiting_reasons')
     and (select a.attname from pg_constraint con
            join pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
           where con.conrelid = c.oid and con.contype = 'p') is distinct from 'workspace_id'
$$, 'every table''s primary key starts with workspace_id (V1, Citus distribution column)');

select is_empty($$
  select con.conname from pg_constraint con join pg_namespace n on n.oid = con.connamespace
   where n.nspname = 'memory_private' and con.contype = 'f'
     and (select a.attname from pg_attribute a
           where a.attrelid = con.conrelid and a.attnum = con.conkey[1]) <> 'workspace_id'
$$, 'every foreign key starts with workspace_id');

select is_empty($$
  select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
   where n.nspname = 'memory' and c.relkind not in ('v')
$$, 'the memory schema holds no tables, only functions and views');

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname = 'memory' and has_function_privilege('public', p.oid, 'execute')
$$, 'PUBLIC may execute no memory function');

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname = 'memory_private' and has_function_privilege('public', p.oid, 'execute')
$$, 'PUBLIC may execute no memory_private function (not only the schema''s USAGE protects them)');

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname in ('memory', 'memory_private') and p.prosecdef
     and not exists (select 1 from unnest(p.proconfig) c where c like 'search_path=pg_catalog%')
$$, 'every SECURITY DEFINER function pins search_path starting with pg_catalog');

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname in ('memory', 'memory_private') and not p.prosecdef
     and exists (select 1 from unnest(p.proconfig) c where c like 'search_path=%')
$$, 'no other function sets search_path: it runs under its caller''s, qualifies every name, '
    'and a plain SQL helper stays inlinable');

select is_empty($$
  select p.oid::regprocedure::text from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname in ('memory', 'memory_private') and obj_description(p.oid, 'pg_proc') is null
$$, 'every function has a COMMENT');

select is_empty($$
  select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
   where n.nspname in ('memory', 'memory_private') and c.relkind in ('r', 'v')
     and obj_description(c.oid, 'pg_class') is null
$$, 'every table and view has a COMMENT');

select is_empty($$
  select n.nspname || '.' || c.relname || ' to ' || r.rolname
    from pg_class c join pg_namespace n on n.oid = c.relnamespace
    cross join pg_roles r
   where n.nspname = 'memory_private' and c.relkind in ('r', 'v', 'S')
     and r.rolname in ('memory_backend', 'memory_worker', 'memory_operator', 'public')
     and has_table_privilege(r.oid, c.oid, 'select, insert, update, delete')
$$, 'no memory role has any privilege on any private table');

select * from finish();
rollback;
