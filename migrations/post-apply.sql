-- Runs after every migration run that applied something (yoyo's post-apply hook): no function of
-- memory_private is executable by PUBLIC, including functions later migrations add
-- (see sql/90_privileges.sql).
revoke execute on all functions in schema memory_private from public;
-- ... and every function of the API runs without JIT compilation (sql/90_privileges.sql says why).
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
