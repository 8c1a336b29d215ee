-- 54_request_phrases.sql: recognising a direct request to the memory (C1, C2).
--
-- manage_memory acts only when the user's current message itself directly asks for the action.
-- memory_private.request_form reads a message and says what it asks of the memory (remember,
-- forget, enable-memory, disable-memory) or why it asks nothing (quoted, question, negative,
-- empty, none), in English and Chinese. The phrasings are data-like regular expressions, kept here
-- apart from the permissions of 55_control.sql; tests/data/manage_phrasings.json lists the forms
-- covered. The recogniser reads the first 300 characters and the end of a message, so it is
-- linear in its length and cheap under the workspace lock.

create function memory_private.request_has_content(p_rest text) returns boolean
  language sql immutable
  as $$
  select char_length(regexp_replace(
           regexp_replace(coalesce(p_rest, ''),
             '^([ ,.:;!\-，。：；！、…]|that\M|this\M|it\M|these\M|those\M|the following\M'
             || '|following\M|things\M|stuff\M|something\M|anything\M|everything\M'
             || '|下面|以下|这个|那个|这件事|这点|这些|它|一下|下来|下)*', ''),
           '[[:space:][:punct:]，。！？、：；“”‘’「」『』…]', '', 'g')) >= 2
$$;
comment on function memory_private.request_has_content(text) is
  'Whether what follows a remember phrase says something: not just "this", "that", "it", '
  '"things" or punctuation ("remember it" has nothing to remember).';

-- Long: a decision list, one pattern group per outcome, in the order they must be tried
-- (quoted speech before questions before negatives before the actions); split apart, the order
-- that decides ambiguous messages would be spread over several functions.
create function memory_private.request_clause_form(p_clause text, p_ends_as_question boolean)
  returns text
  language plpgsql immutable
  as $$
declare
  t text := p_clause;
  v_prev text;
  v_rest text;
  v_polite boolean := false;
  v_steps integer := 0;
  c_remember constant text :=
    '^(remember|memorize|memorise|keep in mind|keep (this|that|it) in mind|note down'
    || '|make a note of|make a note|take note of|take note|note that|note:'
    || '|save (this |that |it )?(to|in|into) (your )?memory'
    || '|add (this |that |it )?to (your )?memory)';
  c_forget constant text :=
    '^(forget|(delete|remove|erase|wipe) (this |that |the |my |your )?(memory|memories|note|notes))'
    || '([^a-z]|$)';
  c_disable constant text :=
    '^(((turn|switch|shut) off|disable|deactivate|pause) (the |your )?'
    || '(memory|memories|remembering|recall)|stop (remembering|memorizing|using memory)'
    || '|(turn|switch) (the |your )?(memory|recall)( feature)? off)([^a-z]|$)';
  c_enable constant text :=
    '^(((turn|switch) on|enable|activate|resume|reactivate) (the |your )?'
    || '(memory|memories|remembering|recall)|start (remembering|using memory)'
    || '|(turn|switch) (the |your )?(memory|recall)( feature)? (back )?on)([^a-z]|$)';
  c_zh_remember constant text := '^(记住|记下来|记下|记一下|牢记|记得|要记住|帮我记)';
  -- An explanation question right after the verb ("记住是什么意思"); after a separator it is
  -- content ("记住：API 是什么协议").
  c_zh_explain constant text :=
    '^(是什么|什么意思|是啥|怎么用|如何用|如何使用|有什么用|怎么回事|干什么用|做什么用'
    || '|什么作用|会怎么样|怎么样|是干嘛的|是干什么的)';
