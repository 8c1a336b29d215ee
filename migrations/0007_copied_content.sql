-- 0007_copied_content: provenance by content (issue 31; docs/retention.md, "What a record
-- copies"). A record depends on every batch message and every memory shown with the batch whose
-- content its title or summary copies, cited or not: a non-trivial message copied whole, eight
-- consecutive words, or a distinctive token (a number, code, identifier, URL, e-mail address), on
-- text normalised first (format characters removed, NFKC, lower case; CJK by characters).
-- - memory_private.copied_sources (with copy_normal, copy_words, word_runs, distinctive_tokens,
--   is_trivial, copied_parts, stock_runs, copy_counts) replaces the eight-word rule of the
--   summary (memory_private.passages, memory_private.repeated_sources: dropped).
-- - record_dependencies.via: 'copied' replaces 'repeated' (existing rows are renamed: they were
--   found by eight consecutive words, a part of the copy rule); copied_by says by which part.
--   A copied memory's dependencies join as 'reused', as a declared reuse does.
-- - Four policy numbers: copy_run_words, copy_message_words, copy_token_chars,
--   copy_stock_records.
-- - memory_private.write_extraction writes them; commit_job answers copied, copied_memories and
--   copied_by (and repeated, the same number as copied, for readers of release 0.1.0);
--   memory.explain_record lists each dependency's copied_by.

alter type memory_private.policy_values
  add attribute copy_run_words integer,
  add attribute copy_message_words integer,
  add attribute copy_token_chars integer,
  add attribute copy_stock_records integer;

create or replace function memory_private.policy() returns memory_private.policy_values
  language sql immutable parallel safe security definer
  -- Definer only so that the operator views may read it (their callers have no usage on this
  -- schema); immutable, so every query folds it to constants when it is planned.
  set search_path = pg_catalog, pg_temp
  as $$
  select row(
    200,                    -- id_bytes
    100,                    -- id_list_entries
    64000,                  -- message_bytes
    43200,                  -- max_idle_minutes
    30,                     -- default_idle_minutes
    1000000,                -- max_dollars
    24000,                  -- batch_bytes
    4,                      -- existing_with_batch
    300,                    -- title_bytes
    4000,                   -- summary_bytes
    48,                     -- candidates
    4500,                   -- index_bytes
    12,                     -- index_ids
    3,                      -- max_claims
    interval '2 minutes',   -- lease
    interval '1 hour',      -- failure_backoff
    2000,                   -- error_chars
    8,                      -- directory_records
    300,                    -- directory_summary_chars
    12,                     -- query_limit
    1000,                   -- query_bytes
    20,                     -- shown_sources
    60,                     -- note_title_chars
    30,                     -- unused_days
    256,                    -- workspace_records
    8,                      -- copy_run_words
    4,                      -- copy_message_words
    4,                      -- copy_token_chars
    48                      -- copy_stock_records
  )::memory_private.policy_values
$$;
comment on function memory_private.policy() is
  'Every limit, count and period of the memory''s rules (memory_private.policy_values names '
  'them): byte and count limits of ingest, model output, recall and tools; three model calls per '
  'unchanged input, the two-minute lease, the one-hour backoff; 30 days unused and 256 records '
  'per workspace; what the copy rule counts as a copy (8 consecutive words, a message of 4 '
  'words, a token of 4 characters; stock phrasing looked for in the 48 newest records). '
  'Immutable: changing one is a migration.';

alter table memory_private.record_dependencies
  drop constraint record_dependencies_via_check,
  add column copied_by text[];
update memory_private.record_dependencies set via = 'copied', copied_by = '{run}'
 where via = 'repeated';
alter table memory_private.record_dependencies
  add constraint record_dependencies_via_check check (via in ('cited', 'reused', 'copied')),
  -- What the copy rule found a copied dependency by; a reused one has it when the memory it
  -- came through was copied rather than declared; a cited one never.
  add constraint record_dependencies_copied_by_check
    check (case when copied_by is null then via <> 'copied'
                else via in ('copied', 'reused') and cardinality(copied_by) > 0
                     and copied_by <@ array['message', 'run', 'token'] end);
comment on table memory_private.record_dependencies is
  'What a record''s content was made from: each message with the content hash it had when used, '
  'and why it counts: cited (a source of the record), reused (a dependency of a memory shown '
  'with the batch that the output declared it reused or copies) or copied (an uncited message '
  'of the batch whose content the record copies: memory_private.copied_sources). '
  'Validity, forgetting, retention and grants act on these (T1, T7, T8). A cited one is a '
  'source: position numbers the sources in the order the summary uses them (position 1 first; '
  'memory_private.record_sources lists them).';
comment on column memory_private.record_dependencies.copied_by is
  'Which parts of the copy rule (memory_private.copied_parts: message, run, token) found the '
  'copied message, or the copied memory a reused dependency came through; NULL otherwise.';

-- What a record copies ------------------------------------------------------------------------
-- A record depends on every message of its batch and every memory shown with the batch whose
-- content it copies, cited or not (docs/retention.md, "What a record copies"). The record's
-- text is its title and summary: everything else it stores (record_texts, record_documents,
-- record_lines, line_sources) is derived from those two.

create function memory_private.copy_normal(p_text text) returns text
  language sql immutable strict parallel safe
  as $$
  -- Without invisible characters (every format character, Unicode category Cf, and the other
  -- default-ignorable code points: variation selectors, fillers, tags), in Unicode
  -- compatibility form (full-width letters, ligatures and the like become the plain ones),
  -- lower case. The database is UTF-8, as normalize() and every CJK rule here need.
  select lower(normalize(regexp_replace(p_text,
           '[\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u115f-\u1160'
           '\u17b4-\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164'
           '\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f'
           '\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]', '', 'g'), nfkc))
$$;
comment on function memory_private.copy_normal(text) is
  'A text as the copy rule compares it: format characters (Unicode category Cf) and the other '
  'default-ignorable code points removed, NFKC (compatibility form), lower case.';

create function memory_private.copy_words(p_text text) returns text[]
  language sql immutable strict parallel safe
  as $$
  -- Words are runs of letters and digits of the normalised text; a Chinese, Japanese or Korean
  -- character is a word of its own (those scripts do not separate words with spaces). They are
  -- spaced apart first: a regular expression takes the longest match, so a run of them would
  -- otherwise be one word.
  select coalesce(array_agg(m.word[1] order by m.n), '{}')
    from regexp_matches(
           regexp_replace(memory_private.copy_normal(p_text),
                          '([぀-ヿ㐀-䶿一-鿿가-힯豈-﫿])', ' \1 ', 'g'),
           '[぀-ヿ㐀-䶿一-鿿가-힯豈-﫿]|[[:alnum:]]+', 'g') with ordinality as m(word, n)
$$;
comment on function memory_private.copy_words(text) is
  'The words of a text in order, normalised (memory_private.copy_normal): runs of letters and '
  'digits, each CJK character a word of its own.';

create function memory_private.word_runs(p_words text[]) returns text[]
  language sql immutable strict parallel safe
  as $$
  select coalesce(array_agg(distinct array_to_string(
                    p_words[i:i + (memory_private.policy()).copy_run_words - 1], ' ')), '{}')
    from generate_series(1, cardinality(p_words) - (memory_private.policy()).copy_run_words + 1)
         as i
$$;
comment on function memory_private.word_runs(text[]) is
  'Every run of policy copy_run_words (8) consecutive words of a word list '
  '(memory_private.copy_words), joined by a space; none when the list is shorter.';

create function memory_private.distinctive_tokens(p_text text) returns text[]
  language sql immutable strict parallel safe
  as $$
  -- A token is a run of characters other than blanks and CJK characters, without what is not a
  -- letter or a digit at either end ("4711-ZEBRA." -> 4711-zebra). Distinctive: at least
  -- copy_token_chars characters, and a digit in it (numbers, codes, dates, times, phone
  -- numbers), or one of @ _ / \ : = # $ % & + ~ | in it (e-mail addresses, URLs, paths,
  -- identifiers, key=value, credential-shaped strings), or a dot between two letters or digits
  -- (domains, file names). Plain words, hyphenated words and short numbers are not.
  select coalesce(array_agg(distinct t.token), '{}')
    from (select regexp_replace(m.run[1], '^[^[:alnum:]]+|[^[:alnum:]]+$', '', 'g') as token
            from regexp_matches(memory_private.copy_normal(p_text),
                                '[^[:space:]぀-ヿ㐀-䶿一-鿿가-힯豈-﫿]+', 'g') as m(run)) t
   where char_length(t.token) >= (memory_private.policy()).copy_token_chars
     and t.token ~ '[[:digit:]]|[@_/\\:=#$%&+~|]|[[:alnum:]]\.[[:alnum:]]'
