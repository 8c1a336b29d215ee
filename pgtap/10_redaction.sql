-- Credential redaction (P8, T9). Every shared vector is checked by tests/test_jobs_redaction.py;
-- this file pins a few representative cases and the function's properties.
begin;
select plan(9);

select is(memory_private.redact('key sk-proj-AbCdEf0123456789XyZaBcDeF ok'), 'key [REDACTED] ok',
  'an OpenAI-style key is redacted');
select is(memory_private.redact('postgres://admin:hunter2@db:5432/app'),
  'postgres://admin:[REDACTED]@db:5432/app', 'a password in a URL is redacted, the user kept');
select is(memory_private.redact(e'a\n-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----\nb'),
  e'a\n[REDACTED]\nb', 'a private key block is redacted whole');
select is(memory_private.redact('DB_PASSWORD=abc123def'), 'DB_PASSWORD=[REDACTED]',
  'a password assignment is redacted');
select is(memory_private.redact('set max_tokens=4000, author: Jane'),
  'set max_tokens=4000, author: Jane', 'look-alikes are left alone');
select is(memory_private.redact('Schlüssel ✓ ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789'),
  'Schlüssel ✓ [REDACTED]', 'multibyte text around a token survives');
select is(memory_private.redact(memory_private.redact('Bearer AbCdEf0123456789AbCdEf01 x')),
  memory_private.redact('Bearer AbCdEf0123456789AbCdEf01 x'), 'redacting twice changes nothing');
select is(memory_private.redact_json_strings('{"a": ["token=abcd1234", 1, null]}'),
  '{"a": ["token=[REDACTED]", 1, null]}'::jsonb, 'JSON strings are redacted, other values kept');
select ok(not has_schema_privilege('memory_worker', 'memory_private', 'usage'),
  'redact is internal: no role reaches memory_private');

select * from finish();
rollback;
