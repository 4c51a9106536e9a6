"""ChatML encoder: exact text, tools in the system turn, tool calls and results, tokenization."""

from __future__ import annotations

import json
import logging
import types

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ds4d.contracts import ChatRenderRequest, PluginContext
from ds4d.plugins.chatml_encoder import ChatMLEncoder, render_messages

CTX = PluginContext(config=types.SimpleNamespace(), log=logging.getLogger("test.chatml"))

READ_TOOL = {"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {"type": "object", \
"properties": {"path": {"type": "string"}}, "required": ["path"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


class StandInTokenizer:
    """A byte-level tokenizer with no merges plus the ChatML markers as special tokens."""

    def __init__(self, with_markers: bool = True) -> None:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._tok.decoder = decoders.ByteLevel()
        self._tok.add_special_tokens([AddedToken("<s>", special=True)])
        if with_markers:
            self._tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                          AddedToken("<|im_end|>", special=True)])
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = self._tok.token_to_id("<s>")
        self.eos_token_ids = frozenset()

    def encode(self, text, *, add_special_tokens=False):
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens=False):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id):
        return self._tok.id_to_token(token_id)


def test_plain_conversation():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [
                    {"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}]
    assert render_messages(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nTwo parts<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_no_generation_prompt_and_consecutive_user_turns():
    messages = [{"role": "user", "content": "Generate a title."}, {"role": "user", "content": "hello"}]
    assert render_messages(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nGenerate a title.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n")


def test_tools_go_at_the_end_of_the_system_turn():
    text = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
                           [READ_TOOL])
    assert text == (f"<|im_start|>system\nBe brief.\n\n{TOOLS_SECTION}<|im_end|>\n"
                    "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_tools_without_a_system_message_get_their_own_system_turn():
    text = render_messages([{"role": "user", "content": "x"}], [READ_TOOL["function"]])  # a bare function too
    assert text == (f"<|im_start|>system\n{TOOLS_SECTION}<|im_end|>\n"
                    "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_tool_calls_and_results():
    messages = [
        {"role": "user", "content": "Show a.py"},
        {"role": "assistant", "content": "", "reasoning_content": "I should read it.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a.py"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": '{"path":"b/ü.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "call_2", "content": "print(2)"},
        {"role": "assistant", "content": "Done.", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "list", "arguments": ""}}]},
    ]
    assert render_messages(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nShow a.py<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read", "arguments": {"path": "b/ü.py"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\nprint(1)<|im_end|>\n"
        "<|im_start|>tool\nprint(2)<|im_end|>\n"
        "<|im_start|>assistant\nDone.\n"
        '<tool_call>\n{"name": "list", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_replayed_arguments_render_the_same_whatever_their_spacing():
    def turn(arguments):
        return render_messages([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": arguments}}]}])

    assert turn('{"a": 1, "b": [1, 2]}') == turn('{"a":1,"b":[1,2]}') == turn({"a": 1, "b": [1, 2]})
    assert json.loads(turn("not json").split("\n")[2]) == {"name": "f", "arguments": "not json"}


def test_roles_are_mapped_and_unknown_ones_refused():
    assert render_messages([{"role": "developer", "content": "d"}, {"role": "function", "content": "r"}],
                           add_generation_prompt=False) == (
        "<|im_start|>system\nd<|im_end|>\n<|im_start|>tool\nr<|im_end|>\n")
    with pytest.raises(ValueError):
        render_messages([{"role": "narrator", "content": "x"}])


def test_encoder_tokenizes_markers_as_single_tokens():
    tokenizer = StandInTokenizer()
    encoder = ChatMLEncoder(CTX, {}, tokenizer, None)
    assert encoder.name == "chatml"
    request = ChatRenderRequest(messages=({"role": "user", "content": "hé"},))
    rendered = encoder.render(request)
    assert rendered.text == "<|im_start|>user\nhé<|im_end|>\n<|im_start|>assistant\n"
    assert not rendered.ends_in_reasoning
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert rendered.token_ids.count(start) == 2 and rendered.token_ids.count(end) == 1
    assert rendered.token_ids[0] == start
    assert tokenizer.decode(rendered.token_ids) == rendered.text


def test_encoder_options(caplog):
    tokenizer = StandInTokenizer(with_markers=False)
    with caplog.at_level(logging.WARNING, logger="test.chatml"):
        encoder = ChatMLEncoder(CTX, {"default_system": "You are helpful.", "add_bos": True}, tokenizer, None)
    assert "not a token of this vocabulary" in caplog.text
    rendered = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},),
                                                add_generation_prompt=False))
    assert rendered.text == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
    assert rendered.token_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(rendered.token_ids[1:]) == rendered.text


def test_with_the_deepseek_v4_tokenizer():
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer

    tokenizer = deepseek_v4_tokenizer()
    rendered = ChatMLEncoder(CTX, {}, tokenizer, None).render(
        ChatRenderRequest(messages=({"role": "user", "content": "Hi"},), tools=(READ_TOOL,)))
    assert tokenizer.decode(rendered.token_ids) == rendered.text
