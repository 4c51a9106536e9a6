"""Write the DeepSeek-V4.1 golden fixtures under tests/fixtures/dsv41/ (run by hand, not by pytest).

    .venv/bin/python tests/parity/make_dsv41_goldens.py [--oracle DIR]

It imports the Hugging Face ``deepseek_v41`` model kept in the shared
reference directory (with its shims for transformers 5.24), builds two tiny
random configs, and for each writes the weights, the config, the tokenizer the
Engram compressed vocabulary comes from, and what the oracle's *cache path*
computes (a DynamicCache: prefill, then one token per step):

* ``prompt_logits``: the logits of every prompt position (one-shot prefill);
* ``greedy_ids`` / ``decode_logits``: 32 greedy tokens after the prompt and the
  logits each decode step produced;
* ``engram_tokens`` / ``engram_rows``: Engram row ids of random token streams
  (each from an empty history), and ``token_map``: the compressed vocabulary.

``tiny_a`` is written by ``save_pretrained`` (HF names, a bare
``deepseek_v41_text`` config); ``tiny_b`` under the official names with a
composite ``deepseek_v41`` config.json, so both loading paths are covered.
The configs cover ratio 0/1/2 layers, two KV sources each with reuse and
reindex layers, a candidate source, two Engram layers, windows shorter than
the prompt, and prompts long enough that both top-k levels select.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "dsv41"
DEFAULT_ORACLE = Path("/work/shared/reference/dsv41/oracle")
GREEDY_TOKENS = 32

WORDS = (
    "alpha beta gamma delta river stone cloud light north south east west early late quick slow green "
    "silver paper glass window garden market bridge engine signal number letter story winter summer "
    "orange violet purple yellow basket rocket planet comet metal wood water fire earth wind song dance"
).split()
ACCENTED = ("café", "naïve", "résumé", "Ångström", "ﬁne")  # NFKC / accent folding merge these with plain forms


def tokenizer_json(path: Path):
    """A 320-piece word-level tokenizer whose pieces collapse in the Engram normalisation."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    pieces = ["<|bos|>", "<|eos|>", "<|pad|>", " ", "  ", "\n", "\t", " \n"]
    for word in WORDS + list(ACCENTED) + ["cafe", "naive", "resume", "angstrom", "fine"]:
        for form in (word, word.title(), word.upper(), " " + word, " " + word.title()):
            if form not in pieces:
                pieces.append(form)
    pieces += [f"<|extra_{i}|>" for i in range(len(pieces), 320)]
    assert len(pieces) == 320, len(pieces)
    tokenizer = Tokenizer(WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<|pad|>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path))
    return tokenizer


class HFTokenizerView:
    """The two things the oracle's compressed-vocabulary builder reads."""

    def __init__(self, tokenizer) -> None:
        self.backend_tokenizer = tokenizer

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


COMMON = dict(
    vocab_size=320, hidden_size=32, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
    rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096, index_head_dim=32,
    o_lora_rank=16, moe_intermediate_size=16, n_shared_experts=1, hc_sinkhorn_iters=20,
    num_nextn_predict_layers=0, initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    engram_pad_id=2, engram_head_dim=32,
)
CONFIGS = {
    # 0 0 | 2 2 2 (KV source 2; 3 reuses, 4 reindexes) | 1 1 1 (KV source 5, candidate source; 6 reuses,
    # 7 reindexes inside the candidate blocks)
    "tiny_a": dict(
        num_hidden_layers=8, num_attention_heads=2, o_groups=2, sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 4, 5, 7],
        candidate_source_layer_id=5, candidate_topk_blocks=3, candidate_block_size=2, index_n_heads=8,
        index_topk=4, n_routed_experts=4, num_experts_per_tok=2, hc_mult=4, engram_layer_ids=[1, 3],
        engram_vocab_size=40, engram_max_ngram_size=3, engram_n_heads=2, swiglu_limit=10.0,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 32},
        prompt_length=44, seed=11,
    ),
    # 0 | 2 2 (KV source 1; 2 reuses) | 1 1 1 (KV source 3 = candidate source; 4 reuses, 5 reindexes) | 0;
    # 2 copies, a clamp that bites, 4-grams, Engram on a KV source, plain rope, sigmoid router
    "tiny_b": dict(
        num_hidden_layers=7, num_attention_heads=4, o_groups=4, sliding_window=5,
        compress_ratios=[0, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
        candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=3, index_n_heads=8,
        index_topk=5, n_routed_experts=6, num_experts_per_tok=3, hc_mult=2, engram_layer_ids=[0, 3],
        engram_vocab_size=30, engram_max_ngram_size=4, engram_n_heads=2, swiglu_limit=0.05,
        scoring_func="sigmoid", routed_scaling_factor=2.0, rope_scaling=None, hc_sinkhorn_iters=7,
        prompt_length=37, seed=23,
    ),
}


