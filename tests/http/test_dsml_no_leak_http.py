"""No DSML leaks to the client: tiny DeepSeek-V4 and V4.1 daemons with ``tool_markup_guard`` on,
whose models are pushed into writing DSML, answer 200 seeded sampled requests each (streamed and
not, through the openai SDK) with either plain text free of the ``｜DSML｜`` marker or valid tool
calls only; under ``tool_choice: "none"`` the marker never appears.

The push: the checkpoint's output head is rewritten so that the tokens of the DSML tags (``<``,
``</``, the marker, the tag names, ``>``) get rows of a far larger norm than the rest, so a
random model at temperature 0.3 writes mostly pieces of tags.  Nothing else about the model or
the daemon is changed; the guard alone decides what reaches the client.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4d.models.deepseek_v41.make_tiny import write_tiny
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from ds4d.models.hf_tokenizer import HFTokenizer
from ds4d.plugins.dsml_format import V4_SPELLING, V41_SPELLING
from tests.daemon import Daemon

pytest.importorskip("transformers")

from ds4d.models.deepseek_v4 import write_tiny_checkpoint  # noqa: E402

MARKER = "｜DSML｜"
TOOLS = [
    {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"filePath": {"type": "string"}, "limit": {"enum": [10, 20, 50]}},
        "required": ["filePath"]}}},
    {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "background": {"type": "boolean"},
                                         "mode": {"enum": ["fast", "slow"]}}}}},
]
CHECKS = {"filePath": lambda v: isinstance(v, str), "command": lambda v: isinstance(v, str),
          "limit": lambda v: v in (10, 20, 50) and not isinstance(v, bool), "background": lambda v: isinstance(v, bool),
          "mode": lambda v: v in ("fast", "slow")}
DECLARED = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Look at a.txt and run the tests."}]
AUTO_REQUESTS, NONE_REQUESTS, MAX_TOKENS = 160, 40, 40
PUSH_NORMS = (8.0, 4.0)
"""Head-row norms of ``<`` (and the marker, tied to it), and of the other tag pieces (the rest keep about 0.1)."""
TEMPERATURE = 0.5


def push_towards(checkpoint: Path, norms: dict[int, float], same_as: dict[int, int], seed: int = 0) -> None:
    """Rewrite ``head.weight``: the row of each token in ``norms`` random with about that norm, the rest a
    tenth of theirs; then each ``same_as`` key gets its value's row (the two tokens tie)."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text(encoding="utf-8"))
    shard = checkpoint / index["weight_map"]["head.weight"]
    tensors = load_file(str(shard))
    head = tensors["head.weight"].float() * 0.1
    gen = torch.Generator().manual_seed(seed)
    ids = list(norms)
    scale = torch.tensor([norms[i] for i in ids])[:, None]
    head[ids] = scale * torch.randn(len(ids), head.shape[1], generator=gen) / head.shape[1] ** 0.5
    for token_id, model_id in same_as.items():
        head[token_id] = head[model_id]
    tensors["head.weight"] = head.to(tensors["head.weight"].dtype).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def tag_tokens(tokenizer, spelling) -> tuple[dict[int, float], dict[int, int]]:
    """The tokens of the DSML tags with the head-row norms that push the model to them (``<`` most),
    and the marker tied to ``<``: wherever the model would write ``<`` it may as well write the
    marker, so it keeps trying to open a tag (or to write a stray one)."""
    pieces = ("</", spelling.block, spelling.invoke, spelling.parameter, ">", "\n", spelling.calls_open,
              spelling.calls_close)
    norms = {t: PUSH_NORMS[1] for piece in pieces for t in tokenizer.encode(piece)}
    (less,), (marker,) = tokenizer.encode("<"), tokenizer.encode(MARKER)
    norms[less] = PUSH_NORMS[0]
    return norms, {marker: less}


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def served(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v4":
        path, spelling = write_tiny_checkpoint(out, layers=[0, 4], seed=3), V4_SPELLING
        tokenizer = HFTokenizer(path / "tokenizer.json")
    else:
        path, spelling = write_tiny(out, layers=[0, 2, 1], seed=3, tokenizer="v4"), V41_SPELLING
        tokenizer = load_tokenizer(path)[0]
    push_towards(path, *tag_tokens(tokenizer, spelling))
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "8192", "--max-num-seqs", "4",
                    "--tool-markup-guard")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
        yield request.param, client, client.models.list().data[0].id
    finally:
        daemon.stop()


def ask(client, model_id: str, seed: int, stream: bool, tool_choice: str) -> dict:
    """One sampled request; the reply gathered into {content, reasoning, calls, finish, ids}."""
    body = {"model": model_id, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "seed": seed,
            "extra_body": {"chat_template_kwargs": {"thinking": False}}}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        message = choice.message
        return {"content": message.content or "", "reasoning": getattr(message, "reasoning_content", None) or "",
                "finish": choice.finish_reason, "ids_on_first_delta": True,
                "calls": [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]}
    content, reasoning, finish, calls, first_has_id = [], [], None, {}, True
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for call in delta.tool_calls or ():
            if call.index not in calls:
                first_has_id &= bool(call.id)
                calls[call.index] = [call.id, "", ""]
            if call.function is not None:
                calls[call.index][1] += call.function.name or ""
                calls[call.index][2] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning), "finish": finish,
            "ids_on_first_delta": first_has_id, "calls": [tuple(calls[i]) for i in sorted(calls)]}


def check_reply(reply: dict, tool_choice: str) -> None:
    assert MARKER not in reply["content"] and MARKER not in reply["reasoning"], reply
    if tool_choice == "none" or not reply["calls"]:
        assert not reply["calls"] and reply["finish"] in ("stop", "length"), reply
        return
    assert reply["finish"] == "tool_calls" and reply["ids_on_first_delta"], reply
    assert len({call_id for call_id, _, _ in reply["calls"]}) == len(reply["calls"]), reply
    for call_id, name, arguments in reply["calls"]:
        assert call_id and name in DECLARED, reply
        values = json.loads(arguments)
        assert isinstance(values, dict) and set(values) <= DECLARED[name], reply
        assert all(CHECKS[key](value) for key, value in values.items()), reply


def test_no_dsml_reaches_the_client(served):
    family, client, model_id = served
    jobs = [(seed, seed % 2 == 1, "auto") for seed in range(AUTO_REQUESTS)]
    jobs += [(seed, seed % 2 == 1, "none") for seed in range(AUTO_REQUESTS, AUTO_REQUESTS + NONE_REQUESTS)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda job: (job, ask(client, model_id, *job)), jobs))
    for (seed, stream, tool_choice), reply in replies:
        check_reply(reply, tool_choice)
    auto = [reply for (_, _, choice), reply in replies if choice == "auto"]
    with_calls = sum(bool(reply["calls"]) for reply in auto)
    print(f"{family}: {len(replies)} requests, {with_calls} of {len(auto)} auto replies made tool calls")
    # the push does make the model write DSML: many replies are calls, and some are plain text
    assert AUTO_REQUESTS // 10 <= with_calls < AUTO_REQUESTS, with_calls
