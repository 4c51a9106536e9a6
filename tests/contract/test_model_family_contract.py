"""Contract tests every registered model family must pass (built-in table and entry points).

A family is constructed as ``Factory(ctx, options)``.  ``can_load`` refuses what
is not its checkpoint (nothing there, an empty directory, a text file, another
family's checkpoint) and accepts its own; ``load`` returns a :class:`Model`
whose :class:`ModelInfo` names the family, and which an :class:`OfflineEngine`
serves with greedy output independent of batch composition and prefill chunk
size (exact on the CPU in float32).

Each family needs a tiny checkpoint here (``TINY``): a registered family without
one fails ``test_every_family_has_a_tiny_checkpoint``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ds4d.config import Config
from ds4d.contracts import Model, PluginContext
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, SamplingParams
from ds4d.registry import available

CTX = PluginContext(Config(device="cpu", dtype="float32", threads=1), logging.getLogger("t"))
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llama(into: Path) -> Path:
    from tests.unit.test_llama import write_tiny_llama

    return write_tiny_llama(into / "tiny-llama.gguf")


def _deepseek_v4(into: Path) -> Path:
    from ds4d.models.deepseek_v4 import write_tiny_checkpoint

    return write_tiny_checkpoint(into, seed=5, layers=[0, 4, 128, 4])


def _deepseek_v41(into: Path) -> Path:
    from tests.unit.test_dsv41_serving import checkpoint_dir

    return checkpoint_dir("tiny_a", into / "tiny_a")


TINY: dict[str, Callable[[Path], Path]] = {"llama": _llama, "deepseek_v4": _deepseek_v4,
                                          "deepseek_v41": _deepseek_v41}
"""Family name -> writes a tiny checkpoint of that family under a directory, returns its path."""
REGISTERED = sorted(available("model_family"))


def family(name: str):
    return available("model_family")[name].load()(CTX, {})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {name: TINY[name](tmp_path_factory.mktemp(name)) for name in REGISTERED if name in TINY}


def test_every_family_has_a_tiny_checkpoint():
    assert set(REGISTERED) <= set(TINY), f"no tiny checkpoint here for {sorted(set(REGISTERED) - set(TINY))}"


@pytest.mark.parametrize("name", REGISTERED)
def test_can_load_refuses_what_is_not_its_checkpoint(name, tmp_path):
    fam = family(name)
    assert fam.name == name
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    (tmp_path / "config.json").write_text('{"model_type": "something_else"}')
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "notes.txt", tmp_path):
        assert not fam.can_load(path), path


def test_each_tiny_checkpoint_is_claimed_by_its_family_alone(checkpoints):
    for owner, path in checkpoints.items():
        claimed = [name for name in REGISTERED if family(name).can_load(path)]
        assert claimed == [owner], (owner, claimed)


def prompt(model: Model, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, model.info.vocab_size) for _ in range(length)]


def greedy(model: Model, prompts: dict[str, list[int]], n: int, *, chunk: int, together: bool) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, all submitted at once or each on its own."""
    context = max(map(len, prompts.values())) + n
    engine = OfflineEngine(model, max_num_seqs=len(prompts), context_tokens=context, prefill_chunk=chunk,
                           step_tokens=chunk * len(prompts), prefix_caching=False)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.submit(EngineRequest(rid, tuple(ids), params))
        if not together:
            engine.run_until_idle(10_000)
    engine.run_until_idle(10_000)
    tokens: dict[str, list[int]] = {}
    for o in engine.outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


@pytest.mark.parametrize("name", REGISTERED)
def test_loaded_model_serves_greedy_independent_of_batch_and_chunking(name, checkpoints):
    if name not in checkpoints:
        pytest.fail(f"no tiny checkpoint for {name}")
    model = family(name).load(checkpoints[name])
    info = model.info
    assert isinstance(model, Model)
    assert info.family == name
    assert info.block_size_tokens > 0 and info.cache_bytes_per_block > 0 and info.max_context_tokens > 0
    assert model.tokenizer.vocab_size > 0
    prompts = {"a": prompt(model, 21, 1), "b": prompt(model, 9, 2)}
    solo = greedy(model, prompts, 5, chunk=512, together=False)
    assert {rid: len(t) for rid, t in solo.items()} == {"a": 5, "b": 5}
    assert all(0 <= t < info.vocab_size for t in solo["a"] + solo["b"])
    assert greedy(model, prompts, 5, chunk=4, together=True) == solo
