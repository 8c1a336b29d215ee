-- 30_redaction.sql: common credential patterns, replaced by a marker (P8, T9).
--
-- The memory redacts model inputs before they are serialized into a claim payload and model
-- outputs before they are stored. This is defense in depth, not proof: a secret in an unusual
-- format, or described in words, passes through (T9).
--
-- The patterns are applied in order: whole private-key blocks first, then structured forms
-- (credentials in URLs, JWTs, vendor keys with recognisable prefixes, authorization headers),
-- then `key = value` assignments of secrets. The marker is `[REDACTED]`; redacting twice changes
-- nothing. The shared test vectors in pyworker/data/redaction_vectors.json pin the behaviour for
-- the SQL and for the worker's own redaction (pgtap/10_redaction.sql, tests/test_jobs_redaction.py).
--
-- Regular expressions are PostgreSQL AREs: \y is a word boundary (Python's \b). An ARE takes its
-- greediness from its first quantifier, so the private-key block pattern starts with a
-- non-greedy one to stop at the first END line.

create table memory_private.redaction_patterns (
  position integer primary key,
  name text not null unique,
  pattern text not null,
  replacement text not null,
  flags text not null check (flags in ('g', 'gi'))
);
comment on table memory_private.redaction_patterns is
  'The credential patterns memory_private.redact applies, in position order (regexp_replace '
  'pattern, replacement and flags). Not per workspace: the same rules hold everywhere.';

insert into memory_private.redaction_patterns (position, name, pattern, replacement, flags) values
  (10, 'private_key_block',
   $re$-----BEGIN ([A-Z0-9]+ )*?PRIVATE KEY( BLOCK)?-----.*?-----END ([A-Z0-9]+ )*?PRIVATE KEY( BLOCK)?-----$re$,
   '[REDACTED]', 'g'),
  (20, 'private_key_block_truncated',
   $re$-----BEGIN ([A-Z0-9]+ )*PRIVATE KEY( BLOCK)?-----.*$$re$,
   '[REDACTED]', 'g'),
  (30, 'url_password',
   $re$\y([a-z][a-z0-9+.-]*://[^\s:/@]+:)[^\s@/]+@$re$,
   '\1[REDACTED]@', 'gi'),
  (40, 'jwt',
   $re$\yeyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}$re$,
   '[REDACTED]', 'g'),
  (50, 'openai_anthropic_key', $re$\ysk-[A-Za-z0-9_-]{16,}$re$, '[REDACTED]', 'g'),
  (51, 'stripe_key', $re$\y(sk|rk)_(live|test)_[A-Za-z0-9]{16,}$re$, '[REDACTED]', 'g'),
  (52, 'github_token', $re$\y(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}$re$, '[REDACTED]', 'g'),
  (53, 'github_fine_grained_token', $re$\ygithub_pat_[A-Za-z0-9_]{20,}$re$, '[REDACTED]', 'g'),
  (54, 'gitlab_token', $re$\yglpat-[A-Za-z0-9_-]{20,}$re$, '[REDACTED]', 'g'),
  (55, 'slack_token', $re$\yxox[abposr]-[A-Za-z0-9-]{10,}$re$, '[REDACTED]', 'g'),
  (56, 'aws_access_key_id', $re$\y(AKIA|ASIA)[0-9A-Z]{16}\y$re$, '[REDACTED]', 'g'),
  (57, 'google_api_key', $re$\yAIza[0-9A-Za-z_-]{35}$re$, '[REDACTED]', 'g'),
  (58, 'telegram_bot_token', $re$\y[0-9]{8,10}:[A-Za-z0-9_-]{35}\y$re$, '[REDACTED]', 'g'),
  (60, 'authorization_header',
   $re$\y(authorization"?\s*[:=]\s*"?((bearer|basic|token)\s+)?)[^\s"',;]+$re$,
   '\1[REDACTED]', 'gi'),
  (61, 'bearer_token',
   $re$\y(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{16,}$re$,
   '\1 [REDACTED]', 'gi'),
  (70, 'secret_assignment_double_quoted',
   $re$\y([A-Za-z0-9_.-]*(password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"?\s*[:=]\s*)"[^"]+"$re$,
   '\1"[REDACTED]"', 'gi'),
  (71, 'secret_assignment_single_quoted',
   $re$\y([A-Za-z0-9_.-]*(password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"?\s*[:=]\s*)'[^']+'$re$,
   '\1''[REDACTED]''', 'gi'),
  (72, 'secret_assignment',
   $re$\y([A-Za-z0-9_.-]*(password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"?\s*[:=]\s*)[^\s"',;]{4,}$re$,
   '\1[REDACTED]', 'gi');

create function memory_private.redact(p_text text) returns text
  language plpgsql stable strict parallel safe
  as $$
declare
  v_text text := p_text;
  v_rule record;
begin
  for v_rule in
    select pattern, replacement, flags from memory_private.redaction_patterns order by position
  loop
    v_text := regexp_replace(v_text, v_rule.pattern, v_rule.replacement, v_rule.flags);
  end loop;
  return v_text;
end
$$;
comment on function memory_private.redact(text) is
  'The text with common credential patterns (API keys, tokens, JWTs, bearer headers, passwords '
  'in URLs, private-key blocks, password=/secret=/token= assignments) replaced by [REDACTED]. '
  'Defense in depth: it cannot find every secret (T9).';

create function memory_private.redact_json_strings(p_value jsonb) returns jsonb
  language plpgsql stable strict parallel safe
  as $$
begin
  return case jsonb_typeof(p_value)
    when 'string' then to_jsonb(memory_private.redact(p_value #>> '{}'))
    when 'array' then coalesce(
      (select jsonb_agg(memory_private.redact_json_strings(e) order by n)
         from jsonb_array_elements(p_value) with ordinality as a(e, n)), '[]'::jsonb)
    when 'object' then coalesce(
      (select jsonb_object_agg(k, memory_private.redact_json_strings(v))
         from jsonb_each(p_value) as o(k, v)), '{}'::jsonb)
    else p_value
  end;
end
$$;
comment on function memory_private.redact_json_strings(jsonb) is
  'A JSON value with memory_private.redact applied to every string in it (keys untouched).';
