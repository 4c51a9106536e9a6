"""Regenerate tests/fixtures/gguf_v4/: tiny DeepSeek-V4 GGUF files written by llama.cpp's converter.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    .venv/bin/python -m tests.parity.make_gguf_v4_fixtures \\
        --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        [--quantize /tmp/sdist/.../build/bin/llama-quantize]

What it writes (every file comes out of the vendored ``convert_hf_to_gguf.py``, run with
that tree's own ``gguf-py``):

* ``converted.gguf``: the tiny checkpoint of :data:`CHECKPOINT` (``write_tiny_checkpoint``,
  the official format) as the converter writes it: its FP8 linears dequantised and stored
  Q8_0, bf16 tensors BF16, f32 tensors F32, MXFP4 experts repacked as MXFP4, the hash
  layers' ``tid2eid`` as I32.
* ``bf16.gguf`` and the split set ``bf16-0000N-of-00003.gguf`` (``--split-max-tensors``):
  the same checkpoint with each FP8 linear stored as the bf16 tensor it decodes to
  (exactly: an e4m3 value times a power of two is a bf16 value), which the converter keeps
  as BF16, so these files hold exactly the weights ds4d decodes from the checkpoint.
* ``vocab-only.gguf.xz``: the converter's ``--vocab-only`` file (the whole V4 vocabulary,
  129,280 ids, BPE merges, token types), xz-compressed.
* with ``--quantize``: ``quant-TYPE.gguf`` for each type of :data:`QUANT_TYPES` that
  ``llama-quantize`` writes from ``bf16.gguf`` (it falls back to another type for rows it
  cannot block, and may refuse a type outright; what it did is in ``MANIFEST.json``).  The IQ2 and
  IQ3 types need an importance matrix: they get a uniform one (:func:`uniform_imatrix`).

The converter needs the tokenizer's 129,280 ids to fit ``vocab_size``, but a 129,280-row
embedding makes tens of MB; so the checkpoint has :data:`VOCAB` rows, the converter is run
on a copy whose config.json says 129,280, and each written file is then copied with its
vocabulary (``tokenizer.ggml.tokens``/``token_type``, the merges among those tokens) cut to
the first :data:`VOCAB` ids.  Tensors, their bytes and every other key stay as written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ds4d.models.deepseek_v4 import write_tiny_checkpoint
from ds4d.models.deepseek_v4.quant import dequant_fp8_block

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "gguf_v4"
VOCAB = 512
CHECKPOINT = {
    "seed": 11,
    "layers": [0, 4, 128],
    "overrides": {"vocab_size": VOCAB, "hidden_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "index_head_dim": 64},
}
"""``write_tiny_checkpoint(dir, seed=..., layers=..., **overrides)``: all three attention kinds,
two hash-routed layers and one score-routed, rows of 256 (K-quant blocks) in most matrices.  The
indexer's head is 64 wide, not make-tiny's 32: llama.cpp's deepseek4 graph (0.3.36) aborts on 32
(``GGML_ASSERT(ggml_nelements(a) == ne0*ne1)`` reshaping the indexer's compressed keys for their
Hadamard rotation) and runs these files at 64."""
QUANT_TYPES = ("Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ3_XXS", "IQ2_XS", "IQ2_XXS")
"""One file per K- and IQ-quant; Q8_0, BF16, F32 and MXFP4 are in the converted files already (F16 is
checked on a rewritten copy in the test)."""
SPLIT_TENSORS = 40


def tiny_checkpoint(directory: Path) -> Path:
    """The source checkpoint (official format: FP8 linears, MXFP4 experts)."""
    return write_tiny_checkpoint(directory, seed=CHECKPOINT["seed"], layers=CHECKPOINT["layers"],
                                 **CHECKPOINT["overrides"])


def bf16_linears(source: Path, out: Path) -> Path:
    """A copy of ``source`` whose FP8 linears are stored as the bf16 tensors they decode to."""
    shutil.copytree(source, out)
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in [n for n in tensors if n.endswith(".scale")]:
            weight = name.removesuffix(".scale") + ".weight"
            if tensors[weight].dtype != torch.float8_e4m3fn:
                continue
            decoded = dequant_fp8_block(tensors[weight], tensors[name], (128, 128))
            assert torch.equal(decoded.to(torch.bfloat16).float(), decoded), weight
            tensors[weight] = decoded.to(torch.bfloat16)
            del tensors[name]
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    present = {n for shard in out.glob("*.safetensors") for n in load_file(str(shard))}
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in present}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def convert(llama_cpp: Path, checkpoint: Path, outfile: Path, *extra: str) -> None:
    """Run the vendored converter on a copy of ``checkpoint`` whose config names the tokenizer's vocabulary."""
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / checkpoint.name
        shutil.copytree(checkpoint, staged)
        config = json.loads((staged / "config.json").read_text())
        config["vocab_size"] = 129280
        (staged / "config.json").write_text(json.dumps(config, indent=2))
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(staged), "--outfile",
                        str(outfile), "--outtype", "bf16", *extra], check=True, env=env,
                       stdout=subprocess.DEVNULL)


