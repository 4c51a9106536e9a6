"""DeepSeek-V4.1's fixed-shape decode step (``decode.py``) against the per-sequence forward.

Two servings over the same weights: one runs its one-token chunks through the
per-sequence reference path, the other through the fixed-shape step
(``decode_graphs = padded``: the step a CUDA graph captures, run eagerly at the
bucket's padded shapes).  As in tests/unit/test_dsv41_paths.py, each decode step
starts from the same states (the reference's, copied over through
``save_state``/``load_state`` and ``export_blocks``/``import_blocks``), since these
random tiny models amplify a rounding difference of a later step into a flipped
FP8 code; each step's logits and the state it writes (window rings, compressor
tails, compressed entries and index keys) are compared.  Three sequences (a
bucket of four rows: one padding row on the scratch slot) at depths where the
window wraps, ratio-2 pairs complete on odd positions, blocks fill and the
index top-k selects among more entries than it keeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v41 import DeepseekV41Model
from ds4d.models.deepseek_v4.decode import pack_rows
from ds4d.models.deepseek_v41.decode import SlotArrays
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.serving import DeepseekV41Serving

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
BLOCK = 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max()
    return float((got - want).abs().max() / scale) if scale > 0 else float((got - want).abs().max())


def servings(name: str | DeepseekV41Model, decode_graphs: str, device: str = "cpu",
             compile_decode: bool = False, reference: DeepseekV41Model | None = None,
             route_kernel: bool | None = None) -> tuple[DeepseekV41Serving, DeepseekV41Serving]:
    """(per-sequence reference, fixed-shape step) servings of one fixture (or of a model's weights and
    expert offload; the reference path over the same weights, or ``reference`` as it is), caches
    allocated.  ``route_kernel``: the fixed step's routing in one launch or not (None: the device's default)."""
    model = name if isinstance(name, DeepseekV41Model) else None
    if reference is None and model is not None:
        reference = DeepseekV41Model(model.cfg, model.weights, model.hasher, device=device, dtype=model.dtype,
                                     paths=ForwardPaths(), expert_offload=model.expert_offload)
    elif reference is None:
        reference = DeepseekV41Model.from_pretrained(FIXTURES / name, device=device, paths=ForwardPaths())
    model = model or reference
    paths = ForwardPaths.for_device(device).replace(decode_graphs=decode_graphs, compile_decode=compile_decode)
    if route_kernel is not None:
        paths = paths.replace(route_kernel=route_kernel)
    fixed = DeepseekV41Model(model.cfg, model.weights, model.hasher, device=device, dtype=model.dtype, paths=paths,
                             expert_offload=model.expert_offload)
    out = tuple(DeepseekV41Serving(model, tokenizer=None, block_tokens=BLOCK) for model in (reference, fixed))
    for serving in out:
        serving.allocate_cache(40, 4)
    return out


def prompt(cfg, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (length,), generator=gen).tolist()


def copy_state(source: DeepseekV41Serving, target: DeepseekV41Serving, slot: int, blocks) -> None:
    target.load_state(slot, source.save_state(slot))
    target.import_blocks(blocks, source.export_blocks(blocks))


def state_error(got: DeepseekV41Serving, want: DeepseekV41Serving, slot: int, blocks) -> float:
    """The largest relative difference between two slots' saved states and their blocks' rows."""
    a, b = want.save_state(slot), got.save_state(slot)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # position, counts, Engram ids
    pairs = list(zip(a[2:], b[2:])) + list(zip(want.export_blocks(blocks), got.export_blocks(blocks)))
    worst = 0.0
    for x, y in pairs:
        assert x.shape == y.shape
        if x.dtype == torch.uint8:  # block payloads: compare as the pool dtype
            x, y = x.view(want.model.dtype), y.view(want.model.dtype)
        if x.numel():
            worst = max(worst, relative_error(y.float().cpu(), x.float().cpu()))
    return worst


def check_fixed_decode(name: str | DeepseekV41Model, decode_graphs: str, device: str = "cpu", steps: int = 12,
                       tolerance: float = 1e-5, compile_decode: bool = False,
                       reference: DeepseekV41Model | None = None,
                       route_kernel: bool | None = None) -> DeepseekV41Serving:
    """Decode steps of three sequences on both servings (:func:`servings`) from the same states; the
    fixed one back."""
    reference, fixed = servings(name, decode_graphs, device, compile_decode, reference, route_kernel)
    cfg = reference.cfg
    window = cfg.sliding_window
    lengths = (3, 2 * window + 1, 6 * BLOCK + 5)
    prompts = [prompt(cfg, n, seed=n) for n in lengths]
    tables = [tuple(range(12 * slot, 12 * slot + 12)) for slot in range(3)]
    nxt = []
    for slot, ids in enumerate(prompts):
        logits = reference.forward(ForwardBatch((SeqChunk(slot, tuple(ids), 0, tables[slot], 1),)))
        copy_state(reference, fixed, slot, tables[slot])
        nxt.append(int(logits[-1].argmax()))
    positions = list(lengths)
    for _ in range(steps):
        batch = ForwardBatch(tuple(SeqChunk(slot, (nxt[slot],), positions[slot], tables[slot], 1) for slot in range(3)))
        want, got = reference.forward(batch), fixed.forward(batch)
        assert got.shape == want.shape == (3, cfg.vocab_size)
        assert relative_error(got.cpu(), want.cpu()) < tolerance
        assert torch.equal(got.argmax(-1).cpu(), want.argmax(-1).cpu())
        for slot in range(3):
            assert state_error(fixed, reference, slot, tables[slot]) < tolerance
            copy_state(reference, fixed, slot, tables[slot])
        nxt = want.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    return fixed


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_fixed_decode_steps_equal_the_per_sequence_forward(name):
    check_fixed_decode(name, "padded")


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_fixed_decode_steps_routed_in_one_launch_equal_the_per_sequence_forward(name):
    """``route_kernel`` in the fixed step (``route_triton``, Triton's interpreter here): each row's experts
    and weights from one launch after the router's product, against the reference path's torch routing."""
    fixed = check_fixed_decode(name, "padded", route_kernel=True)
    assert fixed.model.paths.route_kernel


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_a_prompt_chunk_after_fixed_decode_steps_continues_from_their_state(name):
    """The fixed step updates only the slot's arrays and the pool; the per-sequence forward of the next
    chunk reads its entry counts and compressor tail from there."""
    reference, fixed = servings(name, "padded")
    cfg = reference.cfg
    ids = prompt(cfg, 2 * cfg.sliding_window + 2, seed=5)  # even: the first decode leaves a ratio-2 tail
    table = tuple(range(12))
    for serving in (reference, fixed):
        serving.forward(ForwardBatch((SeqChunk(0, tuple(ids), 0, table, 1),)))
    copy_state(reference, fixed, 0, table)
    position = len(ids)
    for token in (7, 8, 9):
        batch = ForwardBatch((SeqChunk(0, (token,), position, table, 1),))
        want, got = reference.forward(batch), fixed.forward(batch)
        assert relative_error(got, want) < 1e-5
        position += 1
    chunk = ForwardBatch((SeqChunk(0, (11, 12, 13, 14, 15), position, table, 5),))
    want, got = reference.forward(chunk), fixed.forward(chunk)
    assert got.shape == (5, cfg.vocab_size) and relative_error(got, want) < 1e-4
    assert state_error(fixed, reference, 0, table) < 1e-4


def test_padding_rows_use_the_scratch_slot_and_the_trash_block():
    model = DeepseekV41Model.from_pretrained(FIXTURES / "tiny_a")
    arrays = SlotArrays(model, slots=3)
    assert arrays.scratch == 3 and arrays.rings.shape[0] == 4
    packed = pack_rows([(5, 17, 1, (4, 9))], 2, 4, arrays.scratch, trash=40)
    assert packed.tolist() == [[5, 17, 1, 4, 9, 40, 40], [0, 0, 3, 40, 40, 40, 40]]


def test_decode_graphs_takes_off_padded_or_cuda():
    assert ForwardPaths().decode_graphs == "off" and ForwardPaths.for_device("cpu").decode_graphs == "off"
    with pytest.raises(ValueError, match="off, padded or cuda"):
        ForwardPaths(decode_graphs="on")


def test_a_failed_graph_capture_is_recorded_and_the_same_step_runs_eagerly(caplog):
    """``decode_graphs = cuda`` where no graph can be captured (here: no CUDA device; on a GPU, any
    capture error): the failure is logged and kept for ``/v1/ds4d/stats``, the step runs eagerly and
    gives the per-sequence forward's logits, and later steps do not try to capture again."""
    pytest.importorskip("triton")
    from ds4d.cuda import moe_gemv

    if torch.cuda.is_available() or not moe_gemv.available():
        pytest.skip("needs the CPU with Triton's interpreter (the row kernel makes the bucket capturable)")
    reference = DeepseekV41Model.from_pretrained(FIXTURES / "tiny_a", paths=ForwardPaths())
    graphs = DeepseekV41Model(reference.cfg, reference.weights, reference.hasher,
                              paths=ForwardPaths(expert_rows=True, decode_graphs="cuda"))
    servings = [DeepseekV41Serving(model, tokenizer=None, block_tokens=BLOCK) for model in (reference, graphs)]
    ids = prompt(reference.cfg, 20, seed=2)
    table = tuple(range(4))
    outputs = []
    for serving in servings:
        serving.allocate_cache(8, 1)
        assert serving.graph_failure is None
        serving.forward(ForwardBatch((SeqChunk(0, tuple(ids), 0, table, 1),)))
        outputs.append([serving.forward(ForwardBatch((SeqChunk(0, (token,), len(ids) + i, table, 1),)))
                        for i, token in enumerate((5, 6))])
    assert "decode graph capture failed" in caplog.text
    fixed = servings[1]
    assert fixed.graph_failure.startswith("RuntimeError") and len(fixed.graphs) == 0
    assert caplog.text.count("decode graph capture failed") == 1
    for got, want in zip(outputs[1], outputs[0]):
        assert relative_error(got, want) < 1e-5
