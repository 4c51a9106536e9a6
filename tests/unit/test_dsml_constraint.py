"""The forced-tool-call constraint drives random logits to one valid DSML call (real V4 tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ds4d.engine.request import SamplingParams
from ds4d.engine.sampler import Sampler
from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer
from ds4d.plugins.dsml_constraint import build_tool_constraint
from ds4d.plugins.dsml_format import V4_SPELLING, V41_SPELLING
from ds4d.plugins.dsml_tools import parse_completion
from ds4d.plugins.dsv4_encoder import EOS, render_tool_calls
from ds4d.plugins.token_table import token_table

SEEDS = range(20)
MAX_TOKENS = 120
PARTIAL_CLOSE = V4_SPELLING.parameter_close[:-1]

TOOLS = [
    {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {
        "type": "object",
        "properties": {"filePath": {"type": "string"}, "limit": {"type": "integer"}, "offset": {"type": "number"}},
        "required": ["filePath", "limit"]}}},
    {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "background": {"type": "boolean"},
                       "mode": {"type": "string", "enum": ["fast", "slow"]}, "timeout": {"type": "integer"}},
        "required": ["mode", "command", "background"]}}},
    {"type": "function", "function": {"name": "todoread", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "glob", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}, "items": {"type": ["array", "null"]}},
        "required": ["pattern", "items"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer():
    tok = deepseek_v4_tokenizer()
    token_table(tok)  # built once for the module
    return tok


def drive(tokenizer, constraint, seed: int, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Sample with the mask from seeded random logits (argmax of random logits = a uniform draw)."""
    gen = torch.Generator().manual_seed(seed)
    all_logits = torch.randn(max_tokens, tokenizer.vocab_size, generator=gen).numpy()
    ids: list[int] = []
    for logits in all_logits:
        mask = constraint.allowed_mask(tokenizer.vocab_size)
        assert mask.dtype == torch.bool and mask.shape == (tokenizer.vocab_size,)
        allowed = mask.numpy()
        assert allowed.any()
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        constraint.accept(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return ids


def check_call(text: str, thinking: bool, allowed: set[str], spelling=V4_SPELLING) -> dict:
    assert text.endswith(EOS)
    message = parse_completion(text, thinking, spelling)
    assert message["content"] == "" and message["reasoning_content"] == ""
    assert len(message["tool_calls"]) == 1, text
    call = message["tool_calls"][0]["function"]
    assert call["name"] in allowed
    arguments = json.loads(call["arguments"])
    schema = SCHEMAS[call["name"]]
    assert sorted(arguments) == sorted(schema.get("required", []))
    for key, value in arguments.items():
        kind = schema["properties"][key].get("type")
        if kind == "integer":
            assert isinstance(value, int) and not isinstance(value, bool)
        elif kind == "boolean":
            assert isinstance(value, bool)
        elif kind == "string":
            assert isinstance(value, str)
            assert value in schema["properties"][key].get("enum", [value])
        else:
            assert value == []
    return message["tool_calls"][0]["function"]


@pytest.mark.parametrize("seed", SEEDS)
def test_named_function_random_logits(tokenizer, seed):
    thinking = seed % 2 == 0
    choice = {"type": "function", "function": {"name": ("read", "bash")[seed % 3 == 0]}}
    constraint = build_tool_constraint(tokenizer, TOOLS, choice, prompt_ends_in_reasoning=thinking,
                                       max_tokens=MAX_TOKENS)
    ids = drive(tokenizer, constraint, seed)
    assert len(ids) <= MAX_TOKENS and constraint.finished
    text = tokenizer.decode(ids)
    assert text.startswith("</think>\n\n<｜DSML｜tool_calls>" if thinking else "\n\n<｜DSML｜tool_calls>")
    assert check_call(text, thinking, {choice["function"]["name"]})["name"] == choice["function"]["name"]


def test_required_random_logits(tokenizer):
    names = []
    for seed in SEEDS:
        thinking = seed % 2 == 1
        constraint = build_tool_constraint(tokenizer, TOOLS, "required", prompt_ends_in_reasoning=thinking,
                                           max_tokens=MAX_TOKENS)
        ids = drive(tokenizer, constraint, 1000 + seed)
        assert len(ids) <= MAX_TOKENS and constraint.finished
        names.append(check_call(tokenizer.decode(ids), thinking, set(SCHEMAS))["name"])
    assert set(names) == set(SCHEMAS), names  # every tool is reachable


def test_required_random_logits_in_v41_spelling(tokenizer):
    for seed in SEEDS[:6]:
        thinking = seed % 2 == 1
        constraint = build_tool_constraint(tokenizer, TOOLS, "required", prompt_ends_in_reasoning=thinking,
                                           max_tokens=MAX_TOKENS, spelling=V41_SPELLING)
        ids = drive(tokenizer, constraint, 2000 + seed)
        text = tokenizer.decode(ids)
        assert constraint.finished and "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=" in text
        check_call(text, thinking, set(SCHEMAS), V41_SPELLING)


def test_through_the_engine_sampler(tokenizer):
    sampler, max_tokens = Sampler(), 64
    constraint = build_tool_constraint(tokenizer, TOOLS, "required", prompt_ends_in_reasoning=True,
                                       max_tokens=max_tokens)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, constraint=constraint)
    gen = torch.Generator().manual_seed(7)
    ids: list[int] = []
    while not ids or ids[-1] not in tokenizer.eos_token_ids:
        logits = torch.randn(1, tokenizer.vocab_size, generator=gen)
        ids.extend(sampler.sample(logits, [("r", params)])[0])
        assert len(ids) <= max_tokens
    check_call(tokenizer.decode(ids), True, set(SCHEMAS))


