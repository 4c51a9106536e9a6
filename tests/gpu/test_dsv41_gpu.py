"""DeepSeek-V4.1 on a CUDA GPU against the oracle's goldens (tests/fixtures/dsv41).

The model has no GPU-specific paths yet: this checks that its torch forward runs on the device and
what precision costs there.

* float32 (TF32 off): prompt and decode logits within 1e-4 of the oracle's, relative to the largest
  logit (as on the CPU), and the greedy tokens identical.
* bfloat16 weights and activations: per position, the max |logit diff| over max |logit| has median
  < 3e-2 and maximum < 0.15, and the argmax agrees with the oracle wherever the oracle's top-2 margin
  exceeds 5% of the largest logit (bf16 rounds the FP4/FP8 QAT inputs differently, which can flip
  a top-k pick or a rounding step; those positions move by more than plain bf16 noise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4d.models.deepseek_v41 import DeepseekV41Model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def run(directory: Path, dtype: torch.dtype, golden: dict) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits, then decode logits along the oracle's greedy tokens (teacher-forced), and the
    model's own greedy picks at each step."""
    model = DeepseekV41Model.from_pretrained(directory, dtype=dtype, device="cuda")
    state = model.new_state()
    rows = [model.prefill(state, golden["prompt_ids"].tolist()).float().cpu()]
    for token in golden["greedy_ids"].tolist():
        rows.append(model.decode(state, token).float().cpu()[None])
    logits = torch.cat(rows)
    return logits, logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_float32_on_the_device_matches_the_oracle(name):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    logits, _ = run(FIXTURES / name, torch.float32, golden)
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    assert logits.shape == want.shape
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-4
    picks = logits[golden["prompt_ids"].numel() - 1 :].argmax(-1)[:-1]
    assert picks.tolist() == golden["greedy_ids"].tolist()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_bfloat16_on_the_device_within_its_bound(name):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    logits, picks = run(FIXTURES / name, torch.bfloat16, golden)
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    scale = want.abs().amax(-1)
    per_position = (logits - want).abs().amax(-1) / scale
    assert float(per_position.median()) < 3e-2 and float(per_position.max()) < 0.15, per_position
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
    assert torch.equal(torch.tensor(picks)[decisive], want.argmax(-1)[decisive])
