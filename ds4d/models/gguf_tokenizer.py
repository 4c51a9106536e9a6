"""A ``Tokenizer`` rebuilt from the vocabulary a GGUF file carries.

GGUF checkpoints embed their tokenizer as metadata (``tokenizer.ggml.*``): the token
strings, the BPE merges, a type per token (normal, control, user-defined, ...) and
the name of the pre-tokenizer (``tokenizer.ggml.pre``) that splits text into words
before BPE runs.  This module turns that into a ``tokenizers.Tokenizer`` so encoding
runs in Rust and is safe to share between the engine thread and the API side.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3,
Qwen, StarCoder, ...) are supported.  Pre-tokenisation follows llama.cpp: its word
splitting for a named pre-tokenizer is a list of regular expressions applied one
after another, each splitting the pieces the previous one left, keeping the text in
between as pieces of its own.  That is exactly a chain of ``Split(..., "isolated")``
steps, followed by the byte-to-unicode mapping with no regex of its own.

Control and user-defined tokens become added tokens, so their literal text inside a
prompt (``<|im_start|>``) maps to one id, as a chat template needs; control tokens
are "special" and vanish under ``skip_special_tokens``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ds4d.models.gguf_file import GGUFFile

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_WORDS = (
    _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_WORDS = (
    _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_WORDS, r"\p{N}+", r"[0-9][0-9][0-9]")
_DEEPSEEK3_SPLITS = (  # also DeepSeek-V4's (the converter names it "joyai-llm", whose hash it shares)
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
     r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
)

_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {}
for _names, _splits in (
    (("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"), (_GPT2_WORDS,)),
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (r"\p{N}", _GPT2_WORDS),
    ),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), (_LLAMA3_WORDS,)),
    (("qwen2", "stablelm2", "hunyuan", "megrez"), (_QWEN2_WORDS,)),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_WORDS, r"[0-9][0-9][0-9]")),
    (("deepseek-v3", "joyai-llm", "hunyuan-dense", "hy_v4"), _DEEPSEEK3_SPLITS),
    (("deepseek-coder",), (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    (("default",), _DEFAULT_SPLITS),
):
    for _name in _names:
        _PRE_TOKENIZER_SPLITS[_name] = _splits

# Control tokens that end a turn or a document, by text (ids vary per vocabulary).
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<|return|>",
        "<EOT>",
        "</s>",
    }
)


def pre_tokenizer_splits(pre_name: str, log: logging.Logger | None = None) -> tuple[str, ...]:
    """The word-splitting regexes for a ``tokenizer.ggml.pre`` name."""
    splits = _PRE_TOKENIZER_SPLITS.get(pre_name)
    if splits is None:
        if log is not None:
            log.warning("unknown tokenizer.ggml.pre %r: using the default BPE pre-tokenizer", pre_name)
        splits = _DEFAULT_SPLITS
    return splits


class GGUFTokenizer:
    """Byte-level BPE tokenizer built from GGUF metadata (implements ``contracts.Tokenizer``)."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None,
        *,
        pre_name: str = "default",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        log: logging.Logger | None = None,
    ) -> None:
        self.vocab_size = len(tokens)
        self._tokens = list(tokens)
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * len(tokens)

        vocab: dict[str, int] = {}
        for token_id, token in enumerate(tokens):
            vocab.setdefault(token, token_id)
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        model = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
        tokenizer = HFTokenizer(model)
        splits = [
            pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in pre_tokenizer_splits(pre_name, log)
        ]
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
        tokenizer.decoder = decoders.ByteLevel()

        control = [tokens[i] for i, t in enumerate(types) if t == TOKEN_CONTROL]
        user_defined = [tokens[i] for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
        self._tokenizer = tokenizer
        self.special_token_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_CONTROL)

        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        eos_ids = {i for i in (eos_token_id, *extra_eos_token_ids) if i is not None}
        eos_ids.update(i for i in self.special_token_ids if tokens[i] in _END_OF_GENERATION_TEXTS)
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset(eos_ids)

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile, log: logging.Logger | None = None) -> GGUFTokenizer:
        kind = gguf_file.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(
                f"{gguf_file.path.name}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' BPE)"
            )
        types = gguf_file.get_array("tokenizer.ggml.token_type")
        extra_eos = [
            gguf_file.get(key)
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if gguf_file.get(key) is not None
        ]
        return cls(
            gguf_file.require("tokenizer.ggml.tokens"),
            gguf_file.require("tokenizer.ggml.merges"),
            types.tolist() if types is not None else None,
            pre_name=gguf_file.get("tokenizer.ggml.pre", "default"),
            bos_token_id=gguf_file.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf_file.get("tokenizer.ggml.eos_token_id"),
            extra_eos_token_ids=extra_eos,
            add_bos_token=bool(gguf_file.get("tokenizer.ggml.add_bos_token", True)),
            log=log,
        )

    # ------------------------------------------------------------------ Tokenizer protocol

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def boundary_tokens(self) -> tuple[str, ...]:
        """Added tokens the text is split at before anything else (``hf_tokenizer.boundary_tokens``)."""
        from ds4d.models.hf_tokenizer import boundary_tokens

        return boundary_tokens(self._tokenizer)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < self.vocab_size:
            return self._tokens[token_id]
        return None

    # ------------------------------------------------------------------ conveniences

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)
