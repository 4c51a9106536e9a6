"""``ds4d make-tiny --family deepseek_v4 --gguf q2``: a GGUF file of the weights ``load_format = random-q2``
draws, in llama.cpp's converter layout.  The loader reads it back as the config it was written from, every
tensor holds the drawn bytes (blocks) or values exactly, and the model it loads gives the in-process
random-q2 model's logits."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ds4d.bench.random_v4 import base_config
from ds4d.models.deepseek_v4 import load_model
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.gguf_loader import GGUFSet, load_gguf_model, read_config
from ds4d.models.deepseek_v4.gguf_names import EXPERT_TENSORS, expert_gguf_name, gguf_name
from ds4d.models.deepseek_v4.gguf_writer import STORED_LINEARS
from ds4d.models.deepseek_v4.loader import expected_tensors
from ds4d.models.deepseek_v4.random_init import RandomGgufReader

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYERS = [0, 0, 4, 128]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the file, the config it was written from, a directory holding only that config.json)."""
    root = tmp_path_factory.mktemp("gguf_writer")
    path = root / "random-q2.gguf"
    run = subprocess.run([sys.executable, "-m", "ds4d.cli", "make-tiny", "--family", "deepseek_v4", "--gguf", "q2",
                          "--out", str(path), "--layers", ",".join(map(str, LAYERS)), "--seed", "0"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 layers, compress ratios [0, 0, 4, 128]" in run.stdout
    data = {**base_config(True), "num_hidden_layers": len(LAYERS), "compress_ratios": LAYERS}
    directory = root / "config-only"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(data))
    return path, DeepseekV4Config.from_dict(data), directory


def test_the_metadata_reads_back_as_the_config(written):
    path, cfg, _ = written
    files = GGUFSet(path)
    try:
        back = read_config(files)
        assert back.name == "random-q2"  # the file's name
        assert dataclasses.replace(back, name=cfg.name) == cfg
        assert files.get("general.architecture") == "deepseek4"
    finally:
        files.close()


def test_every_tensor_holds_what_random_q2_draws(written):
    path, cfg, _ = written
    reader = RandomGgufReader(cfg, dtype=torch.float32, device="cpu", recipe="q2", seed=0)
    files = GGUFSet(path)
    try:
        seen = set()
        for reference in expected_tensors(cfg):
            if ".ffn.experts." in reference:
                layer = int(reference.split(".")[1])
                if layer in seen:
                    continue
                seen.add(layer)
                blocks, types = reader.expert_blocks(layer, torch.device("cpu"))
                for which in EXPERT_TENSORS:
                    name = expert_gguf_name(layer, which)
                    assert files.quant_type(name) == types[which]
                    assert torch.equal(files.raw(name), blocks[which]), name
                continue
            name = gguf_name(reference)
            if reference.endswith(".tid2eid"):
                assert files.quant_type(name) == "I32"
                assert torch.equal(files.tensor(name), reader.index(reference)), name
                continue
            linear = reader.stored_linear(reference) if STORED_LINEARS.match(reference) else None
            if linear is not None:
                assert files.quant_type(name) == linear.qtype == "Q8_0"
                assert torch.equal(files.raw(name), linear.raw), name
                continue
            want = reader.tensor(reference)
            assert files.quant_type(name) == ("F32" if want.dim() == 1 else "BF16"), name
            assert torch.equal(files.tensor(name), want), name
        assert {files.quant_type(expert_gguf_name(0, w)) for w in EXPERT_TENSORS} == {"IQ2_XXS", "Q8_0"}
        assert len(files.tensor_names) == len({n for n in files.tensor_names})
    finally:
        files.close()


def test_the_file_gives_the_in_process_random_q2_logits(written):
    """The same weights by two readers: the file's (its tensors decoded by the gguf package) and the random
    reader's (its blocks kept); on the CPU both decode to the same values, so the logits agree to float32
    summation order, with the same greedy tokens."""
    path, _, directory = written
    ids = np.random.default_rng(3).integers(100, 120000, 48).tolist()
    from_file = load_gguf_model(path).logits_for(ids)
    in_process = load_model(directory, load_format="random-q2").logits_for(ids)
    assert from_file.shape == in_process.shape == (48, 129280)
    assert (from_file - in_process).abs().max().item() <= 1e-4 * in_process.abs().max().item()
    assert torch.equal(from_file.argmax(-1), in_process.argmax(-1))
