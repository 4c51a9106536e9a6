"""DeepSeek-V4 forward pass against HF transformers' DeepseekV4ForCausalLM.

Both models run in float32 on the same weights: the tiny official-format
checkpoint decoded by ds4d's loader and handed to HF under its own names.  Two
configs: every layer kind with FP4 experts and a 128-token window, and a
narrower one (2 hyper-connection streams, FP8 experts, an 8-token window, one
hash layer) where the window is much shorter than the compressed history.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.hf_compat import hf_model

pytest.importorskip("transformers")

CONFIGS = {
    "all_kinds": {"layers": [0, 4, 128, 4], "seed": 1},
    "narrow_window": {
        "layers": [128, 4, 0],
        "seed": 2,
        "sliding_window": 8,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 7,
        "num_hash_layers": 1,
        "expert_dtype": None,
        "index_topk": 3,
        "num_attention_heads": 2,
        "o_groups": 2,
    },
}
PROMPT = "The quick brown fox jumps over the lazy dog; DeepSeek-V4 parity check number "


pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    options = dict(CONFIGS[request.param])
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **options)
    return load_model(path), hf_model(path)


def _prompt(model, length: int) -> list[int]:
    ids: list[int] = []
    number = 0
    while len(ids) < length:
        ids += model.tokenizer.encode(f"{PROMPT}{number}. ")
        number += 1
    return ids[:length]


def test_prompt_logits_match_hf(pair):
    ours, reference = pair
    ids = _prompt(ours, 300)  # past two 128-token HCA windows and many CSA top-k picks
    mine = ours.logits_for(ids)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    relative = ((mine - theirs).abs().max() / theirs.abs().max()).item()
    assert relative < 1e-3, relative
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_greedy_32_tokens_match_hf(pair):
    ours, reference = pair
    ids = _prompt(ours, 140)
    with torch.no_grad():
        generated = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = generated[0, len(ids) :].tolist()

    ours.allocate_cache(num_blocks=4, max_seqs=1)
    block = ours.info.block_size_tokens
    sequence = list(ids)
    logits = ours.forward(ForwardBatch((SeqChunk(0, tuple(sequence), 0, (0, 1), 1),)))
    tokens = []
    for _ in range(32):
        token = int(logits[-1].argmax())
        tokens.append(token)
        sequence.append(token)
        blocks = tuple(range(-(-len(sequence) // block)))
        logits = ours.forward(ForwardBatch((SeqChunk(0, (token,), len(sequence) - 1, blocks, 1),)))
    assert tokens == expected
