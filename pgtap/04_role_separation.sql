-- Roles cannot widen their reach: no table access, no other role's functions, and no
-- search_path hijack of a SECURITY DEFINER function.
begin;
select plan(7);

select memory.upsert_workspace('ws', 1, 10, 0, 30);

create role pimem_evil login in role memory_backend;
create schema evil authorization pimem_evil;

set role pimem_evil;
-- Shadow catalog functions and an operator the API uses, and a private table name.
create function evil.btrim(text) returns text language plpgsql
  as $$ begin raise exception 'hijacked btrim'; end $$;
create function evil.octet_length(text) returns integer language sql as $$ select 0 $$;
create function evil.clock_now() returns timestamptz language sql
  as $$ select '2000-01-01'::timestamptz $$;
create table evil.workspaces (workspace_id text);
create temporary table workspaces (workspace_id text);
create temporary table members (workspace_id text, user_id text);
set search_path = evil, public;

select lives_ok($$ select memory.upsert_member('ws', 'mallory', 'member', true) $$,
  'a shadowing btrim in the caller''s schema is not used by the API');
select throws_ok($$ select memory.upsert_member('ws', repeat('x', 300), 'member', true) $$,
  'MB001', null, 'a shadowing octet_length does not switch off the byte limit');
select is((select count(*)::int from workspaces), 0,
  'the API wrote no row into the caller''s temporary table of the same name');
select throws_ok($$ select memory_private.advance_clock('1 year') $$, '42501', null,
  'the caller cannot reach private helpers by name');
select throws_ok($$ select memory.claim_job('mallory') $$, '42501', null,
  'the backend cannot call the worker''s functions');
reset search_path;
reset role;

select is((select count(*)::int from memory_private.members where user_id = 'mallory'), 1,
  'the member was written to the real table');
select cmp_ok((select updated_at from memory_private.members where user_id = 'mallory'),
  '>', '2001-01-01'::timestamptz, 'the real clock was used, not a shadowing clock_now');

select * from finish();
rollback;
