-- 41_job_contract.sql: the contract between a job and its model call (P6, P8, P9, P11).
--
-- What the model is given (memory_private.job_payload: the redacted input rendered from current
-- facts, the limits, the budget left) and what it must give back (validate_extraction,
-- validate_index: the JSON shape, the byte and count limits of memory_private.policy(), ids
-- within the snapshot, redaction), what a call's usage must look like (check_usage), and the
-- codes a failed call is recorded with (failure_codes). The database is the authority: the
-- worker only carries the reply here.

create function memory_private.failure_codes()
  returns table (code text, meaning text)
  language sql immutable
  as $$
  select * from (values
    ('provider_unreachable', 'the call never reached the provider (nothing was billed)'),
    ('provider_error', 'the provider answered with an error (an HTTP error status, a stop '
                       'reason of error)'),
    ('reply_cut_off', 'the reply stopped at the output token limit'),
    ('reply_unreadable', 'the provider''s response could not be read: not JSON, no reply, '
                         'usage that is missing or not numbers, or usage the database refused '
                         'at the checkpoint (MB001: a negative, fractional or out-of-range '
                         'count or cost); charged at the reserve'),
    ('reply_not_json', 'the model''s reply is not one JSON object (also: not valid Unicode, '
                       'NaN or Infinity, nested deeper than the worker reads)'),
    ('reply_invalid', 'the model asked for a tool, and the worker''s model calls offer none'),
    ('output_refused', 'the database refused the reply''s JSON object as the output: MB023 '
                       '(keys, types, byte limits, ids), or a value PostgreSQL cannot hold (a '
                       'NUL character, a lone surrogate)'),
    ('not_priced', 'the worker cannot price the model, so no call was made'),
    ('budget_exceeded', 'the reserve did not fit the budgets (MB024), so no call was made'),
    ('runtime_failed', 'the model runtime (the Pi CLI) failed or exited'),
    ('call_aborted', 'the worker stopped during the call'),
    ('deadline_exceeded', 'the call did not finish before the tick''s deadline'),
    ('lease_lost', 'the worker lost the lease during the call'),
    ('lease_expired', 'the lease expired while the model call was open (written by '
                      'maintenance)'),
    ('input_changed', 'a source of the batch changed during the call (MB021 at the checkpoint): '
                      'nothing was stored'),
    ('database_error', 'a database call of the tick failed unexpectedly'),
    ('worker_error', 'an unexpected error in the worker')) as c(code, meaning)
$$;
comment on function memory_private.failure_codes() is
  'The codes a failed or unknown attempt is recorded with (fail_job''s error, job_attempts.error, '
  'jobs.last_error). Coded and content-free: a model''s text never reaches storage or an '
  'operator view through an error. docs/errors.md lists them.';

create function memory_private.job_limits() returns jsonb
  language sql immutable
  as $$
  select jsonb_build_object('summary_bytes', p.summary_bytes, 'title_bytes', p.title_bytes,
                            'index_bytes', p.index_bytes, 'index_ids', p.index_ids,
                            'batch_bytes', p.batch_bytes, 'candidates', p.candidates)
    from memory_private.policy() as p
$$;
comment on function memory_private.job_limits() is
  'The limits of model work as the claim payload tells them to the worker (from '
  'memory_private.policy()): summary, title and index bytes (UTF-8), index ids, source batch '
  'bytes, consolidation candidates.';

create function memory_private.check_usage(p_usage jsonb, p_complete boolean default true)
  returns jsonb
  language plpgsql immutable
  as $$
declare
  v_key text;
  v_value jsonb;
  v_number numeric;
  v_result jsonb := '{}';
