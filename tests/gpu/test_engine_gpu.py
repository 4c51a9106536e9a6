"""The engine on a CUDA GPU: reading a step's tokens, and decode steps queued ahead.

* A launched step's tokens are copied to the host right behind its draw, so
  reading them does not wait for work queued later on the same stream (what a
  step queued ahead is): checked with a long sleep kernel queued after the
  launch, which must still be running when the tokens are in hand.
* Decode steps queued ahead through the CUDA graphs give the tokens of
  step-by-step decoding (tiny V4, float32, greedy).
"""

from __future__ import annotations

import pytest
import torch

from ds4d.engine.request import EngineRequest, SamplingParams
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from tests.unit.test_cache_dsv4 import engine, step_by_step_and_ahead
from tests.unit.test_dsv4_model import _tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-engine"), seed=5, layers=[0, 4, 128, 4])
    return load_model(path, dtype=torch.float32, device="cuda")


def test_reading_tokens_does_not_wait_for_work_queued_behind_them(model):
    core, _ = engine(model, prefix=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.submit(EngineRequest("r", tuple(_tokens(model, 40, 3)), params))
    core.step()  # the prompt
    core.step()  # a first decode step: graph captured
    launched = core.runner.launch(core.scheduler.plan())
    torch.cuda._sleep(4_000_000_000)  # about 2 s of device time queued behind the step
    results = launched.results()
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "reading the tokens waited for the work queued behind the step"
    assert len(results) == 1 and results[0].token_id is not None
    assert results[0].token_id == int(launched.tokens[0])


def test_steps_queued_ahead_through_the_graphs_give_step_by_step_tokens(model):
    assert model.paths.decode_graphs == "cuda"
    (plain, none_ahead), (ahead, steps_ahead) = step_by_step_and_ahead(model, 12)
    assert none_ahead == 0 and steps_ahead > 0
    assert ahead == plain
