"""The sharded DeepSeek-V4 forward (expert parallel, layer split, 2 x 2) equals the single-process one.

Each layout runs as real processes over gloo: a spawned rank-0 process calls
``build_parallel_model`` (which starts the other ranks, exactly as the daemon
would) and plays one scenario through the :class:`~ds4d.contracts.Model`
contract: a whole prompt, the same prompt in chunks batched with a second
sequence, 16 greedy decode steps of both, and a state snapshot continued in
another slot from exported and re-imported copies of the sequence's KV blocks.  The single-process model plays the same scenario here; logits
must agree to float rounding and every greedy token must be the same.  The 2 x 2
grid runs the GPU arithmetic (``fast_path``: grouped experts with the tokens of
other ranks masked out, batched decode attention) against the reference path.
With native weights (FP8 linears and MXFP4 experts as stored, the Triton
kernels run in the interpreter) the split model is held to the same bounds
against the decoded single-process model: decoding is exact, so only the
order of float32 sums differs.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ds4d.contracts import ForwardBatch, Model, SeqChunk
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint

DECODE_STEPS = 16
COLUMNS = 8192  # vocabulary columns of prompt logits compared (all columns of decode logits)
RELATIVE_TOLERANCE = 1e-4  # of the largest |logit|
PROCESS_TIMEOUT_S = 150


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Driver:
    """Hands out state slots and block ids the way the engine's block manager does."""

    def __init__(self, model: Model, num_blocks: int = 16, max_seqs: int = 4) -> None:
        self.model = model
        model.allocate_cache(num_blocks, max_seqs)
        self.block_size = model.info.block_size_tokens
        self.free_blocks = list(range(num_blocks))
        random.Random(7).shuffle(self.free_blocks)
        self.free_slots = list(range(max_seqs))
        self.seqs: dict[str, dict] = {}

    def start(self, name: str, length: int = 0, blocks: list[int] | None = None) -> int:
        self.seqs[name] = {"slot": self.free_slots.pop(), "blocks": list(blocks or []), "length": length}
        return self.seqs[name]["slot"]

    def step(self, work: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        chunks = []
        for name, tokens, want in work:
            seq = self.seqs[name]
            end = seq["length"] + len(tokens)
            while len(seq["blocks"]) < -(-end // self.block_size):
                seq["blocks"].append(self.free_blocks.pop())
            chunks.append(SeqChunk(seq["slot"], tuple(tokens), seq["length"], tuple(seq["blocks"]), want))
            seq["length"] = end
        logits = self.model.forward(ForwardBatch(tuple(chunks)))
        assert logits.dtype == torch.float32
        return list(logits.split([want for _, _, want in work]))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 120000) for _ in range(length)]


def scenario(model: Model) -> dict[str, torch.Tensor]:
    columns = torch.randperm(model.info.vocab_size, generator=torch.Generator().manual_seed(0))[:COLUMNS]
    prompt, other = _prompt(200, 1), _prompt(37, 2)
    driver = Driver(model)
    out: dict[str, torch.Tensor] = {}

    driver.start("whole")
    (whole,) = driver.step([("whole", prompt, len(prompt))])
    out["whole"], out["whole_argmax"] = whole[:, columns], whole.argmax(-1)

    # chunked prefill of the same prompt, sharing steps with a second sequence's prefill
    driver.start("b")
    driver.start("c")
    pieces = []
    for begin, end in ((0, 64), (64, 128), (128, 200)):
        work = [("b", prompt[begin:end], end - begin)]
        if begin == 64:
            work.append(("c", other, 1))
        got = driver.step(work)
        pieces.append(got[0])
        if begin == 64:
            last_c = got[1]
    chunked = torch.cat(pieces)
    out["chunked"], out["chunked_argmax"] = chunked[:, columns], chunked.argmax(-1)
    snapshot = model.save_state(driver.seqs["b"]["slot"])
    b_blocks = list(driver.seqs["b"]["blocks"])

    # greedy decode of both together
    tokens = {"b": [int(chunked[-1].argmax())], "c": [int(last_c[-1].argmax())]}
    decoded = {"b": [], "c": []}
    for _ in range(DECODE_STEPS):
        work = [(name, [tokens[name][-1]], 1) for name in ("b", "c")]
        for (name, _, _), logits in zip(work, driver.step(work)):
            decoded[name].append(logits[0])
            tokens[name].append(int(logits[0].argmax()))
    for name in ("b", "c"):
        out[f"decode_{name}"] = torch.stack(decoded[name])
        out[f"tokens_{name}"] = torch.tensor(tokens[name])

    # the snapshot taken after b's prompt continues b in another slot, in other blocks holding copies
    # of b's (exported and imported as the prefix cache's lower tiers do), with the same next tokens
    payloads = model.export_blocks(b_blocks)
    out["payloads"] = torch.stack(payloads).view(getattr(torch, model.info.dtype)).float()
    copies = [driver.free_blocks.pop() for _ in b_blocks]
    model.import_blocks(copies, [bytes(p.numpy()) for p in payloads])  # as the disk tier hands them back
    driver.start("d", length=len(prompt), blocks=copies)
    model.load_state(driver.seqs["d"]["slot"], snapshot)
    (resumed,) = driver.step([("d", tokens["b"][:4], 4)])
    out["resumed"] = resumed
    return out


