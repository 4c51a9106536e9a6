"""Every registered chat encoder honours the ChatEncoder contract on the same conversations."""

from __future__ import annotations

import logging
import types

import pytest

from ds4d.contracts import ChatRenderRequest, ModelInfo, PluginContext
from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer
from ds4d.registry import available

CTX = PluginContext(types.SimpleNamespace(thinking_default=True, dtype="float32", device="cpu"), logging.getLogger("t"))
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INFO = ModelInfo(family="t", name="t", vocab_size=129280, max_context_tokens=4096, block_size_tokens=16,
                 cache_bytes_per_block=1, chat_template=CHATML_TEMPLATE)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text", "text": "work"}]}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return deepseek_v4_tokenizer()


@pytest.mark.parametrize("name", sorted(available("chat_encoder")))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_encoder_contract(name, conversation, tokenizer):
    encoder = available("chat_encoder")[name].load()(CTX, {}, tokenizer, INFO)
    messages = CONVERSATIONS[conversation]
    rendered = encoder.render(ChatRenderRequest(messages=tuple(messages)))
    assert rendered.text and rendered.token_ids
    assert list(rendered.token_ids) == tokenizer.encode(rendered.text)
    last = messages[-1]["content"]
    last_text = last if isinstance(last, str) else last[-1]["text"]
    assert last_text in rendered.text
    again = encoder.render(ChatRenderRequest(messages=tuple(messages)))
    assert again == rendered  # deterministic
