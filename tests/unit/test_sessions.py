"""Session memory with the real DeepSeek-V4 tokenizer and chat encoder.

A reply the model produced in a token split the tokenizer would not choose
must still be read back as the model's own ids when the agent sends it again;
a changed reply is reused up to the change; other salts never see a session;
misses name the message where the new prompt diverged.
"""

from __future__ import annotations

import types

import pytest

from ds4d.contracts import ChatRenderRequest, PluginContext
from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer
from ds4d.plugins.dsv4_encoder import DeepseekV4ChatEncoder
from ds4d.server.sessions import SessionMemory

SYSTEM = {"role": "system", "content": "You are a coding agent. Keep answers short."}
USER = {"role": "user", "content": "Name a sorting algorithm."}
REPLY = "Merge sort, which splits the list in halves."


@pytest.fixture(scope="module")
def tok():
    return deepseek_v4_tokenizer()


@pytest.fixture(scope="module")
def encoder(tok):
    import logging

    ctx = PluginContext(types.SimpleNamespace(), logging.getLogger("t"))
    return DeepseekV4ChatEncoder(ctx, {}, tok, None)


def render(encoder, messages):
    return encoder.render(ChatRenderRequest(messages=tuple(messages), thinking=False))


def odd_split(tok, text: str) -> list[int]:
    """``text`` as single-character tokens: decodes to ``text``, differs from ``encode(text)``."""
    ids = [tok.encode(ch)[0] for ch in text]
    assert len(ids) > len(tok.encode(text)) and tok.decode(ids) == text
    return ids


def first_turn(tok, encoder, memory, key=("", "s1")):
    messages = [SYSTEM, USER]
    prompt = render(encoder, messages)
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    output = odd_split(tok, REPLY) + [eos]
    memory.remember(key, "r1", messages, prompt.text, prompt.token_ids, output)
    return messages, prompt, output


def test_replayed_reply_keeps_the_generated_ids(tok, encoder):
    memory = SessionMemory(tok, block_size=128)
    messages, prompt, output = first_turn(tok, encoder, memory)
    second = render(encoder, [*messages, {"role": "assistant", "content": REPLY},
                              {"role": "user", "content": "And its complexity?"}])
    assert second.text.startswith(prompt.text + tok.decode(output))  # the encoder replays the reply verbatim
    assert list(second.token_ids[:len(prompt.token_ids) + len(output)]) != [*prompt.token_ids, *output]

    got = memory.tokenize(("", "s1"), second.text, second.token_ids)
    head = [*prompt.token_ids, *output]
    assert got.reused_tokens == len(head)
    assert list(got.token_ids[:len(head)]) == head
    assert tok.decode(list(got.token_ids)) == second.text
    assert memory.stats()["prompts_continued_total"] == 1


def test_a_changed_reply_is_reused_up_to_the_change(tok, encoder):
    memory = SessionMemory(tok, block_size=128)
    messages, prompt, _output = first_turn(tok, encoder, memory)
    edited = REPLY.replace("halves", "two parts")
    second = render(encoder, [*messages, {"role": "assistant", "content": edited},
                              {"role": "user", "content": "Thanks."}])
    got = memory.tokenize(("", "s1"), second.text, second.token_ids)
    same_chars = REPLY.index("halves")
    assert got.reused_tokens == len(prompt.token_ids) + same_chars  # one generated token per character
    assert tok.decode(list(got.token_ids)) == second.text


def test_sessions_of_other_salts_or_ids_are_not_used(tok, encoder):
    memory = SessionMemory(tok, block_size=128)
    messages, _prompt, _ = first_turn(tok, encoder, memory, key=("key-a\x00", "s1"))
    second = render(encoder, [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "?"}])
    for key in (("key-b\x00", "s1"), ("key-a\x00", "s2"), ("", "s1")):
        got = memory.tokenize(key, second.text, second.token_ids)
        assert got.reused_tokens == 0 and got.token_ids == second.token_ids


def test_session_key_prefers_the_session_header_and_never_keeps_the_salt():
    tenant, session = SessionMemory.key({"x-session-id": "abc", "x-session-affinity": "zzz"}, "sk-secret\x00")
    assert session == "abc" and "secret" not in tenant and len(tenant) == 32
    assert SessionMemory.key({"x-session-affinity": "zzz"}, "") == ("", "zzz")
    assert SessionMemory.key({}, "sk-secret\x00") == (tenant, "")
    assert SessionMemory.key({}, "sk-other\x00")[0] != tenant


