"""The Hugging Face ``deepseek_v41`` model as the peer of ``bench model --family deepseek_v41 --oracle DIR``.

The model is not in a transformers release yet: ``DIR`` holds its
``configuration_deepseek_v41.py`` and ``modeling_deepseek_v41.py`` and a
``shims.py`` that makes them run on transformers 5.24 (its ``patch_cache_kwarg``
and the cache-layer fix it applies on import).  The peer is built on the same
random tensors as ds4d's model (official names; ``model.`` in front, ``lm_head``
for ``head``), in the benchmark's dtype, with the parameters the HF loader keeps
in float32 (``_keep_in_fp32_modules_strict``) in float32, and run through its cache
path (a ``DynamicCache``: one prefill, then one token per step), the only path
that computes the reference's arithmetic.  Weights drawn as stored (``--native``)
are handed over decoded, as are the FP8 Engram tables.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


class TokenizerView:
    """What the oracle's compressed-vocabulary builder reads from a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = tokenizer

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def hf_name(name: str) -> str:
    """Official tensor name -> the HF model's parameter name."""
    return "lm_head." + name[len("head."):] if name.startswith("head.") else "model." + name


def import_oracle(directory: str | Path):
    """(modeling module, text config class) from ``directory``, shims applied."""
    directory = Path(directory)
    for file in ("configuration_deepseek_v41.py", "modeling_deepseek_v41.py", "shims.py"):
        if not (directory / file).is_file():
            raise FileNotFoundError(f"--oracle {directory}: no {file} there")
    sys.path.insert(0, str(directory))
    import shims  # noqa: F401  (before any cache is built)
    import modeling_deepseek_v41 as hf
    from configuration_deepseek_v41 import DeepseekV41TextConfig

    shims.patch_cache_kwarg(hf)
    return hf, DeepseekV41TextConfig


def decoded(tensor, name: str, tensors: dict):
    """A float tensor as is; an FP8 weight (32 x 32 scales; an Engram table 1 x 32) or an FP4 expert
    (per-32 scales) decoded with its ``.scale`` from ``tensors``."""
    import torch

    from ds4d.models.deepseek_v4.quant import dequant_fp8_block, dequant_mxfp4

    if tensor.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        return tensor
    scale = tensors[name.removesuffix("weight") + "scale"].to(tensor.device)
    if tensor.dtype != torch.float8_e4m3fn:
        return dequant_mxfp4(tensor, scale)
    return dequant_fp8_block(tensor, scale, (1, 32) if ".engram.embed." in name else (32, 32))


class Oracle:
    """The HF model on ``tensors`` (``{official name: tensor}``, the ones ds4d's model was built from)."""

    def __init__(self, directory, config: dict, tensors: dict, tokenizer, device, dtype) -> None:
        import torch

        hf, text_config = import_oracle(directory)
        self.torch, self.device = torch, device
        fields = dict(config.get("text_config", config))
        fields.pop("model_type", None)
        cfg = text_config(**fields)
        cfg._attn_implementation = "eager"
        keep = tuple(hf.DeepseekV41PreTrainedModel._keep_in_fp32_modules_strict)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = hf.DeepseekV41ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(default)
        wanted = dict(model.named_parameters())
        state, missing = {}, set(wanted)
        for name, tensor in tensors.items():
            target = hf_name(name)
            if target.endswith(".embed.scale"):
                continue  # a table handed over decoded needs no scales
            if target not in wanted:
                raise KeyError(f"the oracle has no parameter {target!r} (for {name!r})")
            kept = any(part in target.split(".") for part in keep) or target.endswith(".gate.bias")
            state[target] = decoded(tensor.to(device=device), name, tensors).to(
                torch.float32 if kept else wanted[target].dtype)
            missing.discard(target)
        for name in [n for n in missing if n.endswith(".gate.bias_vl")]:  # the image tokens' router bias
            state[name] = torch.zeros_like(wanted[name], dtype=torch.float32)
            missing.discard(name)
        missing = {name for name in missing if not name.endswith(".embed.scale")}
        if missing:
            raise KeyError(f"no tensor for the oracle's parameters {sorted(missing)[:5]}")
        shapes = [(n, tuple(v.shape), tuple(wanted[n].shape)) for n, v in state.items() if v.shape != wanted[n].shape]
        if shapes:
            raise ValueError(f"shapes differ from the oracle's: {shapes[:3]}")
        model.load_state_dict(state, strict=False, assign=True)
        model.eval()
        model.model.bind_tokenizer(TokenizerView(tokenizer))
        self.model, self.cfg = model, cfg
        del state

    def _cache(self):
        from transformers.cache_utils import DynamicCache

        self.model.model.engram_hash_state.history = None  # a new sequence: empty n-gram history
        return DynamicCache(config=self.cfg)

    def _run(self, ids, cache):
        ids = self.torch.tensor([ids], device=self.device)
        with self.torch.no_grad():
            return self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]

    def prefill(self, prompt: list[int]) -> tuple[float, object]:
        """(seconds, the last position's float32 logits on the host) of one prefill of ``prompt``."""
        cache = self._cache()
        self._sync()
        start = time.perf_counter()
        logits = self._run(prompt, cache)
        self._sync()
        return time.perf_counter() - start, logits[-1].float().cpu()

    def decode_rate(self, prompt: list[int], steps: int) -> float:
        """Greedy tokens/s of ``steps`` single-token steps after a prefill of ``prompt`` (one warm step
        untimed)."""
        cache = self._cache()
        token = int(self._run(prompt, cache)[-1].argmax())
        token = int(self._run([token], cache)[-1].argmax())
        self._sync()
        start = time.perf_counter()
        for _ in range(steps):
            token = int(self._run([token], cache)[-1].argmax())
        self._sync()
        return steps / (time.perf_counter() - start)

    def _sync(self) -> None:
        if self.torch.device(self.device).type == "cuda":
            self.torch.cuda.synchronize(self.device)
