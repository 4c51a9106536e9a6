"""A prompt split into 16-token prefill chunks gives the same greedy output as one chunk."""

from __future__ import annotations

import openai

from tests.daemon import Daemon

STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who every morning "
         "walked to the harbour, checked his nets, and told the children stories about the storms he had seen. ")


def test_prefill_chunks_of_16_match_one_chunk(client, model_id):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": STORY * 2 + "Summarise the story in one sentence."}]
    whole = client.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=20)
    assert whole.usage.prompt_tokens > 4 * 16
    small = Daemon("--max-context", "1024", "--prefill-chunk", "16", "--step-tokens", "32", "--threads", "2",
                   "--kv-cache-tokens", "4096")
    try:
        c = openai.OpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0, timeout=120)
        chunked = c.chat.completions.create(model=model_id, messages=messages, temperature=0, max_tokens=20)
    finally:
        small.stop()
    assert chunked.choices[0].message.content == whole.choices[0].message.content
    assert chunked.usage.prompt_tokens == whole.usage.prompt_tokens