def cut_vocabulary(source: Path, out: Path, vocab: int = VOCAB) -> None:
    """Copy GGUF ``source`` to ``out`` with the vocabulary cut to its first ``vocab`` ids."""
    import gguf

    reader = gguf.GGUFReader(source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:  # a split set's later shard: tensors only
        shutil.copyfile(source, out)
        return
    kept = set(tokens.contents()[:vocab])
    writer = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:vocab]
        elif field.name == "tokenizer.ggml.merges":
            value = [m for m in value if (pair := m.split(" ", 1)) and len(pair) == 2
                     and pair[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()


NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XS", "IQ2_XXS")
"""Types llama-quantize writes only with an importance matrix; they get a uniform one (every input
column weighted 1: plain least squares)."""


def uniform_imatrix(source: Path, out: Path) -> Path:
    """An importance matrix in llama.cpp's legacy binary layout with weight 1 for every input column
    of every matrix of ``source`` (per expert for stacked experts)."""
    import struct

    import gguf

    entries = []
    for tensor in gguf.GGUFReader(source).tensors:
        shape = [int(d) for d in tensor.shape.tolist()]  # innermost first
        if len(shape) < 2 or not tensor.name.endswith(".weight"):
            continue
        columns = shape[0] * (shape[2] if len(shape) > 2 else 1)
        entries.append((tensor.name.encode(), columns))
    with out.open("wb") as handle:
        handle.write(struct.pack("<i", len(entries)))
        for name, columns in entries:
            handle.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, columns))
            handle.write(struct.pack(f"<{columns}f", *([1.0] * columns)))
    return out


def quantize(tool: Path, source: Path, out: Path, type_name: str, imatrix: Path | None = None) -> str:
    """Run llama-quantize; returns its log (raises CalledProcessError with the log on failure)."""
    extra = ["--imatrix", str(imatrix)] if imatrix is not None else []
    run = subprocess.run([str(tool), "--allow-requantize", *extra, str(source), str(out), type_name, "1"],
                         check=False, capture_output=True, text=True, errors="replace")
    if run.returncode:
        raise subprocess.CalledProcessError(run.returncode, run.args, run.stdout + run.stderr)
    return run.stdout + run.stderr


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (vendor/llama.cpp)")
    parser.add_argument("--quantize", type=Path, help="a built llama-quantize")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("*.gguf"), *args.out.glob("*.gguf.xz")]:
        old.unlink()
    manifest: dict = {"checkpoint": CHECKPOINT, "vocabulary_cut_to": VOCAB, "files": {}, "refused": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp8 = tiny_checkpoint(tmp / "tiny-v4")
        bf16 = bf16_linears(fp8, tmp / "tiny-v4-bf16")
        written = tmp / "written"
        written.mkdir()
        convert(args.llama_cpp, fp8, written / "converted.gguf")
        convert(args.llama_cpp, bf16, written / "bf16.gguf")
        convert(args.llama_cpp, bf16, written / "bf16.gguf", "--split-max-tensors", str(SPLIT_TENSORS))
        for path in sorted(written.glob("*.gguf")):
            cut_vocabulary(path, args.out / path.name)
        convert(args.llama_cpp, fp8, written / "vocab-only.gguf", "--vocab-only")
        (args.out / "vocab-only.gguf.xz").write_bytes(lzma.compress((written / "vocab-only.gguf").read_bytes(),
                                                                    preset=9))
        if args.quantize is not None:
            imatrix = uniform_imatrix(args.out / "bf16.gguf", tmp / "uniform.imatrix")
            for type_name in QUANT_TYPES:
                out = args.out / f"quant-{type_name}.gguf"
                try:
                    quantize(args.quantize, args.out / "bf16.gguf", out, type_name,
                             imatrix if type_name in NEEDS_IMATRIX else None)
                except subprocess.CalledProcessError as error:
                    manifest["refused"][type_name] = str(error.output).strip().splitlines()[-3:]
                    out.unlink(missing_ok=True)
    for path in sorted(args.out.glob("*.gguf")):
        types = sorted(set(tensor_types(path).values()))
        manifest["files"][path.name] = {"bytes": path.stat().st_size, "tensor_types": types,
                                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['bytes'] / 2**20:.2f} MiB, {', '.join(entry['tensor_types'])}")
    for name, why in manifest["refused"].items():
        print(f"{name}: refused: {why}")


if __name__ == "__main__":
    main()