$$;
comment on function memory_private.distinctive_tokens(text) is
  'The distinctive tokens of a text, normalised (memory_private.copy_normal): blank-separated '
  'runs trimmed to a letter or digit at both ends, of at least policy copy_token_chars (4) '
  'characters, holding a digit, one of @ _ / \ : = # $ % & + ~ |, or a dot between letters '
  'or digits: numbers, codes, identifiers, URLs, e-mail addresses, credential-shaped strings.';

create function memory_private.is_trivial(p_words text[]) returns boolean
  language sql immutable strict parallel safe
  as $$
  select cardinality(p_words) < (memory_private.policy()).copy_message_words
      or pg_catalog.to_tsvector('pg_catalog.english', array_to_string(p_words, ' '))
         = ''::pg_catalog.tsvector
$$;
comment on function memory_private.is_trivial(text[]) is
  'Whether a message''s words (memory_private.copy_words) are too few to count as copied whole: '
  'fewer than policy copy_message_words (4; a CJK character is a word), or English stop words '
  'only ("ok", "thanks", "sounds good", "it is what it is").';

create function memory_private.copied_parts(p_record text, p_texts text[], p_common text[])
  returns table (n integer, parts text[])
  language sql immutable strict parallel safe
  as $$
  -- The record's words, runs and tokens (but the common ones) once (materialized: not
  -- recomputed for each text); each text's against them.
  with rec as materialized (
    select ' ' || array_to_string(w.words, ' ') || ' ' as line,
           array(select unnest(memory_private.word_runs(w.words))
                 except select unnest(p_common)) as runs,
           array(select unnest(memory_private.distinctive_tokens(p_record))
                 except select unnest(p_common)) as tokens
      from (select memory_private.copy_words(p_record) as words) w
  )
  select x.n, x.parts
    from (select t.n::integer as n,
                 array_remove(array[
                   case when not memory_private.is_trivial(w.words)
                         and strpos(rec.line, ' ' || array_to_string(w.words, ' ') || ' ') > 0
                        then 'message' end,
                   case when memory_private.word_runs(w.words) && rec.runs then 'run' end,
                   case when memory_private.distinctive_tokens(t.body) && rec.tokens
                        then 'token' end], null) as parts
            from rec
           cross join unnest(p_texts) with ordinality as t(body, n)
           cross join lateral (select memory_private.copy_words(t.body) as words) w) x
   where cardinality(x.parts) > 0