begin
  if p_usage is null or jsonb_typeof(p_usage) <> 'object' then
    raise exception 'usage must be a JSON object {"input_tokens", "output_tokens", "cost_usd"}'
      using errcode = 'MB001';
  end if;
  for v_key in select jsonb_object_keys(p_usage) loop
    if v_key not in ('input_tokens', 'output_tokens', 'cost_usd') then
      raise exception 'usage has an unknown key' using errcode = 'MB001',
        hint = 'usage is {"input_tokens": int, "output_tokens": int, "cost_usd": number}.';
    end if;
  end loop;
  foreach v_key in array array['input_tokens', 'output_tokens', 'cost_usd'] loop
    v_value := p_usage -> v_key;
    if v_value is null then
      raise exception 'usage lacks %', v_key using errcode = 'MB001';
    end if;
    if jsonb_typeof(v_value) = 'null' and not p_complete then
      v_result := v_result || jsonb_build_object(v_key, null);  -- not known
      continue;
    end if;
    if jsonb_typeof(v_value) <> 'number' then
      raise exception 'usage.% must be a number%', v_key,
        case when p_complete then '' else ' or null (not known)' end using errcode = 'MB001';
    end if;
    v_number := (v_value #>> '{}')::numeric;
    if v_key = 'cost_usd' then
      perform memory_private.check_money('usage.cost_usd', v_number);
      v_result := v_result || jsonb_build_object(v_key, round(v_number, 6));
    else
      if v_number <> trunc(v_number) or v_number < 0 or v_number > 2147483647 then
        raise exception 'usage.% must be an integer from 0 to 2147483647', v_key
          using errcode = 'MB001';
      end if;
      v_result := v_result || jsonb_build_object(v_key, v_number::integer);
    end if;
  end loop;
  return v_result;
end
$$;
comment on function memory_private.check_usage(jsonb, boolean) is
  'Validates a model call''s usage {"input_tokens": 0..2147483647, "output_tokens": same, '
  '"cost_usd": 0..1000000} (all three keys, no other) and returns it normalized; raises MB001. '
  'With p_complete false (fail_job) a value may be null: the worker could not read it (a '
  'provider''s NaN, negative or oversized count), and a null cost is charged at the reserve.';

create function memory_private.is_id_array(p_value jsonb) returns boolean
  language sql immutable parallel safe
  as $$
  -- An id is an integer literal between 1 and the bigint maximum (1.0 is not: it would not cast
  -- to bigint, and a model that writes it has not copied the id).
  select jsonb_typeof(p_value) = 'array'
     and not exists (select 1 from jsonb_array_elements(p_value) e
                      where jsonb_typeof(e) <> 'number' or (e #>> '{}') !~ '^[0-9]{1,19}$'
                         or (e #>> '{}')::numeric not between 1 and 9223372036854775807)
$$;
comment on function memory_private.is_id_array(jsonb) is
  'Whether a JSON value is an array of record ids (integer literals, 1 .. 2^63-1).';

create function memory_private.check_output_keys(
  p_phase text, p_output jsonb, p_expected text[], p_optional text[]
) returns void
  language plpgsql immutable
  as $$
declare
  v_keys text[];
  v_bad text;
begin
  if p_output is null or jsonb_typeof(p_output) <> 'object' then
    raise exception 'the % output must be a JSON object with keys %', p_phase,
      array_to_string(p_expected, ', ') using errcode = 'MB023';
  end if;
  v_keys := array(select k from jsonb_object_keys(p_output) as k order by k);
  -- Messages name the contract, never what the model wrote (its keys, ids or text): they reach
  -- the worker's logs, and a model's output is hostile input.
  select count(*)::text into v_bad from unnest(v_keys) as k
   where k <> all (p_expected || p_optional);
  if v_bad <> '0' then
    raise exception 'the % output has % unknown key(s); the keys are exactly %', p_phase,
      v_bad, array_to_string(p_expected, ', ') using errcode = 'MB023';
  end if;
  select string_agg(k, ', ') into v_bad from unnest(p_expected) as k where k <> all (v_keys);
  if v_bad is not null then
    raise exception 'the % output lacks keys: %', p_phase, v_bad using errcode = 'MB023';
  end if;
end
$$;
comment on function memory_private.check_output_keys(text, jsonb, text[], text[]) is
  'Raises MB023 unless a model output is a JSON object with exactly the expected keys (and '
  'perhaps the optional ones).';

create function memory_private.validate_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
declare
  v_title text;
  v_summary text;
  v_ids text[];
  v_reused bigint[];
  v_bad text;
  v_policy memory_private.policy_values := memory_private.policy();
begin
  -- reused_ids is optional: an output that declares no reuse may leave it out.
  perform memory_private.check_output_keys('extract', p_output,
                                           array['source_ids', 'summary', 'title'],
                                           array['reused_ids']);
  if jsonb_typeof(p_output -> 'title') <> 'string'
     or jsonb_typeof(p_output -> 'summary') <> 'string' then
    raise exception 'title and summary must be strings' using errcode = 'MB023';
  end if;
  if jsonb_typeof(p_output -> 'source_ids') <> 'array'
     or exists (select 1 from jsonb_array_elements(p_output -> 'source_ids') e
                 where jsonb_typeof(e) <> 'string') then
    raise exception 'source_ids must be an array of message id strings' using errcode = 'MB023';
  end if;
  if not memory_private.is_id_array(coalesce(p_output -> 'reused_ids', '[]')) then
    raise exception 'reused_ids must be an array of memory ids (positive integers)'
      using errcode = 'MB023';
  end if;
  v_title := p_output ->> 'title';
  v_summary := p_output ->> 'summary';
  -- The sources in the order the output lists them (the order the summary uses them), each
  -- once, at its first place; the same for the memories it reused.
  v_ids := array(select e.id
                   from jsonb_array_elements_text(p_output -> 'source_ids')
                        with ordinality as e(id, n)
                  group by e.id order by min(e.n));
  v_reused := array(select e.id::bigint
                      from jsonb_array_elements_text(coalesce(p_output -> 'reused_ids', '[]'))
                           with ordinality as e(id, n)
                     group by e.id order by min(e.n));
  if v_title = '' and v_summary = '' and cardinality(v_ids) = 0 then
    if cardinality(v_reused) > 0 then
      raise exception 'an empty (no-op) output reuses no memory: reused_ids must be empty'
        using errcode = 'MB023';
    end if;
    return jsonb_build_object('title', '', 'summary', '', 'source_ids', '[]'::jsonb,
                              'reused_ids', '[]'::jsonb);
  end if;
  if v_title ~ '^\s*$' or v_summary ~ '^\s*$' or cardinality(v_ids) = 0 then
    raise exception 'title, summary and source_ids must be all empty (no-op) or all present'
      using errcode = 'MB023';
  end if;
  if octet_length(v_title) > v_policy.title_bytes then
    raise exception 'title is % bytes; the limit is % UTF-8 bytes', octet_length(v_title),
      v_policy.title_bytes using errcode = 'MB023';
  end if;
  if octet_length(v_summary) > v_policy.summary_bytes then
    raise exception 'summary is % bytes; the limit is % UTF-8 bytes', octet_length(v_summary),
      v_policy.summary_bytes using errcode = 'MB023';
  end if;
  select count(*)::text into v_bad from unnest(v_ids) as i
   where not exists (select 1 from jsonb_array_elements(p_job.input -> 'sources') s
                      where s ->> 'id' = i);
  if v_bad <> '0' then
    raise exception '% source id(s) are not messages of the job''s batch', v_bad
      using errcode = 'MB023';
  end if;
  -- Reuse can only be declared of a memory the model was shown with the batch (P5).
  select count(*)::text into v_bad from unnest(v_reused) as x
   where not exists (select 1 from jsonb_array_elements_text(p_job.input -> 'existing') e
                      where e::bigint = x);
  if v_bad <> '0' then
    raise exception '% reused id(s) are not memories shown with the batch', v_bad
      using errcode = 'MB023';
  end if;
  v_title := memory_private.redact(v_title);
  v_summary := memory_private.redact(v_summary);
  if octet_length(v_title) > v_policy.title_bytes
     or octet_length(v_summary) > v_policy.summary_bytes then
    raise exception 'title or summary is over its byte limit once credentials are redacted'
      using errcode = 'MB023';
  end if;
  -- A line cites the sources it rests on ([m1] or [m1, m2]): a message of the batch cited on a
  -- line must be one of source_ids.
  select count(distinct c.message_id)::text into v_bad
    from memory_private.line_citations(
           v_summary, array(select s ->> 'id'
                              from jsonb_array_elements(p_job.input -> 'sources') s)) c
   where c.message_id <> all (v_ids);
  if v_bad <> '0' then
    raise exception '% message id(s) cited in the summary are not among source_ids', v_bad
      using errcode = 'MB023';
  end if;
  return jsonb_build_object('title', v_title, 'summary', v_summary,
                            'source_ids', to_jsonb(v_ids), 'reused_ids', to_jsonb(v_reused));
end
$$;
comment on function memory_private.validate_extraction(memory_private.jobs, jsonb) is
  'Validates an extraction output and returns it redacted and normalized; raises MB023. '
  '{"title", "summary", "source_ids", "reused_ids"?}: all empty = no-op; title and summary '
  'within their byte limits (also after redaction); source ids within the batch, kept in the '
  'order given, each once; every batch message a summary line cites ([m1]) among them; reused '
  'ids among the memories shown with the batch (P6, P8).';

create function memory_private.validate_index(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
declare
  v_index text;
  v_record_ids bigint[];
  v_bad text;
  v_policy memory_private.policy_values := memory_private.policy();
begin
  perform memory_private.check_output_keys('consolidate', p_output,
                                           array['index', 'record_ids'], '{}');
  if jsonb_typeof(p_output -> 'index') <> 'string' then
    raise exception 'index must be a string' using errcode = 'MB023';
  end if;
  if not memory_private.is_id_array(p_output -> 'record_ids') then
    raise exception 'record_ids must be an array of record ids (positive integers)'
      using errcode = 'MB023';
  end if;
  v_index := p_output ->> 'index';
  if v_index ~ '^\s*$' then
    raise exception 'index must not be empty' using errcode = 'MB023';
  end if;
  if octet_length(v_index) > v_policy.index_bytes then
    raise exception 'index is % bytes; the limit is % UTF-8 bytes', octet_length(v_index),
      v_policy.index_bytes using errcode = 'MB023';
  end if;
  v_record_ids := array(select (e #>> '{}')::bigint
                          from jsonb_array_elements(p_output -> 'record_ids')
                               with ordinality as a(e, n) order by n);
  if cardinality(v_record_ids) = 0 then
    raise exception 'record_ids must name at least one memory' using errcode = 'MB023';
  end if;
  if cardinality(v_record_ids) > v_policy.index_ids then
    raise exception 'record_ids has % ids; the limit is %', cardinality(v_record_ids),
      v_policy.index_ids using errcode = 'MB023';
  end if;
  if cardinality(v_record_ids)
     <> (select count(distinct x) from unnest(v_record_ids) as x) then
    raise exception 'record_ids has duplicates' using errcode = 'MB023';
  end if;
  select count(*)::text into v_bad from unnest(v_record_ids) as x
   where not exists (select 1 from jsonb_array_elements_text(p_job.input -> 'candidates') c
                      where c::bigint = x);
  if v_bad <> '0' then
    raise exception '% record id(s) are not among the job''s candidates', v_bad
      using errcode = 'MB023';
  end if;
  v_index := memory_private.redact(v_index);
  if octet_length(v_index) > v_policy.index_bytes then
    raise exception 'index is over its byte limit once credentials are redacted'
      using errcode = 'MB023';
  end if;
  return jsonb_build_object('index', v_index, 'record_ids', to_jsonb(v_record_ids));
end
$$;
comment on function memory_private.validate_index(memory_private.jobs, jsonb) is
  'Validates a consolidation output and returns it redacted and normalized; raises MB023. '
  '{"index", "record_ids"}: index non-empty, within its byte limit (also after redaction); 1 to '
  'the limit of distinct record ids, all among the candidates (P8, P9).';

create function memory_private.validate_output(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql stable
  as $$
begin
  if p_job.phase = 'extract' then
    return memory_private.validate_extraction(p_job, p_output);
  end if;
  return memory_private.validate_index(p_job, p_output);
end
$$;
comment on function memory_private.validate_output(memory_private.jobs, jsonb) is
  'Validates a model output for a job and returns it redacted and normalized; raises MB023. '
  'extract (memory_private.validate_extraction): {"title", "summary", "source_ids", '
  '"reused_ids"?} (all empty = no-op; title and summary within the policy''s byte limits; '
  'source ids within the batch, kept in the order given; a batch id cited in a summary line''s '
  'brackets must be among them; reused ids among the memories shown with the batch). '
  'consolidate (memory_private.validate_index): {"index", "record_ids"} (index non-empty, within '
  'the policy''s index bytes; distinct ids among the candidates, at most the policy''s index '
  'records). No other keys. The limits are memory_private.policy()''s.';

create function memory_private.job_payload(p_job memory_private.jobs) returns jsonb
  language plpgsql stable
  as $$
declare
  v_scope memory_private.scopes;
  v_budget record;
  v_input jsonb;
begin
  select * into v_scope from memory_private.scopes
   where workspace_id = p_job.workspace_id and scope_id = p_job.scope_id;
  select * into v_budget
    from memory_private.budget_left(p_job.workspace_id, p_job.origin_request_id);

  -- Inputs are redacted before they are serialized (P8).
  if p_job.phase = 'extract' then
    v_input := jsonb_build_object(
      'sources', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', m.message_id, 'role', m.role, 'speaker_id', m.speaker_id,
                 'thread_id', r.thread_id, 'created_at', m.created_at,
                 'text', memory_private.redact(m.body))
               order by m.created_at, m.message_id)
          from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
          join memory_private.messages m
            on m.workspace_id = p_job.workspace_id and m.message_id = s.id
          join memory_private.requests r
            on r.workspace_id = m.workspace_id and r.request_id = m.request_id), '[]'::jsonb),
      'existing', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', rec.record_id, 'title', memory_private.redact(rec.title),
                 'summary', memory_private.redact(rec.summary))
               order by rec.created_at, rec.record_id)
          from jsonb_array_elements_text(p_job.input -> 'existing') as e(id)
          join memory_private.records rec
            on rec.workspace_id = p_job.workspace_id and rec.record_id = e.id::bigint),
        '[]'::jsonb));
  else
    v_input := jsonb_build_object(
      'candidates', coalesce((
        select jsonb_agg(jsonb_build_object(
                 'id', rec.record_id, 'kind', rec.kind, 'title', memory_private.redact(rec.title),
                 'summary', memory_private.redact(rec.summary),
                 'speaker_ids', to_jsonb(rec.speaker_ids), 'created_at', rec.created_at)
               order by rec.created_at desc, rec.record_id desc)
          from jsonb_array_elements_text(p_job.input -> 'candidates') as c(id)
          join memory_private.records rec
            on rec.workspace_id = p_job.workspace_id and rec.record_id = c.id::bigint),
        '[]'::jsonb));
  end if;

  return jsonb_build_object(
    'job_id', p_job.job_id,
    'workspace_id', p_job.workspace_id,
    'token', p_job.token::text,
    'phase', p_job.phase,
    -- The number this claim's model call gets (claims count calls); none with a checkpoint.
    'attempt', case when p_job.checkpoint is null then p_job.claims + 1 end,
    'lease_expires_at', p_job.lease_expires_at,
    'scope', jsonb_build_object('scope_id', v_scope.scope_id, 'kind', v_scope.kind,
                                'bot_id', v_scope.bot_id, 'chat_id', v_scope.chat_id,
                                'user_id', v_scope.user_id, 'topic_id', v_scope.topic_id),
    'origin_request_id', p_job.origin_request_id,
    'model', jsonb_build_object('provider', p_job.model_provider, 'id', p_job.model_id),
    -- Dollars as exact decimal strings, as the rest of the API takes them (a JSON number is a
    -- float in most clients).
    'budget', jsonb_build_object(
       'request_left_usd', v_budget.request_left::text,
       'workspace_left_usd', v_budget.workspace_left::text),
    'limits', memory_private.job_limits(),
    'input', v_input,
    'checkpoint', case when p_job.checkpoint is not null
                       then jsonb_build_object('output', p_job.checkpoint -> 'output',
                                               'usage', p_job.checkpoint -> 'usage') end);
end
$$;
comment on function memory_private.job_payload(memory_private.jobs) is
  'The claim payload of a running job: ids, token, phase, attempt (the number its model call '
  'gets; null with a checkpoint), lease, scope, origin request, pinned model, budget left (exact '
  'decimal strings), limits, the redacted input rendered from current facts, and the '
  'checkpoint when one exists.';

