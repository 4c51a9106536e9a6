"""Contract of ``ConstrainingToolCallParser.constraint``, for every registered tool parser that has it.

What a parser's constraint lets a model write, that same parser reads: seeded random logits (any
model, random weights included) driven through the constraint's masks give, for ``tool_choice``
"required" or a named function, exactly one call to a declared tool with its required parameters,
ended by end-of-sentence within ``max_tokens``; under "auto" with the markup guard the parser never
meets malformed markup.  A parser without the method cannot force a choice (the server answers 400
``unsupported_tool_choice``, tests/http/test_reliability_admission.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ds4d.contracts import ConstrainingToolCallParser
from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer
from ds4d.plugins.token_table import token_table
from tests.contract.test_parsers_contract import CTX, TOOL_PARSERS

MAX_TOKENS = 120
SEEDS = range(4)
TOOLS = [
    {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"filePath": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["filePath", "limit"]}}},
    {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "background": {"type": "boolean"},
                                         "mode": {"type": "string", "enum": ["fast", "slow"]}},
        "required": ["mode", "background"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CONSTRAINING = [f for f in TOOL_PARSERS if isinstance(f(CTX, {}), ConstrainingToolCallParser)]


@pytest.fixture(scope="module")
def tokenizer():
    tok = deepseek_v4_tokenizer()
    token_table(tok)  # built once for the module
    return tok


def constraint_of(factory, tokenizer, tool_choice, *, guard_markup=False, max_tokens=MAX_TOKENS):
    return factory(CTX, {}).constraint(tokenizer, tools=TOOLS, tool_choice=tool_choice, prompt_ends_in_reasoning=False,
                                       max_tokens=max_tokens, guard_markup=guard_markup)


def drive(tokenizer, constraint, seed: int, steps: int = MAX_TOKENS) -> list[int]:
    """Sample under the masks from seeded random logits, up to end-of-sentence."""
    logits = torch.randn(steps, tokenizer.vocab_size, generator=torch.Generator().manual_seed(seed)).numpy()
    ids: list[int] = []
    for row in logits:
        mask = constraint.allowed_mask(tokenizer.vocab_size)
        allowed = np.ones(tokenizer.vocab_size, bool) if mask is None else mask.numpy()
        assert allowed.any()
        token = int(np.argmax(np.where(allowed, row, -np.inf)))
        constraint.accept(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return ids


def parse(factory, tokenizer, ids: list[int]):
    text = tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids])
    stream = factory(CTX, {}).stream(tools=TOOLS)
    stream.feed(text)
    return stream.finish()[1]


def test_the_dsml_parsers_constrain():
    assert {"dsml", "dsml_v41"} <= {f.name for f in CONSTRAINING}


@pytest.mark.parametrize("factory", CONSTRAINING, ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", "read", "bash"])
def test_a_forced_choice_is_one_valid_call_the_parser_reads(factory, tokenizer, choice):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for seed in SEEDS:
        ids = drive(tokenizer, constraint_of(factory, tokenizer, tool_choice), seed)
        assert len(ids) <= MAX_TOKENS and ids[-1] in tokenizer.eos_token_ids
        result = parse(factory, tokenizer, ids)
        assert result.error is None and result.content == "" and len(result.calls) == 1, result
        call = result.calls[0]
        assert call.name == choice if choice != "required" else call.name in SCHEMAS
        arguments, schema = json.loads(call.arguments), SCHEMAS[call.name]
        assert sorted(arguments) == sorted(schema["required"])
        for key, value in arguments.items():
            kind = schema["properties"][key]["type"]
            assert isinstance(value, {"string": str, "integer": int, "boolean": bool}[kind])
            assert value in schema["properties"][key].get("enum", [value])


@pytest.mark.parametrize("factory", CONSTRAINING, ids=lambda f: f.name)
def test_a_choice_that_cannot_be_met_is_a_value_error(factory, tokenizer):
    with pytest.raises(ValueError):
        constraint_of(factory, tokenizer, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError):
        constraint_of(factory, tokenizer, "required", max_tokens=3)


@pytest.mark.parametrize("factory", CONSTRAINING, ids=lambda f: f.name)
def test_free_choices_are_left_free_without_the_guard(factory, tokenizer):
    for choice in (None, "auto", "none"):
        assert constraint_of(factory, tokenizer, choice) is None


@pytest.mark.parametrize("factory", CONSTRAINING, ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_the_guard_never_lets_malformed_markup_through(factory, tokenizer, choice):
    for seed in SEEDS:
        constraint = constraint_of(factory, tokenizer, choice, guard_markup=True)
        if constraint is None:
            continue  # the parser guards nothing under this choice
        result = parse(factory, tokenizer, drive(tokenizer, constraint, 100 + seed))
        assert result.error is None
        if choice == "none":
            assert result.calls == ()