$$;
comment on function memory_private.copied_parts(text, text[], text[]) is
  'The copy rule: which of p_texts (by place, from 1) the text p_record copies, and by which '
  'parts of the rule, on normalised text (memory_private.copy_normal): message (all its words, '
  'in order, unless trivial: memory_private.is_trivial), run (policy copy_run_words consecutive '
  'words, memory_private.word_runs), token (a distinctive token: '
  'memory_private.distinctive_tokens); runs and tokens of p_common do not count. Texts it '
  'copies nothing of are left out.';

create function memory_private.stock_runs(
  p_workspace_id text, p_scope_id bigint, p_runs text[]
) returns text[]
  language sql stable
  as $$
  -- A run of words that two records of the scope hold although they cite no message in common
  -- is the model's own stock phrasing (a label, a set phrase), not what either was made from.
  -- Only the given runs are looked for, in the scope's policy copy_stock_records newest
  -- records (records_scope_idx); none when no run is given.
  with recent as (
    select r.record_id, r.source_ids, r.title, r.summary
      from memory_private.records r
     where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
       and cardinality(p_runs) > 0
     order by r.created_at desc
     limit (memory_private.policy()).copy_stock_records
  ), hits as (
    select r.record_id, r.source_ids, x.run
      from recent r
     cross join lateral unnest(memory_private.word_runs(
                  memory_private.copy_words(r.title || e'\n' || r.summary))) as x(run)
     where x.run = any (p_runs)
  )
  select coalesce(array_agg(distinct a.run), '{}')
    from hits a
    join hits b on b.run = a.run and b.record_id > a.record_id
   where not a.source_ids && b.source_ids
