"""tool_choice auto / none: a tool-call block the model opens is valid markup over the declared tools
(never content), and under "none" no block opens; V4 and V4.1 spellings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer
from ds4d.plugins.dsml_constraint import build_block_guard, build_tool_constraint
from ds4d.plugins.dsml_format import V4_SPELLING, V41_SPELLING
from ds4d.plugins.dsml_tools import parse_completion
from ds4d.plugins.token_table import token_table

SPELLINGS = {"v4": V4_SPELLING, "v41": V41_SPELLING}
EOS = "<｜end▁of▁sentence｜>"
TOOLS = [
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {
        "filePath": {"type": "string"}, "limit": {"type": "integer"}, "offset": {"type": "number"}},
        "required": ["filePath"]}}},
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "description": {"type": "string"}, "background": {"type": "boolean"},
        "mode": {"enum": ["fast", "slow"]}}}}},
    {"type": "function", "function": {"name": "todowrite", "parameters": {"type": "object", "properties": {
        "todos": {"type": "array"}, "note": {}}}}},
]
PROPERTIES = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in TOOLS}
VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "dsv41_encoding.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    tok = deepseek_v4_tokenizer()
    token_table(tok)
    return tok


def feed(guard, tokenizer, text: str) -> int:
    """Feed ``text``'s own tokens, each of which must be allowed; returns how many steps had a mask."""
    masked = 0
    for token in tokenizer.encode(text):
        mask = guard.allowed_mask(tokenizer.vocab_size)
        assert mask is None or bool(mask[token]), repr(tokenizer.decode([token]))
        masked += mask is not None
        guard.accept(token)
    return masked


def sample(guard, tokenizer, seed: int, steps: int) -> list[int]:
    """Random logits under the guard's masks (argmax of random logits = a uniform draw)."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        mask = guard.allowed_mask(tokenizer.vocab_size)
        logits = torch.randn(tokenizer.vocab_size, generator=gen).numpy()
        token = int(np.argmax(logits if mask is None else np.where(mask.numpy(), logits, -np.inf)))
        guard.accept(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return ids


@pytest.mark.parametrize("spelling", SPELLINGS, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_an_opened_block_is_written_as_valid_calls(tokenizer, spelling, seed):
    spelling = SPELLINGS[spelling]
    max_tokens = 160
    guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=spelling, max_tokens=max_tokens)
    head = "Let me look.\n\n" + spelling.calls_open
    feed(guard, tokenizer, head)
    assert guard.in_block
    ids = sample(guard, tokenizer, seed, max_tokens - len(tokenizer.encode(head)))
    text = head + tokenizer.decode(ids)
    assert text.endswith(EOS), "the block closes and the turn ends within max_tokens"
    message = parse_completion(text, False, spelling)
    assert message["content"] == "Let me look." and message["tool_calls"]
    for call in message["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])  # no duplicate names: the parser would refuse
        assert set(arguments) <= PROPERTIES[call["function"]["name"]]
        assert arguments.get("mode", "fast") in ("fast", "slow")
        assert isinstance(arguments.get("background", False), bool)


def test_the_models_own_tokens_of_valid_blocks_are_allowed(tokenizer):
    """The release's completions (V4.1) fed token by token: nothing they write is refused."""
    completions = [c for c in VECTORS["extra"] if "expected_message" in c and "DSML" in c["completion_text"]]
    for case in completions:
        guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=V41_SPELLING, max_tokens=400)
        text = case["completion_text"].split("</think>", 1)[1]
        feed(guard, tokenizer, text)
        assert guard.in_block


@pytest.mark.parametrize("spelling", SPELLINGS, ids=str)
def test_rendered_calls_are_allowed_token_by_token(tokenizer, spelling):
    """What the encoder renders for calls the client declared passes the guard unchanged."""
    spelling = SPELLINGS[spelling]
    calls = [("bash", {"description": "list", "command": "ls -la </x>", "mode": "slow", "background": True}),
             ("todowrite", {"todos": [{"content": "a", "status": "pending"}], "note": 7}),
             ("read", {}), ("read", {"offset": -1.5, "filePath": "/a", "limit": 20})]
    text = "\n\n" + spelling.render_calls(calls) + EOS
    guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=spelling, max_tokens=400)
    feed(guard, tokenizer, text)
    assert guard.in_block
    message = parse_completion(text, False, spelling)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls


