-- 20_memory_state.sql: scopes, records, what each record rests on, tombstones, and the one
-- rule that decides at read time whether a record may be recalled.
--
-- A scope is private (workspace, bot, private chat, user) or shared (workspace, bot, group,
-- topic). Neither imports the other (V2-V4). A record belongs to exactly one scope and keeps two
-- sets of messages (V7):
--   sources       the messages its output cites, in the order the summary uses them: what
--                 query_memories shows (20 at most) and what enters a request's citation set;
--   dependencies  what its content may have been made from, each message with the content hash
--                 it had: everything its model call was shown (every message of the batch,
--                 every dependency of every memory shown with the batch), whatever the output
--                 cites, declares or copies; a note, the message that asked for it. The model
--                 is stateless per call: it can only write what it was shown.
-- Validity, forgetting, retention and grants act on the dependencies (T1, T7, T8), so a record
-- never outlives a message it may hold, in whatever spelling or words (docs/retention.md).

create table memory_private.scopes (
  workspace_id text not null,
  scope_id bigint generated always as identity,
  kind text not null check (kind in ('private', 'shared')),
  bot_id text not null,
  chat_id text not null,
  user_id text,
  topic_id bigint,
  recall_enabled boolean not null default true,
  consolidation_due_at timestamptz,
  created_at timestamptz not null,
  primary key (workspace_id, scope_id),
  foreign key (workspace_id, bot_id) references memory_private.bots on delete cascade,
  foreign key (workspace_id, chat_id) references memory_private.chats on delete cascade,
  check ((kind = 'private' and user_id is not null and topic_id is null)
      or (kind = 'shared' and user_id is null and topic_id is not null))
);
comment on table memory_private.scopes is
  'Memory scopes: private (bot, private chat, user) or shared (bot, group, topic). Carries recall '
  'on/off and whether a consolidation is due; the scope''s index is its row of scope_indexes.';
comment on column memory_private.scopes.consolidation_due_at is
  'Set when the index no longer reflects the records (an extraction, a note, a prune, a '
  'forget); NULL when the index is current.';
-- The scopes whose index is due, read by every tick (memory_private.schedule_jobs).
create index scopes_consolidation_due_idx on memory_private.scopes (workspace_id, scope_id)
  where consolidation_due_at is not null;

create unique index scopes_private_key on memory_private.scopes (workspace_id, bot_id, chat_id, user_id)
  where kind = 'private';
create unique index scopes_shared_key on memory_private.scopes (workspace_id, bot_id, chat_id, topic_id)
  where kind = 'shared';

-- A summary's lines and the sources each cites: the one rule, wherever lines and sources meet.
create function memory_private.summary_lines(p_summary text)
  returns table (line_no integer, line text)
  language sql immutable parallel safe
  as $$
  -- Inlined where it is used: a summary's lines are numbered the same way everywhere.
  select l.n::integer, l.line from string_to_table(p_summary, e'\n') with ordinality as l(line, n)
$$;
comment on function memory_private.summary_lines(text) is
  'A summary''s lines, numbered from 1, split at every newline: the numbering line citations, '
  'the lines of the search documents (record_documents'' positions) and the lines a search '
  'finds share.';

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

create function memory_private.line_sources(p_summary text, p_ids text[]) returns text[]
  language plpgsql immutable parallel safe
  as $$
begin
  -- One element per line of the summary, from line 1: the ids of p_ids the line cites
  -- (memory_private.cited_ids), joined by a space (a cited id holds none), '' for a line that
  -- cites nothing; no element at all when there is nothing to cite (no p_ids: a record before
  -- its sources are written). A line without a bracket cites nothing: the rule is not run on it.
  -- PL/pgSQL, so that its plan is kept for the session: it runs whenever a record is written.
  return (
    select case when cardinality(p_ids) = 0 then '{}'::text[]
                else coalesce(array_agg(case when strpos(l.line, '[') = 0 then ''
                                             else coalesce((select string_agg(c.id, ' ')
                                                              from memory_private.cited_ids(
                                                                     l.line, p_ids) as c(id)),
                                                           '') end
                                        order by l.line_no), '{}') end
      from memory_private.summary_lines(p_summary) l
  );
end
$$;
comment on function memory_private.line_sources(text, text[]) is
  'Each line''s citations of a summary (memory_private.cited_ids against p_ids), one element '
  'per line from line 1, the ids joined by a space (empty when p_ids is): records.line_sources, '
  'what a search reads to show first the sources of the lines it found.';