$$;
comment on function memory_private.stock_runs(text, bigint, text[]) is
  'Those of p_runs (runs of words: memory_private.word_runs) that two of the scope''s newest '
  'records (policy copy_stock_records) hold although they cite no message in common: stock '
  'phrasing of the model (a label, a set phrase), which the copy rule does not take as '
  'copying a shown memory.';

create function memory_private.copied_sources(p_job memory_private.jobs, p_output jsonb)
  returns table (message_id text, content_hash text, record_id bigint, copied_by text[])
  language sql stable
  as $$
  -- What the model saw besides what the output cites or declares it reused, as it saw it
  -- (redacted, memory_private.job_payload): the batch's other messages at the hash the job saw,
  -- and the other memories shown with the batch (title and summary). Against a memory, what
  -- the batch itself says (its runs and tokens) and the scope's stock phrasing
  -- (memory_private.stock_runs) do not count: the record has those from its batch or from the
  -- model. Each list numbered once (materialized), so that the rule's answer by place finds
  -- its row.
  with said as (
    select concat_ws(e'\n', p_output ->> 'title', p_output ->> 'summary') as text
  ), batch as materialized (
    select s.id, s.hash, memory_private.redact(m.body) as body,
           (p_output -> 'source_ids') ? s.id as cited
      from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
      join memory_private.messages m
        on m.workspace_id = p_job.workspace_id and m.message_id = s.id
     where m.content_hash = s.hash
  ), messages as materialized (
    select row_number() over ()::integer as n, b.id, b.hash, b.body from batch b where not b.cited
  ), memories as materialized (
    select row_number() over ()::integer as n, r.record_id,
           memory_private.redact(r.title) || e'\n' || memory_private.redact(r.summary) as body
      from jsonb_array_elements_text(p_job.input -> 'existing') as e(id)
      join memory_private.records r
        on r.workspace_id = p_job.workspace_id and r.record_id = e.id::bigint
     where not coalesce(p_output -> 'reused_ids', '[]') @> to_jsonb(r.record_id)
  ), batch_says as (
    select array(select unnest(memory_private.word_runs(memory_private.copy_words(b.body)))
                   from batch b
                 union
                 select unnest(memory_private.distinctive_tokens(b.body)) from batch b) as parts
  ), common as (
    -- Stock phrasing is looked for only among the runs the record shares with a shown memory
    -- and not with its batch (usually none).
    select s.parts || memory_private.stock_runs(
             p_job.workspace_id, p_job.scope_id,
             array(select unnest(memory_private.word_runs(memory_private.copy_words(said.text)))
                   intersect
                   select unnest(memory_private.word_runs(memory_private.copy_words(m.body)))
                     from memories m
                   except
                   select unnest(s.parts))) as parts
      from said, batch_says s
  )
  select m.id, m.hash, null::bigint, c.parts
    from said, memory_private.copied_parts(said.text, array(select b.body from messages b
                                                            order by b.n), '{}') c
    join messages m on m.n = c.n
  union all
  select null, null, m.record_id, c.parts
    from said, common,
         memory_private.copied_parts(said.text, array(select b.body from memories b
                                                      order by b.n), common.parts) c
    join memories m on m.n = c.n
$$;
comment on function memory_private.copied_sources(memory_private.jobs, jsonb) is
  'The batch messages (message_id, with the hash the job saw) and the memories shown with the '
  'batch (record_id) that a validated extraction output (its title and summary) copies '
  'although it neither cites nor declares reusing them (memory_private.copied_parts, against '
  'what the model saw: redacted), with the parts of the rule that found each (copied_by). '
  'Against a memory, the runs and tokens of the batch''s own messages and the scope''s stock '
  'phrasing (memory_private.stock_runs) do not count. write_extraction makes the messages '
  'dependencies (via copied) and the memories reused.';

drop function memory_private.repeated_sources(memory_private.jobs, text, text[]);
drop function memory_private.passages(text);

