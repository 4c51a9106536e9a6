"""``load_format = random``: random weights with the checkpoint's names, shapes and stored formats.

A V4.1 model drawn by :class:`RandomTensors` must be built exactly as one read from
its checkpoint, so the random source hands out the tensors a checkpoint of the
same config.json hands out (``CheckpointTensors``), under the same names, in the
same shapes and, for the kinds kept as stored, the same dtypes; each tensor is
drawn from its own name, so the order of the questions changes nothing.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ds4d.kernel import refuse_unhonoured_knobs
from ds4d.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model
from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
from ds4d.models.deepseek_v41.family import CheckpointTensors
from ds4d.models.deepseek_v41.make_tiny import write_tiny
from ds4d.models.deepseek_v41.random_init import RandomTensors
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from ds4d.registry import PluginError


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny41"))


@pytest.mark.parametrize("stored", [(), ("fp4",), ("fp8", "fp4")])
def test_the_random_tensors_are_the_checkpoints_tensors(official, stored):
    config = json.loads((official / "config.json").read_text())
    checkpoint = OfficialCheckpoint(official, groups=("text",))
    try:
        read = CheckpointTensors(checkpoint, "ram", stored=stored)
        drawn = RandomTensors(config, stored=stored)
        assert list(drawn) == list(read) and len(drawn) == len(read)
        for name in read:
            want, got = read[name], drawn[name]
            assert got.shape == want.shape, name
            if want.dtype not in (torch.float32, torch.bfloat16):  # as stored: e4m3, e8m0, FP4 codes
                assert got.dtype == want.dtype, name
            assert got.is_floating_point() or got.dtype == torch.int8
            assert torch.isfinite(got.float()).all(), name
        engram = [name for name in read if ".engram.embed." in name]
        assert engram and drawn.table_bytes() == sum(read[name].nbytes for name in engram)
    finally:
        checkpoint.shards.close()
    with pytest.raises(KeyError):
        drawn["layers.0.attn.no_such.weight"]


def test_each_tensor_is_drawn_from_its_name(official):
    config = json.loads((official / "config.json").read_text())
    names = list(RandomTensors(config))
    forward = {name: RandomTensors(config, seed=3)[name] for name in names}
    backward = RandomTensors(config, seed=3)
    for name in reversed(names):
        assert torch.equal(backward[name].float(), forward[name].float()), name
    other = RandomTensors(config, seed=4)
    assert not torch.equal(other["head.weight"], forward["head.weight"])


def test_a_model_of_random_weights_runs(official):
    config = json.loads((official / "config.json").read_text())
    cfg = DeepseekV41Config.from_file(official)
    tokenizer, _ = load_tokenizer(official)
    model = DeepseekV41Model.from_tensors(cfg, RandomTensors(config), tokenizer)
    logits = model.prefill(model.new_state(), list(range(5, 5 + 2 * cfg.sliding_window)))
    assert logits.shape == (2 * cfg.sliding_window, cfg.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_random_weights_with_experts_offloaded_give_what_they_give_on_the_device(official):
    """The routed experts come in host memory, as from a checkpoint: an offloaded model (most experts in
    RAM) built from them gives the logits of the same random weights with every expert in its banks."""
    from ds4d.models.deepseek_v4.offload import OffloadOptions

    config = json.loads((official / "config.json").read_text())
    cfg = DeepseekV41Config.from_file(official)
    tokenizer, _ = load_tokenizer(official)
    drawn = RandomTensors(config, seed=2)
    assert all(drawn[name].device.type == "cpu" for name in drawn if ".ffn.experts." in name)
    plain = DeepseekV41Model.from_tensors(cfg, drawn, tokenizer)
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    offloaded = DeepseekV41Model.from_tensors(cfg, drawn, tokenizer, offload=OffloadOptions(
        vram_bytes=(2 + 4) * expert, stage_experts=2, pin_threads=0))
    assert offloaded.expert_offload is not None and offloaded.expert_offload.expert_stats()["ram_experts"] > 0
    ids = list(range(7, 7 + cfg.sliding_window + 3))
    want = plain.prefill(plain.new_state(), ids)
    got = offloaded.prefill(offloaded.new_state(), ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_a_family_that_cannot_draw_random_weights_refuses_them():
    config = SimpleNamespace(expert_vram_gib=0, gpus="", load_format="random")
    with pytest.raises(PluginError, match="load_format=random: the plain model family cannot"):
        refuse_unhonoured_knobs(SimpleNamespace(name="plain"), config)
    refuse_unhonoured_knobs(SimpleNamespace(name="v41", random_formats=("random",)), config)
    with pytest.raises(PluginError, match="load_format=random-q2: the v41 model family cannot"):
        refuse_unhonoured_knobs(SimpleNamespace(name="v41", random_formats=("random",)),
                                SimpleNamespace(**{**vars(config), "load_format": "random-q2"}))
    refuse_unhonoured_knobs(SimpleNamespace(name="plain"), SimpleNamespace(**{**vars(config), "load_format": "auto"}))


def test_random_weights_are_refused_where_they_cannot_be_drawn(official, tmp_path):
    """V4: not the GGUF blocks of random-q2 for a model split over gpus (random is: each rank draws its own
    tensors, tests/http/test_load_format_random.py), not for a GGUF file; V4.1: not when its Engram tables
    would not fit in host memory (random tables cannot be memory-mapped)."""
    import logging

    from ds4d.config import Config
    from ds4d.contracts import PluginContext
    from ds4d.models.deepseek_v4.family import DeepseekV4Family
    from ds4d.models.deepseek_v41.family import load_model

    log = logging.getLogger("test")
    split = DeepseekV4Family(PluginContext(Config(load_format="random-q2", gpus="cpu:2"), log))
    with pytest.raises(PluginError, match="GGUF blocks are not split over processes yet"):
        split.load(tmp_path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PluginError, match="not for a GGUF file"):
        DeepseekV4Family(PluginContext(Config(load_format="random"), log)).load(gguf)
    with pytest.raises(PluginError, match="draws the Engram tables into host memory"):
        load_model(official, load_format="random", available_bytes=0)
    with pytest.raises(PluginError, match="or engram_storage is mmap"):
        load_model(official, load_format="random", engram_storage="mmap")
