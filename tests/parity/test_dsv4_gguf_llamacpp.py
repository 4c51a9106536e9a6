"""ds4d against llama.cpp itself on the DeepSeek-V4 GGUF fixtures (tests/fixtures/gguf_v4).

Runs when llama.cpp's ``llama-perplexity`` is on PATH (built from the same vendored tree as the
fixtures: ``cmake --build build --target llama-perplexity``; llama-cpp-python is not needed).
llama.cpp scores one 128-token chunk of a text the way its perplexity tool does (logits of every
position, the negative log-likelihood of the second half's next tokens); ds4d scores the same
tokens from its own tokenizer of the file.  The two perplexities must agree within 1%: llama.cpp's
CPU dot products round the activations to the weights' dot-product type (Q8_0 for the K- and
IQ-quants, bf16 for BF16) and sum in other orders, which moves logits by about a thousandth.
Measured on a 2-core x86 VM (AVX-512 build): bf16 +0.13%, converted (Q8_0) +0.24%, Q4_K_M -0.10%,
Q2_K +0.08%, IQ2_XXS -0.001% (ds4d against llama.cpp).

The fixtures' indexer head is 64 wide because llama.cpp's deepseek4 graph aborts on make-tiny's 32
(see ``make_gguf_v4_fixtures.CHECKPOINT``).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import pytest
import torch

from ds4d.models.deepseek_v4.gguf_loader import load_gguf_model
from tests.parity.make_gguf_v4_fixtures import OUT as FIXTURES

PERPLEXITY = shutil.which("llama-perplexity")
pytestmark = [pytest.mark.skipif(PERPLEXITY is None, reason="llama.cpp's llama-perplexity is not on PATH"),
              pytest.mark.usefixtures("one_torch_thread")]
CONTEXT = 128
TEXT = "The quick brown fox jumps over the lazy dog. " * 200
FILES = ["bf16.gguf", "converted.gguf", "quant-Q4_K_M.gguf", "quant-Q2_K.gguf", "quant-IQ2_XXS.gguf"]


def llama_cpp_perplexity(file: str, text_path) -> float:
    run = subprocess.run([PERPLEXITY, "-m", str(FIXTURES / file), "-f", str(text_path), "-c", str(CONTEXT),
                          "-b", str(CONTEXT), "--chunks", "1", "-t", "2"], check=False, capture_output=True,
                         text=True, errors="replace", timeout=300)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    assert match, (run.stdout + run.stderr)[-2000:]
    return float(match.group(1))


def ds4d_perplexity(file: str) -> float:
    model = load_gguf_model(FIXTURES / file)
    ids = model.tokenizer.encode(TEXT)[:CONTEXT]  # no BOS: the file says add_bos_token false
    logp = torch.log_softmax(model.logits_for(ids).double(), dim=-1)
    nll = [-logp[j, ids[j + 1]].item() for j in range(CONTEXT // 2, CONTEXT - 1)]
    return math.exp(sum(nll) / len(nll))


@pytest.mark.parametrize("file", FILES)
def test_perplexity_agrees_with_llama_cpp(file, tmp_path):
    text_path = tmp_path / "text.txt"
    text_path.write_text(TEXT + "\n")
    ours, theirs = ds4d_perplexity(file), llama_cpp_perplexity(file, text_path)
    assert ours == pytest.approx(theirs, rel=0.01), (ours, theirs)