create function memory_private.copy_counts(p_copied jsonb, p_via text[]) returns jsonb
  language sql immutable
  as $$
  -- p_copied: memory_private.copied_sources as a JSON array; p_via: the record's dependencies'.
  select jsonb_build_object(
           'copied', v.copied,
           -- The name of the count before the copy rule replaced the eight-word rule
           -- (schema version 6), kept for readers of that release.
           'repeated', v.copied,
           'copied_memories', c.memories,
           'copied_by', jsonb_build_object('message', c.message, 'run', c.run,
                                           'token', c.token))
    from (select count(*) filter (where x = 'copied') as copied from unnest(p_via) x) v,
         (select count(*) filter (where e ->> 'record_id' is not null) as memories,
                 count(*) filter (where e -> 'copied_by' ? 'message') as message,
                 count(*) filter (where e -> 'copied_by' ? 'run') as run,
                 count(*) filter (where e -> 'copied_by' ? 'token') as token
            from jsonb_array_elements(p_copied) e) c
$$;
comment on function memory_private.copy_counts(jsonb, text[]) is
  'What commit_job answers of the copy rule for one record: copied (dependencies via copied; '
  'also under its former name repeated), copied_memories (memories shown with the batch that it '
  'copies, reused), and copied_by: how many of those messages and memories each part of the '
  'rule found (message, run, token).';

create or replace function memory_private.write_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_cited text[] := array(select jsonb_array_elements_text(p_output -> 'source_ids'));
  v_reused bigint[] := array(select jsonb_array_elements_text(p_output -> 'reused_ids')::bigint);
  v_copied jsonb := coalesce((select jsonb_agg(to_jsonb(c))
                                from memory_private.copied_sources(p_job, p_output) c), '[]');
  v_dep_ids text[];
  v_dep_hashes text[];
  v_dep_via text[];
  v_dep_by text[];
  v_record_id bigint;
begin
  -- The dependencies: the cited messages at the hash the job saw; every dependency of the
  -- memories the output declared it reused (P5: existing memory accompanies the batch; what it
  -- rests on stays tracked without resending it) or copies (memory_private.copied_sources: a
  -- copied memory counts as reused); and the batch messages it copies without citing. A
  -- message that counts twice is kept once, under its first reason in that order.
  select array_agg(d.message_id order by d.message_id),
         array_agg(d.content_hash order by d.message_id),
         array_agg(d.via order by d.message_id),
         array_agg(d.copied_by order by d.message_id)
    into v_dep_ids, v_dep_hashes, v_dep_via, v_dep_by
    from (select distinct on (u.message_id) u.message_id, u.content_hash, u.via,
                 array_to_string(u.copied_by, ' ') as copied_by
            from (select s.id as message_id, s.hash as content_hash, 'cited' as via, 1 as rank,
                         null::text[] as copied_by
                    from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
                   where s.id = any (v_cited)
                  union all
                  select rd.message_id, rd.content_hash, 'reused', 2, null
                    from memory_private.record_dependencies rd
                   where rd.workspace_id = p_job.workspace_id and rd.record_id = any (v_reused)
                  union all
                  select rd.message_id, rd.content_hash, 'reused', 3, c.copied_by
                    from jsonb_to_recordset(v_copied) as c(record_id bigint, copied_by text[])
                    join memory_private.record_dependencies rd
                      on rd.workspace_id = p_job.workspace_id and rd.record_id = c.record_id
                  union all
                  select c.message_id, c.content_hash, 'copied', 4, c.copied_by
                    from jsonb_to_recordset(v_copied)
                         as c(message_id text, content_hash text, record_id bigint,
                              copied_by text[])
                   where c.record_id is null
                 ) u
           order by u.message_id, u.rank) d;

  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  select p_job.workspace_id, p_job.scope_id, 'extracted', p_output ->> 'title',
         p_output ->> 'summary',
         -- Statements are attributed to the people whose messages the record rests on (V9);
         -- grants follow every repository those messages drew on (V6).
         coalesce(array_agg(distinct m.speaker_id order by m.speaker_id)
                    filter (where m.role = 'user'), '{}'),
         coalesce(array_agg(distinct q.thread_id order by q.thread_id), '{}'),
         coalesce(array(select distinct x from memory_private.messages mm,
                                              unnest(mm.repositories) as x
                         where mm.workspace_id = p_job.workspace_id
                           and mm.message_id = any (v_dep_ids) order by 1), '{}'),
         p_job.input ->> 'bot_identity', p_job.origin_request_id, v_now
    from memory_private.messages m
    join memory_private.requests q
      on q.workspace_id = m.workspace_id and q.request_id = m.request_id
   where m.workspace_id = p_job.workspace_id and m.message_id = any (v_dep_ids)
  returning record_id into v_record_id;
  -- The dependencies; the cited ones are the sources, numbered in the order the summary uses
  -- them: by the first line that cites each, then those no line cites, in the order the
  -- output listed them.
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via, position, copied_by)
  select p_job.workspace_id, v_record_id, d.id, d.hash, d.via, o.position,
         string_to_array(nullif(d.copied_by, ''), ' ')
    from unnest(v_dep_ids, v_dep_hashes, v_dep_via, v_dep_by) as d(id, hash, via, copied_by)
    left join (select f.id, row_number() over (order by f.first_line nulls last, f.n) as position
                 from (select c.id, c.n,
                              (select min(l.line_no)
                                 from memory_private.line_citations(p_output ->> 'summary',
                                                                    v_cited) l
                                where l.message_id = c.id) as first_line
                         from unnest(v_cited) with ordinality as c(id, n)) f) o
      on d.via = 'cited' and o.id = d.id;
  perform memory_private.mark_consolidation_due(p_job.workspace_id, p_job.scope_id);
  return jsonb_build_object('record_id', v_record_id,
                            'sources', cardinality(v_cited),
                            'dependencies', cardinality(v_dep_ids))
         || memory_private.copy_counts(v_copied, v_dep_via);