begin
  -- Politeness, addressing, thanks and framing in front of the request. The clause is at most
  -- 300 characters (request_form cuts it) and at most 20 words are stripped, so this costs the
  -- same whatever the length of the message.
  loop
    v_prev := t;
    t := regexp_replace(t, (
      '^(@[^ ]+|(hey|hi|hello|ok|okay) [^ ,，]+[,，]|hey\M|hi\M|hello\M|ok\M|okay\M|alright\M'
      || '|so\M|also\M|and\M|now\M|then\M|oh\M|bot\M|please\M|pls\M|plz\M|kindly\M|just\M'
      || '|thanks\M|thank you\M|thx\M|great\M|cool\M|nice\M|perfect\M|awesome\M|got it\M'
      || '|sure\M|btw\M|by the way\M|one more thing\M'
      || '|from now on\M|i want you to\M|i''d like you to\M|i would like you to\M|i need you to\M'
      || '|go ahead and\M|be sure to\M|make sure to\M|you should\M|you must\M'
      || '|请问|请你|请|麻烦你|麻烦|拜托你|拜托|帮我|帮忙|给我|你|好的|好|嗯|哦|噢|谢谢|多谢|对了'
      || '|另外|还有|顺便说一下|顺便|那就|现在|以后|今后|从现在开始|从现在起)'
      || '[ ,，、:：!！.。~～-]*'), '');
    v_steps := v_steps + 1;
    exit when t = v_prev or v_steps >= 20;
  end loop;
  if t ~ '^[>"''“”‘„«»「」『』`{\[<|]' then
    return 'quoted';
  end if;

  -- Negative requests ("don't remember this", "不要记住").
  if t ~ ('^(do not|don''t|dont|never|not|no need to|there''s no need to|you don''t need to'
          || '|you do not need to|i don''t want you to|i do not want you to)\M')
     or t ~ '^(不要|别|不用|无需|不必|不需要|甭|千万别|勿|我不想|我不希望|我不要|我不需要)' then
    return 'negative';
  end if;

  -- "Can you ..." is a polite request only when it says what to remember or forget ("Can you
  -- remember that my deploy day is Friday?"); otherwise it asks about the capability ("can you
  -- remember things", "could you turn off memory?").
  if t ~ '^(can|could|would|will) you\M' then
    t := regexp_replace(t, '^(can|could|would|will) you( please| kindly| also)*[ ,，]*', '');
    if not (t ~ (c_remember || ' *(that\M|[:：])') or t ~ '^forget (that|about)\M') then
      return 'question';
    end if;
    v_polite := true;
  end if;
  -- "你能帮我记住……吗？" asks for help: a request. "你能记住……吗" asks what it can do.
  if t ~ '^(能不能|可不可以|能否|可以|能|会)' then
    if not t ~ '^(能不能|可不可以|能否|可以|能)(帮我|替我)(记住|记下来|记下|记一下)' then
      return 'question';
    end if;
    t := regexp_replace(t, '^(能不能|可不可以|能否|可以|能)(帮我|替我)', '');
    v_polite := true;
  end if;
  if p_ends_as_question and not v_polite then
    return 'question';
  end if;

  if t ~ c_disable
     or t ~ '^(关闭|关掉|关上|停用|禁用|暂停|停止)(你的)?(长期)?(记忆|记忆功能)'
     or t ~ '^把(你的)?(长期)?(记忆|记忆功能)(关闭|关掉|关了|关上|停用|禁用)' then
    return 'disable-memory';
  end if;
  if t ~ c_enable
     or t ~ '^(打开|开启|启用|恢复|重新开启|重新打开)(你的)?(长期)?(记忆|记忆功能)'
     or t ~ '^把(你的)?(长期)?(记忆|记忆功能)(打开|开启|启用|恢复|开了)' then
    return 'enable-memory';
  end if;
  if t ~ c_forget
     or t ~ '^(忘记|忘掉|遗忘)'
     or t ~ '^(删除|删掉|清除|抹去|抹掉).*(记忆|笔记|备忘)'
     or t ~ '^把.+(忘记|忘掉|忘了|删掉|删除)' then
    return 'forget';
  end if;
  if t ~ (c_remember || '([^a-z]|$)') then
    v_rest := regexp_replace(t, c_remember, '');
    return case when memory_private.request_has_content(v_rest) then 'remember' else 'empty' end;
  end if;
  if t ~ c_zh_remember then
    v_rest := regexp_replace(t, c_zh_remember, '');
    if v_rest ~ c_zh_explain then
      return 'question';
    end if;
    return case when memory_private.request_has_content(v_rest) then 'remember' else 'empty' end;
  end if;
  if t ~ '^把.{2,}(记住|记下来|记下)' then
    return 'remember';
  end if;
  return 'none';
end
$$;
comment on function memory_private.request_clause_form(text, boolean) is
  'The request a normalized clause opens with, after politeness and thanks: remember, forget, '
  'enable-memory, disable-memory, or quoted, question, negative, empty, none. A polite request '
  'question ("can you remember that ...?", "你能帮我记住……吗？") is a request; a question '
  'about the capability ("can you remember things") or an explanation ("记住是什么意思") is not. '
  'p_ends_as_question: the whole message ends with a question mark or 吗.';

create function memory_private.request_form(p_text text) returns text
  language plpgsql immutable
  as $$
declare
  t text;
  v_head text;
  v_question boolean;
  v_form text;
  v_preamble text;
begin
  if p_text is null then
    return 'none';
  end if;
  -- One line of lower-case text: one pass over the message. Everything after is read from its
  -- first 300 characters (a request opens the message, after at most a short preamble) and its
  -- last few, so the cost is linear in the length of the message and small under the workspace
  -- lock however long it is (64,000 bytes of "please please ..." included).
  t := lower(btrim(regexp_replace(p_text, '[\s\u3000]+', ' ', 'g')));
  if t = '' then
    return 'none';
  end if;
  v_head := translate(left(t, 300), '’', '''');
  v_question := right(t, 8) ~ '([?？]|(吗|嘛|么)[。.!！~～ ]*)$';

  -- Quoted history, code or tool output: the request is not the user's own words.
  if v_head ~ '^[>"''“”‘„«»「」『』`{\[<|]' then
    return 'quoted';
  end if;
  -- Reported speech: someone else's words.
  if v_head ~ '^(he|she|they|someone|somebody|people|[a-z]+|my [a-z]+) (said|says|told|wrote|asked|mentioned)\M'
     or v_head ~ '^(他|她|他们|她们|有人|别人|老板|同事|经理|朋友|我)(刚才|之前|以前)?(说|说过|讲过|告诉我|让我|跟我说)' then
    return 'quoted';
  end if;
  -- Questions about the feature or anything else.
  if v_head ~ '^(what|how|why|when|where|who|which|explain|tell me (about|what|how|why))\M'
     or v_head ~ '^(什么|怎么|如何|为什么|为啥|啥是)' then
    return 'question';
  end if;

  v_form := memory_private.request_clause_form(v_head, v_question);
  if v_form = 'none' then
    -- A request may open the second sentence, after one short preamble ("Great meeting.
    -- Remember that ..."), unless the preamble quotes something.
    v_preamble := substring(v_head from '^[^"“”‘’「」『』`>]{1,60}?(?:[.!] |[。！])');
    if v_preamble is not null then
      v_form := memory_private.request_clause_form(substr(v_head, char_length(v_preamble) + 1),
                                                   v_question);
    end if;
  end if;
  return v_form;
end
$$;
comment on function memory_private.request_form(text) is
  'What a human message directly asks of the memory: remember, forget, enable-memory, '
  'disable-memory; or why it does not: quoted (quoted history, code, tool output, reported '
  'speech), question (about the feature or anything else; a polite request question is a '
  'request), negative ("don''t remember"), empty (remember with nothing to remember) or none. '
  'English and Chinese; the request phrase opens the message, after politeness and thanks '
  '("please", "thanks!", "请", "对了", "@bot"), or opens its second sentence after one short '
  'preamble. Linear in the length of the message: it reads the first 300 characters and the '
  'last few.';

create function memory_private.classify_request(p_text text) returns text
  language sql immutable
  as $$
  select case when f in ('remember', 'forget', 'enable-memory', 'disable-memory') then f end
    from memory_private.request_form(p_text) as f
$$;
comment on function memory_private.classify_request(text) is
  'The manage_memory action a human message directly requests, or NULL when it requests none.';