def randomize(model, seed: int) -> None:
    """Every parameter random (the oracle's init leaves sinks, biases and hc bases at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
                value = 1.0 + 0.2 * noise
            elif name.endswith("attn_sink"):
                value = 0.5 * noise
            elif name.endswith(("gate.bias", "_base")):
                value = 0.2 * noise
            elif name.endswith("_scale"):
                value = 0.5 + 0.25 * noise.abs()
            elif name.endswith("embed.scale"):
                value = torch.ones(param.shape)
            else:
                value = 0.15 * noise
            param.copy_(value.to(param.dtype))


def build(oracle: Path, name: str, spec: dict, tokenizer):
    sys.path.insert(0, str(oracle))
    import shims  # noqa: F401  (before any cache is built)
    import modeling_deepseek_v41 as hf
    from configuration_deepseek_v41 import DeepseekV41TextConfig

    shims.patch_cache_kwarg(hf)
    spec = dict(spec)
    prompt_length, seed = spec.pop("prompt_length"), spec.pop("seed")
    _, compressed = hf.build_compressed_token_map(HFTokenizerView(tokenizer))
    kwargs = {**COMMON, **spec, "engram_compressed_vocab_size": compressed}
    probe = DeepseekV41TextConfig(**kwargs, engram_num_embeddings=[1] * len(spec["engram_layer_ids"]))
    layout = hf.EngramLayout.from_config(probe)
    rows = [sum(p for size in layer for p in size) for layer in layout.primes]
    cfg = DeepseekV41TextConfig(**kwargs, engram_num_embeddings=rows)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = hf.DeepseekV41ForCausalLM(cfg).eval()
    randomize(model, seed)
    model.model.bind_tokenizer(HFTokenizerView(tokenizer))
    return hf, cfg, model, prompt_length, seed


@contextmanager
def no_ties_at_the_top_k_boundary():
    """Fail if an indexer or candidate top-k (3-d scores) has to choose among equal finite scores.

    Which of equal scores ``torch.topk`` keeps is not part of the model (ds4d keeps the lower index),
    so a golden that depends on it would pin an accident."""
    plain_topk = torch.Tensor.topk
    ties = []

    def checked(self, k, dim=-1, largest=True, sorted=True):
        result = plain_topk(self, k, dim=dim, largest=largest, sorted=sorted)
        if self.dim() == 3 and self.shape[-1] > k:
            boundary = result.values.min(dim=-1, keepdim=True).values
            straddles = (self == boundary).sum(-1) > (result.values == boundary).sum(-1)
            ties.append(int((straddles & (boundary[..., 0] > float("-inf"))).sum()))
        return result

    torch.Tensor.topk = checked
    try:
        yield
    finally:
        torch.Tensor.topk = plain_topk
    if sum(ties):
        raise SystemExit(f"{sum(ties)} top-k choices among equal scores: pick another seed")


def goldens(hf, cfg, model, prompt_length: int, seed: int) -> dict[str, torch.Tensor]:
    with no_ties_at_the_top_k_boundary():
        return _goldens(hf, cfg, model, prompt_length, seed)


def _goldens(hf, cfg, model, prompt_length: int, seed: int) -> dict[str, torch.Tensor]:
    from transformers.cache_utils import DynamicCache

    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, cfg.vocab_size, (1, prompt_length), generator=gen)
    state = model.model.engram_hash_state
    with torch.no_grad():
        state.history = None
        cache = DynamicCache(config=cfg)
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0]
        greedy, decode_logits = [], []
        step = logits[-1]
        for _ in range(GREEDY_TOKENS):
            greedy.append(int(step.argmax()))
            step = model(input_ids=torch.tensor([[greedy[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
            decode_logits.append(step)
        streams = torch.randint(0, cfg.vocab_size, (4, 24), generator=gen)
        engram_rows = []
        for stream in streams:
            state.history = None
            positions = torch.arange(stream.numel()).unsqueeze(0)
            engram_rows.append(state(stream.unsqueeze(0), positions, None)[0])
    return {
        "prompt_ids": prompt[0],
        "prompt_logits": logits.contiguous(),
        "greedy_ids": torch.tensor(greedy),
        "decode_logits": torch.stack(decode_logits).contiguous(),
        "engram_tokens": streams,
        "engram_rows": torch.stack(engram_rows).contiguous(),
        "token_map": state.token_map.clone(),
    }


def write(name: str, oracle: Path, tokenizer, tokenizer_path: Path) -> None:
    from safetensors.torch import save_file

    hf, cfg, model, prompt_length, seed = build(oracle, name, CONFIGS[name], tokenizer)
    out = FIXTURES / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if name == "tiny_a":
        model.save_pretrained(str(out), safe_serialization=True)
        for extra in ("generation_config.json",):
            (out / extra).unlink(missing_ok=True)
    else:
        tensors = {}
        for key, value in model.state_dict().items():
            key = key[len("model."):] if key.startswith("model.") else "head." + key[len("lm_head."):]
            tensors[key] = value.contiguous()
        save_file(tensors, str(out / "model.safetensors"))
        text = {k: v for k, v in cfg.to_dict().items() if k not in ("rope_parameters", "layer_types")}
        text["engram_pad_token_id"] = text.pop("engram_pad_id")
        composite = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
                     "image_token_id": 129264, "text_config": text}
        (out / "config.json").write_text(json.dumps(composite, indent=2, sort_keys=True) + "\n")
    shutil.copy(tokenizer_path, out / "tokenizer.json")
    data = goldens(hf, cfg, model, prompt_length, seed)
    save_file(data, str(out / "goldens.safetensors"))
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    print(name, "greedy:", data["greedy_ids"].tolist(), "files:", sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oracle", type=Path, default=DEFAULT_ORACLE)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    tokenizer_path = FIXTURES / "tokenizer.json"
    tokenizer = tokenizer_json(tokenizer_path)
    for name in CONFIGS:
        write(name, args.oracle, tokenizer, tokenizer_path)
    tokenizer_path.unlink()


if __name__ == "__main__":
    main()