end
$$;
comment on function memory_private.write_extraction(memory_private.jobs, jsonb) is
  'Writes the record of a validated, non-empty extraction output: its sources (the cited '
  'messages in the order given), its dependencies (cited; reused: of the memories it declared '
  'it reused or copies; copied: the batch messages it copies without citing, '
  'memory_private.copied_sources) with the hashes the job saw, speakers, threads and '
  'repositories taken from the dependencies; marks the scope due for consolidation. Returns '
  'the record id and the counts (memory_private.copy_counts).';

comment on function memory.commit_job(text, bigint, text) is
  'Writes a job''s checkpointed output and marks the job succeeded, after re-checking '
  'ownership (MB020), the config version (MB022) and that the input snapshot is still current '
  '(MB021). extract: one record whose sources are the cited messages and whose dependencies '
  'are what it was made from (cited, reused, copied), the batch marked extracted, the scope '
  'due for consolidation; an empty output only marks the batch. consolidate: the scope index, '
  'depending on every candidate. All or nothing.';

create or replace function memory.explain_record(
  p_workspace_id text, p_record_id bigint, p_requester text default null
) returns jsonb
  language plpgsql stable security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_record memory_private.records;
  v_usage memory_private.record_usage;
  v_scope memory_private.scopes;
  v_now timestamptz := memory_private.clock_now();
  v_checks jsonb;
  v_reason text;
