import gc
import os
import string

import jax
import numpy as np
import pytest

from kvjax.models.config import ModelConfig

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # before any test imports transformers
os.environ.setdefault("KVJAX_COMPILE_CACHE", "off")  # no compile cache but test_compile_cache.py's own

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Each compiled XLA executable maps pages of code into the process, and JAX keeps them cached: the whole suite
    in one process neared the kernel's vm.max_map_count (65,530), where XLA's next compile segfaults (reproduced by
    filling the maps by hand: bench/notes/2026-11-27-first-hour.md). Each test module's executables go when it
    ends."""
    yield
    jax.clear_caches()
    gc.collect()


def varied_plan_model(model, method="zack", band=None, qk_basis=None):
    """``model`` compressed with a plan whose heads all have different K and V widths (``band``: banded ZACK;
    ``qk_basis="pair"``: queries and keys on a score-aware pair)."""
    from kvjax.compression import BASIS, RankPlan, calibrate, calibration_tokens, fold

    stats = calibrate(model, calibration_tokens(model, "random", 128, 64), progress=False)
    kind = "qk-pair" if qk_basis == "pair" else BASIS[method][0]
    bases = {"k": stats.basis(kind, model, max_context=band), "v": stats.basis("v", model)}
    layers, heads = bases["k"].s.shape[:2]
    widths = np.array([[64, 32, 16, 48], [16, 48, 64, 32]])
    k_qk, k_v = np.resize(widths, (layers, heads)), np.resize(widths[::-1], (layers, heads))
    plan = RankPlan(method, 64, k_qk, k_v, bases["k"].s, bases["v"].s, band=band, qk_basis=qk_basis)
    return fold(model, plan, bases)


def latent_case(rng, layout, lengths, page_size, dtype=np.float32, theta=10000.0, band=None):
    """A decode case over a K latent (Palu's, or banded ZACK's with ``band``): random (never zero) q, latent and V
    pages scattered through the pool, the block table, lengths and the layer's ``LatentK`` (``up`` per head)."""
    import jax.numpy as jnp

    from kvjax.models.latent import LatentK
    from kvjax.models.rope import inverse_frequencies

    b, d = len(lengths), layout.head_dim
    pps = -(-max(lengths) // page_size) + 1
    num_pages = b * pps + 1
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, layout.k_cols)), dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, layout.v_cols)), dtype)
    q = jnp.asarray(rng.standard_normal((b, layout.num_heads * d)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(b, pps).astype(np.int32))
    up = tuple(jnp.asarray(rng.standard_normal((w, d)) / np.sqrt(w), dtype) for w in layout.k_widths)
    rebuild = LatentK(up, inverse_frequencies(d, theta, {}), layout, band)
    return q, k, v, table, jnp.asarray(lengths, jnp.int32), rebuild


def fresh_seed() -> int:
    """A new random seed for a test's inputs (tests report it in their failure messages); ``KVJAX_TEST_SEED`` pins
    it, to rerun a reported failure."""
    pinned = os.environ.get("KVJAX_TEST_SEED")
    return int(pinned) if pinned else int(np.random.SeedSequence().entropy % 2**32)


TINY = dict(
    num_layers=2,
    num_heads=4,
    head_dim=16,
    hidden_size=64,
    intermediate_size=96,
    vocab_size=97,
    norm_eps=1e-5,
    max_position_embeddings=256,
    eos_token_ids=(),
)

TINY_CONFIGS = {
    "llama": ModelConfig(arch="llama", num_kv_heads=2, **TINY),
    "llama3_tied": ModelConfig(
        arch="llama",
        num_kv_heads=1,
        tie_word_embeddings=True,
        rope_theta=5e5,
        rope_scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 32),
            ("rope_type", "llama3"),
        ),
        **TINY,
    ),
    "mistral": ModelConfig(arch="mistral", num_kv_heads=2, sliding_window=5, **TINY),
    "falcon_7b": ModelConfig(arch="falcon", num_kv_heads=1, parallel_block=True, tie_word_embeddings=True, **TINY),
    "falcon_new": ModelConfig(
        arch="falcon",
        num_kv_heads=2,
        parallel_block=True,
        parallel_norms=2,
        new_decoder_architecture=True,
        attention_bias=True,
        mlp_bias=True,
        **TINY,
    ),
}


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_config(request):
    return TINY_CONFIGS[request.param]


CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)


def tiny_tokenizer(vocab_size: int):
    """A character tokenizer of exactly ``vocab_size`` ids (the tiny model samples any of them), with a chat
    template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *string.ascii_letters, *string.digits, *" .,!?'-:;()\"/&%$#@+=*"]
    pieces += [a + b for a in "thaeiou" for b in "nrst"][: vocab_size - len(pieces)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT
    return fast