def short_scenario(model: Model) -> dict[str, torch.Tensor]:
    """A 64-token prompt, then three greedy decode steps (logits of every step)."""
    driver = Driver(model)
    driver.start("a")
    logits = driver.step([("a", _prompt(64, 3), 64)])
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(3):
        logits += driver.step([("a", tokens[-1:], 1)])
        tokens.append(int(logits[-1][-1].argmax()))
    return {"logits": torch.cat(logits).cpu(), "tokens": torch.tensor(tokens)}


def padded_scenario(model: Model) -> dict[str, torch.Tensor]:
    """Three sequences of 1, 2 and 3 blocks decoding together: a bucket of four rows (one of them padding,
    at the scratch slot) and block tables padded with the trash block, as the decode graphs run them."""
    driver = Driver(model)
    tokens: dict[str, list[int]] = {}
    for i, name in enumerate("abc"):
        driver.start(name)
        (prompt_logits,) = driver.step([(name, _prompt((40, 170, 300)[i], 10 + i), 1)])
        tokens[name] = [int(prompt_logits[-1].argmax())]
    logits = []
    for _ in range(4):
        work = [(name, tokens[name][-1:], 1) for name in "abc"]
        for (name, _, _), row in zip(work, driver.step(work)):
            logits.append(row[0])
            tokens[name].append(int(row[0].argmax()))
    return {"logits": torch.stack(logits).cpu(), "tokens": torch.tensor([tokens[name] for name in "abc"])}


def _rank0(
    path: str, ranks, layout: str, fast_path: bool | None, result: str, dtype: str = "float32", native: bool = False,
    offload: bool = False, padded: bool = False,
) -> None:
    """Rank 0 of a sharded model (``ranks``: a number of CPU processes or a list of GPU indices)."""
    from ds4d.models.deepseek_v4.offload import OffloadOptions
    from ds4d.models.deepseek_v4.parallel import build_parallel_model

    torch.set_num_threads(1)
    # offload: no expert kept on the "device"; every used expert is staged in, two at a time
    options = OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy") if offload else None
    model = build_parallel_model(path, ranks, layout, dtype=dtype, threads=1, fast_path=fast_path, native=native,
                                 offload=options, padded_decode=padded)
    try:
        assert isinstance(model, Model)
        if padded:
            out = padded_scenario(model)
            out["buckets"] = torch.tensor(sorted(model.runner.graphs.keys) if model.runner.graphs is not None else [])
            torch.save(out, result)
            return
        if native:  # the kernels run in Triton's interpreter: a short scenario
            out = short_scenario(model)
            out["native"] = torch.tensor(model.info.extra["weights"] == "native")
            torch.save(out, result)
            return
        out = scenario(model)
        # a bad batch is refused on rank 0 and the workers stay in step
        try:
            model.forward(ForwardBatch((SeqChunk(0, (1, 2), 0, (0,)), SeqChunk(0, (3,), 0, (1,)))))
            out["refused"] = torch.tensor(False)
        except ValueError:
            out["refused"] = torch.tensor(True)
        out["native"] = torch.tensor(model.info.extra["weights"] == "native")
        again = model.forward(ForwardBatch((SeqChunk(0, tuple(_prompt(200, 1)[:5]), 0, (0,), 5),)))
        out["after_refusal"] = again
        out = {key: value.cpu() for key, value in out.items()}
        out["parallel"] = torch.tensor(
            [model.info.extra["parallel"]["stages"], model.info.extra["parallel"]["ep_size"]]
        )
        out["pipelined_steps"] = torch.tensor(model.runner.pipelined_steps)
        model.refresh_expert_stats()  # gathered at most once a second between steps otherwise
        out["expert_stats"] = model.expert_stats()
    finally:
        model.close()
    torch.save(out, result)