create table memory_private.records (
  workspace_id text not null,
  record_id bigint generated always as identity,
  scope_id bigint not null,
  kind text not null check (kind in ('extracted', 'note')),
  title text not null check (octet_length(title) between 1 and memory_private.policy_limit('title_bytes')),
  summary text not null check (octet_length(summary) between 1 and memory_private.policy_limit('summary_bytes')),
  speaker_ids text[] not null,
  thread_ids text[] not null,
  repositories text[] not null default '{}',
  bot_identity text not null,
  origin_request_id text,
  created_at timestamptz not null,
  -- The record's dependencies and sources as its own row holds them, written by the database
  -- only (memory_private.follow_record_dependencies, from record_dependencies): validating a
  -- record and listing its sources read the page the record is on, not an index leaf each.
  dependency_ids text[] not null default '{}',
  dependency_hashes text[] not null default '{}',
  source_ids text[] not null default '{}',
  -- Each line's citations among the sources, derived by PostgreSQL from the summary and the
  -- sources whenever either is written: a search shows first the sources of the lines it found
  -- without reading the citations out of the text again.
  line_sources text[] not null
    generated always as (memory_private.line_sources(summary, source_ids)) stored,
  primary key (workspace_id, record_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  constraint records_dependency_hashes_check
    check (cardinality(dependency_hashes) = cardinality(dependency_ids))
);
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
comment on column memory_private.records.line_sources is
  'For each line of the summary (from line 1), the source ids it cites, joined by a space '
  '(memory_private.line_sources of summary and source_ids: generated, never written): a search '
  'shows first the sources of the lines it found (memory_private.answer_records).';

create index records_scope_idx on memory_private.records (workspace_id, scope_id, created_at desc);
-- A scope belongs to one workspace: without this the planner multiplies the two columns'
-- selectivities, takes a scope for about one record and reads a whole scope through
-- records_scope_idx to find a few records by id (a plan kept for the session).
create statistics memory_private.records_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.records;
comment on statistics memory_private.records_scope_stats is
  'scope_id depends on workspace_id: keeps plans on the primary key when records are asked by id.';

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

create function memory_private.records_add_usage_row() returns trigger
  language plpgsql
  as $$
declare
  v_new record;
begin
  -- A row at a time: on Citus a statement may not join the transition table with a
  -- distributed table (and a statement adds one record, or a few).
  for v_new in select n.workspace_id, n.record_id from added n loop
    insert into memory_private.record_usage (workspace_id, record_id, last_used_at, usage_count)
    values (v_new.workspace_id, v_new.record_id, null, 0)
    on conflict do nothing;
  end loop;
  return null;
end
$$;
comment on function memory_private.records_add_usage_row() is
  'Trigger: every new record gets its record_usage row (never used) in the same statement, so '
  'that query_memories counts a use by updating it and never touches the records table.';

create trigger records_add_usage_row after insert on memory_private.records
  referencing new table as added
  for each statement execute function memory_private.records_add_usage_row();

create function memory_private.fold(p_text text) returns text
  language sql immutable parallel safe
  as $$
  -- The literal search's case folding: lower() in the database's collation, the same wherever
  -- text and query are folded (record_texts, the query, the lines a search finds). Inlined. A
  -- text of ASCII characters only (as many bytes as characters, in a UTF-8 database), where
  -- the collation folds the 26 capitals to the 26 small letters (any but a Turkish or Azeri
  -- one), is folded byte by byte (lower() in the "C" collation): the same result, without
  -- turning every character into a wide character and back (docs/benchmarks.md). The tests of
  -- the database's encoding and collation are constants, folded when a statement is planned.
  select case when octet_length(p_text) = char_length(p_text)
               and char_length('é') = 1 and octet_length('é') = 2
               and lower('ABCDEFGHIJKLMNOPQRSTUVWXYZ') = 'abcdefghijklmnopqrstuvwxyz'
              then lower(p_text collate "C") else lower(p_text) end
$$;
comment on function memory_private.fold(text) is
  'The case folding of the literal search: lower(p_text) in the database''s collation '
  '(computed byte by byte for ASCII text in a UTF-8 database where that gives the same).';

create function memory_private.text_grams(p_text text) returns bit(1024)
  language plpgsql immutable strict parallel safe
  as $$
begin
  -- Every run of three characters of the text (at every offset: three passes of
  -- non-overlapping matches, from the first, second and third character) sets one of 1021 bits,
  -- chosen by its characters' code points: a text holding another holds all of its runs, so
  -- its bits cover the other's. Code points, not a hash function of the server's, so that the
  -- bits a record keeps mean the same after any upgrade. PL/pgSQL, so that its plan is kept for
  -- the session (a SQL function reading FROM is planned again in every transaction).
  return (
    select coalesce(bit_or(B'1'::bit(1024) >> g.bit), B'0'::bit(1024))
      from (select distinct (((ascii(m.run[1]) * 7919::bigint + ascii(substr(m.run[1], 2)))
                              * 104729 + ascii(substr(m.run[1], 3))) % 1021)::integer as bit
              from (select regexp_matches(p_text, '...', 'g')
                    union all
                    select regexp_matches(substr(p_text, 2), '...', 'g')
                    union all
                    select regexp_matches(substr(p_text, 3), '...', 'g')) as m(run)) g
  );
end
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
  'Each record''s title and summary case-folded at write time (search_text: the folded title, '
  'a newline, the folded summary: memory_private.fold) and the three-character runs of both '
  '(grams: memory_private.text_grams of each, OR-ed), with its scope and date, written by a '
  'trigger on records (memory_private.index_record): what query_memories'' literal search reads. '
  'It scans the scope''s grams newest first in the index alone and reads the folded text only of '
  'the records holding every run of the query. Kept apart from records so that nothing wide is '
  'read and nothing is folded at search time.';
create index record_texts_scope_idx
  on memory_private.record_texts (workspace_id, scope_id, created_at desc, record_id desc)
  include (grams);
create statistics memory_private.record_texts_scope_stats (dependencies, ndistinct)
  on workspace_id, scope_id from memory_private.record_texts;
comment on statistics memory_private.record_texts_scope_stats is
  'scope_id depends on workspace_id (as memory_private.records_scope_stats).';

create table memory_private.record_dependencies (
  workspace_id text not null,
  record_id bigint not null,
  message_id text not null,
  content_hash text not null,
  via text not null check (via in ('cited', 'shown', 'inherited')),
  position integer constraint record_dependencies_position_check check (position >= 1),
  -- content_hash and position included: a record's dependencies and sources in order are read
  -- from the index alone (memory_private.copy_dependencies after every write, and the readers
  -- of record_sources: request_citations, record_status, explain_record).
  primary key (workspace_id, record_id, message_id) include (content_hash, position),
  -- A cited dependency is a source and has a place among the record's sources; no other has.
  -- (The writers number a record's sources 1..n in one statement. No unique index on the
  -- places: the planner would read a record's sources through it and the heap instead of from
  -- the primary key alone.)
  constraint record_dependencies_cited_position check ((via = 'cited') = (position is not null)),
  foreign key (workspace_id, record_id) references memory_private.records on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.record_dependencies is
  'What a record''s content may have been made from: everything its model call was shown, each '
  'message with the content hash it had then, and why it counts: cited (a source of the record: '
  'its output cites it), shown (a message of its batch the output does not cite) or inherited '
  '(a dependency of a memory shown with the batch). A note depends on the message that asked for '
  'it. Validity, forgetting, retention and grants act on these (T1, T7, T8). A cited one is a '
  'source: position numbers the sources in the order the summary uses them (position 1 first; '
  'memory_private.record_sources lists them).';
comment on column memory_private.record_dependencies.position is
  'For a source (via = cited): its place among the record''s sources, in the order the summary '
  'uses them; NULL for any other dependency.';

create view memory_private.record_sources as
  select d.workspace_id, d.record_id, d.message_id, d.position
    from memory_private.record_dependencies d
   where d.position is not null;
comment on view memory_private.record_sources is
  'The messages a record cites, numbered in the order its summary uses them (position 1 first): '
  'its cited dependencies (memory_private.record_dependencies, one row per message, so a source '
  'and its hash are one fact). What query_memories shows (from the records'' copy, '
  'records.source_ids) and what enters the citation set (R5, R6).';

create index record_dependencies_message_idx
  on memory_private.record_dependencies (workspace_id, message_id);

-- The records' own copy of what they rest on. record_dependencies is where every writer puts a
-- record's dependencies (and where forgetting and retention find the records of a message);
-- after each statement that writes it, the database copies the touched records' dependencies,
-- hashes and sources into the records themselves, which is what the validity rule and
-- query_memories read (the record's page, read anyway, instead of an index leaf per record).
create function memory_private.copy_dependencies(p_workspace_ids text[], p_record_ids bigint[])
  returns void
  language plpgsql volatile
  as $$
declare
  v_ws text;
begin
  -- One workspace at a time: each update stays on the node holding the workspace (Citus).
  foreach v_ws in array array(select distinct w from unnest(p_workspace_ids) w) loop
    update memory_private.records r
       set dependency_ids = x.ids, dependency_hashes = x.hashes, source_ids = x.sources
      from (select k.workspace_id, k.record_id,
                   coalesce(array_agg(d.message_id order by d.message_id collate "C")
                              filter (where d.message_id is not null), '{}') as ids,
                   coalesce(array_agg(d.content_hash order by d.message_id collate "C")
                              filter (where d.message_id is not null), '{}') as hashes,
                   coalesce(array_agg(d.message_id order by d.position)
                              filter (where d.position is not null), '{}') as sources
              from (select distinct u.w, u.id
                      from unnest(p_workspace_ids, p_record_ids) as u(w, id)
                     where u.w = v_ws) as k(workspace_id, record_id)
              left join memory_private.record_dependencies d
                on d.workspace_id = v_ws and d.workspace_id = k.workspace_id
               and d.record_id = k.record_id
             group by k.workspace_id, k.record_id) x
     where r.workspace_id = v_ws and r.workspace_id = x.workspace_id
       and r.record_id = x.record_id
       and (r.dependency_ids, r.dependency_hashes, r.source_ids)
           is distinct from (x.ids, x.hashes, x.sources);
  end loop;
end
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

create table memory_private.tombstones (
  workspace_id text not null,
  scope_id bigint not null,
  message_id text not null,
  created_at timestamptz not null,
  primary key (workspace_id, scope_id, message_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.tombstones is
  'Content-free marks of forgotten sources. While the original message is retained, no record '
  'of the scope may depend on it and extraction never takes it again (T8).';

create function memory_private.tombstone(
  p_workspace_id text, p_scope_id bigint, p_message_id text
) returns setof memory_private.tombstones
  language sql stable
  as $$
  -- Inlined (no SET clause) wherever it is asked: exists (select from tombstone(...)).
  select t.* from memory_private.tombstones t
   where t.workspace_id = p_workspace_id and t.scope_id = p_scope_id
     and t.message_id = p_message_id
$$;
comment on function memory_private.tombstone(text, bigint, text) is
  'The tombstone of a message in a scope, if it was forgotten there (T8): no row, none. The '
  'one place "tombstoned" is asked (validity, extraction, a job''s staleness, a note, '
  'explain_record).';

-- A scope's consolidated index: a row while there is one, dropped by deleting the row (its
-- dependencies go with it).
create table memory_private.scope_indexes (
  workspace_id text not null,
  scope_id bigint not null,
  index_text text not null
    check (octet_length(index_text) <= memory_private.policy_limit('index_bytes')),
  record_ids bigint[] not null
    check (cardinality(record_ids) <= memory_private.policy_limit('index_ids')),
  candidate_ids bigint[] not null
    check (cardinality(candidate_ids) <= memory_private.policy_limit('candidates')),
  bot_identity text not null,
  repositories text[] not null,
  built_at timestamptz not null,
  primary key (workspace_id, scope_id),
  foreign key (workspace_id, scope_id) references memory_private.scopes on delete cascade,
  check (record_ids <@ candidate_ids)
);
comment on table memory_private.scope_indexes is
  'The consolidated index of a scope (<= 4,500 bytes, naming <= 12 records) and what it was '
  'built from: the <= 48 candidates the model saw, the bot identity they were made under, the '
  'repositories they drew on, when. Dropping the index is deleting its row; its '
  'index_dependencies go with it.';
comment on column memory_private.scope_indexes.candidate_ids is
  'Every record the consolidation model saw when it wrote index_text. The text may speak of any '
  'of them, so the index depends on all of them: a reader gets it only while every candidate is '
  'valid for that reader, and deleting any candidate drops it.';
comment on column memory_private.scope_indexes.bot_identity is
  'The bot identity every candidate of the index was made under.';
comment on column memory_private.scope_indexes.repositories is
  'Every repository a candidate of the index drew on: a reader needs a grant for each.';

create table memory_private.index_dependencies (
  workspace_id text not null,
  scope_id bigint not null,
  message_id text not null,
  content_hash text not null,
  primary key (workspace_id, scope_id, message_id),
  foreign key (workspace_id, scope_id) references memory_private.scope_indexes on delete cascade,
  foreign key (workspace_id, message_id) references memory_private.messages on delete cascade
);
comment on table memory_private.index_dependencies is
  'The dependencies of every candidate of a scope''s index, once each, with the content hash the '
  'candidate kept: what memory_private.index_holds checks so that a recall validates the index '
  'with one look at each message. Written with the index, deleted with its row.';

create function memory_private.line_citations(p_summary text, p_ids text[])
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

-- Scope resolution -------------------------------------------------------------------------

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

create function memory_private.scope_of_request(
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

create function memory_private.requests_scope() returns trigger
  language plpgsql
  as $$
begin
  -- An interactive request's scope is created with its first report. Created later by the
  -- first recall or by maintenance instead, one of them would wait on the other's uncommitted
  -- insert of the same scope key: a recall waited on a whole run_maintenance() transaction
  -- (P16).
  if new.kind = 'interactive' then
    perform memory_private.scope_of_request(new.workspace_id, new.request_id);
  end if;
  return null;
end
$$;
comment on function memory_private.requests_scope() is
  'Trigger: a new interactive request gets its memory scope in the same transaction.';

create trigger requests_scope after insert on memory_private.requests
  for each row execute function memory_private.requests_scope();

create function memory.resolve_scope(p_workspace_id text, p_request_id text)
  returns table (scope_kind text, scope_id bigint, bot_id text, chat_id text, user_id text,
                 topic_id bigint)
  language plpgsql volatile security definer
  set search_path = pg_catalog, pg_temp
  as $$
declare
  v_scope memory_private.scopes;
begin
  begin
    v_scope := memory_private.scope_of_request(p_workspace_id, p_request_id);
  exception when sqlstate 'MB005' then
    return query select 'none'::text, null::bigint, null::text, null::text, null::text,
                        null::bigint;
    return;
  end;
  return query select v_scope.kind, v_scope.scope_id, v_scope.bot_id, v_scope.chat_id,
                      v_scope.user_id, v_scope.topic_id;
end
$$;
comment on function memory.resolve_scope(text, text) is
  'The memory scope a request belongs to: private (bot, chat, user), shared (bot, group, topic) '
  'or none for a scheduled request.';

-- Validity at read time: the one rule ----------------------------------------------------------
--
-- Whether a record may be recalled now, for a reader, is decided from current facts on every read
-- (V6, T1); the retention sweep only makes the permanent reasons final (60_retention.sql). The
-- reasons, in the order the rule gives them, are the rows of memory_private.invalid_reasons. The
-- rule is built from three pieces, each written once:
--   scope_checks      the scope's facts for a reader: recall on, bot active, group linked,
--                     membership (a row per check, with a detail, in rank order);
--   dependency_state  the state of one message a record depends on: removed, expired, edited,
--                     forgotten, or current (is_retained says whether a message is retained);
--   own_reasons       every reason a record fails whatever the reader, from its columns: the
--                     bot replaced, and the state of each of its dependencies (record_reasons:
--                     the same for a set of records, read by id).
-- invalid_records composes them for a set of records (the one verdict every reader uses:
-- recall, query_memories, citations, candidates, forget); record_failures for one record a
-- reader has in hand (recent_valid_records, walking a scope newest first, after the scope's
-- checks); record_checks lists the same checks for one record with details (explain_record).
-- Repository grants are checked by missing_grants. tests/test_validity_set.py keeps the three
-- equal for every reason.

create table memory_private.invalid_reasons (
  reason text primary key,
  rank integer not null unique,
  permanent boolean not null,
  description text not null
);
comment on table memory_private.invalid_reasons is
  'Why a record may not be recalled, in the order the rule gives them (the first that holds is '
  'the answer), and whether the reason can pass (recall turned on again, a grant given back) or '
  'is permanent (the retention sweep then deletes the record). Not per workspace.';

insert into memory_private.invalid_reasons (reason, rank, permanent, description) values
  ('recall_disabled', 1, false, 'recall is turned off in the scope'),
  ('bot_inactive', 2, false, 'the scope''s bot is inactive'),
  ('group_unlinked', 3, false, 'the group is not linked to the workspace'),
  ('membership', 4, false, 'the reader is not an active member, or not the private scope''s user'),
  ('bot_replaced', 5, true, 'the record was made under another identity of the bot'),
  ('source_removed', 6, true, 'a message it was made from was removed'),
  ('source_expired', 7, true, 'a message it was made from is past its retention'),
  ('source_edited', 8, true, 'a message it was made from was edited since'),
  ('forgotten', 9, true, 'a message it was made from was forgotten in the scope'),
  ('grant_revoked', 10, false, 'the reader may no longer read a repository it drew on');

create function memory_private.is_retained(
  p_has_text boolean, p_retain_until timestamptz, p_now timestamptz
) returns boolean
  language sql immutable parallel safe
  as $$ select p_has_text and (p_retain_until is null or p_retain_until > p_now) $$;
comment on function memory_private.is_retained(boolean, timestamptz, timestamptz) is
  'Whether a message is retained at p_now: its text is still there (not removed or erased) and '
  'its retention has not ended. The retention rule, for every reader of it (T1, T6).';

create function memory_private.retention_ends(p_workspace_id text)
  returns table (message_id text, request_id text, retain_until timestamptz)
  language sql stable
  as $$
  -- Inlined (no SET clause): read from messages_retention_idx, earliest first when the caller
  -- orders by retain_until; whether one is still retained is memory_private.is_retained.
  select m.message_id, m.request_id, m.retain_until from memory_private.messages m
   where m.workspace_id = p_workspace_id and m.body is not null
     and m.retain_until is not null
$$;
comment on function memory_private.retention_ends(text) is
  'The workspace''s messages that still have their text and a retention end, with it: what '
  'the retention sweep erases once memory_private.is_retained says so (T6), and where the next '
  'retention end comes from (memory_private.next_maintenance_at).';

create function memory_private.prune_at(p_last_used_at timestamptz, p_created_at timestamptz)
  returns timestamptz
  language sql immutable parallel safe
  as $$
  -- A record unused for strictly longer than unused_days is pruned (T5).
  select coalesce(p_last_used_at, p_created_at)
         + make_interval(days => (memory_private.policy()).unused_days)
         + interval '1 microsecond'
$$;
comment on function memory_private.prune_at(timestamptz, timestamptz) is
  'When a record used last at p_last_used_at (never: made at p_created_at) is pruned for being '
  'unused (T5): the pruning horizon, for the sweep (prune_records) and the tick that plans it '
  '(next_maintenance_at).';

create function memory_private.dependency_state(
  p_removed_at timestamptz, p_has_text boolean, p_retain_until timestamptz,
  p_current_hash text, p_recorded_hash text, p_tombstoned boolean, p_now timestamptz
) returns text
  language sql immutable parallel safe
  as $$
  select case when p_removed_at is not null then 'source_removed'
              when not memory_private.is_retained(p_has_text, p_retain_until, p_now)
                then 'source_expired'
              when p_current_hash is distinct from p_recorded_hash then 'source_edited'
              when p_tombstoned then 'forgotten' end
$$;
comment on function memory_private.dependency_state(timestamptz, boolean, timestamptz, text, text,
                                                     boolean, timestamptz) is
  'The state of a message something depends on, given the hash it had when used and whether it '
  'is tombstoned in the scope: source_removed, source_expired, source_edited, forgotten (in that '
  'order), or NULL when it is current. Plain SQL so that a query inlines it.';

create function memory_private.scope_checks(
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

create function memory_private.scope_reason(
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

create function memory_private.own_reasons(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_now timestamptz
) returns table (reason text, message_id text)
  language sql stable
  as $$
  -- Inlined (no SET clause), from columns a reader of the record has in hand: no read of the
  -- record itself. The bot replaced since the record was made (p_bot_identity: the scope's bot
  -- now; p_record_identity: the record's) ...
  select 'bot_replaced', null::text
   where p_record_identity <> p_bot_identity
  union all
  -- ... and every dependency that is not current (the record's copy of its dependencies, with
  -- the hashes they had when it was made).
  select x.state, d.message_id
    from unnest(p_dependency_ids, p_dependency_hashes) as d(message_id, content_hash)
   cross join lateral (
     -- each message by its key (kept apart: joined, a planner that takes the dependencies for
     -- ten may read every message of the workspace for them)
     select m.removed_at, m.content_hash, m.retain_until from memory_private.messages m
      where m.workspace_id = p_workspace_id and m.message_id = d.message_id
     offset 0) m
   cross join lateral (
     -- content_hash, not body: NULL exactly when the text is gone, and in messages_state_idx
     select memory_private.dependency_state(
              m.removed_at, m.content_hash is not null, m.retain_until, m.content_hash,
              d.content_hash,
              exists (select from memory_private.tombstone(p_workspace_id, p_scope_id,
                                                           d.message_id)),
              p_now) as state) x
   where x.state is not null
$$;
comment on function memory_private.own_reasons(text, bigint, text, text, text[], text[],
                                               timestamptz) is
  'Every reason a record of the scope fails whatever the reader, from its bot identity and its '
  'dependencies (ids and the hashes they had): bot_replaced when the scope''s bot '
  '(p_bot_identity) has another identity now, and the state of each dependency that is not '
  'current (removed, expired, edited, forgotten) with the message. No row: none.';

create function memory_private.record_reasons(
  p_workspace_id text, p_scope_id bigint, p_record_ids bigint[],
  p_now timestamptz default memory_private.clock_now()
) returns table (record_id bigint, reason text, message_id text)
  language sql stable
  as $$
  -- memory_private.own_reasons of each record, read from its own page (its copy of its
  -- dependencies), which every reader of the record reads anyway; the scope's bot identity
  -- once.
  select r.record_id, x.reason, x.message_id
    from (select (select b.identity
                    from memory_private.scopes s
                    join memory_private.bots b
                      on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
                   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id) as identity
          offset 0) sb  -- a column, not a subquery: own_reasons is then inlined
    join memory_private.records r
      on r.workspace_id = p_workspace_id and r.record_id = any(p_record_ids)
   cross join lateral memory_private.own_reasons(p_workspace_id, p_scope_id, sb.identity,
                                                 r.bot_identity, r.dependency_ids,
                                                 r.dependency_hashes, p_now) x
$$;
comment on function memory_private.record_reasons(text, bigint, bigint[], timestamptz) is
  'Every reason each given record of the scope fails whatever the reader '
  '(memory_private.own_reasons): bot_replaced, and the state of each dependency that is not '
  'current (removed, expired, edited, forgotten) with the message. A record that fails none has '
  'no row. The retention sweep deletes the records with a permanent one.';

create function memory_private.missing_grants(
  p_workspace_id text, p_reader text, p_repositories text[]
) returns table (repository_id text)
  language sql stable
  as $$
  -- Inlined (no SET clause). No reader (background work on a shared scope): nothing is checked.
  select repo.repository_id
    from unnest(p_repositories) as repo(repository_id)
   where p_reader is not null
     and not exists (select 1 from memory_private.repository_grants g
                      where g.workspace_id = p_workspace_id and g.user_id = p_reader
                        and g.repository_id = repo.repository_id)
$$;
comment on function memory_private.missing_grants(text, text, text[]) is
  'The repositories of p_repositories the reader may not read (no repository_grants row): a '
  'record drawing on one is not valid for them (grant_revoked). None when there is no reader.';

create function memory_private.invalid_records(
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
           -- (no call for a record drawing on no repository: on Citus each call is planned)
           where case when cardinality(r.repositories) > 0
                      then exists (select 1 from memory_private.missing_grants(
                                     p_workspace_id, rd.id, r.repositories))
                      else false end),
           '{}')
    into v_scope_reason, v_ids, v_no_grant
    from memory_private.records r
   cross join (select coalesce((select s.user_id from memory_private.scopes s
                                 where s.workspace_id = p_workspace_id
                                   and s.scope_id = p_scope_id), p_requester) as id
               offset 0) rd  -- kept a column: missing_grants is inlined only without a subquery
                             -- in its arguments
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

create function memory_private.index_holds(
  p_workspace_id text, p_scope_id bigint, p_requester text
) returns boolean
  language plpgsql stable
  as $$
declare
  v_index memory_private.scope_indexes;
  v_scope memory_private.scopes;
  v_reader text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- The validity rule for every candidate of the scope's index at once, in the form the index
  -- keeps (its candidates' dependencies, bot identity and repositories, taken when it was built):
  -- what invalid_records would say of each candidate, without reading them one by one. A test
  -- keeps the two equal for every reason (tests/test_provenance.py,
  -- test_index_holds_exactly_when_every_candidate_is_valid_for_the_reader).
  select * into v_index from memory_private.scope_indexes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  if not found then
    return false;
  end if;
  select * into v_scope from memory_private.scopes
   where workspace_id = p_workspace_id and scope_id = p_scope_id;
  v_reader := coalesce(v_scope.user_id, p_requester);
  return memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester) is null
     and (select b.identity from memory_private.bots b
           where b.workspace_id = p_workspace_id and b.bot_id = v_scope.bot_id)
         = v_index.bot_identity
     and (cardinality(v_index.repositories) = 0
          or not exists (select 1 from memory_private.missing_grants(
                           p_workspace_id, v_reader, v_index.repositories)))
     and not exists (select 1 from memory_private.index_dependencies d
                      join memory_private.messages m
                        on m.workspace_id = d.workspace_id and m.message_id = d.message_id
                     where d.workspace_id = p_workspace_id and d.scope_id = p_scope_id
                       -- content_hash is not null: the text is there (messages_state_idx)
                       and memory_private.dependency_state(m.removed_at,
                             m.content_hash is not null, m.retain_until, m.content_hash,
                             d.content_hash,
                             exists (select from memory_private.tombstone(
                                                   p_workspace_id, p_scope_id, d.message_id)),
                             v_now)
                           is not null);
end
$$;
comment on function memory_private.index_holds(text, bigint, text) is
  'Whether the scope''s index may be given to the requester now: every record it was built from '
  'is valid for them (the scope''s checks, the bot identity, the repository grants, and every '
  'dependency current and not forgotten), checked from what the index kept when it was built.';

create function memory_private.record_invalid_reason(
  p_record memory_private.records, p_requester text
) returns text
  language sql stable
  as $$
  select v.reason
    from memory_private.invalid_records(p_record.workspace_id, p_record.scope_id,
                                        array[p_record.record_id], p_requester) v
   limit 1  -- one row at most (one id); the cluster's form depends on it (cluster_code.py)
$$;
comment on function memory_private.record_invalid_reason(memory_private.records, text) is
  'memory_private.invalid_records for one record: why it may not be recalled now for the '
  'requester, or NULL when it may.';

create function memory_private.record_checks(
  p_workspace_id text, p_record_id bigint, p_requester text
) returns table (rank integer, check_name text, reason text, ok boolean, detail text)
  language plpgsql stable
  as $$
declare
  v_record memory_private.records;
  v_identity text;
  v_reader text;
  v_states text[];
  v_bad text[];
  v_deps integer;
  v_missing text[];
begin
  -- The same checks as memory_private.invalid_records, one row each with a detail, for
  -- explain_record; the first failing row is the record's reason (a test keeps them equal).
  select * into v_record from memory_private.records
   where workspace_id = p_workspace_id and record_id = p_record_id;
  if not found then
    return;
  end if;
  return query select * from memory_private.scope_checks(p_workspace_id, v_record.scope_id,
                                                         p_requester);
  select b.identity, coalesce(s.user_id, p_requester) into v_identity, v_reader
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
   where s.workspace_id = p_workspace_id and s.scope_id = v_record.scope_id;
  return query select 5, 'bot_identity', 'bot_replaced',
    v_identity is null or v_identity = v_record.bot_identity,
    case when v_identity is null then 'no bot to compare with'
         when v_identity = v_record.bot_identity then 'made under the bot''s current identity'
         else format('made under identity %s; the bot is now %s', v_record.bot_identity,
                     v_identity) end;
  select count(*) into v_deps from memory_private.record_dependencies
   where workspace_id = p_workspace_id and record_id = p_record_id;
  select array_agg(x.reason order by ir.rank, x.message_id),
         array_agg(x.message_id || ' ' || x.reason order by ir.rank, x.message_id)
    into v_states, v_bad
    from memory_private.record_reasons(p_workspace_id, v_record.scope_id, array[p_record_id]) x
    join memory_private.invalid_reasons ir on ir.reason = x.reason
   where x.reason <> 'bot_replaced';
  return query select coalesce((select ir.rank from memory_private.invalid_reasons ir
                                 where ir.reason = v_states[1]), 6),
    'dependencies_current', v_states[1], v_states is null,
    case when v_states is null
           then format('all %s messages it was made from are retained and unchanged', v_deps)
         else format('%s of the %s messages it was made from are not current: %s',
                     cardinality(v_states), v_deps, array_to_string(v_bad, ', ')) end;
  select array_agg(m.repository_id order by m.repository_id) into v_missing
    from memory_private.missing_grants(p_workspace_id, v_reader, v_record.repositories) m;
  return query select 10, 'repository_grants', 'grant_revoked',
    coalesce(cardinality(v_missing), 0) = 0,
    case when cardinality(v_record.repositories) = 0 then 'drew on no repository'
         when v_reader is null
           then 'shared scope and no requester: per-requester grants not checked'
         when coalesce(cardinality(v_missing), 0) = 0
           then format('%s can read every repository it drew on', v_reader)
         else format('%s can no longer read %s', v_reader, array_to_string(v_missing, ', '))
    end;
end
$$;
comment on function memory_private.record_checks(text, bigint, text) is
  'Every check of the validity rule for one record and reader, in rank order, with ok and a '
  'detail (explain_record shows them): the scope''s checks, the bot identity, the dependencies, '
  'the repository grants. The first failing one is what memory_private.invalid_records answers.';

create function memory_private.first_valid_records(
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

create function memory_private.within_a_part(p_title text, p_summary text, p_query text)
  returns boolean
  language sql immutable parallel safe
  as $$
  -- Inlined (no SET clause). A folded query found in search_text (the folded title, a newline,
  -- the folded summary) is a literal match only within one part: a query holding a newline may
  -- have matched across the title's end, so it is looked for in each part apart.
  select strpos(p_query, e'\n') = 0
      or strpos(memory_private.fold(p_title), p_query) > 0
      or strpos(memory_private.fold(p_summary), p_query) > 0
$$;
comment on function memory_private.within_a_part(text, text, text) is
  'Whether a folded query that search_text holds is a literal match of the record: it holds no '
  'newline, or the folded title or the folded summary holds it (a match across the title''s end '
  'is none). The literal search''s re-check (recent_valid_records).';

create function memory_private.record_failures(
  p_workspace_id text, p_scope_id bigint, p_bot_identity text, p_record_identity text,
  p_dependency_ids text[], p_dependency_hashes text[], p_repositories text[], p_reader text,
  p_now timestamptz
) returns table (reason text)
  language sql stable
  as $$
  -- Inlined (no SET clause), with own_reasons and missing_grants inside it: the checks of one
  -- record for a reader, from the record's columns, as a reader walking records one by one
  -- asks them.
  select x.reason
    from memory_private.own_reasons(p_workspace_id, p_scope_id, p_bot_identity,
                                    p_record_identity, p_dependency_ids, p_dependency_hashes,
                                    p_now) x
  union all
  select 'grant_revoked'
    from memory_private.missing_grants(p_workspace_id, p_reader, p_repositories)
   where cardinality(p_repositories) > 0  -- no call without repositories (planned on Citus)
$$;
comment on function memory_private.record_failures(text, bigint, text, text, text[], text[],
                                                   text[], text, timestamptz) is
  'Every reason one record of the scope fails for the reader (the private scope''s user or the '
  'requester), the scope''s checks aside, from its bot identity, dependencies and repositories: '
  'its own reasons (memory_private.own_reasons; p_bot_identity is the scope''s bot now) and '
  'grant_revoked for each repository the reader lacks. No row: valid, once the scope''s checks '
  'pass. memory_private.invalid_records, one record at a time.';

create function memory_private.recent_valid_records(
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
  v_query text := memory_private.fold(p_query);
  v_grams bit(1024);
  v_scope_reason text;
  v_reader text;
  v_identity text;
  v_now timestamptz := memory_private.clock_now();
begin
  -- Newest first, a page at a time (limit, then four times more); a page's records checked
  -- in one statement (record_failures: invalid_records' verdict, tests/test_validity_set.py)
  -- after the scope's checks (scope_reason), asked with the reader and the bot's identity. A
  -- scope whose newest records are valid costs one short index scan and one pass over just
  -- those, never a read of the whole scope. One snapshot throughout (stable).
  v_scope_reason := memory_private.scope_reason(p_workspace_id, p_scope_id, p_requester);
  select s.user_id, b.identity into v_reader, v_identity
    from memory_private.scopes s
    left join memory_private.bots b on b.workspace_id = s.workspace_id and b.bot_id = s.bot_id
   where s.workspace_id = p_workspace_id and s.scope_id = p_scope_id;
  v_reader := coalesce(v_reader, p_requester);
  if v_scope_reason is not null then
    return '{}';
  end if;
  if char_length(v_query) >= 3 then
    v_grams := memory_private.text_grams(v_query);
  end if;
  loop
    if v_query is null then
      v_chunk := array(
        select r.record_id from memory_private.records r
         where r.workspace_id = p_workspace_id and r.scope_id = p_scope_id
           and (p_record_id is null or r.record_id = p_record_id)
         order by r.created_at desc, r.record_id desc
         limit v_size offset v_offset);
    elsif v_grams is null then
      -- Too short for a three-character run (a two-character Chinese word): every folded text
      -- of the scope newest first (narrow rows).
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
      -- every three-character run of the query, the record: the query as typed in its title or
      -- summary matches; else the folded text decides (search_text; a query holding a newline
      -- is re-checked in each part, within_a_part: across the title's end is no match).
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
    v_valid := v_valid || array(
      select c.record_id
        from unnest(v_chunk) with ordinality as c(record_id, pos)
        join memory_private.records r
          on r.workspace_id = p_workspace_id and r.record_id = c.record_id
       where r.scope_id = p_scope_id
         and not exists (select 1 from memory_private.record_failures(
                           p_workspace_id, p_scope_id, v_identity, r.bot_identity,
                           r.dependency_ids, r.dependency_hashes, r.repositories, v_reader,
                           v_now))
       order by c.pos);
    exit when cardinality(v_valid) >= p_limit or cardinality(v_chunk) < v_size;
    v_offset := v_offset + v_size;
    v_size := v_size * 4;
  end loop;
  return v_valid[1:p_limit];
end
$$;
comment on function memory_private.recent_valid_records(text, bigint, integer, text, text, bigint)
  is
  'The ids of a scope''s most recent valid records for the requester, newest first, at most '
  'p_limit; optionally only those whose title or summary contains p_query (literal, '
  'case-insensitive) or the one record p_record_id. 48 are the consolidation candidates (P9); 4 '
  'accompany a new extraction batch (P5); 8 make recall''s directory; query_memories browses '
  'and searches with it. Read a page at a time; the scope''s checks once, then each record of '
  'a page (memory_private.record_failures).';

revoke all on function memory.resolve_scope(text, text) from public;
grant execute on function memory.resolve_scope(text, text) to memory_backend, memory_operator;
