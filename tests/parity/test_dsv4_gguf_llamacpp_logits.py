"""ds4d against llama.cpp itself, position by position, on the DeepSeek-V4 GGUF fixtures.

Runs when llama-cpp-python is installed (the ``bench`` extra; built from source, it vendors the
llama.cpp tree the fixtures were made with).  Both score the same token ids (ds4d's tokenizer of
the file, no BOS): llama.cpp's logits of every position (``logits_all``) against ds4d's float32
forward on the file's weights as the gguf package dequantises them (tests/unit/test_dsv4_gguf.py
pins that forward to the checkpoint's).  llama.cpp's CPU dot products round the activations to
the weights' dot-product type (Q8_0 for the K- and IQ-quants, bf16 for BF16) and sum in other
orders, so the two differ by that rounding, not by a formula.  Per position, the largest |logit
difference| over the largest |logit|: a noise floor of 1-2% at every position (the fixtures' logits
are small, max about 3), and at a few isolated positions 0.1-0.4, where the rounding flips a discrete
pick (a routed expert, an indexer entry) -- the next position is back at the floor.  Measured on a
2-core x86 VM (llama-cpp-python 0.3.36 built with AVX2, 96 tokens), median / max / same next token:
BF16 0.0096 / 0.029 / 1.000, the converter's Q8_0 0.016 / 0.26 / 0.990, Q6_K 0.019 / 0.17 / 0.958,
Q4_K_M 0.019 / 0.036 / 0.969, Q2_K 0.019 / 0.39 / 0.990, IQ4_XS 0.019 / 0.10 / 0.979, IQ2_XXS
0.018 / 0.041 / 0.958.  Held to: median below 0.03, at most 4 of 96 positions above 0.1, none above
0.6, the same next token at 90% of the positions or more.  The logits of the wrong position (ds4d's
shifted by one against llama.cpp's, BF16) differ by a median of 1.35.
"""

from __future__ import annotations

import pytest
import torch

from ds4d.models.deepseek_v4.gguf_loader import load_gguf_model
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENS = 96
TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 20
FILES = ["bf16.gguf", "converted.gguf", "quant-Q6_K.gguf", "quant-Q4_K_M.gguf", "quant-Q2_K.gguf",
         "quant-IQ4_XS.gguf", "quant-IQ2_XXS.gguf"]


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=2 * TOKENS, n_batch=TOKENS, n_threads=2,
                            logits_all=True, verbose=False)
    try:
        model.eval(ids)
        return torch.tensor(model.scores[: len(ids)], dtype=torch.float32)
    finally:
        model.close()


@pytest.mark.parametrize("file", FILES)
def test_every_position_agrees_with_llama_cpp(file):
    ours_model = load_gguf_model(FIXTURES / file)
    ids = ours_model.tokenizer.encode(TEXT)[:TOKENS]
    assert len(ids) == TOKENS
    ours = ours_model.logits_for(ids).float()
    theirs = llama_cpp_logits(FIXTURES / file, ids)
    assert theirs.shape == ours.shape
    per_position = (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)
    print(f"{file}: per position max |diff| / max |logit|: median {per_position.median():.2e}, "
          f"max {per_position.max():.2e}; same argmax at {(ours.argmax(-1) == theirs.argmax(-1)).float().mean():.3f}")
    assert float(per_position.median()) < 0.03
    assert int((per_position > 0.1).sum()) <= 4 and float(per_position.max()) < 0.6
    assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.9
