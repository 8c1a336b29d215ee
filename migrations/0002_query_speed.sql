-- 0002_query_speed: query_memories reads and writes less (issue 13's search target,
-- docs/benchmarks.md).
-- - Extended statistics: a scope belongs to one workspace, so the planner no longer takes a scope
--   for about one record and reads a whole scope to find a few records by id.
-- - The lines a search finds are found for all shown records in one pass (matching_lines in set
--   form) and shown_sources is one planned statement; query_memories writes its tool_calls row
--   once, at the end.
-- - The lines a literal search finds are read from the shown records' summaries, and the sources
--   they cite from the lines themselves (memory_private.cited_ids, the rule the record was written
--   with), instead of an index lookup per line in record_lines and record_line_sources; that
--   table goes (explain_record reads a line's sources from the summary too: one form of the fact).
-- - A record's sources in order, a record's dependencies with their hashes and the state of the
--   messages they are on are read from an index alone (record_sources' position key includes
--   message_id; record_dependencies' primary key includes content_hash; messages_state_idx
--   holds a message's hash, removal and retention).
-- - A tool call resolves its request once (memory_private.request_scope); the scope's checks are
--   one query (scope_checks in SQL, planned inside scope_reason); record_detail is inlined;
--   upsert_message reads its request through known_request, as the tools do; known_request
--   looks the request up first and checks the workspace only when it finds nothing.
-- - The literal search reads record_texts, the records' folded texts in narrow rows, instead of
--   records.search_text in the records themselves (nothing wide, nothing to decompress), and
--   reads the text only of records holding every three-character run of the query (their
--   signature, memory_private.text_grams, is scanned in the scope's index alone).
-- - A search or browse validates as many records as it shows first (was four more).
-- - A record carries a copy of its dependencies (ids and hashes) and sources, which the database
--   writes from record_dependencies (a trigger after each statement writing it): the validity
--   rule and query_memories read them from the record's own page.
-- - Usage moves from records to record_usage: counting a call rewrites a few narrow rows instead
--   of twelve whole records (their indexes, and their full pages in the WAL after a checkpoint).
--   Every record gets its row when it is made (a trigger; never used: count 0, no date), so
--   counting a use updates it: no insert whose foreign-key check locks the record's row.

create statistics memory_private.records_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.records;
comment on statistics memory_private.records_scope_stats is
  'scope_id depends on workspace_id: keeps plans on the primary key when records are asked by id.';
create statistics memory_private.record_documents_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.record_documents;
comment on statistics memory_private.record_documents_scope_stats is
  'scope_id depends on workspace_id (as memory_private.records_scope_stats).';
analyze memory_private.records, memory_private.record_documents;

-- A source is a cited dependency with its place among the sources: record_sources becomes a
-- view of record_dependencies (one row per message a record rests on, its hash and, for a
-- source, its position), so query_memories reads a record's sources in order from the pages
-- validation reads its dependencies from (the primary key includes hash and position).
alter table memory_private.record_dependencies
  add column position integer constraint record_dependencies_position_check
    check (position >= 1);
comment on column memory_private.record_dependencies.position is
  'For a source (via = cited): its place among the record''s sources, in the order the summary '
  'uses them; NULL for any other dependency.';
update memory_private.record_dependencies d
   set position = s.position
  from memory_private.record_sources s
 where s.workspace_id = d.workspace_id and s.record_id = d.record_id
   and s.message_id = d.message_id;
-- Every source was a cited dependency and every cited dependency a source (commit_job and
-- control_remember wrote both); a source without a dependency, and the constraint below,
-- refuse an upgrade of data where that fails, rather than lose a source.
do $$
begin
  if exists (select 1 from memory_private.record_sources s
              where not exists (select 1 from memory_private.record_dependencies d
                                 where d.workspace_id = s.workspace_id
                                   and d.record_id = s.record_id
                                   and d.message_id = s.message_id)) then
    raise exception 'a record has a source that is not among its dependencies: '
      'not upgraded (0002 keeps the sources as cited dependencies)';
  end if;
end
$$;
alter table memory_private.record_dependencies
  drop constraint record_dependencies_pkey,
  add constraint record_dependencies_pkey
    primary key (workspace_id, record_id, message_id) include (content_hash, position),
  add constraint record_dependencies_cited_position
    check ((via = 'cited') = (position is not null));
comment on table memory_private.record_dependencies is
  'What a record''s content was made from: each message with the content hash it had when used, '
  'and why it counts: cited (a source of the record), reused (a dependency of a memory the '
  'output declared it reused) or repeated (an uncited message whose words the summary repeats). '
  'Validity, forgetting, retention and grants act on these (T1, T7, T8). A cited one is a '
  'source: position numbers the sources in the order the summary uses them (position 1 first; '
  'memory_private.record_sources lists them).';
alter table memory_private.record_sources rename to record_sources_moved;
create view memory_private.record_sources as
  select d.workspace_id, d.record_id, d.message_id, d.position
    from memory_private.record_dependencies d
   where d.position is not null;
comment on view memory_private.record_sources is
  'The messages a record cites, numbered in the order its summary uses them (position 1 first): '
  'its cited dependencies (memory_private.record_dependencies, one row per message, so a source '
  'and its hash are one fact). What query_memories shows (from the records'' copy, '
  'records.source_ids) and what enters the citation set (R5, R6).';

create table memory_private.record_usage (
  workspace_id text not null,
  record_id bigint not null,
  last_used_at timestamptz,
  usage_count integer not null check (usage_count >= 0),
  primary key (workspace_id, record_id),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade,
  constraint record_usage_never_used check ((usage_count = 0) = (last_used_at is null))
);
comment on table memory_private.record_usage is
  'How often and when query_memories last returned a record (R7: once per tool call id); a row '
  'for every record, made with it (memory_private.records_add_usage_row: count 0, no date until '
  'first returned). Kept apart from records so that counting a call rewrites a few narrow rows, '
  'not twelve whole records (their summaries, indexes and full pages in the WAL); made with the '
  'record so that counting never inserts: an insert''s foreign-key check would lock each '
  'returned record''s row, writing its page. Retention prunes the least recently used '
  '(memory_private.prune_records).';

-- Every record has its row: the use it had, or never used.
insert into memory_private.record_usage (workspace_id, record_id, last_used_at, usage_count)
select workspace_id, record_id,
       case when usage_count > 0 and last_used_at is not null then last_used_at end,
       case when usage_count > 0 and last_used_at is not null then usage_count else 0 end
  from memory_private.records;

create function memory_private.records_add_usage_row() returns trigger
  language plpgsql
  as $$
begin
  insert into memory_private.record_usage (workspace_id, record_id, last_used_at, usage_count)
  select n.workspace_id, n.record_id, null, 0 from added n
  on conflict do nothing;
  return null;
end
$$;
comment on function memory_private.records_add_usage_row() is
  'Trigger: every new record gets its record_usage row (never used) in the same statement, so '
  'that query_memories counts a use by updating it and never touches the records table.';

create trigger records_add_usage_row after insert on memory_private.records
  referencing new table as added
  for each statement execute function memory_private.records_add_usage_row();

create or replace view memory.record_status as
select r.workspace_id, r.record_id, r.scope_id, s.kind as scope_kind, r.kind,
       r.created_at, u.last_used_at, coalesce(u.usage_count, 0) as usage_count,
       (select count(*) from memory_private.record_sources rs
         where rs.workspace_id = r.workspace_id and rs.record_id = r.record_id) as sources,
       (select count(*) from memory_private.record_dependencies d
         where d.workspace_id = r.workspace_id and d.record_id = r.record_id) as dependencies,
       octet_length(r.title) as title_bytes, octet_length(r.summary) as summary_bytes,
       coalesce(r.record_id = any(s.index_record_ids), false) as in_index,
       v.reason is null as valid,
       v.reason as invalid_reason
  from memory_private.scopes s
 cross join lateral memory_private.operator_invalid_records(s.workspace_id, s.scope_id) v
  join memory_private.records r on r.workspace_id = s.workspace_id and r.record_id = v.record_id
  left join memory_private.record_usage u
    on u.workspace_id = r.workspace_id and u.record_id = r.record_id;

alter table memory_private.records drop column last_used_at, drop column usage_count;

-- A record carries its own copy of what it rests on (its dependencies with their hashes, its
-- sources in order), written by the database from record_dependencies after every statement
-- that writes it: the validity rule and query_memories read the record's own page instead of
-- an index leaf of record_dependencies per record.
alter table memory_private.records
  add column dependency_ids text[] not null default '{}',
  add column dependency_hashes text[] not null default '{}',
  add column source_ids text[] not null default '{}',
  add constraint records_dependency_hashes_check
    check (cardinality(dependency_hashes) = cardinality(dependency_ids));
comment on table memory_private.records is
  'Memories: a title and a historical summary (<= 4,000 bytes) with the speakers, threads and '
  'repositories they came from and the bot identity that made them, and what they rest on '
  '(dependency_ids, dependency_hashes, source_ids: the database''s copy of '
  'record_dependencies). Validity is decided from current facts on every read; the retention '
  'sweep deletes records that can never be valid again.';
comment on column memory_private.records.dependency_ids is
  'The messages the record depends on (record_dependencies.message_id, in bytewise id '
  'order), kept by the database (memory_private.follow_record_dependencies); what the validity '
  'rule checks.';
comment on column memory_private.records.dependency_hashes is
  'The content hash each of dependency_ids had when the record was made (same order).';
comment on column memory_private.records.source_ids is
  'The record''s sources (its cited dependencies) in the order its summary uses them '
  '(record_dependencies.position), kept by the database; what query_memories shows.';

-- The records' own copy of what they rest on. record_dependencies is where every writer puts a
-- record's dependencies (and where forgetting and retention find the records of a message);
-- after each statement that writes it, the database copies the touched records' dependencies,
-- hashes and sources into the records themselves, which is what the validity rule and
-- query_memories read (the record's page, read anyway, instead of an index leaf per record).
create function memory_private.copy_dependencies(p_workspace_ids text[], p_record_ids bigint[])
  returns void
  language sql volatile
  as $$
  update memory_private.records r
     set dependency_ids = x.ids, dependency_hashes = x.hashes, source_ids = x.sources
    from (select k.workspace_id, k.record_id,
                 coalesce(array_agg(d.message_id order by d.message_id collate "C")
                            filter (where d.message_id is not null), '{}') as ids,
                 coalesce(array_agg(d.content_hash order by d.message_id collate "C")
                            filter (where d.message_id is not null), '{}') as hashes,
                 coalesce(array_agg(d.message_id order by d.position)
                            filter (where d.position is not null), '{}') as sources
            from (select distinct w, id from unnest(p_workspace_ids, p_record_ids) as u(w, id))
                 as k(workspace_id, record_id)
            left join memory_private.record_dependencies d
              on d.workspace_id = k.workspace_id and d.record_id = k.record_id
           group by k.workspace_id, k.record_id) x
   where r.workspace_id = x.workspace_id and r.record_id = x.record_id
     and (r.dependency_ids, r.dependency_hashes, r.source_ids)
         is distinct from (x.ids, x.hashes, x.sources)
$$;
comment on function memory_private.copy_dependencies(text[], bigint[]) is
  'Sets the given records'' dependency_ids, dependency_hashes (in bytewise message id order) '
  'and source_ids (in source order) to what record_dependencies holds for them now.';

create function memory_private.follow_record_dependencies() returns trigger
  language plpgsql volatile
  as $$
begin
  -- Statement-level, with the statement's rows: one copy for every record it touched.
  if tg_op in ('INSERT', 'UPDATE') then
    perform memory_private.copy_dependencies(array(select n.workspace_id from new_rows n),
                                             array(select n.record_id from new_rows n));
  end if;
  if tg_op in ('UPDATE', 'DELETE') then
    perform memory_private.copy_dependencies(array(select o.workspace_id from old_rows o),
                                             array(select o.record_id from old_rows o));
  end if;
  return null;
end
$$;
comment on function memory_private.follow_record_dependencies() is
  'Trigger (after each statement writing record_dependencies): copies the touched records'' '
  'dependencies into the records (memory_private.copy_dependencies).';

create trigger record_dependencies_follow_insert
  after insert on memory_private.record_dependencies
  referencing new table as new_rows
  for each statement execute function memory_private.follow_record_dependencies();
create trigger record_dependencies_follow_update
  after update on memory_private.record_dependencies
  referencing old table as old_rows new table as new_rows
  for each statement execute function memory_private.follow_record_dependencies();
create trigger record_dependencies_follow_delete
  after delete on memory_private.record_dependencies
  referencing old table as old_rows
  for each statement execute function memory_private.follow_record_dependencies();

create function memory_private.refuse_dependency_copy() returns trigger
  language plpgsql
  as $$
begin
  raise exception 'records.dependency_ids, dependency_hashes and source_ids are the database''s '
    'copy of record_dependencies; write record_dependencies instead'
    using errcode = 'check_violation';
end
$$;
comment on function memory_private.refuse_dependency_copy() is
  'Trigger: refuses a statement that writes a record''s copy of its dependencies itself (only '
  'memory_private.copy_dependencies, run by the record_dependencies triggers, does).';

-- Every record's copy, before the guards that keep anything else from writing it.
select memory_private.copy_dependencies(array_agg(r.workspace_id), array_agg(r.record_id))
  from memory_private.records r;

-- pg_trigger_depth() is 0 for a statement of its own, 1 inside the record_dependencies trigger.
create trigger records_refuse_dependency_copy_insert
  before insert on memory_private.records
  for each row
  when (pg_trigger_depth() = 0
        and (cardinality(new.dependency_ids) > 0 or cardinality(new.dependency_hashes) > 0
             or cardinality(new.source_ids) > 0))
  execute function memory_private.refuse_dependency_copy();

create trigger records_refuse_dependency_copy_update
  before update of dependency_ids, dependency_hashes, source_ids on memory_private.records
  for each row
  when (pg_trigger_depth() = 0
        and (new.dependency_ids, new.dependency_hashes, new.source_ids)
            is distinct from (old.dependency_ids, old.dependency_hashes, old.source_ids))
  execute function memory_private.refuse_dependency_copy();
-- The folded texts move to their own narrow table (filled from records.search_text), with the
-- three-character runs of title and summary that the literal search skips records by.
create function memory_private.text_grams(p_text text) returns bit(1024)
  language sql immutable strict parallel safe
  as $$
  -- Every run of three characters of the text (at every offset: three passes of
  -- non-overlapping matches, from the first, second and third character) sets one of 1021 bits,
  -- chosen by its characters' code points: a text holding another holds all of its runs, so
  -- its bits cover the other's. Code points, not a hash function of the server's, so that the
  -- bits a record keeps mean the same after any upgrade.
  select coalesce(bit_or(B'1'::bit(1024) >> g.bit), B'0'::bit(1024))
    from (select distinct (((ascii(m.run[1]) * 7919::bigint + ascii(substr(m.run[1], 2)))
                            * 104729 + ascii(substr(m.run[1], 3))) % 1021)::integer as bit
            from (select regexp_matches(p_text, '...', 'g')
                  union all
                  select regexp_matches(substr(p_text, 2), '...', 'g')
                  union all
                  select regexp_matches(substr(p_text, 3), '...', 'g')) as m(run)) g
$$;
comment on function memory_private.text_grams(text) is
  'The text''s three-character runs as a 1024-bit signature (a bit per run, by its code points): '
  'if a text contains another, text_grams(text) & text_grams(other) = text_grams(other). '
  'A text shorter than three characters sets no bit. What the literal search skips texts with.';

create table memory_private.record_texts (
  workspace_id text not null,
  record_id bigint not null,
  scope_id bigint not null,
  created_at timestamptz not null,
  search_text text not null,
  grams bit(1024) not null,
  primary key (workspace_id, record_id),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade
);
comment on table memory_private.record_texts is
  'Each record''s title and summary case-folded at write time (search_text: lower(title), a '
  'newline, lower(summary)) and the three-character runs of both (grams: '
  'memory_private.text_grams of each, OR-ed), with its scope and date, written by a trigger on '
  'records (memory_private.index_record): what query_memories'' literal search reads. It scans '
  'the scope''s grams newest first in the index alone and reads the folded text only of the '
  'records holding every run of the query. Kept apart from records so that nothing wide is read '
  'and nothing is folded at search time.';
create index record_texts_scope_idx
  on memory_private.record_texts (workspace_id, scope_id, created_at desc, record_id desc)
  include (grams);
create statistics memory_private.record_texts_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.record_texts;
comment on statistics memory_private.record_texts_scope_stats is
  'scope_id depends on workspace_id (as memory_private.records_scope_stats).';
insert into memory_private.record_texts
  (workspace_id, record_id, scope_id, created_at, search_text, grams)
select workspace_id, record_id, scope_id, created_at, search_text,
       memory_private.text_grams(lower(title)) | memory_private.text_grams(lower(summary))
  from memory_private.records;
analyze memory_private.record_texts;
alter table memory_private.records drop column search_text;

-- What the validity rule reads of a message a record or an index depends on (its hash, removal
-- and retention; content_hash is NULL exactly when the text is gone, by the table's check), so
-- that validating a record reads the messages from this index alone, a few pages per scope
-- instead of a heap page per message (memory_private.record_reasons, index_holds).
create index messages_state_idx on memory_private.messages (workspace_id, message_id)
  include (content_hash, removed_at, retain_until);
analyze memory_private.messages;

drop function memory_private.matching_lines(text, bigint, text, text, tsquery[]);
drop function memory_private.record_detail(memory_private.records, jsonb, bigint);
drop function memory_private.shown_sources(text, bigint[], text);
-- Which line cites which source is read from the summary itself (memory_private.line_citations,
-- the rule the record was written with), not kept a second time.
drop table memory_private.record_line_sources;
-- The sources' old table (its rows are the cited dependencies' positions now).
drop table memory_private.record_sources_moved;

create function memory_private.within_a_part(p_title text, p_summary text, p_query text)
  returns boolean
  language sql immutable parallel safe
  as $$
  -- Inlined (no SET clause). A folded query found in search_text (the folded title, a newline,
  -- the folded summary) is a literal match only within one part: a query holding a newline may
  -- have matched across the title's end, so it is looked for in each part apart.
  select strpos(p_query, e'\n') = 0
      or strpos(lower(p_title), p_query) > 0 or strpos(lower(p_summary), p_query) > 0
$$;
comment on function memory_private.within_a_part(text, text, text) is
  'Whether a folded query that search_text holds is a literal match of the record: it holds no '
  'newline, or the folded title or the folded summary holds it (a match across the title''s end '
  'is none). The literal search''s re-check (recent_valid_records).';

create function memory_private.summary_lines(p_summary text)
  returns table (line_no integer, line text)
  language sql immutable parallel safe
  as $$
  -- Inlined where it is used: a summary's lines are numbered the same way everywhere.
  select l.n::integer, l.line from string_to_table(p_summary, e'\n') with ordinality as l(line, n)
$$;
comment on function memory_private.summary_lines(text) is
  'A summary''s lines, numbered from 1, split at every newline: the numbering line citations, '
  'the lines'' stored documents (record_lines) and the lines a search finds share.';

create function memory_private.cited_ids(p_line text, p_ids text[]) returns setof text
  language sql immutable parallel safe
  as $$
  -- The line's bracketed lists, [m1] or [m1, m2]; a token that is one of p_ids (the messages a
  -- record may cite) is a citation, anything else in brackets ([REDACTED], [1]) is text. An id
  -- cited twice comes twice.
  select t.token
    from regexp_matches(p_line, '\[([^][]+)\]', 'g') as b(inner_text)
   cross join lateral regexp_split_to_table(b.inner_text[1], '[,;[:space:]]+') as t(token)
   where t.token = any(p_ids)
$$;
comment on function memory_private.cited_ids(text, text[]) is
  'The ids of p_ids one line of a summary cites: written in square brackets ([m1] or [m1, m2]). '
  'The citation rule, read from the summary wherever lines and sources meet: ordering a new '
  'record''s sources (memory_private.line_citations), explain_record''s lines, and the sources '
  'of the lines a search finds first.';

create function memory_private.request_scope(
  p_request memory_private.requests
) returns memory_private.scopes
  language plpgsql volatile
  as $$
declare
  v_request memory_private.requests := p_request;
  v_ws text := p_request.workspace_id;
  v_chat memory_private.chats;
  v_scope memory_private.scopes;
begin
  if v_request.kind <> 'interactive' then
    raise exception 'request % is scheduled; scheduled work neither feeds nor reads memories',
      v_request.request_id using errcode = 'MB005';
  end if;
  select * into v_chat from memory_private.chats
   where workspace_id = v_ws and chat_id = v_request.chat_id;

  if v_chat.kind = 'private' then
    select * into v_scope from memory_private.scopes
     where workspace_id = v_ws and kind = 'private' and bot_id = v_request.bot_id
       and chat_id = v_chat.chat_id and user_id = v_chat.private_user_id;
    if not found then
      insert into memory_private.scopes (workspace_id, kind, bot_id, chat_id, user_id, created_at)
      values (v_ws, 'private', v_request.bot_id, v_chat.chat_id,
              v_chat.private_user_id, memory_private.clock_now())
      on conflict do nothing;
      select * into strict v_scope from memory_private.scopes
       where workspace_id = v_ws and kind = 'private' and bot_id = v_request.bot_id
         and chat_id = v_chat.chat_id and user_id = v_chat.private_user_id;
    end if;
  else
    select * into v_scope from memory_private.scopes
     where workspace_id = v_ws and kind = 'shared' and bot_id = v_request.bot_id
       and chat_id = v_chat.chat_id and topic_id = v_request.topic_id;
    if not found then
      insert into memory_private.scopes (workspace_id, kind, bot_id, chat_id, topic_id, created_at)
      values (v_ws, 'shared', v_request.bot_id, v_chat.chat_id, v_request.topic_id,
              memory_private.clock_now())
      on conflict do nothing;
      select * into strict v_scope from memory_private.scopes
       where workspace_id = v_ws and kind = 'shared' and bot_id = v_request.bot_id
         and chat_id = v_chat.chat_id and topic_id = v_request.topic_id;
    end if;
  end if;
  return v_scope;
end
$$;
comment on function memory_private.request_scope(memory_private.requests) is
  'The one scope of an interactive request (a row the caller has read), created on first use: '
  'private for a private chat, shared (group + topic) for a group. Raises MB005 for scheduled '
  'requests (V5).';

create function memory_private.matching_lines(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_word_ids bigint[],
  p_terms tsquery[]
) returns table (record_id bigint, line_no integer, line text)
  language sql stable
  as $$
  -- The lines (from 1) of the records' summaries that a query finds, with their text: the query
  -- is part of the line (case-folded), or, in the records found by their words (p_word_ids), the
  -- line holds one of the words (p_terms, memory_private.search_terms of the query, against the
  -- line's stored document in record_lines: as written or English-stemmed, CJK bigrams). One
  -- pass over the lines of the summaries themselves (the records a call shows, in pages it has
  -- just read).
  select r.record_id, l.line_no, l.line
    from memory_private.records r
   cross join lateral memory_private.summary_lines(r.summary) l
   where p_query is not null
     and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and (strpos(lower(l.line), (select lower(p_query))) > 0  -- the query folded once
          -- not correlated: one index read of the word-found records' lines, then a hash
          -- probe per line (a correlated EXISTS may be hashed over every line of the table)
          or (r.record_id, l.line_no) in (
               select d.record_id, d.line_no
                 from memory_private.record_lines d
                where d.workspace_id = p_workspace_id and d.record_id = any(p_word_ids)
                  and d.document @@ any(p_terms)))
$$;
comment on function memory_private.matching_lines(text, bigint[], text, bigint[], tsquery[]) is
  'The summary lines (record, line number, text) a query_memories search finds among the given '
  'records: those holding the query (case-insensitive), and in the records found by their words '
  '(p_word_ids) those holding one of the words given as p_terms, read from the lines'' stored '
  'documents (record_lines).';

create function memory_private.record_detail(
  p_record memory_private.records, p_source_ids jsonb, p_source_count bigint,
  p_last_used_at timestamptz, p_match text
) returns jsonb
  language sql stable
  -- stable, not immutable: jsonb_build_object and to_jsonb are stable, and an immutable
  -- function calling them is not inlined (a separate execution for every record shown).
  as $$
  select jsonb_build_object(
           'id', p_record.record_id, 'kind', p_record.kind, 'title', p_record.title,
           'summary', p_record.summary, 'speaker_ids', to_jsonb(p_record.speaker_ids),
           'thread_ids', to_jsonb(p_record.thread_ids),
           'source_ids', p_source_ids,
           'source_count', p_source_count,
           'sources_overflow', greatest(p_source_count - (memory_private.policy()).shown_sources, 0),
           'created_at', p_record.created_at, 'last_used_at', p_last_used_at,
           'match', p_match)
$$;
comment on function memory_private.record_detail(memory_private.records, jsonb, bigint,
                                                  timestamptz, text) is
  'A record as query_memories returns it: title, summary, speakers, threads, the first 20 '
  'source ids, how many sources there are and how many were not shown, dates (R5), and how it '
  'matched (literal, words, fuzzy; null when browsing). '
  'query_memories ranks the sources of all shown records in one pass and passes them in, with '
  'the record''s last use before the call (memory_private.record_usage).';

create function memory_private.shown_sources(
  p_workspace_id text, p_record_ids bigint[], p_query text, p_matches jsonb default '{}'
) returns table (record_id bigint, source_ids text[], total integer)
  language plpgsql stable
  as $$
declare
  v_terms tsquery[];
  v_word_ids bigint[] := array(select m.key::bigint from jsonb_each_text(p_matches) m
                                where m.value <> 'literal');
begin
  -- Each record's sources in the order its summary uses them; for a search, those cited by the
  -- lines the query finds (memory_private.matching_lines; a line's citations are its bracketed
  -- ids, memory_private.cited_ids, as when the record was written) come first. The first
  -- shown_sources of them are shown (R5). One statement for all the records, its plan kept for
  -- the session (plpgsql); a record without sources has no row. The words are looked for only
  -- in the records found by them (p_matches: record id -> how it matched), not in literal
  -- matches.
  if p_query is not null and cardinality(v_word_ids) > 0 then
    v_terms := memory_private.search_terms(p_query);
  end if;
  return query
    with src as materialized (
      -- the records' copy of their sources, in order (memory_private.copy_dependencies)
      select r.record_id, s.message_id, s.position
        from memory_private.records r
       cross join lateral unnest(r.source_ids) with ordinality as s(message_id, position)
       where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
    ), first_line as materialized (
      select f.record_id, c.id as message_id, min(f.line_no) as line_no
        from memory_private.matching_lines(p_workspace_id, p_record_ids, p_query, v_word_ids,
                                           v_terms) f
        join (select s.record_id, array_agg(s.message_id) as ids
                from src s group by s.record_id) k on k.record_id = f.record_id
       cross join lateral memory_private.cited_ids(f.line, k.ids) as c(id)  -- inlined
       group by f.record_id, c.id
    )
    select s.record_id,
           (array_agg(s.message_id order by h.line_no nulls last, s.position))
             [1:(memory_private.policy()).shown_sources],
           count(*)::integer
      from src s
      left join first_line h on h.record_id = s.record_id and h.message_id = s.message_id
     group by s.record_id;
end
$$;
comment on function memory_private.shown_sources(text, bigint[], text, jsonb) is
  'The source ids query_memories shows of each record (at most policy shown_sources), in the '
  'order the summary uses them, the sources cited on the lines a search query finds first '
  '(memory_private.matching_lines: literally in every record, by its words in those p_matches '
  'says were found by words or fuzzy), and how many sources the record has.';

create or replace function memory_private.line_citations(p_summary text, p_ids text[])
  returns table (line_no integer, message_id text)
  language sql immutable parallel safe
  as $$
  -- Each line's citations (memory_private.cited_ids), once each, with the line's number.
  select distinct l.line_no, c.id
    from memory_private.summary_lines(p_summary) l
   cross join lateral memory_private.cited_ids(l.line, p_ids) as c(id)
$$;
comment on function memory_private.line_citations(text, text[]) is
  'The citations of a summary, line by line: every id of p_ids written in square brackets on '
  'a line ([m1] or [m1, m2], memory_private.cited_ids), with the line''s number (from 1).';

create or replace function memory_private.scope_checks(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns table (rank integer, check_name text, reason text, ok boolean, detail text)
  language sql stable
  as $$
  -- One query (inlined into its callers' plans): the scope, its bot, its chat's link and the
  -- reader's membership. The reader: the private scope's user, or the requester of a shared
  -- scope (none for background work, which then checks no membership). No scope, no rows.
  select c.rank, c.check_name, c.reason, c.ok, c.detail
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
    left join memory_private.chats ch
      on ch.workspace_id = s.workspace_id and ch.chat_id = s.chat_id
    left join memory_private.members m
      on m.workspace_id = s.workspace_id and m.user_id = coalesce(s.user_id, p_requester)
   cross join lateral (values
    (1, 'recall_enabled', 'recall_disabled', s.recall_enabled,
     case when s.recall_enabled then 'recall is on in the scope'
          else 'recall is off in the scope (records kept, not read)' end),
    (2, 'bot_active', 'bot_inactive', coalesce(b.active, false),
     case when b.bot_id is null then format('bot %s is unknown', s.bot_id)
          when b.active then format('bot %s is active', b.bot_id)
          else format('bot %s is inactive', b.bot_id) end),
    (3, 'group_linked', 'group_unlinked', s.kind = 'private' or coalesce(ch.linked, false),
     case when s.kind = 'private' then 'private scope: no group link needed'
          when ch.linked then format('group %s is linked', s.chat_id)
          else format('group %s is not linked', s.chat_id) end),
    (4, 'membership', 'membership',
     coalesce(s.user_id, p_requester) is null or coalesce(m.active, false),
     case when coalesce(s.user_id, p_requester) is null
            then 'shared scope and no requester: per-requester membership not checked'
          when m.user_id is null
            then format('user %s is not a member of the workspace',
                        coalesce(s.user_id, p_requester))
          when m.active then format('user %s is an active %s', m.user_id, m.role)
          else format('user %s is an inactive member', m.user_id) end),
    (4, 'requester_is_scope_user', 'membership',
     p_requester is null or s.kind <> 'private' or p_requester = s.user_id,
     case when p_requester is null then 'no requester given'
          when s.kind <> 'private' then 'shared scope: any active member'
          when p_requester = s.user_id then 'the requester owns the private scope'
          else format('the private scope belongs to %s, not %s', s.user_id,
                      p_requester) end)
   ) as c(rank, check_name, reason, ok, detail)
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id
$$;
comment on function memory_private.scope_checks(text, bigint, text) is
  'The checks of the validity rule that depend on the scope and the reader, not on a record, '
  'in rank order, each with ok and a detail: recall on, bot active, group linked, membership '
  '(the reader is an active member; a requester of a private scope is its user). The reader is '
  'the private scope''s user or the requester of a shared scope.';

create or replace function memory_private.scope_reason(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns text
  language plpgsql stable
  as $$
begin
  -- plpgsql: the plan (scope_checks inlined) is kept for the session.
  return (select c.reason
            from memory_private.scope_checks(p_workspace_id, p_scope_id, p_requester) c
           where not c.ok order by c.rank limit 1);
end
$$;
comment on function memory_private.scope_reason(text, bigint, text) is
  'The first failing scope check for the reader (memory_private.scope_checks), or NULL.';

create or replace function memory_private.scope_of_request(
  p_workspace_id text, p_request_id text
) returns memory_private.scopes
  language plpgsql volatile
  as $$
begin
  return memory_private.request_scope(
           memory_private.known_request(p_workspace_id, p_request_id));
end
$$;
comment on function memory_private.scope_of_request(text, text) is
  'The one scope of an interactive request given by its ids (memory_private.known_request: '
  'MB001, MB002), created on first use (memory_private.request_scope). Raises MB005 for '
  'scheduled requests (V5).';

create or replace function memory_private.known_request(p_workspace_id text, p_request_id text)
  returns memory_private.requests
  language plpgsql stable
  as $$
declare
  v_request memory_private.requests;
begin
  -- A request found has a known workspace and a valid id (both were checked when it was
  -- stored), so the lookup comes first; the errors, only when it finds nothing, come in the
  -- order the checks name them: the workspace's id, the workspace, the request's id.
  perform memory_private.check_id('workspace_id', p_workspace_id);
  select * into v_request from memory_private.requests
   where workspace_id = p_workspace_id and request_id = p_request_id;
  if not found then
    perform memory_private.require_workspace(p_workspace_id);
    perform memory_private.check_id('request_id', p_request_id);
    raise exception 'request % is unknown in workspace %', p_request_id, p_workspace_id
      using errcode = 'MB002', hint = 'Report it first with memory.upsert_request.';
  end if;
  return v_request;
end
$$;
comment on function memory_private.known_request(text, text) is
  'The request row after validating the workspace and request ids (MB001/MB002). The caller '
  'decides what a scheduled request gets.';

create or replace function memory.upsert_message(
  p_workspace_id text,
  p_message_id text,
  p_request_id text,
  p_role text,
  p_speaker_id text,
  p_text text,
  p_directed boolean default true,
  p_retain_until timestamptz default null,
  p_repositories text[] default '{}'
) returns text
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_request memory_private.requests;
  v_chat_kind text;
  v_old memory_private.messages;
  v_repos text[];
  v_hash text;
  v_now timestamptz := memory_private.clock_now();
begin
  perform memory_private.require_workspace(p_workspace_id);
  perform memory_private.check_id('message_id', p_message_id);
  perform memory_private.check_id('request_id', p_request_id);
  perform memory_private.check_id('speaker_id', p_speaker_id);
  perform memory_private.check_choice('role', p_role, array['user', 'assistant']);
  perform memory_private.check_text('text', p_text, (memory_private.policy()).message_bytes);
  if p_directed is null then
    raise exception 'directed is required' using errcode = 'MB001';
  end if;
  v_repos := memory_private.check_ids('repositories', p_repositories);

  v_request := memory_private.known_request(p_workspace_id, p_request_id);
  select kind into v_chat_kind from memory_private.chats
   where workspace_id = p_workspace_id and chat_id = v_request.chat_id;

  v_hash := memory_private.content_hash(p_text);
  select * into v_old from memory_private.messages
   where workspace_id = p_workspace_id and message_id = p_message_id;
  if found then
    if (v_old.request_id, v_old.role, v_old.speaker_id)
       is distinct from (p_request_id, p_role, p_speaker_id) then
      raise exception 'message % cannot move to another request, role or speaker', p_message_id
        using errcode = 'MB003';
    end if;
  end if;
  -- V10: ordinary group traffic is never collected. A message first reported as directed and
  -- now as not directed loses its stored copy, exactly as remove_message would erase it: its
  -- text and hash go, and every memory built on it stops being recalled.
  if v_chat_kind = 'group' and not p_directed then
    if v_old.message_id is null then
      return 'ignored';
    end if;
    update memory_private.messages
       set body = null, content_hash = null, removed_at = v_now, removal_reason = 'removed',
           scrub_pending = true
     where workspace_id = p_workspace_id and message_id = p_message_id and removed_at is null;
    return case when found then 'updated' else 'unchanged' end;
  end if;
  if v_old.message_id is not null then
    if v_old.removed_at is not null then
      raise exception 'message % was removed; a removed message cannot be edited', p_message_id
        using errcode = 'MB003';
    end if;
    if v_old.body is null then
      raise exception 'message % is past its retention; it cannot be edited', p_message_id
        using errcode = 'MB003';
    end if;
    if (v_old.content_hash, v_old.directed, v_old.retain_until, v_old.repositories)
       is not distinct from (v_hash, p_directed, p_retain_until, v_repos) then
      return 'unchanged';
    end if;
    update memory_private.messages
       set body = p_text, content_hash = v_hash, directed = p_directed,
           retain_until = p_retain_until, repositories = v_repos,
           edited_at = case when content_hash <> v_hash then v_now else edited_at end
     where workspace_id = p_workspace_id and message_id = p_message_id;
    return 'updated';
  end if;

  insert into memory_private.messages
    (workspace_id, message_id, request_id, role, speaker_id, body, content_hash, directed,
     retain_until, repositories, created_at)
  values (p_workspace_id, p_message_id, p_request_id, p_role, p_speaker_id, p_text, v_hash,
          p_directed, p_retain_until, v_repos, v_now);
  return 'inserted';
end
$$;
comment on function memory.upsert_message(text, text, text, text, text, text, boolean,
                                          timestamptz, text[]) is
  'Creates or edits a message of a request (text <= 64,000 bytes). The content hash is computed '
  'here; an edit changes it, which invalidates memories built on the old text. A group message '
  'that is not directed at the bot is not stored and the call answers ''ignored'' (V10); one '
  'stored earlier as directed is removed as remove_message would remove it (''updated'').';

create or replace function memory_private.begin_tool_call(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_tool text, p_args jsonb,
  p_allowed_keys text[],
  out request memory_private.requests, out scope memory_private.scopes,
  out previous memory_private.tool_calls
)
  language plpgsql volatile
  as $$
begin
  -- What both tools do first: a known request, a tool call id, arguments that are a JSON
  -- object of the tool's keys (their values are the tool's to check), an interactive request
  -- (V5); then the workspace's memory lock (a tool call writes: usage, a change) and the
  -- request's scope; and the earlier call with this id, which must have been the same tool
  -- with the same arguments (MB003).
  request := memory_private.known_request(p_workspace_id, p_request_id);
  perform memory_private.check_id('tool_call_id', p_tool_call_id);
  perform memory_private.check_tool_args(p_args, p_allowed_keys);
  if request.kind <> 'interactive' then
    raise exception 'request % is scheduled; scheduled work neither feeds nor reads memories',
      p_request_id using errcode = 'MB005';
  end if;
  perform memory_private.lock_workspace(p_workspace_id);
  scope := memory_private.request_scope(request);
  select * into previous from memory_private.tool_calls c
   where c.workspace_id = p_workspace_id and c.request_id = p_request_id
     and c.tool_call_id = p_tool_call_id;
  if found and (previous.tool <> p_tool
                or previous.args_hash <> memory_private.args_hash(p_args)) then
    raise exception 'tool call % of request % was already made with other arguments',
      p_tool_call_id, p_request_id using errcode = 'MB003',
      hint = 'A replay must repeat the same tool and arguments; a new call needs a new id.';
  end if;
end
$$;
comment on function memory_private.begin_tool_call(text, text, text, text, jsonb, text[]) is
  'The start both memory tools share: validates the request (MB001/MB002), the tool call id, '
  'the argument keys (MB001) and that the request is interactive (MB005); takes the workspace''s '
  'memory lock; answers the request, its scope and the earlier call with this id (NULL on the '
  'first call), raising MB003 when that was another tool or other arguments.';

create or replace function memory.recall(p_workspace_id text, p_request_id text) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  -- Every statement under it keeps one plan for the session (see query_memories).
  set plan_cache_mode = force_generic_plan
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_frozen memory_private.request_recall;
  v_mode text;
  v_index text;
  v_ids bigint[];
  v_basis bigint[] := '{}';
begin
  v_request := memory_private.known_request(p_workspace_id, p_request_id);
  if v_request.kind <> 'interactive' then
    return jsonb_build_object('mode', 'none');  -- V5: scheduled work reads no memories
  end if;
  v_scope := memory_private.request_scope(v_request);

  select * into v_frozen from memory_private.request_recall
   where workspace_id = p_workspace_id and request_id = p_request_id;
  if found then
    return memory_private.recall_payload(v_frozen, v_request.user_id);
  end if;

  if not v_scope.recall_enabled then
    v_mode := 'disabled';
    v_ids := '{}';
  else
    if v_scope.index_text is not null and v_scope.consolidation_due_at is null then
      -- The index holds for this reader when every record it was built from (every candidate
      -- the model saw, not only those it names) is valid for them.
      if memory_private.index_holds(p_workspace_id, v_scope.scope_id, v_request.user_id) then
        v_mode := 'index';
        v_index := v_scope.index_text;
        v_ids := v_scope.index_record_ids;
        v_basis := v_scope.index_candidate_ids;
      end if;
    end if;
    if v_mode is null then
      -- Consolidation pending, no index, or the index rests on a record this reader may not
      -- read now (R2).
      v_ids := memory_private.recent_valid_records(p_workspace_id, v_scope.scope_id,
                                                   (memory_private.policy()).directory_records,
                                                   v_request.user_id);
      v_basis := v_ids;
      v_mode := case when cardinality(v_ids) = 0 then 'none' else 'directory' end;
    end if;
  end if;
  insert into memory_private.request_recall
    (workspace_id, request_id, scope_id, mode, index_text, record_ids, basis_record_ids,
     created_at)
  values (p_workspace_id, p_request_id, v_scope.scope_id, v_mode, v_index, v_ids, v_basis,
          memory_private.clock_now())
  on conflict (workspace_id, request_id) do nothing
  returning * into v_frozen;
  if found then
    -- Frozen now from records validated above: the payload does not validate them again.
    return memory_private.recall_payload(v_frozen, v_request.user_id, v_basis);
  end if;
  -- A concurrent first call froze it first: show what it froze, checked now.
  select * into strict v_frozen from memory_private.request_recall
   where workspace_id = p_workspace_id and request_id = p_request_id;
  return memory_private.recall_payload(v_frozen, v_request.user_id);
end
$$;
comment on function memory.recall(text, text) is
  'The memories a new interactive request starts with, labelled as historical reference data '
  '(V8) with speaker ids (V9): {"mode":"index"} with the scope''s consolidated index, when every '
  'record it was built from is valid for the requester, or {"mode":"directory"} with up to '
  'eight valid records, newest first, while a consolidation is pending or the index rests on a '
  'record the requester may not read now (R1, R2); {"mode":"none"} when there is nothing (and '
  'for scheduled requests, V5); {"mode":"disabled"} when recall is off (C8). Frozen on the first '
  'call: later calls return the same content minus records no longer valid, and the index text '
  'only while every record it was built from still is (R3). Those records are the request''s '
  'provenance (T2).';

create or replace function memory_private.control_remember(
  p_request memory_private.requests, p_scope memory_private.scopes, p_source_id text,
  p_title text, out outcome jsonb, out authority text
)
  language plpgsql volatile
  as $$
declare
  v_ws text := p_request.workspace_id;
  v_now timestamptz := memory_private.clock_now();
  v_source memory_private.messages;
  v_refusal text;
  v_record memory_private.records;
  v_summary text;
  v_title text;
  c_action constant text := 'remember';
begin
  select * into strict v_source from memory_private.messages
   where workspace_id = v_ws and message_id = p_source_id;
  authority := case when p_scope.kind = 'private' then 'scope_user' else 'participant' end;
  v_refusal := memory_private.control_refusal(p_request, p_scope, authority);
  if v_refusal is not null then
    outcome := memory_private.control_outcome('refused', c_action, 'not_allowed',
      'Not remembered: ' || v_refusal || '.');
    return;
  end if;
  if not p_scope.recall_enabled then
    outcome := memory_private.control_outcome('refused', c_action, 'recall_disabled',
      'Memory is turned off in this chat, so nothing is stored; turn it on first.');
    return;
  end if;
  if exists (select 1 from memory_private.tombstones
              where workspace_id = v_ws and scope_id = p_scope.scope_id
                and message_id = v_source.message_id) then
    outcome := memory_private.control_outcome('refused', c_action, 'forgotten',
      'This message was forgotten in this chat and is not stored again.');
    return;
  end if;
  select r.* into v_record from memory_private.records r
    join memory_private.record_dependencies d
      on d.workspace_id = r.workspace_id and d.record_id = r.record_id
   where r.workspace_id = v_ws and r.scope_id = p_scope.scope_id and r.kind = 'note'
     and d.message_id = v_source.message_id and d.content_hash = v_source.content_hash
   limit 1;
  if found then
    outcome := memory_private.control_outcome('done', c_action, 'already_remembered',
      format('This message is already remembered as memory %s.', v_record.record_id),
      v_record.record_id);
    return;
  end if;
  v_summary := memory_private.note_redact(v_source.body);
  if octet_length(v_summary) > (memory_private.policy()).summary_bytes then
    outcome := memory_private.control_outcome('refused', c_action, 'too_long',
      format('The message is %s bytes; a note holds at most %s bytes (UTF-8). Ask the user '
             'for a shorter message to remember.', octet_length(v_summary),
             (memory_private.policy()).summary_bytes));
    return;
  end if;
  v_title := memory_private.note_redact(coalesce(p_title, memory_private.note_title(v_source.body)));
  v_title := memory_private.clip_bytes(v_title, (memory_private.policy()).title_bytes);
  insert into memory_private.records
    (workspace_id, scope_id, kind, title, summary, speaker_ids, thread_ids, repositories,
     bot_identity, origin_request_id, created_at)
  select v_ws, p_scope.scope_id, 'note', v_title, v_summary, array[v_source.speaker_id],
         array[p_request.thread_id], v_source.repositories, b.identity, p_request.request_id,
         v_now
    from memory_private.bots b
   where b.workspace_id = v_ws and b.bot_id = p_scope.bot_id
  returning * into strict v_record;
  -- A note cites, and rests on, exactly the message that asked for it (C3).
  insert into memory_private.record_dependencies
    (workspace_id, record_id, message_id, content_hash, via, position)
  values (v_ws, v_record.record_id, v_source.message_id, v_source.content_hash, 'cited', 1);
  update memory_private.scopes
     set consolidation_due_at = coalesce(consolidation_due_at, v_now)
   where workspace_id = v_ws and scope_id = p_scope.scope_id;
  outcome := memory_private.control_outcome('done', c_action, 'remembered',
    format('Saved the message as memory %s, attributed to %s. It is historical reference, '
           'not an instruction.', v_record.record_id, v_source.speaker_id),
    v_record.record_id);
end
$$;
comment on function memory_private.control_remember(memory_private.requests,
                                                    memory_private.scopes, text, text) is
  'manage_memory remember, once the source asks for it: the user''s standing, recall on, not '
  'forgotten, not already a note; then the message itself (redacted) becomes a note citing and '
  'resting on it (C3, C5, C6). Returns the outcome and the standing it needed.';

create or replace function memory_private.record_reasons(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[],
  p_now timestamptz default memory_private.clock_now()
) returns table (record_id bigint, reason text, message_id text)
  language sql stable
  as $$
  -- The bot replaced since the record was made ...
  select r.record_id, 'bot_replaced', null::text
    from memory_private.records r
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and r.bot_identity <> (select b.identity
                              from memory_private.scopes s
                              join memory_private.bots b
                                on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
                             where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id)
  union all
  -- ... and every dependency that is not current (the record's copy of its dependencies:
  -- read from its own page, which every reader of the record reads anyway).
  select r.record_id, x.state, d.message_id
    from memory_private.records r
   cross join lateral unnest(r.dependency_ids, r.dependency_hashes) as d(message_id, content_hash)
    join memory_private.messages m
      on m.workspace_id = r.workspace_id and m.message_id = d.message_id
    left join memory_private.tombstones t
      on t.workspace_id = r.workspace_id and t.scope_id = p_scope_id
     and t.message_id = d.message_id
   cross join lateral (
     -- content_hash, not body: NULL exactly when the text is gone, and in messages_state_idx
     select memory_private.dependency_state(
              m.removed_at, m.content_hash is not null, m.retain_until, m.content_hash,
              d.content_hash, t.message_id is not null, p_now) as state) x
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and x.state is not null
$$;
comment on function memory_private.record_reasons(text, bigint, bigint[], timestamptz) is
  'Every reason each given record of the scope fails whatever the reader: bot_replaced, and the '
  'state of each dependency that is not current (removed, expired, edited, forgotten) with the '
  'message. A record that fails none has no row. The retention sweep deletes the records with a '
  'permanent one.';

create or replace function memory_private.invalid_records(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[], p_requester text
) returns table (record_id bigint, reason text)
  language plpgsql stable
  as $$
declare
  v_scope_reason text;
  v_ids bigint[];
  v_no_grant bigint[];
  v_now timestamptz := memory_private.clock_now();
begin
  -- Two queries. The first reads the scope's first failing check for the reader (scope_reason's
  -- query, inlined), the records of the set that are the scope's, and those drawing on a
  -- repository the reader (the private scope's user, else the requester) may not read. The
  -- second decides every record of the set: the first reason in rank order among its record
  -- reasons and its repository grants. plpgsql so that the plans are cached for the session; the
  -- ids are a variable so that record_reasons is inlined into that plan. Ids that are not
  -- records of the scope are not returned (no scope, no records of it).
  select (select c.reason
            from memory_private.scope_checks(p_workspace_id, p_scope_id, p_requester) c
           where not c.ok order by c.rank limit 1),
         coalesce(array_agg(r.record_id), '{}'),
         coalesce(array_agg(r.record_id) filter (
           where rd.id is not null
             and exists (select 1 from unnest(r.repositories) as repo(repository_id)
                          where not exists (select 1 from memory_private.repository_grants g
                                             where g.workspace_id = p_workspace_id
                                               and g.user_id = rd.id
                                               and g.repository_id = repo.repository_id))),
           '{}')
    into v_scope_reason, v_ids, v_no_grant
    from memory_private.records r
   cross join (select coalesce((select s.user_id from memory_private.scopes s
                                 where s.workspace_id = p_workspace_id
                                   and s.scope_id = p_scope_id), p_requester) as id) rd
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
     and r.scope_id = p_scope_id;
  return query
    with failing as materialized (
      -- One pass over every record of the set (not one per record).
      select x.record_id, x.reason
        from memory_private.record_reasons(p_workspace_id, p_scope_id, v_ids, v_now) x
      union all
      select g.id, 'grant_revoked' from unnest(v_no_grant) as g(id)
    )
    , first as (
      select distinct on (f.record_id) f.record_id, f.reason
        from failing f join memory_private.invalid_reasons ir on ir.reason = f.reason
       order by f.record_id, ir.rank
    )
    select i.id, coalesce(v_scope_reason, first.reason)
      from unnest(v_ids) as i(id)
      left join first on first.record_id = i.id;
end
$$;
comment on function memory_private.invalid_records(text, bigint, bigint[], text) is
  'The validity rule for records of one scope: each given id that is a record of the scope, with '
  'the first reason in rank order (memory_private.invalid_reasons) why it may not be recalled '
  'now for the requester, or NULL when it may: the scope''s checks for the reader, then the '
  'record''s reasons (bot replaced, a dependency removed, expired, edited or forgotten), then a '
  'repository grant the reader lacks. One query for the whole set; every reader of records uses '
  'it (V6, T1). With no requester (background work on a shared scope) the requester''s '
  'membership and grants are not checked.';

create or replace function memory_private.index_holds(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns boolean
  language plpgsql stable
  as $$
declare
  v_scope memory_private.scopes;
  v_reader text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The validity rule for every candidate of the scope's index at once, in the form the index
  -- keeps (its candidates' dependencies, bot identity and repositories, taken when it was built):
  -- what invalid_records would say of each candidate, without reading them one by one. A test
  -- keeps the two equal for every reason (tests/test_provenance.py,
  -- test_index_holds_exactly_when_every_candidate_is_valid_for_the_reader).
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if not found or v_scope.index_text is null then
    return false;
  end if;
  v_reader := coalesce(v_scope.user_id, p_requester);
  return memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester) is null
     and (select b.identity from memory_private.bots b
           where b.workspace_id = p_workspace_id and b.bot_id = v_scope.bot_id)
         = v_scope.index_bot_identity
     and (v_reader is null
          or not exists (select 1 from unnest(v_scope.index_repositories) as repo(id)
                          where not exists (select 1 from memory_private.repository_grants g
                                             where g.workspace_id = p_workspace_id
                                               and g.user_id = v_reader
                                               and g.repository_id = repo.id)))
     and not exists (select 1 from memory_private.tombstones t
                      join memory_private.index_dependencies d
                        on d.workspace_id = t.workspace_id and d.scope_id = t.scope_id
                       and d.message_id = t.message_id
                     where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id)
     and not exists (select 1 from memory_private.index_dependencies d
                      join memory_private.messages m
                        on m.workspace_id = d.workspace_id and m.message_id = d.message_id
                     where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
                       -- content_hash is not null: the text is there (messages_state_idx)
                       and memory_private.dependency_state(m.removed_at,
                             m.content_hash is not null, m.retain_until, m.content_hash,
                             d.content_hash, false, v_now)
                           is not null);
end
$$;
comment on function memory_private.index_holds(text, bigint, text) is
  'Whether the scope''s index may be given to the requester now: every record it was built from '
  'is valid for them (the scope''s checks, the bot identity, the repository grants, and every '
  'dependency current and not forgotten), checked from what the index kept when it was built.';

create or replace function memory_private.first_valid_records(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[], p_limit integer,
  p_requester text
) returns bigint[]
  language plpgsql stable
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_from integer := 1;
  v_size integer := p_limit;
begin
  -- Candidates are validated in growing chunks (limit, then four times more each round), so a
  -- scope whose newest records are valid costs one set validation of just the records shown.
  while v_from <= coalesce(cardinality(p_record_ids), 0) and cardinality(v_valid) < p_limit loop
    v_chunk := p_record_ids[v_from:v_from + v_size - 1];
    v_valid := v_valid || array(
      select c.record_id
        from unnest(v_chunk) with ordinality as c(record_id, pos)
        join memory_private.invalid_records(p_workspace_id, p_scope_id, v_chunk, p_requester) v
          on v.record_id = c.record_id and v.reason is null
       order by c.pos);
    v_from := v_from + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid[1:p_limit];
end
$$;
comment on function memory_private.first_valid_records(text, bigint, bigint[], integer, text) is
  'The first p_limit of the given record ids (in their order) that are records of the scope '
  'and valid now for the requester (memory_private.invalid_records).';

create or replace function memory_private.recent_valid_records(
  p_workspace_id text, p_scope_id bigint, p_limit integer, p_requester text default null,
  p_query text default null, p_record_id bigint default null
) returns bigint[]
  language plpgsql stable
  as $$
declare
  v_valid bigint[] := '{}';
  v_chunk bigint[];
  v_size integer := p_limit;
  v_offset integer := 0;
  v_query text := lower(p_query);
  v_grams bit(1024) := memory_private.text_grams(lower(p_query));
begin
  -- Newest first, a page at a time (limit, then four times more), each page validated as
  -- one set: a scope whose newest records are valid costs one short index scan and one
  -- validation, never a read of the whole scope. One snapshot throughout (stable).
  loop
    if v_query is null then
      v_chunk := array(
        select r.record_id from memory_private.records r
         where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
           and (p_record_id is null or r.record_id = p_record_id)
         order by r.created_at desc, r.record_id desc
         limit v_size offset v_offset);
    elsif char_length(v_query) < 3 then
      -- Too short for a three-character run (a two-character Chinese word): every folded text
      -- of the scope newest first, narrow rows, rather than every record itself.
      v_chunk := array(
        select t.record_id from memory_private.record_texts t
         where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
           and (p_record_id is null or t.record_id = p_record_id)
           and strpos(t.search_text, v_query) > 0
           and (strpos(v_query, e'\n') = 0
                or exists (select 1 from memory_private.records r
                            where r.workspace_id = t.workspace_id and r.record_id = t.record_id
                              and memory_private.within_a_part(r.title, r.summary, v_query)))
         order by t.created_at desc, t.record_id desc
         limit v_size offset v_offset);
    else
      -- The scope's grams newest first from the index alone; then, of the records holding
      -- every three-character run of the query, the record itself (its pages are read for
      -- validation and the answer anyway): the query as typed in its title or summary is a
      -- match with nothing folded; otherwise the folded text decides (search_text: the folded
      -- title, a newline and the folded summary; a query holding a newline is re-checked on
      -- each apart, memory_private.within_a_part: one spanning the title's end is no match).
      v_chunk := array(
        select g.record_id
          from (select g.record_id, g.created_at from memory_private.record_texts g
                 where g.workspace_id = p_workspace_id and g.scope_id = p_scope_id
                   and (p_record_id is null or g.record_id = p_record_id)
                   and g.grams & v_grams = v_grams
                 order by g.created_at desc, g.record_id desc
                 offset 0) g  -- kept apart: PostgreSQL 18 would merge it into a full read
          join memory_private.records r
            on r.workspace_id = p_workspace_id and r.record_id = g.record_id
         where strpos(r.title, v_query) > 0 or strpos(r.summary, v_query) > 0
            or exists (select 1 from memory_private.record_texts t
                        where t.workspace_id = r.workspace_id and t.record_id = r.record_id
                          and strpos(t.search_text, v_query) > 0
                          and memory_private.within_a_part(r.title, r.summary, v_query))
         order by g.created_at desc, g.record_id desc
         limit v_size offset v_offset);
    end if;
    v_valid := v_valid || memory_private.first_valid_records(
                 p_workspace_id, p_scope_id, v_chunk, p_limit - cardinality(v_valid),
                 p_requester);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid;
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Validated set-wise a page at a time.';

create or replace function memory.query_memories(
  p_workspace_id text, p_request_id text, p_tool_call_id text, p_args jsonb
) returns jsonb
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  -- One plan per statement for the session (re-planning cost ms: docs/benchmarks.md).
  set plan_cache_mode = force_generic_plan
  as $$
declare
  v_request memory_private.requests;
  v_scope memory_private.scopes;
  v_query text;
  v_id bigint;
  v_limit integer;
  v_call memory_private.tool_calls;
  v_start record;
  v_first boolean;
  v_ids bigint[] := '{}';
  v_records jsonb;
  v_matches jsonb := '{}';
  v_shown text[];
  v_now timestamptz := memory_private.clock_now();
begin
  v_start := memory_private.begin_tool_call(p_workspace_id, p_request_id, p_tool_call_id,
                                        'query_memories', p_args,
                                        array['query', 'id', 'limit']);
  v_request := v_start.request;
  v_scope := v_start.scope;
  v_call := v_start.previous;
  v_query := nullif(btrim(memory_private.arg_text(p_args, 'query',
                                                  (memory_private.policy()).query_bytes)), '');
  v_id := memory_private.arg_integer(p_args, 'id', 1, 9223372036854775807);
  v_limit := coalesce(memory_private.arg_integer(p_args, 'limit', 1,
                                                 (memory_private.policy()).query_limit),
                      (memory_private.policy()).query_limit);
  v_first := v_call.tool_call_id is null;

  -- Recall turned off in the scope: nothing is read (C8); the call is still kept, so that a
  -- replay is recognised.
  if v_scope.recall_enabled then
    select q.ids, q.matches into v_ids, v_matches
      from memory_private.query_records(p_workspace_id, v_scope.scope_id, v_limit,
                                        v_request.user_id, v_query, v_id) q;
  end if;

  -- The shown records with their sources (R5): what the call shows makes the citations it
  -- authorizes (R6, memory.request_citations).
  with shown as materialized (
    select * from memory_private.shown_sources(p_workspace_id, v_ids, v_query, v_matches)
  )
  select coalesce(jsonb_agg(memory_private.record_detail(r,
                    to_jsonb(coalesce(d.source_ids, '{}')), coalesce(d.total, 0), u.last_used_at,
                    v_matches ->> f.record_id::text)
                  order by f.pos), '[]'::jsonb),
         (select coalesce(array_agg(distinct x), '{}') from shown, unnest(shown.source_ids) x)
    into v_records, v_shown
    from unnest(v_ids) with ordinality as f(record_id, pos)
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = f.record_id
    left join memory_private.record_usage u
      on u.workspace_id = p_workspace_id and u.record_id = f.record_id
    left join shown d on d.record_id = f.record_id;

  -- What the call returned (the answer's provenance, T2, T3, and its citations, R6), kept with
  -- the tool call (one write: the workspace's memory lock, taken by begin_tool_call, keeps a
  -- concurrent call with the same id out); a replay adds what it returned.
  insert into memory_private.tool_calls as c
    (workspace_id, request_id, tool_call_id, tool, scope_id, args_hash, record_ids, source_ids,
     created_at, updated_at)
  values (p_workspace_id, p_request_id, p_tool_call_id, 'query_memories', v_scope.scope_id,
          memory_private.args_hash(p_args), array(select distinct x from unnest(v_ids) x order by 1),
          array(select distinct x from unnest(v_shown) x order by 1), v_now, v_now)
  on conflict (workspace_id, request_id, tool_call_id) do update
    set record_ids = array(select distinct x from unnest(c.record_ids || v_ids) x order by 1),
        source_ids = array(select distinct x from unnest(c.source_ids || v_shown) x order by 1),
        updated_at = v_now;
  -- Usage once per tool call id (R7; a replay counts nothing): updates the row made with the record.
  if v_first then
    insert into memory_private.record_usage as u (workspace_id, record_id, last_used_at,
                                                  usage_count)
    select p_workspace_id, x, v_now, 1 from unnest(v_ids) x
    on conflict (workspace_id, record_id)
      do update set last_used_at = excluded.last_used_at, usage_count = u.usage_count + 1;
  end if;

  if not v_scope.recall_enabled then
    return jsonb_build_object('mode', 'disabled', 'records', '[]'::jsonb, 'count', 0,
                              'replayed', not v_first,
                              'note', 'Memory is turned off in this chat; nothing is read.');
  end if;
  return jsonb_build_object(
           'mode', case when v_query is not null then 'search'
                        when v_id is not null then 'id' else 'browse' end,
           'label', memory_private.recall_label(v_scope.kind),
           'scope', v_scope.kind,
           'records', v_records,
           'count', cardinality(v_ids),
           'replayed', not v_first);
end
$$;
comment on function memory.query_memories(text, text, text, jsonb) is
  'The query_memories tool: args {query?, id?, limit?} (validated here, MB001). Browses newest '
  'first, or searches the records of the request''s scope that are valid now: literal, '
  'case-insensitive matches of the query in title or summary first, then ranked matches of its '
  'words, then typo and partial-word matches (memory_private.search_records); at most limit '
  '(1..12, default 12). Each result has title, summary, speaker ids, thread ids, up to 20 source '
  'ids (the messages its summary cites, in the order it uses them), the source count and '
  'overflow, dates, and match: how it matched (literal, words, fuzzy; null when browsing) (R4, '
  'R5). The source ids join the request''s citation set (R6); the returned records are the '
  'request''s provenance (T2). Usage is counted once per tool call id; a replay re-reads '
  'current state (R7, C9). MB003 when the id was used with other arguments; MB005 for a '
  'scheduled request.';

create or replace function memory_private.prune_records(p_workspace_id text) returns integer
  language plpgsql volatile
  as $$
declare
  v_ids bigint[];
begin
  select coalesce(array_agg(record_id), '{}') into v_ids
    from (select r.record_id,
                 coalesce(u.last_used_at, r.created_at) as used,
                 row_number() over (order by coalesce(u.last_used_at, r.created_at) desc,
                                             r.record_id desc) as rank
            from memory_private.records r
            left join memory_private.record_usage u
              on u.workspace_id = r.workspace_id and u.record_id = r.record_id
           where r.workspace_id = p_workspace_id) r
   where r.used < memory_private.clock_now() - make_interval(days => (memory_private.policy()).unused_days)
      or r.rank > (memory_private.policy()).workspace_records;
  return memory_private.delete_records(p_workspace_id, v_ids);
end
$$;
comment on function memory_private.prune_records(text) is
  'Prunes records unused for 30 days and, beyond 256 records in the workspace, the least '
  'recently used; their scopes are marked for consolidation (T5).';

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
               'message_id', d.message_id, 'via', d.via, 'role', m.role,
               'speaker_id', m.speaker_id,
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
  'reused or repeated) with the hash it had when used, the hash it has now and its state '
  '(current, source_removed, source_expired, source_edited, forgotten). MB001, MB002 when the '
  'record is unknown.';

create or replace function memory_private.write_extraction(p_job memory_private.jobs, p_output jsonb)
  returns jsonb
  language plpgsql volatile
  as $$
declare
  v_now timestamptz := memory_private.clock_now();
  v_cited text[] := array(select jsonb_array_elements_text(p_output -> 'source_ids'));
  v_reused bigint[] := array(select jsonb_array_elements_text(p_output -> 'reused_ids')::bigint);
  v_dep_ids text[];
  v_dep_hashes text[];
  v_dep_via text[];
  v_record_id bigint;
begin
  -- The dependencies: the cited messages at the hash the job saw, every dependency of the
  -- memories the output declared it reused (P5: existing memory accompanies the batch; what it
  -- rests on stays tracked without resending it), and uncited messages the summary repeats.
  -- A message that counts twice is kept once, under its first reason in that order.
  select array_agg(d.message_id order by d.message_id),
         array_agg(d.content_hash order by d.message_id),
         array_agg(d.via order by d.message_id)
    into v_dep_ids, v_dep_hashes, v_dep_via
    from (select distinct on (u.message_id) u.message_id, u.content_hash, u.via
            from (select s.id as message_id, s.hash as content_hash, 'cited' as via, 1 as rank
                    from jsonb_to_recordset(p_job.input -> 'sources') as s(id text, hash text)
                   where s.id = any (v_cited)
                  union all
                  select rd.message_id, rd.content_hash, 'reused', 2
                    from memory_private.record_dependencies rd
                   where rd.workspace_id = p_job.workspace_id and rd.record_id = any (v_reused)
                  union all
                  select r.message_id, r.content_hash, 'repeated', 3
                    from memory_private.repeated_sources(p_job, p_output ->> 'summary', v_cited) r
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
    (workspace_id, record_id, message_id, content_hash, via, position)
  select p_job.workspace_id, v_record_id, d.id, d.hash, d.via, o.position
    from unnest(v_dep_ids, v_dep_hashes, v_dep_via) as d(id, hash, via)
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
                            'dependencies', cardinality(v_dep_ids),
                            'repeated', (select count(*) from unnest(v_dep_via) v
                                          where v = 'repeated'));
end
$$;
comment on function memory_private.write_extraction(memory_private.jobs, jsonb) is
  'Writes the record of a validated, non-empty extraction output: its sources (the cited '
  'messages in the order given), its dependencies (cited, reused, repeated) with the hashes '
  'the job saw, speakers, threads and repositories taken from the dependencies; marks the '
  'scope due for consolidation. Returns the record id and the counts.';

create or replace function memory_private.index_records(
  p_workspace_id text, p_record_ids bigint[], p_lines boolean
) returns void
  language sql volatile
  as $$
  -- What the searches read of the given records, derived from their title and summary: the
  -- word search's document, the literal search's folded text and, with p_lines, the documents
  -- of the summary's lines.
  insert into memory_private.record_documents
    (workspace_id, record_id, scope_id, created_at, document)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         memory_private.search_document(r.title, r.summary)
    from memory_private.records r
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        document = excluded.document;
  insert into memory_private.record_texts
    (workspace_id, record_id, scope_id, created_at, search_text, grams)
  select r.workspace_id, r.record_id, r.scope_id, r.created_at,
         f.title || e'\n' || f.summary,
         memory_private.text_grams(f.title) | memory_private.text_grams(f.summary)
    from memory_private.records r
   cross join lateral (select lower(r.title) as title, lower(r.summary) as summary) f
   where r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
  on conflict (workspace_id, record_id) do update
    set scope_id = excluded.scope_id, created_at = excluded.created_at,
        search_text = excluded.search_text, grams = excluded.grams;
  delete from memory_private.record_lines
   where p_lines and workspace_id = p_workspace_id and record_id = any(p_record_ids);
  insert into memory_private.record_lines (workspace_id, record_id, line_no, document)
  select r.workspace_id, r.record_id, l.line_no, memory_private.text_document(l.line)
    from memory_private.records r
   cross join lateral memory_private.summary_lines(r.summary) l
   where p_lines and r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids);
$$;
comment on function memory_private.index_records(text, bigint[], boolean) is
  'Writes what the searches read of the given records: their documents (record_documents), '
  'their folded texts and three-character runs (record_texts) and, with p_lines, their lines'' '
  'documents (record_lines). The records trigger calls it for one record; a bulk load with '
  'triggers off calls it for all it loaded.';

create or replace function memory_private.index_record() returns trigger
  language plpgsql volatile
  as $$
begin
  perform memory_private.index_records(
            new.workspace_id, array[new.record_id],
            tg_op = 'INSERT' or new.summary is distinct from old.summary);
  return null;
end
$$;
comment on function memory_private.index_record() is
  'Trigger: memory_private.index_records for a record that was inserted or whose title, '
  'summary, scope or date changed; its lines only when the summary is new.';

create or replace function memory.schema_version() returns integer
  language sql immutable security definer
  set search_path = pg_catalog, pg_temp
  as $$ select 2 $$;
comment on function memory.schema_version() is
  'The schema version of this database: the number of the last migration applied (0001 = 1). '
  'pimem migrate fails when it differs from the version the package expects.';

