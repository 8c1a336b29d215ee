-- 90_privileges.sql: last in name order, after every function exists.
--
-- PostgreSQL grants EXECUTE on every new function to PUBLIC. The public API revokes it function
-- by function where it is defined (and grants each role its own); the internal helpers in
-- memory_private had only the missing USAGE on their schema between them and any role
-- (memory_private.advance_clock among them). Here every memory_private function loses PUBLIC's
-- EXECUTE: a role given USAGE on the schema by mistake still calls nothing. The operator views'
-- wrappers (memory_private.operator_*) keep their explicit grant to memory_operator.
--
-- Functions added later are covered twice: migrations/post-apply.sql repeats this statement after
-- every `pimem migrate` / `yoyo apply` that applied something, and pgtap/00_schema_shape.sql
-- fails when any memory_private function is executable by PUBLIC. (ALTER DEFAULT PRIVILEGES
-- cannot do it per schema: PUBLIC's EXECUTE on functions is a global default, and a
-- per-schema default only adds to it; the global form would change the migrating role's
-- functions in every other schema of the database too.)

revoke execute on all functions in schema memory_private from public;
