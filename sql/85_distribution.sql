-- 85_distribution.sql: the schema on a Citus cluster (docs/scaling.md).
--
-- On plain PostgreSQL nothing here runs. On a Citus coordinator `pimem migrate` applies the
-- cluster's form of the SQL functions (sql/cluster/functions.sql, written from sql/ by `pimem
-- cluster-code`) in the transaction of the migrations, then calls memory_private.distribute();
-- it brings whatever is not yet distributed onto the cluster and leaves what is alone, so it is
-- idempotent and a later migration's new table, view or function is distributed the same way:
--   - tables without a workspace_id (global configuration: clock, redaction_patterns,
--     invalid_reasons, waiting_reasons) become reference tables, replicated on every node;
--   - every table with a workspace_id is distributed by it, co-located with
--     memory_private.workspaces, so a workspace's rows of every table live on one node and every
--     join, foreign key, trigger and cascade of one workspace stays on it;
--   - every function and every view of memory_private exists on every node; a call runs on the
--     coordinator (or the node it was made on) and each of its statements, filtered by the
--     workspace, is routed to the node holding it. No function is delegated whole by its
--     workspace argument: Citus 13.2.2 crashes the coordinator's backend on such a call with
--     a NULL workspace;
--   - every composite type is on every node with the function whose signature names it.
-- Order matters, because Citus creates an object's dependencies on the workers first and
-- refuses one whose dependencies it cannot place: the reference tables, then the functions that
-- use no table's row type, then the tables in foreign-key order, then the views, then the
-- remaining functions. Function bodies are not checked while they are created on the workers
-- (check_function_bodies off, carried to the workers' connections), since they refer to one
-- another in any order.

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
    -- Citus makes the function on the workers with its grants, not with its revokes: PUBLIC's
    -- EXECUTE, revoked here, would be back there (a role reaching a worker could call it).
    if not has_function_privilege('public', v_function, 'execute') then
      execute format('revoke execute on function %s from public', v_function);
    end if;
    v_count := v_count + 1;
  end loop;
  return v_count;
end
$$;
comment on function memory_private.distribute_functions(boolean) is
  'Puts every function of memory and memory_private not yet on the cluster on every node (none '
  'delegated by its workspace: a NULL one would crash the coordinator, docs/scaling.md), with '
  'the same privileges (PUBLIC''s EXECUTE revoked there too when it is here). With p_all '
  'false, only those that use no table''s or view''s row type. Answers how many.';

create function memory_private.distribute() returns jsonb
  language plpgsql volatile
  as $$
declare
  v_result jsonb;
  v_view regclass;
  v_views integer := 0;
  v_missing text;
begin
  if not exists (select 1 from pg_extension where extname = 'citus') then
    raise exception 'this database has no Citus extension: nothing to distribute'
      using errcode = 'MB025';
  end if;
  -- A SQL function that is not immutable is inlined into its callers and reads the tables'
  -- empty shells on a shard: on the cluster each is the PL/pgSQL form of
  -- sql/cluster/functions.sql, which pimem migrate applies before it calls this.
  select string_agg(p.oid::regprocedure::text, ', ' order by p.oid::regprocedure::text)
    into v_missing
    from pg_proc p
   where p.pronamespace in ('memory'::regnamespace, 'memory_private'::regnamespace)
     and p.prolang = (select l.oid from pg_language l where l.lanname = 'sql')
     and p.provolatile <> 'i';
  if v_missing is not null then
    raise exception 'the cluster''s form of these SQL functions is not applied: %', v_missing
      using errcode = 'MB025',
            hint = 'Apply sql/cluster/functions.sql first (pimem migrate does, in the '
                   'migrations'' transaction; docs/scaling.md).';
  end if;
  -- Function bodies refer to one another in any order: do not check them while the workers
  -- create them (SET LOCAL reaches the workers' connections with propagate_set_commands).
  set local citus.propagate_set_commands = 'local';
  set local check_function_bodies = off;
  set local citus.enable_unsafe_triggers = on;  -- our triggers touch one workspace's rows
  set local citus.allow_nested_distributed_execution = on;
  v_result := memory_private.distribute_tables();
  -- The views of memory_private (what the functions read on the workers): created again, as
  -- they are, with DDL propagation on, which creates them on the workers. The public views
  -- stay on the coordinator, where operators query them.
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
  v_result := v_result || jsonb_build_object('views', v_views, 'functions',
                                             memory_private.distribute_functions(true));
  -- A composite type reaches the workers as a dependency of a function whose signature names
  -- it; one that only bodies use would be missing there.
  select string_agg(t.oid::regtype::text, ', ' order by t.oid::regtype::text) into v_missing
    from pg_type t join pg_class c on c.oid = t.typrelid
   where t.typnamespace = 'memory_private'::regnamespace and c.relkind = 'c'
     and not exists (select 1 from pg_dist_object o
                      where o.classid = 'pg_type'::regclass and o.objid = t.oid);
  if v_missing is not null then
    raise exception 'the composite types % are not on the workers: no function signature '
      'names them', v_missing using errcode = 'MB003',
      hint = 'Give each a function that takes or returns it (docs/scaling.md).';
  end if;
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
  'every node, nested distributed execution allowed for the database. Idempotent: only what '
  'is not yet on the cluster is done. MB025 without Citus, or while a SQL function that is not '
  'immutable is left (sql/cluster/functions.sql is applied first); MB003 when a composite type '
  'could not reach the workers. Answers the counts.';
