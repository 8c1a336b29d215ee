-- The policy numbers have one home, memory_private.policy(): they are the numbers the rules are
-- specified with (docs/requirements.md), and no CHECK constraint writes one down on its own.
begin;
select plan(4);

select is(
  (select row(p.default_idle_minutes, p.batch_bytes, p.existing_with_batch, p.summary_bytes,
              p.title_bytes, p.candidates, p.index_bytes, p.index_ids, p.max_claims, p.lease,
              p.failure_backoff, p.directory_records, p.query_limit, p.shown_sources,
              p.unused_days, p.workspace_records, p.batch_messages)::text
     from memory_private.policy() p),
  row(30, 24000, 0, 4000, 300, 48, 4500, 12, 3, interval '2 minutes', interval '1 hour', 8, 12,
      20, 30, 256, 200)::text,
  'the policy holds the specified numbers (P3-P6, P9, P12, P13, R2, R4, R5, T5)');

select is_empty($$
  select c.conrelid::regclass || ': ' || pg_get_constraintdef(c.oid)
    from pg_constraint c join pg_namespace n on n.oid = c.connamespace
   where n.nspname = 'memory_private' and c.contype = 'c'
     and pg_get_constraintdef(c.oid) ~ '\m(3|4|8|12|20|48|60|256|300|1000|2000|4000|4500|24000|64000)\M'
$$, 'no CHECK constraint writes a policy number down itself: they read memory_private.policy()');

select is_empty($$
  select p.oid::regprocedure::text
    from pg_proc p join pg_namespace n on n.oid = p.pronamespace
   where n.nspname in ('memory', 'memory_private') and p.proname <> 'policy'
     and p.prosrc ~ '\m(4000|4500|24000|64000)\M|''(2 minutes|1 hour|30 days)'''
$$, 'no function writes a byte limit or a period down itself');

select ok((select count(*) from pg_constraint c join pg_namespace n on n.oid = c.connamespace
            where n.nspname = 'memory_private' and c.contype = 'c'
              and pg_get_constraintdef(c.oid) like '%policy_limit(%') >= 10,
  'the limits of the tables come from the policy');

select * from finish();
rollback;