def test_a_well_formed_call_is_accepted_token_by_token(tokenizer):
    """The model's own tokenization of a call passes; string values may contain '<' and partial closing tags."""
    value = "if a < b && c </ d: print('</｜DSML｜param')"
    text = "\n\n" + render_tool_calls([("bash", {"command": value, "background": False, "mode": "slow"})]) + EOS
    constraint = build_tool_constraint(tokenizer, TOOLS, "required", prompt_ends_in_reasoning=False)
    for token in tokenizer.encode(text):
        assert constraint.allowed_mask(tokenizer.vocab_size)[token], tokenizer.decode([token])
        constraint.accept(token)
    assert constraint.finished
    assert json.loads(parse_completion(text, False)["tool_calls"][0]["function"]["arguments"])["command"] == value


def test_closing_tag_must_be_followed_by_the_markup(tokenizer):
    choice = {"type": "function", "function": {"name": "read"}}
    constraint = build_tool_constraint(tokenizer, TOOLS, choice, prompt_ends_in_reasoning=False)
    table = token_table(tokenizer)
    opening = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n'
               '<｜DSML｜parameter name="filePath" string="true">')
    for token in tokenizer.encode(opening + "x" + PARTIAL_CLOSE):
        constraint.accept(token)
    mask = constraint.allowed_mask(tokenizer.vocab_size)
    closing = table.by_bytes[b">\n"] + table.by_bytes[b">"]
    garbage = table.starting_with(b">x") + table.starting_with(b"><")
    assert all(mask[t] for t in closing) and not any(mask[t] for t in garbage)
    assert mask[table.by_bytes[b"x"][0]]  # still inside the value: plain text goes on


def test_integers_have_no_leading_zero(tokenizer):
    choice = {"type": "function", "function": {"name": "read"}}
    constraint = build_tool_constraint(tokenizer, TOOLS, choice, prompt_ends_in_reasoning=False)
    table = token_table(tokenizer)
    prefix = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n'
              '<｜DSML｜parameter name="filePath" string="true">'
              'a</｜DSML｜parameter>\n<｜DSML｜parameter name="limit" string="false">')
    for token in tokenizer.encode(prefix):
        constraint.accept(token)
    mask = constraint.allowed_mask(tokenizer.vocab_size)
    assert mask[table.by_bytes[b"0"][0]] and mask[table.by_bytes[b"50"][0]] and not mask[table.by_bytes[b"05"][0]]
    assert not mask[table.by_bytes[b"</"][0]]  # a value needs a digit first
    constraint.accept(table.by_bytes[b"0"][0])
    mask = constraint.allowed_mask(tokenizer.vocab_size)
    assert not mask[table.by_bytes[b"5"][0]] and mask[table.by_bytes[b"</"][0]]


def test_mask_matches_the_model_vocabulary_size(tokenizer):
    constraint = build_tool_constraint(tokenizer, TOOLS, "required", prompt_ends_in_reasoning=False)
    assert constraint.allowed_mask(tokenizer.vocab_size + 128)[tokenizer.vocab_size:].sum() == 0
    assert constraint.allowed_mask(tokenizer.vocab_size + 128).shape == (tokenizer.vocab_size + 128,)


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_no_constraint_unless_forced(tokenizer, choice):
    assert build_tool_constraint(tokenizer, TOOLS, choice, prompt_ends_in_reasoning=False) is None


@pytest.mark.parametrize("tools, choice", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}),
    ([], "required"),
    (TOOLS, "sometimes"),
])
def test_bad_tool_choice_is_a_client_error(tokenizer, tools, choice):
    with pytest.raises(ValueError):
        build_tool_constraint(tokenizer, tools, choice, prompt_ends_in_reasoning=False)


def test_max_tokens_too_small_is_a_client_error(tokenizer):
    with pytest.raises(ValueError, match="too small"):
        build_tool_constraint(tokenizer, TOOLS, {"type": "function", "function": {"name": "read"}},
                              prompt_ends_in_reasoning=False, max_tokens=5)
