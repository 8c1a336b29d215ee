-- Memory jobs: the shape that holds the invariants, and one job through its life cycle.
begin;
select plan(25);
-- On a Citus cluster (the Citus profile) every statement over one connection per node, so that
-- the role made at the end may be made in this transaction; a placeholder on one server.
set local citus.multi_shard_modify_mode to 'sequential';

select has_table('memory_private', 'jobs', 'jobs exist');
select has_table('memory_private', 'job_attempts', 'attempts exist');
select has_table('memory_private', 'request_charges', 'charges exist');
select has_table('memory_private', 'extracted_sources', 'extracted sources exist');
select has_index('memory_private', 'jobs', 'jobs_one_running_per_workspace',
  'a partial unique index allows one running job per workspace');
select has_index('memory_private', 'jobs', 'jobs_one_open_per_scope_phase',
  'a partial unique index allows one open job per scope and phase');

select memory.upsert_workspace('wj', 1, 10, 0, 30);
select memory.upsert_member('wj', 'alice', 'owner', true);
select memory.upsert_bot('wj', 'bot', 'bot-id', true);
select memory.upsert_chat('wj', 'dm', 'private', 'alice', true);
select memory.upsert_request('wj', 'r1', 'bot', 'dm', 0, 'alice', 'interactive', 'succeeded',
                             'p', 'm', 1, 0, null);
select memory.upsert_message('wj', 'm1', 'r1', 'user', 'alice', 'I prefer tea', true, null, '{}');
select memory.upsert_message('wj', 'm2', 'r1', 'assistant', 'bot', 'Noted', true, null, '{}');

select is(memory.run_maintenance('wj') ->> 'extract_jobs_created', '0',
  'a conversation inside the idle window waits');
select memory_private.advance_clock('31 minutes');
select is(memory.run_maintenance('wj') ->> 'extract_jobs_created', '1',
  'an idle conversation gets an extraction job');

create temporary table claimed as select memory.claim_job('w1') as job;
select is((select job ->> 'phase' from claimed), 'extract', 'the claim returns the job');
select is((select jsonb_array_length(job -> 'input' -> 'sources') from claimed), 2,
  'with both sources');
select is(memory.claim_job('w2'), null, 'a second claim finds nothing');

select throws_ok($$ select memory.commit_job('wj', (select (job ->> 'job_id')::bigint from claimed),
                                              gen_random_uuid()::text) $$,
  'MB020', null, 'a foreign token is refused');
select throws_ok($$ select memory.commit_job('wj', (select (job ->> 'job_id')::bigint from claimed),
                                              'not-a-token') $$,
  'MB001', null, 'a malformed token is MB001, not a cast error before the function runs');
select throws_ok($$ select memory.start_attempt('wj', (select (job ->> 'job_id')::bigint from claimed),
                                                 (select (job ->> 'token') from claimed), 2) $$,
  'MB024', null, 'a reserve over the request budget is refused');
select is(memory.start_attempt('wj', (select (job ->> 'job_id')::bigint from claimed),
                               (select (job ->> 'token') from claimed), 0.1), 1,
  'a reserve that fits opens attempt 1');
select throws_ok($$ select memory.save_checkpoint('wj', (select (job ->> 'job_id')::bigint from claimed),
                      (select (job ->> 'token') from claimed),
                      '{"title": "Tea", "summary": "Tea.", "source_ids": ["m9"]}',
                      '{"input_tokens": 1, "output_tokens": 1, "cost_usd": 0.01}') $$,
  'MB023', null, 'a source id outside the snapshot is refused');
select lives_ok($$ select memory.save_checkpoint('wj', (select (job ->> 'job_id')::bigint from claimed),
                      (select (job ->> 'token') from claimed),
                      '{"title": "Tea", "summary": "Alice prefers tea.", "source_ids": ["m1"]}',
                      '{"input_tokens": 1, "output_tokens": 1, "cost_usd": 0.01}') $$,
  'a valid output is checkpointed');
select is(memory_private.request_memory_spent('wj', 'r1'),
  0.01::numeric, 'the request is charged');
select is((memory.commit_job('wj', (select (job ->> 'job_id')::bigint from claimed),
                             (select (job ->> 'token') from claimed))) ->> 'status',
  'committed', 'the commit writes the record');
select is((select array_agg(message_id order by message_id) from memory_private.record_sources),
  array['m1'], 'the record cites what the output cites');
select is((select array_agg(message_id order by message_id)
             from memory_private.record_dependencies),
  array['m1', 'm2'], 'and depends on everything the call was shown, the uncited rest of the '
  'batch too');
select throws_ok($$ update memory_private.jobs set status = 'running' $$, 'MB025', null,
  'a succeeded job cannot run again');
select is(memory.run_maintenance('wj') ->> 'consolidate_jobs_created', '1',
  'the new record schedules a consolidation');

create role pimem_test_jobs_worker login in role memory_worker;
set role pimem_test_jobs_worker;
select lives_ok($$ select memory.claim_job('w3') $$, 'the worker role can claim');
select throws_ok($$ select * from memory_private.jobs $$, '42501', null,
  'the worker role cannot read the jobs table');
reset role;

select * from finish();
rollback;
