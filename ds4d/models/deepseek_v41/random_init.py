"""Random DeepSeek-V4.1 weights of any config, drawn one tensor at a time when asked for.

``load_format = random`` (and ``ds4d bench model --family deepseek_v41``) build a
model of real widths without its checkpoint: :class:`RandomTensors` answers the
questions :class:`~ds4d.models.deepseek_v41.family.CheckpointTensors` answers for
a checkpoint (``{official name: tensor}``, the quantised kinds in ``stored`` as
stored, the others decoded), so the model is built from it exactly as from a
file, layer by layer, its routed experts offloaded as planned.

Every tensor is drawn from its own generator, seeded from the seed and the
tensor's name, so a tensor's values do not depend on the order of the questions
and a second lookup gives the same tensor.  Scales follow the tiny checkpoints:
linears with rows of about ``inputs ** -0.5`` (FP8 values with one e8m0 scale,
FP4 codes with e8m0 scales that put their largest code there), norms near 1,
small biases; Engram tables FP8 with unit scales, in host memory (page-locked
with ``pin``).  The routed experts come in host memory, as a checkpoint hands
them over (the model copies them into its banks or offloads them); everything
else on ``device``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch

from ds4d.models.deepseek_v41.layout import FP4, FP8, SCALE, TEXT, CheckpointLayout, TensorSpec, is_engram_table


class RandomTensors(Mapping):
    """``{official name: tensor}`` of the text model of ``config`` (a V4.1 ``config.json`` as a dict)."""

    def __init__(self, config: Mapping, *, device: str | torch.device = "cpu", seed: int = 0,
                 stored: Iterable[str] = (), pin: bool = False) -> None:
        self.layout = CheckpointLayout(config)
        self.device, self.seed, self.pin = torch.device(device), seed, pin
        self.stored = tuple(stored)
        self._weights: dict[str, TensorSpec] = {}
        self._scales: dict[str, TensorSpec] = {}  # scale name -> its weight's spec, for the weights kept as stored
        self._names: list[str] = []  # each weight, then its scale if it has one here
        for spec in self.layout.select((TEXT,)):
            if spec.quant == SCALE:
                continue
            self._weights[spec.name] = spec
            self._names.append(spec.name)
            if is_engram_table(spec.name) or (spec.is_quantized and spec.quant in self.stored):
                self._scales[spec.scale_name] = spec
                self._names.append(spec.scale_name)

    def table_bytes(self) -> int:
        """Bytes the Engram tables and their scales take as stored."""
        return sum(spec.nbytes + self.layout[spec.scale_name].nbytes
                   for name, spec in self._weights.items() if is_engram_table(name))

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._draw(name)
        return tensor.cpu() if ".ffn.experts." in name else tensor  # as a checkpoint hands them over

    def _draw(self, name: str) -> torch.Tensor:
        if name in self._scales:
            return self._scale(self._scales[name])
        if name not in self._weights:
            raise KeyError(name)
        spec = self._weights[name]
        if is_engram_table(name):
            table = self._randn(spec.shape, name, torch.bfloat16).to(torch.float8_e4m3fn).cpu()
            return table.pin_memory() if self.pin else table
        if spec.quant == FP4 and FP4 in self.stored:
            gen = self._generator(name)
            return torch.randint(-128, 128, spec.shape, generator=gen, device=self.device, dtype=torch.int8)
        if spec.quant == FP8 and FP8 in self.stored:
            return self._randn(spec.shape, name, torch.bfloat16).to(torch.float8_e4m3fn)
        values = self._randn(spec.dense_shape or spec.shape, name, torch.bfloat16)
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            values = 1.0 + 0.1 * values
        elif name.endswith("_scale"):
            values = 1.0 + 0.2 * values
        elif name.endswith(("_base", ".bias")):
            values = 0.1 * values
        elif not name.endswith(("attn_sink", "embed.weight")):
            values = values * values.shape[-1] ** -0.5
        return values

    def _scale(self, weight: TensorSpec) -> torch.Tensor:
        scale = self.layout[weight.scale_name]
        if is_engram_table(weight.name):  # unit scales, beside their table in host memory
            ones = torch.full(scale.shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            return ones.pin_memory() if self.pin else ones
        inputs = weight.dense_shape[1]
        if weight.quant == FP4:  # codes reach 6: a row's weights about 1 / (4 sqrt(inputs))
            exponent = 127 - 2 - round(math.log2(inputs) / 2)
        else:  # e4m3 values of about unit size
            exponent = 127 - round(math.log2(inputs) / 2)
        return torch.full(scale.shape, exponent, dtype=torch.uint8, device=self.device).view(torch.float8_e8m0fnu)

    def _generator(self, name: str) -> torch.Generator:
        # the seed and the name in the low 32 bits: all a CPU generator keeps of its seed
        return torch.Generator(device=self.device).manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))

    def _randn(self, shape, name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator(name), device=self.device, dtype=dtype)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
