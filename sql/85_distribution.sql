-- 85_distribution.sql: the schema on a Citus cluster (docs/scaling.md).
--
-- On plain PostgreSQL nothing here runs. On a Citus coordinator `pimem migrate` calls
-- memory_private.distribute() after every migration run; it brings whatever is not yet
-- distributed onto the cluster and leaves what is alone, so it is idempotent and a later
-- migration's new table, view or function is distributed the same way:
--   - tables without a workspace_id (global configuration: clock, redaction_patterns,
--     invalid_reasons) become reference tables, replicated on every node;
--   - every table with a workspace_id is distributed by it, co-located with
--     memory_private.workspaces, so a workspace's rows of every table live on one node and every
--     join, foreign key, trigger and cascade of one workspace stays on it;
--   - every function and every view of memory_private exists on every node; a call runs on the
--     coordinator (or the node it was made on) and each of its statements, filtered by the
--     workspace, is routed to the node holding it. No function is delegated whole by its
--     workspace argument: Citus 13.2.2 crashes the coordinator's backend on such a call with
--     a NULL workspace;
--   - every SQL function that reads a table becomes PL/pgSQL (distribute_sql_functions).
-- Order matters, because Citus creates an object's dependencies on the workers first and
-- refuses one whose dependencies it cannot place: the reference tables, then the functions that
-- use no table's row type, then the tables in foreign-key order, then the views, then the
-- remaining functions. Function bodies are not checked while they are created on the workers
-- (check_function_bodies off, carried to the workers' connections), since they refer to one
-- another in any order.

create function memory_private.is_distributed() returns boolean
  language plpgsql stable
  as $$
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    return false;
  end if;
  return exists (select 1 from pg_dist_partition
                  where logicalrelid = 'memory_private.workspaces'::regclass);
end
$$;
comment on function memory_private.is_distributed() is
  'True when the schema is distributed on a Citus cluster (memory_private.workspaces is a '
  'distributed table), false on plain PostgreSQL or before memory_private.distribute().';

create function memory_private.distribute_tables() returns jsonb
  language plpgsql volatile
  as $$
declare
  v_table regclass;
  v_reference integer := 0;
  v_distributed integer := 0;
  v_has_rows boolean;
begin
  for v_table in
    select c.oid::regclass from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
       and not exists (select 1 from pg_attribute a
                        where a.attrelid = c.oid and a.attname = 'workspace_id')
       and not exists (select 1 from pg_dist_partition p where p.logicalrelid = c.oid)
     order by c.relname
  loop
    perform create_reference_table(v_table);
    v_reference := v_reference + 1;
  end loop;
  -- The tables that functions without a table row type need exist now on every node: those
  -- functions next, then the workspace tables in foreign-key order (a table once every table
  -- it references is distributed), workspaces first.
  perform memory_private.distribute_functions(false);
  loop
    select c.oid::regclass into v_table from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
       and exists (select 1 from pg_attribute a
                    where a.attrelid = c.oid and a.attname = 'workspace_id')
       and not exists (select 1 from pg_dist_partition p where p.logicalrelid = c.oid)
       and not exists (select 1 from pg_constraint f
                        where f.conrelid = c.oid and f.contype = 'f' and f.confrelid <> c.oid
                          and not exists (select 1 from pg_dist_partition p
                                           where p.logicalrelid = f.confrelid))
     order by c.relname <> 'workspaces', c.relname
     limit 1;
    exit when not found;
    -- A table with rows (a database upgraded onto the cluster) is copied into its shards with
    -- its triggers off: its rows' side effects are already in the other tables, and a trigger
    -- firing on a shard would write to a table not distributed yet.
    execute format('select exists (select 1 from %s)', v_table) into v_has_rows;
    if v_has_rows then
      execute format('alter table %s disable trigger user', v_table);
    end if;
    if v_table = 'memory_private.workspaces'::regclass then
      perform create_distributed_table(v_table, 'workspace_id');
    else
      perform create_distributed_table(v_table, 'workspace_id',
                                       colocate_with => 'memory_private.workspaces');
    end if;
    if v_has_rows then
      execute format('alter table %s enable trigger user', v_table);
    end if;
    v_distributed := v_distributed + 1;
  end loop;
  if exists (select 1 from pg_class c
              where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'r'
                and not exists (select 1 from pg_dist_partition p
                                 where p.logicalrelid = c.oid)) then
    raise exception 'a table of memory_private cannot be distributed: its foreign keys do not '
      'lead to memory_private.workspaces' using errcode = 'MB003';
  end if;
  return jsonb_build_object('reference_tables', v_reference,
                            'distributed_tables', v_distributed);
end
$$;
comment on function memory_private.distribute_tables() is
  'Makes every table of memory_private not yet on the cluster a reference table (no '
  'workspace_id) or a table distributed by workspace_id co-located with workspaces, in '
  'foreign-key order, after the functions that use no table''s row type; answers the counts.';

create function memory_private.distribute_functions(p_all boolean) returns integer
  language plpgsql volatile
  as $$
declare
  v_function regprocedure;
  v_count integer := 0;
begin
  -- Every function is put on every node, none distributed by its workspace argument: Citus
  -- would then delegate a call `select f('ws', ...)` whole to the workspace's node, but it
  -- crashes the coordinator's backend (and so restarts the coordinator) when that argument is
  -- NULL (Citus 13.2.2 hashes the NULL; docs/scaling.md). A call runs on the coordinator and
  -- each of its statements, filtered by the workspace, is routed to the node holding it.
  for v_function in
    select p.oid::regprocedure
      from pg_proc p
     where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_proc'::regclass and o.objid = p.oid)
       and (p_all or not exists (
             select 1 from pg_depend d join pg_type t on t.oid = d.refobjid
               join pg_class c on c.oid = t.typrelid and c.relkind in ('r', 'v')
              where d.classid = 'pg_proc'::regclass and d.objid = p.oid
                and d.refclassid = 'pg_type'::regclass))
     order by 1::text
  loop
    perform create_distributed_function(v_function);
    v_count := v_count + 1;
  end loop;
  return v_count;
end
$$;
comment on function memory_private.distribute_functions(boolean) is
  'Puts every function of memory and memory_private not yet on the cluster on every node (none '
  'delegated by its workspace: a NULL one would crash the coordinator, docs/scaling.md). With '
  'p_all false, only those that use no table''s or view''s row type. Answers how many.';

create function memory_private.distribute_sql_functions() returns integer
  language plpgsql volatile
  as $$
declare
  v_function record;
  v_body text;
  v_header text;
  v_count integer := 0;
begin
  -- A SQL function that reads tables is inlined into the query that calls it on one node, which
  -- is what makes the validity rule and search one plan each. On Citus that breaks in two ways:
  -- Citus routes a statement by the text it was written as, so an inlined helper comes back on
  -- the shard, is inlined there into the shard's query and reads the tables' empty shells (a
  -- silent wrong answer: an edited source read as current); and a statement of a SQL function
  -- with parameters cannot be planned by Citus at all. So on a coordinator every SQL function
  -- that names a table or view of ours (and is not immutable: those read none) is made PL/pgSQL
  -- with the same body: called, never inlined, each of its statements planned by Citus with the
  -- values, on the node of the workspace. Columns win over variables of the same name, as in a
  -- SQL function.
  for v_function in
    select p.oid, p.prosrc, p.proretset,
           pg_get_function_arguments(p.oid) as arguments,
           pg_get_function_result(p.oid) as result,
           case p.provolatile when 's' then 'stable' else 'volatile' end as volatility,
           p.prosecdef, p.proconfig
      from pg_proc p
     where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
       and p.prolang = (select oid from pg_language where lanname = 'sql')
       and p.provolatile <> 'i'
       and exists (select 1 from regexp_matches(p.prosrc, '(memory|memory_private)\.(\w+)', 'g') m
                     join pg_class c on c.relnamespace = m[1]::regnamespace and c.relname = m[2]
                    where c.relkind in ('r', 'v', 'p'))
     order by 1
  loop
    v_body := regexp_replace(v_function.prosrc, ';\s*$', '');
    v_body := case
      when v_function.proretset then
        format(E'#variable_conflict use_column\nbegin\n  return query\n%s\n  ;\nend', v_body)
      else
        format(E'#variable_conflict use_column\nbegin\n  return (\n%s\n  );\nend', v_body)
    end;
    v_header := format('create or replace function %s(%s) returns %s language plpgsql %s%s',
                       v_function.oid::regproc, v_function.arguments, v_function.result,
                       v_function.volatility,
                       case when v_function.prosecdef then ' security definer' else '' end);
    if v_function.proconfig is not null then
      select v_header || string_agg(format(' set %s = %s', split_part(c, '=', 1),
                                           quote_literal(substr(c, strpos(c, '=') + 1))), '')
        into v_header from unnest(v_function.proconfig) c;
    end if;
    execute format('%s as %L', v_header, v_body);
    v_count := v_count + 1;
  end loop;
  return v_count;
end
$$;
comment on function memory_private.distribute_sql_functions() is
  'On a Citus coordinator: makes every SQL function of memory and memory_private that reads a '
  'table or view PL/pgSQL with the same body (columns winning over variables, as in SQL), so that '
  'Citus plans each of its statements on the workspace''s node instead of a shard inlining it '
  'over empty table shells. Answers how many.';

create function memory_private.distribute() returns jsonb
  language plpgsql volatile
  as $$
declare
  v_result jsonb;
  v_view regclass;
  v_views integer := 0;
  v_types integer := 0;
  v_type regtype;
  v_function regprocedure;
  v_sql_functions integer;
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    raise exception 'this database has no Citus extension: nothing to distribute'
      using errcode = 'MB025';
  end if;
  v_sql_functions := memory_private.distribute_sql_functions();
  -- Function bodies refer to one another in any order: do not check them while the workers
  -- create them (SET LOCAL reaches the workers' connections with propagate_set_commands).
  set local citus.propagate_set_commands = 'local';
  set local check_function_bodies = off;
  set local citus.enable_unsafe_triggers = on;  -- our triggers touch one workspace's rows
  set local citus.allow_nested_distributed_execution = on;
  v_result := memory_private.distribute_tables();
  -- A composite type that only function bodies use (no signature names it) is not among any
  -- object's dependencies: a throwaway function taking it carries it to the workers.
  for v_type in
    select t.oid::regtype from pg_type t join pg_class c on c.oid = t.typrelid
     where t.typnamespace = 'memory_private'::regnamespace and c.relkind = 'c'
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_type'::regclass and o.objid = t.oid)
  loop
    execute format('create function memory_private.distribute_type_carrier(%s) returns void '
                   'language sql as %L', v_type, 'select');
    perform create_distributed_function(
      format('memory_private.distribute_type_carrier(%s)', v_type)::regprocedure);
    execute format('drop function memory_private.distribute_type_carrier(%s)', v_type);
    v_types := v_types + 1;
  end loop;
  -- The views of memory_private (what the functions read on the workers): created again with DDL
  -- propagation on, which creates them on the workers. The public views stay on the
  -- coordinator, where operators query them.
  for v_view in
    select c.oid::regclass from pg_class c
     where c.relnamespace = 'memory_private'::regnamespace and c.relkind = 'v'
       and not exists (select 1 from pg_dist_object o
                        where o.classid = 'pg_class'::regclass and o.objid = c.oid)
     order by c.oid
  loop
    execute format('create or replace view %s as %s', v_view, pg_get_viewdef(v_view));
    v_views := v_views + 1;
  end loop;
  v_result := v_result || jsonb_build_object('views', v_views, 'types', v_types,
                                             'sql_functions_made_plpgsql', v_sql_functions,
                                             'functions',
                                             memory_private.distribute_functions(true));
  -- Plans (a block of its own: the routing of calls to the workspace's node, docs/scaling.md).
  -- Every function of the API plans its statements for each call on the cluster
  -- (force_custom_plan, which reaches everything it calls): Citus routes a statement by its
  -- parameters' values, which a generic plan pinned for speed on one node (recall,
  -- query_memories) does not have; and on a worker node, where a routed call runs its
  -- statements locally, Citus 13.2.2 keeps a new local plan in a generic plan at every
  -- execution, never finding the earlier ones (about 250 kB a recall: a pooled connection grew
  -- by gigabytes). ALTER FUNCTION reaches the workers.
  for v_function in
    select p.oid::regprocedure from pg_proc p
     where p.pronamespace = 'memory'::regnamespace and p.prokind = 'f'
       and p.prolang <> (select oid from pg_language where lanname = 'sql')
       and not coalesce('plan_cache_mode=force_custom_plan' = any(p.proconfig), false)
  loop
    execute format('alter function %s set plan_cache_mode = force_custom_plan', v_function);
  end loop;
  -- The functions call one another inside queries (a validity rule inside a search), which
  -- Citus counts as a distributed query nested in a query on a shard and refuses by default.
  -- Every such nested query here reads the same workspace as the query around it, so the
  -- same node: allowed for this database, on every node (ALTER DATABASE reaches the workers).
  execute format('alter database %I set citus.allow_nested_distributed_execution = on',
                 current_database());
  return v_result;
end
$$;
comment on function memory_private.distribute() is
  'Distributes the schema on a Citus coordinator (85_distribution.sql): reference tables, '
  'tables distributed by workspace and co-located, the private views and every function on '
  'every node (SQL functions reading tables made PL/pgSQL), nested distributed '
  'execution allowed for the database, the API''s statements planned for each call. '
  'Idempotent: only what is not yet on the cluster is done. MB025 without Citus. Answers the '
  'counts.';
