-- 90_privileges.sql: last in name order, after every function exists.
--
-- PostgreSQL grants EXECUTE on every new function to PUBLIC. The public API revokes it function
-- by function where it is defined (and grants each role its own); the internal helpers in
-- memory_private had only the missing USAGE on their schema between them and any role
-- (memory_private.advance_clock among them). Here every memory_private function loses PUBLIC's
-- EXECUTE: a role given USAGE on the schema by mistake still calls nothing.
--
-- Functions added later are covered twice: migrations/post-apply.sql repeats this statement after
-- every `pimem migrate` / `yoyo apply` that applied something, and pgtap/00_schema_shape.sql
-- fails when any memory_private function is executable by PUBLIC. (ALTER DEFAULT PRIVILEGES
-- cannot do it per schema: PUBLIC's EXECUTE on functions is a global default, and a
-- per-schema default only adds to it; the global form would change the migrating role's
-- functions in every other schema of the database too.)

revoke execute on all functions in schema memory_private from public;

-- No JIT compilation inside the API. Every statement of ours is a short one over one workspace's
-- rows, but a few carry cost estimates past jit_above_cost (a summary's lines, estimated at the
-- 1,000 rows a set-returning function is assumed to give), and PostgreSQL then compiled them on
-- every call: about 20 ms an extraction commit, more than the rest of its work
-- (docs/benchmarks.md, "Choices the code cites"). A function's SET reaches everything it calls; the internal helpers
-- keep no SET of their own, so that the SQL ones still inline. migrations/post-apply.sql repeats
-- this for the functions later migrations add.
do $$
declare
  v_function regprocedure;
begin
  for v_function in
    select p.oid::regprocedure from pg_proc p
     where p.pronamespace = 'memory'::regnamespace and p.prokind = 'f'
       and not coalesce('jit=off' = any(p.proconfig), false)
  loop
    execute format('alter function %s set jit = off', v_function);
  end loop;
end
$$;