@pytest.mark.parametrize("spelling", SPELLINGS, ids=str)
def test_none_never_opens_a_block(tokenizer, spelling):
    spelling = SPELLINGS[spelling]
    opening = spelling.calls_open
    for seed, cut in enumerate(range(1, len(opening))):
        guard = build_block_guard(tokenizer, TOOLS, "none", spelling=spelling)
        if "｜DSML｜" in opening[:cut]:
            with pytest.raises(AssertionError, match="DSML"):
                feed(guard, tokenizer, "Sure.\n\n" + opening[:cut])  # the marker itself is refused
            continue
        feed(guard, tokenizer, "Sure.\n\n" + opening[:cut])
        mask = guard.allowed_mask(tokenizer.vocab_size)
        completing = tokenizer.encode(opening[cut:])
        if len(completing) == 1:
            assert mask is not None and not mask[completing[0]]
        assert opening not in opening[:cut] + tokenizer.decode(sample(guard, tokenizer, seed, 6))
    plain = build_block_guard(tokenizer, TOOLS, "none", spelling=spelling)
    feed(plain, tokenizer, "Plain text, no markup: a < b.")
    banned = np.flatnonzero(~plain.allowed_mask(tokenizer.vocab_size).numpy())
    assert banned.size and all("｜DSML｜" in tokenizer.decode([t]) for t in banned)  # only the marker's tokens


def test_which_requests_get_a_guard(tokenizer):
    assert build_block_guard(tokenizer, (), "auto") is None
    assert build_block_guard(tokenizer, None, None) is None
    assert build_block_guard(tokenizer, TOOLS, "required") is None
    assert build_block_guard(tokenizer, TOOLS, {"type": "function", "function": {"name": "read"}}) is None
    assert build_block_guard(tokenizer, TOOLS, None) is not None
    assert build_block_guard(tokenizer, (), "none") is not None
    assert build_tool_constraint(tokenizer, TOOLS, "auto", prompt_ends_in_reasoning=False) is None


def test_namespaced_v41_tools_are_called_by_their_qualified_names(tokenizer):
    tools = [{"type": "function", "namespace": {"name": "fs", "description": "Files."},
              "function": {"name": "read", "parameters": {"type": "object", "properties": {
                  "filePath": {"type": "string"}}, "required": ["filePath"]}}}]
    text = "\n\n" + V41_SPELLING.render_calls([("fs::read", {"filePath": "/a"})]) + EOS
    guard = build_block_guard(tokenizer, tools, "auto", spelling=V41_SPELLING, max_tokens=100)
    feed(guard, tokenizer, text)
    message = parse_completion(text, False, V41_SPELLING)
    assert message["tool_calls"][0]["function"]["name"] == "read" and message["tool_calls"][0]["namespace"] == "fs"
    for choice in ("required", {"type": "function", "function": {"name": "read"}},
                   {"type": "function", "function": {"name": "fs::read"}}):
        forced = build_tool_constraint(tokenizer, tools, choice, prompt_ends_in_reasoning=False, max_tokens=60,
                                       spelling=V41_SPELLING)
        ids = sample(forced, tokenizer, 0, 60)
        assert '<｜DSML｜ invoke name="fs::read">' in tokenizer.decode(ids)
    v4 = build_tool_constraint(tokenizer, tools, "required", prompt_ends_in_reasoning=False, max_tokens=60)
    assert '<｜DSML｜invoke name="read">' in tokenizer.decode(sample(v4, tokenizer, 0, 60))


def biased_sample(guard, tokenizer, seed: int, steps: int, favoured: list[int]) -> list[int]:
    """Like :func:`sample`, with the ``favoured`` tokens far more likely than the rest."""
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(steps):
        mask = guard.allowed_mask(tokenizer.vocab_size)
        logits = torch.randn(tokenizer.vocab_size, generator=gen).numpy()
        logits[favoured] += 12.0 * torch.rand(len(favoured), generator=gen).numpy()
        token = int(np.argmax(logits if mask is None else np.where(mask.numpy(), logits, -np.inf)))
        guard.accept(token)
        ids.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return ids


