-- Runs after every migration run that applied something (yoyo's post-apply hook): no function of
-- memory_private is executable by PUBLIC, including functions later migrations add
-- (see sql/90_privileges.sql).
revoke execute on all functions in schema memory_private from public;
