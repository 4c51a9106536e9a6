"""Engram: n-gram table lookups added into the residual streams at a few layers.

Row ids depend on token ids only, so they can be computed (and the table rows
read from host RAM or disk) before layer 0 runs:

1. every token id maps to a *compressed* id: the tokenizer's pieces are decoded
   one by one and normalised (NFKC, accents stripped, lower case, runs of
   whitespace as one space, outer spaces stripped -- a piece that is exactly one
   space stays one space); equal results share an id, in first-seen order.
   Pieces that decode to a broken UTF-8 sequence keep their raw piece string as
   key.  The release tokenizer gives 99,092 ids for its 129,280;
2. at each position, the compressed ids of the token and up to
   ``max_ngram_size - 1`` tokens before it (the pad token's compressed id where
   the sequence has not started yet) are multiplied by per-layer odd
   multipliers (``numpy.random.default_rng(10007 * layer_id)``) and XOR-ed one
   look-back at a time: after ``n`` tokens the value hashes the ``n``-gram;
3. each n-gram size 2..N has ``n_heads`` heads, each with its own prime modulus
   (searched upwards from ``engram_vocab_size``, never reused across sizes and
   layers); the head's rows start after the previous heads' within the layer's
   table.

At the layer, the ``(N - 1) * n_heads`` rows are concatenated and one matmul
(``wkv``) gives a key per residual stream plus one shared value; each stream
adds the value times a sigmoid gate of the signed square root of its scaled
normalised dot product with its key.

Image spans (which stop the look-back and shut the gate in the reference) are
not handled: every token here is text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds4d.models.deepseek_v4.ops import linear
from ds4d.models.deepseek_v41.config import DeepseekV41Config

_GATE_FLOOR = 1e-6


# ---------------------------------------------------------------- compressed vocabulary


def _piece_normalizer():
    from tokenizers import Regex, normalizers

    one_space = "\ue000"  # private use: survives Strip(), then turns back into a space
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), one_space),
        normalizers.Strip(),
        normalizers.Replace(one_space, " "),
    ])


def compressed_vocabulary(tokenizer) -> tuple[list[int], int]:
    """(compressed id of every token id, number of compressed ids) for a ``tokenizers.Tokenizer`` or a
    ds4d :class:`~ds4d.models.hf_tokenizer.HFTokenizer` (anything with ``decode`` and ``id_to_token``)."""
    normalizer = _piece_normalizer()
    ids: dict[str, int] = {}
    lookup = []
    if hasattr(tokenizer, "get_vocab_size"):
        size = tokenizer.get_vocab_size(with_added_tokens=True)
    else:
        size = tokenizer.vocab_size
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(ids.setdefault(key, len(ids)))
    return lookup, len(ids)


# ---------------------------------------------------------------- hash layout


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for every n below 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def bucket_primes(cfg: DeepseekV41Config) -> list[list[list[int]]]:
    """``[engram layer][n-gram size - 2][head]`` prime moduli: each size's heads take the next unused
    primes above ``engram_vocab_size - 1``, in order over layers, sizes and heads."""
    used: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_size = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            heads, candidate = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                candidate += 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            per_size.append(heads)
        out.append(per_size)
    return out


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_size: int) -> torch.Tensor:
    """``[engram layer, look-back]`` odd int64 multipliers, small enough that id * multiplier fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_size) // 2)
    rows = []
    for layer in layer_ids:
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(draws * 2 + 1)
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class EngramHasher:
    """Token ids -> table row ids, for every Engram layer at once."""

    token_map: torch.Tensor
    """``[vocab]`` compressed id of each token id."""
    pad_id: int
    """Compressed id standing in for tokens before the sequence start."""
    multipliers: torch.Tensor
    """``[layers, max_ngram_size]`` int64."""
    primes: torch.Tensor
    """``[layers, max_ngram_size - 1, heads]`` int64."""
    row_offsets: torch.Tensor
    """``[layers, (max_ngram_size - 1) * heads]``: first row of each (size, head) range in its layer's table."""

    @classmethod
    def build(cls, cfg: DeepseekV41Config, token_map: Sequence[int], compressed_size: int) -> EngramHasher:
        if compressed_size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"the tokenizer gives {compressed_size} compressed ids, the config says "
                f"{cfg.engram_compressed_vocab_size}: every Engram row id would be wrong")
        primes = bucket_primes(cfg)
        flat = torch.tensor([[p for size in layer for p in size] for layer in primes], dtype=torch.int64)
        offsets = torch.cumsum(flat, dim=-1) - flat
        token_map_t = torch.tensor(list(token_map), dtype=torch.int64)
        return cls(
            token_map=token_map_t,
            pad_id=int(token_map_t[cfg.engram_pad_id]),
            multipliers=hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size, compressed_size),
            primes=torch.tensor(primes, dtype=torch.int64),
            row_offsets=offsets,
        )

    @classmethod
    def from_tokenizer(cls, cfg: DeepseekV41Config, tokenizer) -> EngramHasher:
        return cls.build(cfg, *compressed_vocabulary(tokenizer))

    @property
    def history(self) -> int:
        """Compressed ids of earlier tokens the next position needs (``max_ngram_size - 1``)."""
        return self.multipliers.shape[1] - 1

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[token_ids.cpu().long()]

    def row_ids(self, earlier: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Row ids ``[S, layers, columns]`` of the ``S`` tokens ``token_ids``, after the compressed ids
        ``earlier`` of the tokens before them (all of them, or at least the last :attr:`history`)."""
        earlier = earlier[-self.history:] if self.history else earlier[:0]
        missing = self.history - earlier.shape[0]
        pad = torch.full((missing,), self.pad_id, dtype=torch.int64)
        ids = torch.cat([pad, earlier.long(), self.compress(token_ids)])
        count = token_ids.shape[0]
        # look-back s of every position: ids[history + i - s]
        grams = torch.stack([ids[self.history - s: self.history - s + count] for s in range(self.history + 1)], -1)
        products = grams.unsqueeze(1) * self.multipliers  # [S, layers, look-back]
        rolling = products[..., 0]
        columns = []
        for size in range(1, self.history + 1):
            rolling = torch.bitwise_xor(rolling, products[..., size])
            columns.append(rolling.unsqueeze(-1) % self.primes[:, size - 1])
        return torch.cat(columns, dim=-1) + self.row_offsets


# ---------------------------------------------------------------- the layer


@dataclass(frozen=True)
class EngramWeights:
    table: torch.Tensor
    """``[rows, head_dim]``: float, or FP8 e4m3 with :attr:`table_scale` (decoded per gathered row)."""
    table_scale: torch.Tensor | None
    """``[rows, head_dim / 32]`` scales of an FP8 table (unused for a float one)."""
    wkv: torch.Tensor
    """``[(hc_mult + 1) * hidden, columns * head_dim]``."""
    gate_weight: torch.Tensor
    """``[hc_mult, hidden]``: the product of the checkpoint's ``q_weight`` and ``k_weight``."""


def gather_rows(weights: EngramWeights, rows: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Table rows ``[..., head_dim]`` for ids ``rows``, as float32 on ``device`` (default: the table's).

    The rows are read where the table lives (host RAM or a memory map), as stored; for another
    device they cross in one copy from page-locked memory (asynchronous, so it overlaps what the
    device is still doing) and an FP8 table's rows are decoded there."""
    at = weights.table.device
    host_ids = rows.to(at)
    values = weights.table[host_ids]
    fp8 = values.dtype == torch.float8_e4m3fn
    scales = weights.table_scale[host_ids] if fp8 else None
    device = at if device is None else torch.device(device)
    if device != at:
        values = _to_device(values, device)
        scales = _to_device(scales, device) if fp8 else None
    if fp8:
        values = values.float().unflatten(-1, (scales.shape[-1], -1)) * scales.float().unsqueeze(-1)
        values = values.flatten(-2)
    return values.float()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def engram_forward(streams: torch.Tensor, gathered: torch.Tensor, weights: EngramWeights, eps: float) -> torch.Tensor:
    """``streams [S, hc, D]`` plus the gated lookup of the rows ``gathered [S, columns, head_dim]``
    (:func:`gather_rows`, done for every Engram layer before layer 0)."""
    hc, hidden = streams.shape[-2], streams.shape[-1]
    gathered = gathered.flatten(-2)
    projected = linear(gathered.to(weights.wkv.dtype), weights.wkv)
    keys, value = projected.split([hc * hidden, hidden], dim=-1)
    keys = keys.float().unflatten(-1, (hc, hidden))
    h = streams.float()
    inv_norms = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(keys.square().mean(-1) + eps)
    dot = (h * weights.gate_weight * keys).sum(-1) * inv_norms * hidden**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(_GATE_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
