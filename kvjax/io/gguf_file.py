"""GGUF checkpoints (llama.cpp's format): config, dequantized tensors and tokenizer from one file.

Tensors are dequantized with the ``gguf`` package one at a time. llama.cpp stores Llama's q/k rows permuted for its
own RoPE layout; we undo that so the weights match the Hugging Face ``rotate_half`` convention (Gemma's are stored
unpermuted, its norm weights shifted by one). The tokenizer is built from the file's vocabulary (and merges) with
``tokenizers`` and transformers' tokenizer classes (transformers' own GGUF path needs torch).
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.errors import CheckpointError
from kvjax.io.hf import MissingTensorError, Path, Source, as_is, q_norm_weight, transposed
from kvjax.io.messages import one_line
from kvjax.models.config import ModelConfig, UnsupportedModelError

# llama.cpp's pre-tokenizer names -> how the text is split before byte-level BPE.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "smollm": ("digits", _GPT2_SPLIT),
    "gpt2": (None, _GPT2_SPLIT),
    "default": (None, _GPT2_SPLIT),
    "llama-bpe": (None, _LLAMA3_SPLIT),
    "llama3": (None, _LLAMA3_SPLIT),
    "smaug-bpe": (None, _LLAMA3_SPLIT),
}


def _read(path: str):
    """A ``gguf.GGUFReader`` of ``path``; a corrupt file, or one too short for its tensors, is a CheckpointError."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # check every tensor's bytes lie in the file before views
            size = len(self.data)
            for field in sorted(fields, key=lambda f: int(f.parts[5][0])):
                _, name, _, dims, raw_type, offset = field.parts
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
                end = int(start_offs) + int(offset[0]) + math.prod(int(d) for d in dims) * type_size // block
                if end > size:
                    raise CheckpointError(
                        f"{path}: truncated: tensor {bytes(name).decode(errors='replace')} needs "
                        f"bytes up to {end}, the file has {size}"
                    )
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except (CheckpointError, OSError):
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file (corrupt or truncated): {one_line(e)}") from None


