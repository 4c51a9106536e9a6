"""A tiny DeepSeek-V4 checkpoint in the official format served over HTTP, checked against HF.

The daemon's /v1/completions echo+logprobs must give, for every prompt token, the
log-probability HF transformers' DeepseekV4ForCausalLM assigns on the same weights;
greedy generation through the API must match HF's greedy tokens; chat requests
stream reasoning in thinking mode.
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.daemon import Daemon

pytest.importorskip("transformers")

from ds4d.models.deepseek_v4 import write_tiny_checkpoint  # noqa: E402
from ds4d.models.deepseek_v4.hf_compat import hf_model  # noqa: E402
from ds4d.models.hf_tokenizer import HFTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tinyv4"), layers=[0, 4, 128, 4], seed=5)
    daemon = Daemon("--model", str(path), "--threads", "1", "--kv-cache-tokens", "4096", "--max-num-seqs", "4",
                    "--prefill-chunk", "64")
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield path, client, client.models.list().data[0].id
    finally:
        daemon.stop()


def test_echo_logprobs_match_hf(tiny):
    path, client, model_id = tiny
    torch.manual_seed(0)
    ids = torch.randint(10, 120_000, (150,)).tolist()  # > 128 tokens: crosses an HCA window and two chunks
    resp = client.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    served = resp.choices[0].logprobs.token_logprobs
    assert len(served) == len(ids) and served[0] is None
    reference = hf_model(path)
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert served[1:] == pytest.approx(expected, abs=2e-3, rel=1e-3)


def test_stats_show_the_forward_paths_the_model_was_built_with(tiny):
    """On the CPU the family builds the reference path (exact); /v1/ds4d/stats says so."""
    import json
    import urllib.request

    from ds4d.models.deepseek_v4.paths import ForwardPaths

    _, client, _ = tiny
    url = str(client.base_url).rstrip("/") + "/ds4d/stats"
    with urllib.request.urlopen(url, timeout=30) as resp:
        model = json.load(resp)["model"]
    assert model["forward_paths"] == ForwardPaths.for_device("cpu").as_dict()
    assert model["forward_paths"]["fast_path"] is False and model["engram_storage"] is None
    assert model["decode_graph_fallback"] is None  # no decode graphs on the CPU, so none fell back


def test_greedy_tokens_match_hf(tiny):
    path, client, model_id = tiny
    ids = list(range(1000, 1040))
    resp = client.completions.create(model=model_id, prompt=ids, max_tokens=16, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    served = resp.choices[0].logprobs.tokens
    reference = hf_model(path)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    tokenizer = HFTokenizer(path / "tokenizer.json")
    assert served == [tokenizer.decode([t]) for t in out]


def test_chat_streams_reasoning_in_thinking_mode(tiny):
    _, client, model_id = tiny
    reasoning = content = ""
    for chunk in client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {"thinking": True}}):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
        if chunk.usage:
            assert chunk.usage.completion_tokens == 12
    assert reasoning  # the prompt ends inside <think>: what a random model says first is reasoning
    assert "<think>" not in content and "</think>" not in content


def test_next_user_turn_in_thinking_mode_reuses_the_previous_prompt(tiny):
    """Without tools, thinking mode drops the previous turn's reasoning and renders its ``<think>``
    hand-over as ``</think>``: the next turn still reuses every prompt token before it."""
    _, client, model_id = tiny
    words = " ".join(f"note{i}" for i in range(150))  # over two 128-token blocks
    messages = [{"role": "system", "content": f"Notes: {words}"}, {"role": "user", "content": "Summarise."}]
    salt = {"cache_salt": "volatile-tail"}
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Shorter."}]
    second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0,
                                            extra_body=salt)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
READ = {"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_valid(tiny, stream, choice):
    import json

    _, client, model_id = tiny
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
              tools=[WEATHER, READ], tool_choice=choice, max_tokens=160, temperature=0.8, seed=11)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for t in c.delta.tool_calls or []:
                    slot = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
                    if t.id:
                        slot["id"] = t.id
                    if t.function and t.function.name:
                        slot["name"] = t.function.name
                    if t.function and t.function.arguments:
                        slot["arguments"] += t.function.arguments
        got = list(calls.values())
    else:
        resp = client.chat.completions.create(**kw)
        finish = resp.choices[0].finish_reason
        got = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
               for t in resp.choices[0].message.tool_calls or []]
    assert finish == "tool_calls"
    assert len(got) == 1
    call = got[0]
    assert isinstance(call["id"], str) and call["id"]
    allowed = {"get_weather"} if isinstance(choice, dict) else {"get_weather", "read"}
    assert call["name"] in allowed
    args = json.loads(call["arguments"])
    required = WEATHER if call["name"] == "get_weather" else READ
    assert set(required["function"]["parameters"]["required"]) <= set(args)


def test_tool_choice_for_unknown_function_is_a_400(tiny):
    _, client, model_id = tiny
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], tools=[READ],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_sessions_with_the_same_system_prompt_and_tools_share_it(tiny):
    """A second session (or a subagent) with the same system prompt and tools resumes after
    them: the engine checkpointed the first session's prompt where the chat encoder said they
    end, and the greedy reply equals the one computed cold (under another cache salt)."""
    import logging

    from ds4d.config import Config
    from ds4d.contracts import ChatRenderRequest, PluginContext
    from ds4d.plugins.dsv4_encoder import DeepseekV4ChatEncoder

    path, client, model_id = tiny
    words = " ".join(f"rule{i}" for i in range(160))  # the system prompt spans over two 128-token blocks
    system = {"role": "system", "content": f"You follow these rules: {words}"}
    salt = {"cache_salt": "shared-system", "chat_template_kwargs": {"thinking": False}}

    def ask(question: str, extra: dict):
        messages = [system, {"role": "user", "content": question}]
        return client.chat.completions.create(model=model_id, messages=messages, tools=[READ], max_tokens=6,
                                              temperature=0, extra_body=extra)

    first = ask("Read the README.", salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = ask("List the tests, then stop.", salt)
    encoder = DeepseekV4ChatEncoder(PluginContext(Config(), logging.getLogger("test")), {},
                                    HFTokenizer(path / "tokenizer.json"), None)
    rendered = encoder.render(ChatRenderRequest(messages=(system, {"role": "user", "content": "x"}), tools=(READ,),
                                                thinking=False))
    assert rendered.stable_prefix > 128
    assert second.usage.prompt_tokens_details.cached_tokens == rendered.stable_prefix
    cold = ask("List the tests, then stop.", {**salt, "cache_salt": "shared-system-cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message == cold.choices[0].message