def test_saved_sessions_continue_after_a_restart(tok, encoder, tmp_path):
    memory = SessionMemory(tok, block_size=128)
    messages, prompt, output = first_turn(tok, encoder, memory)
    path = tmp_path / "sessions.json"
    assert memory.save(path) == 1 and not (tmp_path / "sessions.tmp").exists()
    restarted = SessionMemory(tok, block_size=128)
    assert restarted.load(path) == 1
    second = render(encoder, [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "?"}])
    got = restarted.tokenize(("", "s1"), second.text, second.token_ids)
    assert got.reused_tokens == len(prompt.token_ids) + len(output)
    path.write_text('{"format": "ds4d-sessions", "version": 1, "sessions": [{"tenant": 1}]}')
    assert SessionMemory(tok, block_size=128).load(path) == 0 and not path.exists()  # damaged: deleted


def test_miss_names_the_changed_message(tok, encoder):
    memory = SessionMemory(tok, block_size=16)
    _messages, prompt, _output = first_turn(tok, encoder, memory)
    previous = memory.last(("", "s1"))
    changed = [SYSTEM, {"role": "user", "content": "Name a search algorithm."},
               {"role": "assistant", "content": REPLY}, {"role": "user", "content": "More?"}]
    new = render(encoder, changed)
    ids = memory.tokenize(("", "s1"), new.text, new.token_ids).token_ids
    offset = next(i for i, (a, b) in enumerate(zip(ids, prompt.token_ids)) if a != b)
    record = memory.explain(("", "s1"), previous, request_id="r2", messages=changed, prompt_ids=ids,
                            cached_tokens=offset // 16 * 16, cache_note="", exact=False)
    assert record is not None
    assert record["message_index"] == 1 and record["role"] == "user"
    assert record["diverged_at_token"] == offset
    assert "sorting" in record["previous_excerpt"] or "sort" in record["previous_excerpt"]
    assert "search" in record["new_excerpt"]
    assert memory.stats()["reuse_misses_total"] == 1 and memory.stats()["recent_misses"][0]["request_id"] == "r2"


def test_full_reuse_is_not_a_miss_and_cache_losses_are_explained(tok, encoder):
    memory = SessionMemory(tok, block_size=16)
    messages, _prompt, _output = first_turn(tok, encoder, memory)
    previous = memory.last(("", "s1"))
    nxt = [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Go on."}]
    new = render(encoder, nxt)
    ids = memory.tokenize(("", "s1"), new.text, new.token_ids).token_ids
    fed = previous.fed_tokens
    assert memory.explain(("", "s1"), previous, request_id="r2", messages=nxt, prompt_ids=ids, cached_tokens=fed,
                          cache_note="", exact=True) is None
    assert memory.explain(("", "s1"), previous, request_id="r2", messages=nxt, prompt_ids=ids,
                          cached_tokens=fed - 15, cache_note="", exact=False) is None  # within one block
    record = memory.explain(("", "s1"), previous, request_id="r3", messages=nxt, prompt_ids=ids, cached_tokens=0,
                            cache_note="block 0 was evicted from the ram tier", exact=True)
    assert record["diverged_at_token"] is None and "evicted" in record["reason"]


def test_a_side_request_of_the_session_is_not_taken_for_the_previous_turn(tok, encoder):
    memory = SessionMemory(tok, block_size=16)
    messages, _prompt, _output = first_turn(tok, encoder, memory)
    title = render(encoder, [{"role": "user", "content": "Write a title for this conversation."}])
    memory.remember(("", "s1"), "title", [{"role": "user", "content": "t"}], title.text, title.token_ids,
                    tok.encode("Sorting"))
    nxt = [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Go on."}]
    new = render(encoder, nxt)
    ids = memory.tokenize(("", "s1"), new.text, new.token_ids).token_ids
    assert memory.last(("", "s1")).request_id == "title"
    assert memory.closest(("", "s1"), ids).request_id == "r1"


@pytest.mark.parametrize("split", ["odd", "plain"])
def test_known_prefix_tokenises_only_the_new_part_and_gives_the_same_ids(tok, encoder, split):
    """The session's ``prefix_finder`` hands the encoder a remembered turn's ids when the new text
    continues it up to an added token (here the end-of-turn marker): the ids equal what tokenising
    the whole text and then :meth:`SessionMemory.tokenize` give, whether the reply was generated in
    the tokenizer's own split or not."""
    memory = SessionMemory(tok, block_size=128)
    messages = [SYSTEM, USER]
    prompt = render(encoder, messages)
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    output = (odd_split(tok, REPLY) if split == "odd" else tok.encode(REPLY)) + [eos]
    memory.remember(("", "s1"), "r1", messages, prompt.text, prompt.token_ids, output)
    follow = [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "And its complexity?"}]

    whole = render(encoder, follow)
    slow = memory.tokenize(("", "s1"), whole.text, whole.token_ids).token_ids
    fast = encoder.render(ChatRenderRequest(messages=tuple(follow), thinking=False,
                                            known_prefix=memory.prefix_finder(("", "s1"))))
    assert fast.text == whole.text and fast.token_ids == slow
    assert fast.prefix_tokens == len(prompt.token_ids) + len(output)
    assert whole.prefix_tokens == 0 and memory.prefix_finder(("", "other"))(whole.text) is None
    # remembering it decodes only the ids after the known part, and still refuses ids that do not
    # decode to the text
    reply = tok.encode("Quadratic at worst.") + [eos]
    known = (fast.prefix_tokens, fast.prefix_chars)
    memory.remember(("", "s1"), "r2", follow, fast.text, fast.token_ids[:-1], reply, known=known)
    assert memory.last(("", "s1")).request_id == "r1"  # a dropped id: not remembered
    memory.remember(("", "s1"), "r2", follow, fast.text, fast.token_ids, reply, known=known)
    assert memory.last(("", "s1")).request_id == "r2"

    edited = [*messages, {"role": "assistant", "content": REPLY.replace("halves", "two parts")},
              {"role": "user", "content": "Thanks."}]  # the text leaves the reply mid-token: no shortcut
    text = render(encoder, edited).text
    assert memory.prefix_finder(("", "s1"))(text) is None


def test_common_prefix_matches_an_id_by_id_scan():
    """Block-wise comparison gives the id-by-id answer: differences before, at and after block edges,
    one sequence a prefix of the other, lists against tuples."""
    import random

    from ds4d.server.sessions import _PREFIX_STEP, _common_prefix

    def scan(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(3 * _PREFIX_STEP + 17)]
    cuts = [0, 1, _PREFIX_STEP - 1, _PREFIX_STEP, _PREFIX_STEP + 1, 2 * _PREFIX_STEP, len(base) - 1]
    for cut in cuts:
        changed = base[:cut] + [base[cut] + 1] + base[cut + 1 :]
        assert _common_prefix(base, changed) == scan(base, changed) == cut
        assert _common_prefix(tuple(changed), base) == cut
        assert _common_prefix(base[:cut], base) == cut  # a prefix of the other
        assert _common_prefix(base, base[:cut]) == cut
    assert _common_prefix(base, list(base)) == len(base)
    assert _common_prefix([], base) == 0


@pytest.mark.parametrize("spelling", ["deepseek_v4", "deepseek_v41"])
def test_a_replayed_tool_call_keeps_its_generated_dsml_ids(tok, spelling):
    """The model's DSML tool call, generated in a split the tokenizer would not choose, comes back
    as the agent's ``tool_calls`` with the tool's result: the next prompt starts with the ids the model
    generated (V4's ``<｜DSML｜function_calls>`` and V4.1's spaced ``<｜DSML｜ calls>`` markup alike)."""
    import logging

    from ds4d.plugins.dsv41_encoder import DeepseekV41ChatEncoder

    ctx = PluginContext(types.SimpleNamespace(), logging.getLogger("t"))
    cls = DeepseekV41ChatEncoder if spelling == "deepseek_v41" else DeepseekV4ChatEncoder
    encoder = cls(ctx, {}, tok, None)
    tools = ({"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"]}}},)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "read", "arguments": '{"path": "src/main.py", "limit": 40}'}}]}
    messages = [SYSTEM, {"role": "user", "content": "Open the main file."}]
    prompt = encoder.render(ChatRenderRequest(messages=tuple(messages), tools=tools, thinking=False))
    with_call = encoder.render(ChatRenderRequest(messages=(*messages, call), tools=tools, thinking=False,
                                                 add_generation_prompt=False))
    assert with_call.text.startswith(prompt.text)
    generated = with_call.text[len(prompt.text):]  # the reply exactly as the encoder replays it
    assert "｜DSML｜" in generated and generated.endswith("<｜end▁of▁sentence｜>")
    body = generated[:-len("<｜end▁of▁sentence｜>")]
    output = [i for ch in body for i in tok.encode(ch)]  # one character at a time
    assert tok.decode(output) == body and output != tok.encode(body)
    output.append(tok.token_to_id("<｜end▁of▁sentence｜>"))
    memory = SessionMemory(tok, block_size=128)
    memory.remember(("", "s1"), "r1", messages, prompt.text, prompt.token_ids, output)
    result = {"role": "tool", "tool_call_id": "call_0", "content": "print('hello')"}
    second = encoder.render(ChatRenderRequest(messages=(*messages, call, result), tools=tools, thinking=False))
    assert second.text.startswith(prompt.text + tok.decode(output))
    got = memory.tokenize(("", "s1"), second.text, second.token_ids)
    head = [*prompt.token_ids, *output]
    assert got.reused_tokens == len(head) and list(got.token_ids[:len(head)]) == head
    assert tok.decode(list(got.token_ids)) == second.text
