"""GGUF checkpoints (llama.cpp's format): config, dequantized tensors and tokenizer from one file.

Tensors are dequantized with the ``gguf`` package one at a time. llama.cpp stores Llama's q/k rows permuted for its
own RoPE layout; we undo that so the weights match the Hugging Face ``rotate_half`` convention. The tokenizer is
built from the file's vocabulary and merges with ``tokenizers`` (transformers' own GGUF path needs torch).
"""

from __future__ import annotations

import math

import numpy as np

from kvjax.errors import CheckpointError
from kvjax.io.hf import MissingTensorError, Path, Source, as_is, one_line, transposed
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

    layers_key = "llama.block_count"

    def __init__(self, path: str):
        import gguf

        self.path = path
        self._gguf = gguf
        self.reader = _read(path)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def file_of(self, name: str) -> str:
        return self.path

    def __iter__(self):
        return iter(self.tensors)

    def __contains__(self, name):
        return name in self.tensors

    def field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; kvjax reads GGUF files of the llama architecture "
                "(Llama, Mistral); load Falcon from a Hugging Face directory"
            )

        def a(key, default=None):
            return self.field(f"llama.{key}", default)

        for key in (
            "block_count",
            "attention.head_count",
            "embedding_length",
            "feed_forward_length",
            "attention.layer_norm_rms_epsilon",
        ):
            if a(key) is None:
                raise CheckpointError(f"{self.path}: GGUF metadata has no llama.{key}")
        num_heads, hidden = a("attention.head_count"), a("embedding_length")
        scaling = None
        if a("rope.scaling.type") == "linear":
            scaling = (("factor", float(a("rope.scaling.factor"))), ("rope_type", "linear"))
        elif a("rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"GGUF rope scaling {a('rope.scaling.type')!r} is not supported")
        window = a("attention.sliding_window")
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch="mistral" if window else "llama",
            num_layers=a("block_count"),
            num_heads=num_heads,
            num_kv_heads=a("attention.head_count_kv", num_heads),
            head_dim=a("attention.key_length", hidden // num_heads),
            hidden_size=hidden,
            intermediate_size=a("feed_forward_length"),
            vocab_size=a("vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            norm_eps=float(a("attention.layer_norm_rms_epsilon")),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in self.tensors,
            sliding_window=window,
            max_position_embeddings=a("context_length", 4096),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
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
        def unpermute(heads):  # inverse of llama.cpp's convert-time permute of q/k rows
            def fn(w):
                return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).T

            return fn

        t, same = transposed, as_is
        src: dict[Path, Source] = {
            ("embed",): ("token_embd.weight", same),
            ("final_norm", "scale"): ("output_norm.weight", same),
        }
        for i in range(cfg.num_layers):
            b, layer = f"blk.{i}", ("layers", i)
            src[(*layer, "attn_norm", "scale")] = (f"{b}.attn_norm.weight", same)
            src[(*layer, "mlp_norm", "scale")] = (f"{b}.ffn_norm.weight", same)
            src[(*layer, "attn", "q", "kernel")] = (f"{b}.attn_q.weight", unpermute(cfg.num_heads))
            src[(*layer, "attn", "k", "kernel")] = (f"{b}.attn_k.weight", unpermute(cfg.num_kv_heads))
            src[(*layer, "attn", "v", "kernel")] = (f"{b}.attn_v.weight", t)
            src[(*layer, "attn", "o", "kernel")] = (f"{b}.attn_output.weight", t)
            for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
                src[(*layer, "mlp", ours, "kernel")] = (f"{b}.{theirs}.weight", t)
        if not cfg.tie_word_embeddings:
            src[("lm_head", "kernel")] = ("output.weight", t)
        return src

    def tokenizer(self):
        """A ``transformers`` fast tokenizer rebuilt from the file's byte-level BPE vocabulary and merges."""
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

        def name(key):
            return None if self.field(key) is None else tokens[self.field(key)]

        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=name("tokenizer.ggml.bos_token_id"),
            eos_token=name("tokenizer.ggml.eos_token_id"),
            unk_token=name("tokenizer.ggml.unknown_token_id"),
            pad_token=name("tokenizer.ggml.padding_token_id"),
            chat_template=self.field("tokenizer.chat_template"),
            clean_up_tokenization_spaces=False,
        )
