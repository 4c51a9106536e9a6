"""`ds4d calibrate`: routing counts of a prompt set seed the hot-expert placement.

The counts must be what the model routed (every prefilled token adds
``num_experts_per_tok`` pairs in every layer; the hash layers' pairs are the
``tid2eid`` rows of the prompt tokens), the offloaded model must route the same
way, and a model loaded with ``expert_calibration`` starts with the most-routed
experts on the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.calibrate import FORMAT, read_counts
from ds4d.models.deepseek_v4.knobs import offload_options

REPO = Path(__file__).resolve().parents[2]
LAYERS = [0, 4, 128, 4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("calib"), seed=3, layers=LAYERS)


@pytest.fixture(scope="module")
def calibrated(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("calib-run")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(item) for item in [
        {"prompt": "def quicksort(xs): return xs if len(xs) < 2 else " * 6},
        {"messages": [{"role": "user", "content": "Explain the borrow checker in two sentences."}]},
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 10},
    ]))
    out = folder / "counts.json"
    done = subprocess.run([sys.executable, "-m", "ds4d.cli", "calibrate", "--model", str(checkpoint), "--threads", "1",
                           "--prompts", str(prompts), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_counts_are_the_routed_pairs(checkpoint, calibrated):
    out, stdout = calibrated
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and data["prompts"] == 3 and "3 prompts" in stdout
    counts = read_counts(out)
    model = load_model(checkpoint)
    cfg = model.cfg
    assert len(counts) == cfg.num_hidden_layers and all(len(row) == cfg.n_routed_experts for row in counts)
    tokens = int(stdout.split(" tokens")[0].split()[-1])
    assert all(sum(row) == tokens * cfg.num_experts_per_tok for row in counts)
    assert data["pairs"] == tokens * cfg.num_experts_per_tok


def test_hash_layer_counts_match_the_token_table(checkpoint):
    from ds4d.models.deepseek_v4.calibrate import routing_counts

    model = load_model(checkpoint)
    ids = list(range(500, 700))
    counts = routing_counts(model, [ids])
    table = model.weights.layers[0].ffn.tid2eid
    expected = Counter(int(e) for t in ids for e in table[t].tolist())
    assert counts[0] == [float(expected.get(e, 0)) for e in range(model.cfg.n_routed_experts)]
    assert model.routing_tally is None  # counting is off again


def test_calibration_seeds_the_device_placement(checkpoint, calibrated):
    out, _ = calibrated
    counts = read_counts(out)
    probe = load_model(checkpoint)
    expert_bytes = 3 * probe.cfg.moe_intermediate_size * probe.cfg.hidden_size * 4
    staging = 2 * 8 * expert_bytes
    config = types.SimpleNamespace(expert_vram_gib=(staging + 6 * expert_bytes) / 2**30, expert_placement="static",
                                   expert_cpu_threads=1, expert_decode_cold="copy", mem_watermark_gib=0,
                                   expert_calibration=str(out))
    model = load_model(checkpoint, offload=offload_options(config, {}))
    hot = model.expert_offload.hot_experts()
    room = sum(map(len, hot))  # what the budget holds next to the staging banks
    assert 0 < room < len(counts) * len(counts[0])
    chosen = sorted((counts[layer][e] for layer, experts in enumerate(hot) for e in experts), reverse=True)
    assert chosen == sorted((c for row in counts for c in row), reverse=True)[:room]
    assert min(chosen) > 0


def test_calibration_of_another_shape_is_refused(checkpoint, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": FORMAT, "counts": [[1.0, 2.0]]}))
    config = types.SimpleNamespace(expert_vram_gib=1.0, expert_placement="static", expert_cpu_threads=1,
                                   expert_decode_cold="copy", mem_watermark_gib=0, expert_calibration=str(bad))
    with pytest.raises(ValueError, match="calibration counts"):
        load_model(checkpoint, offload=offload_options(config, {}))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not an expert calibration file"):
        read_counts(tmp_path / "other.json")