@pytest.mark.parametrize("spelling", SPELLINGS, ids=str)
def test_the_marker_appears_only_in_blocks(tokenizer, spelling):
    """A model that keeps writing DSML pieces (the marker, ``<``, ``</``, the tag names) gets either
    plain text without the marker or valid calls; under "none" it never writes the marker."""
    spelling = SPELLINGS[spelling]
    favoured = sorted({t for piece in ("<", "</", "｜DSML｜", spelling.block, spelling.invoke, ">", "\n")
                       for t in tokenizer.encode(piece)})
    opened = 0
    for seed in range(12):
        guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=spelling, max_tokens=80)
        text = tokenizer.decode(biased_sample(guard, tokenizer, seed, 80, favoured))
        message = parse_completion(text, False, spelling)
        assert "｜DSML｜" not in (message["content"] or ""), text
        if "｜DSML｜" in text:
            opened += 1
            assert guard.in_block and message["tool_calls"], text
            for call in message["tool_calls"]:
                assert set(json.loads(call["function"]["arguments"])) <= PROPERTIES[call["function"]["name"]]
        none = build_block_guard(tokenizer, TOOLS, "none", spelling=spelling, max_tokens=80)
        assert "｜DSML｜" not in tokenizer.decode(biased_sample(none, tokenizer, seed, 80, favoured))
    assert opened >= 6  # the bias does open blocks
    unguarded = [parse_completion(tokenizer.decode(biased_sample(_NoGuard(), tokenizer, seed, 80, favoured)), False,
                                  spelling)["content"] or "" for seed in range(12)]
    assert any("｜DSML｜" in content for content in unguarded)  # without the guard the same sampling leaks


class _NoGuard:
    def allowed_mask(self, vocab_size: int) -> None:
        return None

    def accept(self, token_id: int) -> None:
        pass


def test_a_stray_marker_is_refused_and_a_started_tag_must_go_on(tokenizer):
    dsml = tokenizer.token_to_id("｜DSML｜")
    for head, allowed in (("See ", False), ("See </", False), ("See <", True)):
        guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=V41_SPELLING, max_tokens=100)
        feed(guard, tokenizer, head)
        mask = guard.allowed_mask(tokenizer.vocab_size)
        assert (mask is None or bool(mask[dsml])) is allowed, head
    guard.accept(dsml)  # "<｜DSML｜": only " calls>" (in any pieces) may follow
    allowed = np.flatnonzero(guard.allowed_mask(tokenizer.vocab_size).numpy())
    assert allowed.size and all(b" calls>".startswith(tokenizer.decode([t]).encode()) or
                                tokenizer.decode([t]).startswith(" calls>") for t in allowed)
    tight = build_block_guard(tokenizer, TOOLS, "auto", spelling=V41_SPELLING, max_tokens=4)
    feed(tight, tokenizer, "<")
    assert not tight.allowed_mask(tokenizer.vocab_size)[dsml]  # no block fits in what is left


@pytest.mark.parametrize("spelling", SPELLINGS, ids=str)
def test_a_tag_is_started_only_when_it_can_be_finished(tokenizer, spelling):
    """Near the end of the budget the pushed model still never gets a step where every token is
    refused (which would leave a half-written tag in the content)."""
    spelling = SPELLINGS[spelling]
    favoured = sorted({t for piece in ("<", "｜DSML｜", spelling.block, ">") for t in tokenizer.encode(piece)})
    for max_tokens in range(12, 48, 3):
        guard = build_block_guard(tokenizer, TOOLS, "auto", spelling=spelling, max_tokens=max_tokens)
        ids = []
        for step in range(max_tokens):
            mask = guard.allowed_mask(tokenizer.vocab_size)
            assert mask is None or bool(mask.any()), (max_tokens, step, tokenizer.decode(ids))
            gen = torch.Generator().manual_seed(step)
            logits = torch.randn(tokenizer.vocab_size, generator=gen).numpy()
            logits[favoured] += 30.0 * torch.rand(len(favoured), generator=gen).numpy()
            token = int(np.argmax(logits if mask is None else np.where(mask.numpy(), logits, -np.inf)))
            guard.accept(token)
            ids.append(token)
            if token in tokenizer.eos_token_ids:
                break
        message = parse_completion(tokenizer.decode(ids), False, spelling)
        assert "｜DSML｜" not in (message["content"] or ""), tokenizer.decode(ids)