def run_rank0(
    path, ranks, layout: str, fast_path: bool | None, tmp_path: Path, dtype: str = "float32", native: bool = False,
    offload: bool = False, padded: bool = False,
) -> dict:
    """Play :func:`scenario` on a sharded model whose rank 0 is a spawned process; its results."""
    result = tmp_path / f"result-{layout}-{dtype}.pt"
    process = mp.get_context("spawn").Process(
        target=_rank0, args=(str(path), ranks, layout, fast_path, str(result), dtype, native, offload, padded),
        daemon=False,
    )
    process.start()
    process.join(PROCESS_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"{layout} on {ranks} did not finish in {PROCESS_TIMEOUT_S} s")
    assert process.exitcode == 0 and result.is_file()
    return torch.load(result, weights_only=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5, layers=[0, 4, 128, 4])


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint)
    out = scenario(model)
    out["after_refusal"] = model.logits_for(_prompt(200, 1)[:5])
    return out


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    tolerance = RELATIVE_TOLERANCE * max(1.0, expected.abs().max().item())
    worst = (actual - expected).abs().max().item()
    assert worst <= tolerance, f"{what}: max |diff| {worst:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize(
    ("ranks", "layout", "fast_path", "native"),
    [(2, "ep", False, False), (2, "pp", False, False), (4, "2x2", True, False)],
    ids=["expert-parallel-2", "layer-split-2", "grid-2x2-grouped-decode"],
)
def test_sharded_forward_equals_single_process(checkpoint, reference, tmp_path, ranks, layout, fast_path, native):
    got = run_rank0(checkpoint, ranks, layout, fast_path, tmp_path, native=native)
    assert not bool(got["native"])

    stages, ep = {"ep": (1, ranks), "pp": (ranks, 1), "2x2": (2, 2)}[layout]
    assert got["parallel"].tolist() == [stages, ep]
    # over stages, the 200-token prompt (the only step of two 64-token micro-batches) flows through them cut
    # in two, its logits those of the single process
    assert int(got["pipelined_steps"]) == (1 if stages > 1 else 0)
    for key in ("whole", "chunked", "decode_b", "decode_c", "resumed", "after_refusal", "payloads"):
        _assert_close(got[key], reference[key], key)
    for key in ("whole_argmax", "chunked_argmax", "tokens_b", "tokens_c"):
        assert torch.equal(got[key], reference[key]), key
    assert len(got["tokens_b"]) == DECODE_STEPS + 1
    # the resumed slot reproduces b's first decode steps
    _assert_close(got["resumed"], got["decode_b"][:4], "resumed vs decoded")
    assert bool(got["refused"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the FP8/MXFP4 kernels run on the CPU only in Triton's interpreter")
def test_expert_parallel_with_native_weights(checkpoint, tmp_path):
    """FP8 linears and MXFP4 experts as stored on both ranks (grouped tiles for the prompt, per-row GEMVs
    for decode, in the interpreter) against the single-process model with every weight decoded:
    decoding is exact, so they differ only in the order of float32 sums."""
    got = run_rank0(checkpoint, 2, "ep", True, tmp_path, native=True)
    assert bool(got["native"])
    want = short_scenario(load_model(checkpoint))
    _assert_close(got["logits"], want["logits"], "logits")
    assert torch.equal(got["tokens"], want["tokens"])


@pytest.mark.parametrize("layout", ["ep", "pp"])
def test_sharded_forward_with_expert_offload(checkpoint, reference, tmp_path, layout):
    """Each rank keeps its routed experts in host RAM and stages the used ones onto its device: the same
    scenario, the same logits and greedy tokens as the single process with every expert in place."""
    got = run_rank0(checkpoint, 2, layout, True, tmp_path, offload=True)
    for key in ("whole", "chunked", "decode_b", "decode_c", "resumed", "after_refusal", "payloads"):
        _assert_close(got[key], reference[key], key)
    for key in ("whole_argmax", "chunked_argmax", "tokens_b", "tokens_c"):
        assert torch.equal(got[key], reference[key]), key
    assert int(got["pipelined_steps"]) == (1 if layout == "pp" else 0)
    stats = got["expert_stats"]
    cfg = json.loads((checkpoint / "config.json").read_text())
    layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    assert stats["gpu_experts"] == 0 and stats["ram_experts"] == layers * experts, stats
    assert stats["bytes_copied"] > 0, stats
    # every rank reports its own layers, numbered as in the whole model
    ranks_of_layer = {}
    for row in stats["layers"]:
        ranks_of_layer.setdefault(row["layer"], set()).add(row["rank"])
    assert sorted(ranks_of_layer) == list(range(layers))
    assert all(len(ranks) == (2 if layout == "ep" else 1) for ranks in ranks_of_layer.values()), ranks_of_layer


def test_padded_decode_buckets_equal_single_process(checkpoint, tmp_path):
    """The decode path the CUDA graphs replay (rows padded to a bucket, block tables to a width), run
    eagerly on CPU ranks under ep and pp, against the single-process model."""
    want = padded_scenario(load_model(checkpoint))
    for layout in ("ep", "pp"):
        got = run_rank0(checkpoint, 2, layout, True, tmp_path, padded=True)
        assert got["buckets"].tolist() == [[4, 8]], layout  # 3 rows -> 4, up to 3 blocks -> width 8
        _assert_close(got["logits"], want["logits"], f"{layout} logits")
        assert torch.equal(got["tokens"], want["tokens"]), layout