class GGUFCheckpoint:
    """A GGUF file's config, tensors (dequantized to float32 one at a time) and tokenizer."""

    def __init__(self, path: str):
        import gguf

        self.path = path
        self._gguf = gguf
        self.reader = _read(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")
        self.layers_key = f"{self.arch}.block_count"

    def file_of(self, name: str) -> str:
        return self.path

    def __iter__(self):
        return iter(self.tensors)

    def __contains__(self, name):
        return name in self.tensors

    def field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _arch_field(self, key, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def _require(self, *keys) -> None:
        for key in keys:
            if self._arch_field(key) is None:
                raise CheckpointError(f"{self.path}: GGUF metadata has no {self.arch}.{key}")

    def config(self) -> ModelConfig:
        if self.arch not in ("llama", "gemma3"):
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; kvjax reads GGUF files of the llama "
                "(Llama, Mistral) and gemma3 architectures; load Falcon from a Hugging Face directory"
            )
        a = self._arch_field
        self._require(
            "block_count",
            "attention.head_count",
            "embedding_length",
            "feed_forward_length",
            "attention.layer_norm_rms_epsilon",
        )
        num_heads, hidden = a("attention.head_count"), a("embedding_length")
        scaling = None
        if a("rope.scaling.type") == "linear":
            scaling = (("factor", float(a("rope.scaling.factor"))), ("rope_type", "linear"))
        elif a("rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"GGUF rope scaling {a('rope.scaling.type')!r} is not supported")
        eos = self.field("tokenizer.ggml.eos_token_id")
        common = dict(
            num_layers=a("block_count"),
            num_heads=num_heads,
            num_kv_heads=a("attention.head_count_kv", num_heads),
            head_dim=a("attention.key_length", hidden // num_heads),
            hidden_size=hidden,
            intermediate_size=a("feed_forward_length"),
            vocab_size=a("vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            norm_eps=float(a("attention.layer_norm_rms_epsilon")),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in self.tensors,
            max_position_embeddings=a("context_length", 4096),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
        )
        if self.arch == "gemma3":
            return self._gemma3_config(common)
        window = a("attention.sliding_window")
        return ModelConfig(
            arch="mistral" if window else "llama",
            rope_theta=float(a("rope.freq_base", 10000.0)),
            sliding_window=window,
            **common,
        )

    def _gemma3_config(self, common: dict) -> ModelConfig:
        """Gemma 3: what the file leaves out (local layers' pattern and RoPE base, the attention scale) is what
        llama.cpp assumes for this architecture."""
        a = self._arch_field
        self._require("attention.sliding_window")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if a(key) is not None:
                raise UnsupportedModelError(f"Gemma 3 with {key}={a(key)} is not supported (kvjax applies none)")
        if a("attention.value_length", common["head_dim"]) != common["head_dim"]:
            raise UnsupportedModelError(
                f"{self.path}: value heads of {a('attention.value_length')} and key heads of "
                f"{common['head_dim']} columns are not supported"
            )
        layers = common["num_layers"]
        pattern = a("attention.sliding_window_pattern", 6)  # a period (every n-th layer global) or one flag a layer
        if isinstance(pattern, list):
            local = [bool(f) for f in pattern]
        elif isinstance(pattern, int) and pattern > 0:
            local = [(i + 1) % pattern != 0 for i in range(layers)]
        else:
            raise CheckpointError(f"{self.path}: sliding_window_pattern {pattern!r} is neither a period nor flags")
        if len(local) != layers:
            raise CheckpointError(f"{self.path}: sliding_window_pattern has {len(local)} flags for {layers} layers")
        # gemma_pytorch's 27B (62 layers) scales scores by (hidden / heads) ** -0.5, the others by head_dim ** -0.5
        scalar = common["hidden_size"] // common["num_heads"] if layers == 62 else common["head_dim"]
        eos = list(common["eos_token_ids"])
        tokens = self.field("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens:  # ends a chat turn, as llama.cpp's end-of-generation tokens do
            eos.append(tokens.index("<end_of_turn>"))
        return ModelConfig(
            arch="gemma3",
            **dict(common, eos_token_ids=tuple(dict.fromkeys(eos))),
            rope_theta=float(a("rope.freq_base", 1_000_000.0)),
            rope_local_theta=float(a("rope.freq_base_swa", 10_000.0)),
            sliding_window=a("attention.sliding_window"),
            layer_types=tuple("sliding_attention" if f else "full_attention" for f in local),
            query_pre_attn_scalar=float(scalar),
        )

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise MissingTensorError(f"{self.path}: GGUF file has no tensor {name!r}")
        t = self.tensors[name]
        try:
            x = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} is of type {t.tensor_type.name}, which the "
                "gguf package cannot dequantize"
            ) from None
        return np.asarray(x, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))

    def sources(self, cfg: ModelConfig) -> dict[Path, Source]:
        """Where every parameter of ``Transformer(cfg)`` comes from in this file."""
        src: dict[Path, Source] = {("embed",): ("token_embd.weight", as_is)}
        for i in range(cfg.num_layers):
            layer = _gemma3_layer(cfg, i) if cfg.arch == "gemma3" else _llama_layer(cfg, i)
            src.update({("layers", i, *path): source for path, source in layer.items()})
        src[("final_norm", "scale")] = ("output_norm.weight", _unshifted if cfg.arch == "gemma3" else as_is)
        if not cfg.tie_word_embeddings:
            src[("lm_head", "kernel")] = ("output.weight", transposed)
        return src

    def tokenizer(self):
        """A ``transformers`` fast tokenizer rebuilt from the file's vocabulary (and merges)."""
        kind = self.field("tokenizer.ggml.model")
        if kind == "llama" and self.arch == "gemma3":
            return self._gemma_tokenizer()
        return self._byte_level_tokenizer()

    def _special(self, key):
        """The token the file names by ``tokenizer.ggml.<key>`` (None if it names none)."""
        index = self.field(f"tokenizer.ggml.{key}")
        return None if index is None else self.field("tokenizer.ggml.tokens")[index]

    def _gemma_tokenizer(self):
        """Gemma's SentencePiece BPE (byte fallback), built as transformers builds it from a GGUF: the file has no
        merges, so they come from the vocabulary, best-first in file order; tokens of spaces are spelled with
        U+2581, as the tokenizer looks them up."""
        from tokenizers import AddedToken
        from transformers import GemmaTokenizer
        from transformers.tokenization_utils_base import generate_merges

        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in self.field("tokenizer.ggml.tokens")]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})
        tok = GemmaTokenizer(
            vocab=vocab,
            merges=merges,
            bos_token=self._special("bos_token_id"),
            eos_token=self._special("eos_token_id"),
            unk_token=self._special("unknown_token_id"),
            pad_token=self._special("padding_token_id"),
            add_bos_token=bool(self.field("tokenizer.ggml.add_bos_token", True)),
            add_eos_token=bool(self.field("tokenizer.ggml.add_eos_token", False)),
            chat_template=self.field("tokenizer.chat_template"),
        )
        types = self.field("tokenizer.ggml.token_type") or []
        control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
        tok.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
        return tok

    def _byte_level_tokenizer(self):
        """Byte-level BPE from the file's vocabulary and merges (Llama 3, SmolLM2, GPT-2 style)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        kind, pre = self.field("tokenizer.ggml.model"), self.field("tokenizer.ggml.pre", "default")
        if kind != "gpt2" or pre not in _SPLITS:
            raise UnsupportedModelError(
                f"GGUF tokenizer {kind!r}/{pre!r} is not supported (byte-level BPE with pre-tokenizer in "
                f"{sorted(_SPLITS)})"
            )
        tokens = list(self.field("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        backend = Tokenizer(
            models.BPE(
                vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
            )
        )
        digits, split = _SPLITS[pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens(
            [AddedToken(tok, special=True, normalized=False) for tok, kind_ in zip(tokens, types) if kind_ == 3]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=self._special("bos_token_id"),
            eos_token=self._special("eos_token_id"),
            unk_token=self._special("unknown_token_id"),
            pad_token=self._special("padding_token_id"),
            chat_template=self.field("tokenizer.chat_template"),
            clean_up_tokenization_spaces=False,
        )


def _unpermute(heads: int):
    """The inverse of llama.cpp's convert-time permute of Llama's q/k rows, then [in, out]."""

    def fn(w):
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).T

    return fn


def _unshifted(x):
    """A Gemma norm weight: llama.cpp stores ``1 + w``, the model holds ``w``."""
    return x - 1.0


def _llama_layer(cfg: ModelConfig, i: int) -> dict[Path, Source]:
    """Layer ``i``'s parameters (paths inside the layer) of a llama-architecture file."""
    b = f"blk.{i}"
    src: dict[Path, Source] = {
        ("attn_norm", "scale"): (f"{b}.attn_norm.weight", as_is),
        ("mlp_norm", "scale"): (f"{b}.ffn_norm.weight", as_is),
        ("attn", "q", "kernel"): (f"{b}.attn_q.weight", _unpermute(cfg.num_heads)),
        ("attn", "k", "kernel"): (f"{b}.attn_k.weight", _unpermute(cfg.num_kv_heads)),
        ("attn", "v", "kernel"): (f"{b}.attn_v.weight", transposed),
        ("attn", "o", "kernel"): (f"{b}.attn_output.weight", transposed),
    }
    for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        src[("mlp", ours, "kernel")] = (f"{b}.{theirs}.weight", transposed)
    return src


def _gemma3_layer(cfg: ModelConfig, i: int) -> dict[Path, Source]:
    """Layer ``i``'s parameters of a gemma3 file: q/k rows as Hugging Face has them (llama.cpp runs Gemma's RoPE
    in the rotate-half layout), norm weights stored as ``1 + w``, the attention scale folded into the q norm."""
    b = f"blk.{i}"
    src: dict[Path, Source] = {
        ("attn", "q_norm", "scale"): (f"{b}.attn_q_norm.weight", q_norm_weight(cfg, offset=1.0)),
        ("attn", "k_norm", "scale"): (f"{b}.attn_k_norm.weight", _unshifted),
    }
    norms = {
        "attn_norm": "attn_norm",
        "post_attn_norm": "post_attention_norm",
        "mlp_norm": "ffn_norm",
        "post_mlp_norm": "post_ffw_norm",
    }
    for ours, theirs in norms.items():
        src[(ours, "scale")] = (f"{b}.{theirs}.weight", _unshifted)
    for ours, theirs in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        src[("attn", ours, "kernel")] = (f"{b}.{theirs}.weight", transposed)
    for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        src[("mlp", ours, "kernel")] = (f"{b}.{theirs}.weight", transposed)
    return src