begin
  perform memory_private.require_workspace(p_workspace_id);
  if p_record_id is null then
    raise exception 'record_id is required' using errcode = 'MB001';
  end if;
  if p_requester is not null then
    perform memory_private.check_id('requester', p_requester);
  end if;
  select * into v_record from memory_private.records
   where workspace_id = p_workspace_id and record_id = p_record_id;
  if not found then
    raise exception 'record % is unknown in workspace %', p_record_id, p_workspace_id
      using errcode = 'MB002', hint = 'It may have been pruned, forgotten or purged; see '
                                      'memory.record_status.';
  end if;
  select * into v_usage from memory_private.record_usage
   where workspace_id = p_workspace_id and record_id = p_record_id;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = v_record.scope_id;
  -- The rule's own checks, in its order, formatted; the verdict is the rule's (invalid_records).
  select jsonb_agg(jsonb_build_object('check', c.check_name, 'reason', c.reason, 'ok', c.ok,
                                      'detail', c.detail) order by c.rank, c.check_name <> 'membership')
    into v_checks
    from memory_private.record_checks(p_workspace_id, p_record_id, p_requester) c;
  v_reason := memory_private.record_invalid_reason(v_record, p_requester);
  return jsonb_build_object(
    'workspace_id', p_workspace_id,
    'record_id', v_record.record_id,
    'requester', p_requester,
    'valid', v_reason is null,
    'invalid_reason', v_reason,
    'record', jsonb_build_object(
      'kind', v_record.kind, 'created_at', v_record.created_at,
      'last_used_at', v_usage.last_used_at, 'usage_count', coalesce(v_usage.usage_count, 0),
      'title_bytes', octet_length(v_record.title),
      'summary_bytes', octet_length(v_record.summary),
      'speaker_ids', to_jsonb(v_record.speaker_ids), 'thread_ids', to_jsonb(v_record.thread_ids),
      'repositories', to_jsonb(v_record.repositories),
      'bot_identity', v_record.bot_identity, 'origin_request_id', v_record.origin_request_id,
      'in_index', coalesce(v_record.record_id = any(v_scope.index_record_ids), false)),
    'scope', jsonb_build_object(
      'scope_id', v_scope.scope_id, 'kind', v_scope.kind, 'bot_id', v_scope.bot_id,
      'chat_id', v_scope.chat_id, 'user_id', v_scope.user_id, 'topic_id', v_scope.topic_id,
      'recall_enabled', v_scope.recall_enabled),
    'checks', v_checks,
    -- The sources: what the summary cites, in the order it uses them.
    'sources', to_jsonb(array(select rs.message_id from memory_private.record_sources rs
                               where rs.workspace_id = p_workspace_id
                                 and rs.record_id = p_record_id
                               order by rs.position)),
    -- Which line of the summary cites which source (by number, never the text): read from the
    -- summary by the rule the record was written with (memory_private.line_citations).
    'lines', coalesce((
      select jsonb_agg(jsonb_build_object('line', x.line_no, 'sources', x.ids) order by x.line_no)
        from (select l.line_no, jsonb_agg(l.message_id order by rs.position) as ids
                from memory_private.line_citations(
                       v_record.summary,
                       array(select s.message_id from memory_private.record_sources s
                              where s.workspace_id = p_workspace_id
                                and s.record_id = p_record_id)) l
                join memory_private.record_sources rs
                  on rs.workspace_id = p_workspace_id and rs.record_id = p_record_id
                 and rs.message_id = l.message_id
               group by l.line_no) x), '[]'),
    -- Each dependency: why it counts, the hash it had when used, the hash it has now, and its
    -- state by the rule (memory_private.dependency_state).
    'dependencies', coalesce((
      select jsonb_agg(jsonb_build_object(
               'message_id', d.message_id, 'via', d.via, 'copied_by', d.copied_by,
               'role', m.role, 'speaker_id', m.speaker_id,
               'recorded_hash', d.content_hash, 'current_hash', m.content_hash,
               'retain_until', m.retain_until, 'removed_at', m.removed_at,
               'removal_reason', m.removal_reason, 'edited_at', m.edited_at,
               'tombstoned', t.message_id is not null,
               'state', coalesce(memory_private.dependency_state(
                          m.removed_at, m.body is not null, m.retain_until, m.content_hash,
                          d.content_hash, t.message_id is not null, v_now), 'current'))
             order by d.message_id)
        from memory_private.record_dependencies d
        join memory_private.messages m
          on m.workspace_id = d.workspace_id and m.message_id = d.message_id
        left join memory_private.tombstones t
          on t.workspace_id = d.workspace_id and t.scope_id = v_record.scope_id
         and t.message_id = d.message_id
       where d.workspace_id = p_workspace_id and d.record_id = p_record_id), '[]'));
end
$$;
comment on function memory.explain_record(text, bigint, text) is
  'Why a record is or is not valid now, without its text: valid and invalid_reason exactly as '
  'recall decides them (for the given requester, or for the scope''s own user when NULL), '
  'every check in the order the rule applies them (recall on, bot '
  'active, group linked, membership, requester owns the private scope, bot identity, '
  'dependencies current, repository grants) with ok and a detail, its sources (the messages it '
  'cites, in summary order), which line of the summary cites which source, and every dependency (the messages it was made from: via cited, '
  'reused or copied, with copied_by: the parts of the copy rule that found it) with the hash it had when used, the hash it has now and its state '
  '(current, source_removed, source_expired, source_edited, forgotten). MB001, MB002 when the '
  'record is unknown.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 7 $$;
