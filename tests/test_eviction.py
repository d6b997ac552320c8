"""Eviction (issue 37, item 3): every metric against brute-force attention on small random inputs, the selection's
budgets and protection, and the teacher-forced reference: a budget as large as the prompt changes nothing, a cut
prompt reads only what each head kept, and ZACK's reduced space scores as the full heads do at full width."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax.eviction import Eviction, metrics
from kvjax.eviction.reference import compacted_round_trip, evicted_hidden, hidden_after, keep, kept_bytes, prompt_keep
from kvjax.eviction.select import keep_masks
from kvjax.layout import HeadLayout
from kvjax.ops import kv_schemes
from kvjax.ops.grouped import attend_groups
from kvjax.ops.prefill.reference import quantized_causal_attention

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
CALIBRATION = dict(calibration="random", num_tokens=256, seq_len=64, progress=False)


def brute_scores(method, q, k, layout, window, pool, tau=1.0, noise=None):
    """The metric by loops over heads, queries and keys in float64 (noise: Keyformer's Gumbel draws, [Hq, S, S])."""
    s, d = q.shape[0], layout.head_dim
    out = np.zeros((layout.num_kv_heads, s))
    for h in range(layout.num_heads):
        g = h // layout.group_size
        kw = layout.k_widths[g]
        qo = HeadLayout.offsets(layout.k_widths, layout.group_size)[g] + (h % layout.group_size) * kw
        ko = HeadLayout.offsets(layout.k_widths)[g]
        first = max(s - window, 0) if method in ("kvcompress", "snapkv") else 0
        for i in range(first, s):
            seen = [j for j in range(s) if j <= i and (layout.sliding_window is None or i - j < layout.sliding_window)]
            logits = np.array([q[i, qo : qo + kw] @ k[j, ko : ko + kw] / np.sqrt(d) for j in seen], np.float64)
            if method == "keyformer":
                logits = (logits + noise[h, i, seen]) / tau
            p = np.exp(logits - logits.max())
            p /= p.sum()
            if method.startswith("kvcompress"):
                p = p * p
            out[g, seen] += p
    if method in ("kvcompress", "snapkv") and pool > 1:
        padded = np.pad(out, ((0, 0), (pool // 2, (pool - 1) // 2)), constant_values=-np.inf)
        out = np.stack([padded[:, j : j + pool].max(1) for j in range(s)], 1)
    return out


@pytest.mark.parametrize("method", ["kvcompress", "kvcompress-full", "snapkv", "h2o"])
@pytest.mark.parametrize("window", [None, 5])
def test_each_metric_equals_brute_force_attention(method, window):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 8, (8, 5), (8, 3), window)
    s = 23
    q = rng.normal(size=(1, s, layout.q_cols)).astype(np.float32) * 2
    k = rng.normal(size=(1, s, layout.k_cols)).astype(np.float32) * 2
    got = np.asarray(metrics.scores(method, jnp.asarray(q), jnp.asarray(k), layout, window=6, pool=3))[0]
    want = brute_scores(method, q[0], k[0], layout, window=6, pool=3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}")


def test_keyformer_is_the_gumbel_softmax_accumulated_and_its_noise_is_seeded():
    """Keyformer's score is the brute-force Gumbel-softmax sum with the metric's own draws (``gumbel_noise`` at each
    (query head, query position, key position)); the same seed gives the same scores, another seed others."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(2, 1, 8, (8,), (8,))
    s = 19
    q = jnp.asarray(rng.normal(size=(1, s, layout.q_cols)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, s, layout.k_cols)), jnp.float32)
    got = np.asarray(metrics.scores("keyformer", q, k, layout, tau=1.5, seed=3, layer=2))[0]
    noise = np.asarray(metrics.gumbel_noise(3, 2, np.arange(2), np.arange(s)[None], np.arange(s)))[0]  # [Hq, S, S]
    want = brute_scores("keyformer", np.asarray(q)[0], np.asarray(k)[0], layout, 0, 1, tau=1.5, noise=noise)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"seed {seed}")
    again = np.asarray(metrics.scores("keyformer", q, k, layout, tau=1.5, seed=3, layer=2))[0]
    other = np.asarray(metrics.scores("keyformer", q, k, layout, tau=1.5, seed=4, layer=2))[0]
    np.testing.assert_array_equal(got, again)
    assert not np.allclose(got, other)


def test_gumbel_noise_is_standard_gumbel_and_a_function_of_its_positions_alone():
    """The draws have the standard Gumbel's mean (Euler's gamma) and variance (pi^2 / 6); a draw depends on (seed,
    layer, head, query position, key position) only, not on the shape it is drawn in, and each of them changes it."""
    seed = fresh_seed() % 2**31
    rows, keys = np.arange(300)[None], np.arange(400)
    draws = np.asarray(metrics.gumbel_noise(seed, 5, np.arange(4), rows, keys))  # [1, 4, 300, 400]
    assert abs(draws.mean() - np.euler_gamma) < 0.01, f"seed {seed}"
    assert abs(draws.var() - np.pi**2 / 6) < 0.03, f"seed {seed}"
    part = np.asarray(metrics.gumbel_noise(seed, 5, np.array([2, 3]), np.array([[7, 250], [1, 2]]), keys[100:130]))
    np.testing.assert_array_equal(part[0], draws[0, 2:4][:, [7, 250], 100:130])
    one = draws[0, 1, 7, 9]
    for args in ((seed + 1, 5, [1], [[7]], [9]), (seed, 6, [1], [[7]], [9]), (seed, 5, [2], [[7]], [9])):
        assert np.asarray(metrics.gumbel_noise(*args)).item() != one
    assert draws[0, 1, 8, 9] != one and draws[0, 1, 7, 10] != one


def test_the_extreme_hashes_give_finite_draws():
    """The smallest and largest hashes map inside (0, 1): no infinite draw (24 bits made one in 2^24 infinite)."""
    from kvjax.ops import noise

    h = jnp.asarray(np.array([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFFFFE00, 0x80000000], np.uint32).view(np.int32))
    assert np.isfinite(np.asarray(noise.gumbel(h))).all()


@pytest.mark.parametrize("method", ["h2o", "kvcompress-full", "keyformer"])
@pytest.mark.parametrize("window", [None, 5])
def test_chunk_masses_sum_to_the_whole_prompts_scores(method, window, monkeypatch):
    """A full-history metric accumulated chunk by chunk (``chunk_mass``, as the engine's prefill does: each chunk
    padded to one width, keys past it stale) equals the whole prompt's ``scores``, for chunks of random lengths, two
    prompts a call at different starts, and blocks of queries that split a chunk."""
    monkeypatch.setattr(metrics, "QUERY_BLOCK", 4)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 8, (8, 5), (8, 3), window)
    s, width, stored = 29, 10, 40
    q = rng.normal(size=(2, s, layout.q_cols)).astype(np.float32) * 2
    k = rng.normal(size=(2, stored, layout.k_cols)).astype(np.float32) * 2  # keys past the prompt: stale slots
    kw = dict(tau=1.3, seed=7, layer=1)
    want = np.stack([np.asarray(metrics.scores(method, q[[b]], k[[b], :s], layout, **kw))[0] for b in range(2)])
    total = np.zeros((2, layout.num_kv_heads, stored), np.float32)
    chunks = []  # per prompt, its chunks (start, length) of 1..width tokens
    for _ in range(2):
        ends = np.minimum(np.cumsum(rng.integers(1, width + 1, s)), s)
        starts = np.concatenate([[0], ends[:-1]])
        chunks.append([(int(a), int(e - a)) for a, e in zip(starts, ends) if e > a])
    for step in range(max(map(len, chunks))):
        chunk = np.full((2, width, layout.q_cols), 9.0, np.float32)  # padding rows: never read
        at = [c[step] if step < len(c) else (s, 0) for c in chunks]  # a prompt already done: an empty chunk
        for b, (start, length) in enumerate(at):
            chunk[b, :length] = q[b, start : start + length]
        starts, lengths = (np.array(x, np.int32) for x in zip(*at))
        total += np.asarray(metrics.chunk_mass(method, chunk, k, starts, lengths, layout, **kw))
    np.testing.assert_allclose(total[..., :s], want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(total[..., s:], 0.0)


@pytest.mark.parametrize("method", ["h2o", "kvcompress-full"])
def test_queries_past_one_block_sum_as_one_pass(method, monkeypatch):
    """Prompts longer than a block of queries (and not a multiple of it) score as brute force does."""
    monkeypatch.setattr(metrics, "QUERY_BLOCK", 8)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 8, (8, 5), (8, 3), 7)
    q = rng.normal(size=(1, 29, layout.q_cols)).astype(np.float32)
    k = rng.normal(size=(1, 29, layout.k_cols)).astype(np.float32)
    got = np.asarray(metrics.scores(method, jnp.asarray(q), jnp.asarray(k), layout))[0]
    np.testing.assert_allclose(got, brute_scores(method, q[0], k[0], layout, 8, 7), rtol=1e-4, atol=1e-6)


def test_uniform_selection_keeps_the_budget_the_recent_tokens_and_the_top_scores():
    rng = np.random.default_rng(fresh_seed())
    scores = [rng.random((3, 40)) for _ in range(2)]
    spec = Eviction("snapkv", budget=20, window=8, page_size=4)
    keep = keep_masks(spec, scores, [None, None])
    for sc, kp in zip(scores, keep):
        for g in range(3):
            assert kp[g].sum() == 20 and kp[g, -8:].all()  # 20 of 40: 20 evicted, 5 whole pages
            older = np.flatnonzero(~kp[g, :-8])
            kept = np.flatnonzero(kp[g, :-8])
            assert sc[g, kept].min() >= sc[g, older].max()


def test_global_selection_ranks_across_heads_and_layers_within_the_budget():
    """Page size 1: exactly the budget, the protected tokens plus the highest scores of all heads and layers."""
    rng = np.random.default_rng(fresh_seed())
    scores = [rng.random((2, 30)) * (layer + 1) for layer in range(3)]  # later layers score higher
    spec = Eviction("kvcompress", budget=12, window=8, page_size=1)
    keep = keep_masks(spec, scores, [None] * 3)
    assert sum(int(k.sum()) for k in keep) == 12 * 6
    assert all(k[:, -8:].all() for k in keep)
    free = np.concatenate([sc[:, :-8].ravel() for sc in scores])
    kept = np.concatenate([kp[:, :-8].ravel() for kp in keep])
    assert free[kept].min() >= free[~kept].max()
    assert keep[2].sum() > keep[0].sum()  # the heads that attend more keep more


def test_global_selection_evicts_whole_pages_per_head():
    rng = np.random.default_rng(fresh_seed())
    scores = [rng.random((4, 50))]
    keep = keep_masks(Eviction("kvcompress", budget=17, page_size=8), scores, [None])
    assert all((50 - k.sum()) % 8 == 0 for k in keep[0])
    assert 17 * 4 <= keep[0].sum() < 17 * 4 + 4 * 8


def test_a_sliding_window_layer_keeps_only_what_its_window_still_sees():
    scores = [np.ones((1, 40)), np.ones((1, 40))]
    keep = keep_masks(Eviction("h2o", budget=64), scores, [None, 10])
    assert keep[0].all() and keep[1][0, :30].sum() == 0 and keep[1][0, 30:].all()
    layouts = [HeadLayout(1, 1, 8, (8,), (8,), w) for w in (None, 10)]
    assert kept_bytes([k[None] for k in keep], layouts) == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        dict(budget=0),
        dict(budget=1.5),
        dict(budget=float("nan")),
        dict(ratio=0.5),
        dict(ratio=float("nan")),
        dict(budget=4, ratio=2.0),
        {},
        dict(budget=4, tau=float("nan")),
        dict(budget=4, tau="hot"),
        dict(budget=4, tau=-1.0),
        dict(budget=4, seed=-1),
        dict(budget=4, seed="x"),
        dict(budget=4, page_size=-16),
        dict(budget=4, allocation="both"),
    ],
)
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError, match="eviction"):
        Eviction("kvcompress", **bad)
    with pytest.raises(ValueError, match="eviction method"):
        Eviction("lru", budget=4)


def test_attention_with_a_mask_per_kv_head_reads_only_each_heads_keys():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 8, (8, 6), (8, 4))
    t = 9
    q, k, v = (rng.normal(size=(1, t, c)).astype(np.float32) for c in (layout.q_cols, layout.k_cols, layout.v_cols))
    mask = rng.random((1, 2, t, t)) < 0.6
    mask[..., np.arange(t), np.arange(t)] = True
    got = np.asarray(attend_groups(*map(jnp.asarray, (q, k, v, mask)), layout))
    for g in range(2):  # each head alone, with the mask shared by its group only
        one = HeadLayout(2, 1, 8, (layout.k_widths[g],), (layout.v_widths[g],))
        qo, ko, vo = (
            HeadLayout.offsets(w, s)[g] for w, s in ((layout.k_widths, 2), (layout.k_widths, 1), (layout.v_widths, 1))
        )
        part = attend_groups(
            jnp.asarray(q[..., qo : qo + 2 * one.k_cols]),
            jnp.asarray(k[..., ko : ko + one.k_cols]),
            jnp.asarray(v[..., vo : vo + one.v_cols]),
            jnp.asarray(mask[:, g]),
            one,
        )
        out_o = HeadLayout.offsets(layout.v_widths, 2)[g]
        np.testing.assert_allclose(got[..., out_o : out_o + 2 * one.v_cols], part, rtol=1e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("method", ["kvcompress", "snapkv", "h2o", "keyformer"])
def test_a_budget_as_large_as_the_prompt_evicts_nothing_and_changes_no_logit(tiny_config, method):
    seed = fresh_seed()
    model = kvjax.Model.random(tiny_config, seed=seed % 1000)
    tokens = np.random.default_rng(seed).integers(0, tiny_config.vocab_size, (2, 40))
    hidden, keep = evicted_hidden(model, tokens, 30, Eviction(method, budget=30, page_size=4))
    assert kept_bytes(keep, model.module.layouts) == 1.0  # all that a window still sees
    # to float32's rounding: the prompt runs alone (``prompt_prefix``), its rows then the rest's, not one [T, T]
    # forward, and XLA may sum a row in another order at another length
    np.testing.assert_allclose(hidden, model.hidden(tokens), rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


def test_a_prompt_prefix_serves_every_cut_of_its_prompt():
    """``prompt_prefix`` computed once gives each cut's ``hidden_after`` exactly what it computes alone (the eviction
    bench runs a prompt once for every policy), and the prefix the scoring forward leaves (``scores_and_prefix``)
    the same to float rounding; a prefix of another prompt length is refused."""
    from kvjax.eviction.reference import prompt_prefix, scores_and_prefix

    seed = fresh_seed()
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=seed % 1000)
    tokens = np.random.default_rng(seed).integers(0, 97, (2, 40))
    prefix = prompt_prefix(model, tokens[:, :30])
    spec = Eviction("snapkv", budget=4, page_size=4, window=4)
    (scores,), scored = scores_and_prefix(model, tokens[:, :30], [spec])
    for budget in (4, 12):
        kept = keep(model, scores, dataclasses.replace(spec, budget=budget))
        alone = hidden_after(model, tokens, kept)
        np.testing.assert_array_equal(hidden_after(model, tokens, kept, prefix=prefix), alone)
        np.testing.assert_allclose(hidden_after(model, tokens, kept, prefix=scored), alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefix"):
        hidden_after(model, tokens, kept, prefix=prompt_prefix(model, tokens[:, :20]))


def test_evicting_what_no_later_window_sees_changes_nothing_and_evicting_more_changes_only_the_decoded_rows():
    """Mistral's 6-token window: a decoded row cannot see prompt tokens before position 24 anyway, so a selection
    that drops them all leaves every hidden state as it was; a smaller budget drops tokens the decoded rows see and
    changes them, while the prompt's rows, prefilled exactly, stay as they were."""
    seed = fresh_seed()
    cfg = dataclasses.replace(TINY_CONFIGS["mistral"], sliding_window=6)
    model = kvjax.Model.random(cfg, seed=seed % 1000)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, 36))
    hidden, keep = evicted_hidden(model, tokens, 30, Eviction("h2o", budget=6, page_size=2, window=2))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(model.hidden(tokens)), rtol=1e-5, atol=1e-5)
    assert all(not k[..., :24].any() for k in keep)  # outside every later window: neither kept nor needed
    cut, _ = evicted_hidden(model, tokens, 30, Eviction("h2o", budget=2, page_size=2, window=2))
    assert np.array_equal(np.asarray(cut)[:, :30], np.asarray(hidden)[:, :30])
    assert not np.allclose(np.asarray(cut)[:, 30:], np.asarray(hidden)[:, 30:])


def test_zack_at_full_width_scores_in_its_rotated_space_as_the_full_heads_do():
    """The metrics read the rotated, truncated q·k the model runs; at full width the rotation is orthogonal, so
    every score and so every selection is the uncompressed model's."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    zack = kvjax.compress(model, removal_rate=0.0, seed=seed % 1000, **CALIBRATION)
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, (1, 48))
    spec = Eviction("kvcompress-full", budget=16, page_size=1)
    from kvjax.eviction.reference import prompt_scores

    base = prompt_scores(model, tokens, spec)
    rotated = prompt_scores(zack, tokens, spec)
    for a, b in zip(base, rotated):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-3, atol=1e-5, err_msg=f"seed {seed}")
    assert [k.tolist() for k in prompt_keep(model, tokens, spec)] == [
        k.tolist() for k in prompt_keep(zack, tokens, spec)
    ]


def test_one_forward_scores_every_method_as_its_own_forward_does():
    """``many_prompt_scores``: the methods scored together from one forward (the eviction bench's one compile a
    plan) give each method's own ``prompt_scores``, on a plain and a ZACK model."""
    from kvjax.eviction.reference import many_prompt_scores, prompt_scores

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    zack = kvjax.compress(model, removal_rate=0.4, seed=seed % 1000, **CALIBRATION)
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, (2, 40))
    specs = [Eviction(m, budget=8, page_size=1) for m in ("kvcompress", "snapkv", "h2o", "keyformer")]
    for m in (model, zack):
        together = many_prompt_scores(m, tokens, specs)
        for spec, got in zip(specs, together, strict=True):
            for a, b in zip(got, prompt_scores(m, tokens, spec), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}, {spec.name}")


@pytest.mark.parametrize("allocation", ["uniform", "global", "classed"])
def test_a_ratio_cuts_what_each_layer_holds_sliding_windows_included(allocation):
    """A ratio is of the cache: on a layer whose window holds 8 of 32 prompt tokens, 2x keeps 4, not 16 (which would
    keep the whole window and, under a global budget, hand its unused share to the other layers)."""
    rng = np.random.default_rng(fresh_seed())
    spec = Eviction("kvcompress", ratio=2.0, allocation=allocation, window=1, page_size=1)
    scores = [rng.normal(size=(2, 32)) for _ in range(2)]
    kept = keep_masks(spec, scores, [None, 8])
    assert kept[0].sum() + kept[1].sum() == 2 * 16 + 2 * 4
    if allocation == "uniform":
        assert kept[0].sum(-1).tolist() == [16, 16] and kept[1].sum(-1).tolist() == [4, 4]
    if allocation == "classed":  # each window class spends its own heads' share
        assert kept[0].sum() == 2 * 16 and kept[1].sum() == 2 * 4
    assert not kept[1][:, :24].any()  # what the window dropped stays dropped
    assert spec.per_head(32, 8) == 4 and spec.per_head(32) == 16 and Eviction("h2o", budget=6).per_head(32, 8) == 6
    per_head, protect = spec.sizes([32, 5], (None, 8))
    assert per_head.tolist() == [[16, 4], [3, 3]] and protect.tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("method", ["h2o", "keyformer"])
@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_a_recent_share_on_a_sliding_window_layer_is_of_that_layers_budget(method, allocation):
    """H2O's and Keyformer's protected recent window is a share of each layer's own budget: on a layer whose window
    holds 64 of 256 prompt tokens, 4x keeps 16 a head, of which the share is protected, not a share of the whole
    prompt's 64 (which kept 32 a local head, past its budget, and lowered the overall rate on Gemma 3)."""
    rng = np.random.default_rng(fresh_seed())
    spec = Eviction(method, ratio=4.0, allocation=allocation, window=1, page_size=1)
    s, local = 256, 64
    scores = [rng.normal(size=(2, s)) for _ in range(2)]
    kept = keep_masks(spec, scores, [None, local])
    assert spec.protected(s, local) == max(1, int({"h2o": 0.5, "keyformer": 0.2}[method] * 16))
    assert spec.protected(s) == max(1, int({"h2o": 0.5, "keyformer": 0.2}[method] * 64))
    assert kept[0].sum() + kept[1].sum() == 2 * 64 + 2 * 16
    if allocation == "uniform":
        assert kept[1].sum(-1).tolist() == [16, 16]
    assert kept[1][:, s - spec.protected(s, local) :].all()
    per_head, protect = spec.sizes([s], (None, local))
    assert per_head.tolist() == [[64, 16]] and protect.tolist() == [[spec.protected(s), spec.protected(s, local)]]


def test_a_classed_budget_ranks_each_window_class_apart_and_is_global_with_one_class():
    """ "classed": a class of layers of one sliding window spends exactly its heads' shares on its own highest
    scores, however much larger another class's scores are; with one class it is the global budget."""
    from kvjax.eviction import parse

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    s, local = 64, 24
    windows = [None, local, local, None, local]
    scores = [np.abs(rng.normal(size=(3, s))) * (100.0 if w is None else 1.0) for w in windows]  # global ones higher
    budget = int(rng.integers(4, 20))
    spec = dict(budget=budget, window=1, page_size=1)  # the last token is protected, each other one a candidate
    classed = keep_masks(Eviction("kvcompress", allocation="classed", **spec), scores, windows)
    every = keep_masks(Eviction("kvcompress", allocation="global", **spec), scores, windows)
    for w in (None, local):
        layers = [i for i, x in enumerate(windows) if x == w]
        assert sum(int(classed[i].sum()) for i in layers) == 3 * len(layers) * budget, f"seed {seed}"
        candidate = (np.arange(s) >= (0 if w is None else s - w)) & (np.arange(s) < s - 1)
        kept = np.concatenate([scores[i][classed[i] & candidate] for i in layers])
        dropped = np.concatenate([scores[i][~classed[i] & candidate] for i in layers])
        assert kept.min() >= dropped.max(), f"seed {seed}: a class keeps its own highest scores"
    on_local = lambda masks: sum(int(m.sum()) for m, w in zip(masks, windows) if w)  # noqa: E731
    assert on_local(every) < on_local(classed), f"seed {seed}: the global budget moves local heads' share away"
    one = [None] * 3
    for a, b in zip(
        keep_masks(Eviction("kvcompress", ratio=3.0, allocation="classed"), scores[:3], one),
        keep_masks(Eviction("kvcompress", ratio=3.0, allocation="global"), scores[:3], one),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, f"seed {seed}")
    assert parse("kvcompress:4x:classed").allocated == "classed"


def test_the_short_form_parses_and_names_itself():
    from kvjax.eviction import parse

    assert parse("kvcompress:256") == Eviction("kvcompress", budget=256)
    assert parse("SnapKV:4x:global", page_size=8) == Eviction("snapkv", ratio=4.0, allocation="global", page_size=8)
    assert parse("h2o:1.5x").name == "h2o:1.5x" and parse("kvcompress:4x").allocated == "global"
    assert parse("keyformer:64").allocated == "uniform"
    for bad in ("kvcompress", "kvcompress:", "kvcompress:4y", "kvcompress:4x:sideways", "kvcompress:1:2:3"):
        with pytest.raises(ValueError, match="eviction"):
            parse(bad)


@pytest.mark.parametrize("method, band", [("palu", None), ("zack", 16)])
def test_rebuilt_keys_are_scored_and_read_as_the_model_reads_them(method, band):
    """Palu's latent and banded ZACK's keys are rebuilt before scoring and attention: a budget that keeps the whole
    prompt gives the compressed model's own hidden states, a smaller one changes only the decoded rows."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    small = kvjax.compress(model, target_rate=0.5, method=method, band=band, seed=seed % 1000, **CALIBRATION)
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, (1, 40))
    whole, kept = evicted_hidden(small, tokens, 32, Eviction("h2o", budget=32, page_size=4))
    assert all(k.all() for k in kept)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(small.hidden(tokens)), rtol=1e-4, atol=1e-4)
    cut, _ = evicted_hidden(small, tokens, 32, Eviction("kvcompress", budget=8, page_size=4, window=4))
    np.testing.assert_allclose(np.asarray(cut)[:, :32], np.asarray(whole)[:, :32], rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(cut)[:, 32:], np.asarray(whole)[:, 32:], atol=1e-4)


@pytest.mark.parametrize("trial", range(4))
def test_the_device_selection_equals_the_host_one_ties_included(trial):
    """``device_keep`` over a batch of prompts of different lengths, padded to one width with junk past each
    prompt, keeps what ``keep_masks`` keeps for each prompt alone: every method's protection, both allocations,
    budgets and ratios, a sliding-window layer, and scores drawn from a few values so that ties decide."""
    import jax

    from kvjax.eviction.select import device_keep

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layers, heads, width = 3, 2, 64
    windows = (None, int(rng.integers(4, 40)), None)
    for method in ("kvcompress", "snapkv", "h2o", "keyformer"):
        for size in (dict(budget=int(rng.integers(1, 50))), dict(ratio=float(rng.choice([1.0, 1.5, 2.0, 3.3, 8.0])))):
            for allocation in ("global", "classed", "uniform"):
                spec = Eviction(method, allocation=allocation, window=int(rng.integers(1, 12)), page_size=4, **size)
                prompts = rng.integers(1, width + 1, 3)
                scores = rng.integers(0, 4, (3, layers, heads, width)).astype(np.float32)
                per_head, protect = spec.sizes(prompts, windows)
                run = jax.jit(device_keep, static_argnums=(0, 5))
                got = np.asarray(run(spec, jnp.asarray(scores), prompts, per_head, protect, windows))
                for b, n in enumerate(prompts):
                    want = keep_masks(spec, [scores[b, layer, :, :n] for layer in range(layers)], list(windows))
                    context = f"seed {seed}, {spec.name}, prompt {n}, row {b}"
                    np.testing.assert_array_equal(got[b, :, :, :n], np.stack(want), context)
                    assert not got[b, :, :, n:].any(), context


@pytest.mark.parametrize("method", ["kvcompress", "snapkv"])
def test_window_scores_from_the_last_queries_equal_the_full_pass(method):
    """The engine's form (each prompt's last W queries against its keys, prompts of different lengths padded to one
    width with junk, one shorter than W) scores as ``metrics.scores`` does over each prompt alone; a full-history
    method is refused in one line."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(6, 3, 16, (16, 8, 12), (16, 4, 8), sliding_window=int(rng.choice([0, 20])) or None)
    w, s = 8, 48
    lengths = np.array([48, 30, 5])
    q = rng.normal(size=(3, s, layout.q_cols)).astype(np.float32)
    k = rng.normal(size=(3, s, layout.k_cols)).astype(np.float32)
    rows = np.clip(lengths[:, None] - w + np.arange(w), 0, None)
    window = np.take_along_axis(q, rows[..., None], axis=1)
    got = metrics.window_scores(method, jnp.asarray(window), jnp.asarray(k), lengths, layout, pool=5)
    for b, n in enumerate(lengths):
        want = metrics.scores(
            method, jnp.asarray(q[b : b + 1, :n]), jnp.asarray(k[b : b + 1, :n]), layout, window=w, pool=5
        )
        np.testing.assert_allclose(got[b, :, :n], want[0], rtol=1e-5, atol=1e-7, err_msg=f"seed {seed}, row {b}")
        assert not np.asarray(got[b, :, n:]).any()
    with pytest.raises(ValueError, match="needs every query"):
        metrics.window_scores("h2o", jnp.asarray(window), jnp.asarray(k), lengths, layout)


def _prefilled(model, tokens, page_size: int, rng):
    """The model's exact prefill of ``tokens`` [B, T] written into per-sequence pages (noise elsewhere, pages
    shuffled), and each layer's packed queries [B, T, q_cols]: what the engine's prefill step holds."""
    from kvjax.ops.paging import write_pages
    from kvjax.ops.prefill.reference import causal_attention

    module = model.module
    b, t = tokens.shape
    per_seq = -(-t // page_size)
    seq_table = jnp.asarray(rng.permutation(np.arange(1, b * per_seq + 1)).reshape(b, per_seq), jnp.int32)
    k_pages = [
        jnp.asarray(rng.normal(size=(b * per_seq + 1, page_size, lay.k_cols)), jnp.float32) for lay in module.layouts
    ]
    v_pages = [
        jnp.asarray(rng.normal(size=(b * per_seq + 1, page_size, lay.v_cols)), jnp.float32) for lay in module.layouts
    ]
    queries = []
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        valid = jnp.ones((b, t), bool)
        k_pages[i] = write_pages(k_pages[i], seq_table, positions, k, valid)
        v_pages[i] = write_pages(v_pages[i], seq_table, positions, v, valid)
        queries.append(q)
        return causal_attention(q, k, v, module.layouts[i], rebuild)

    module.hidden(jnp.asarray(tokens, jnp.int32), positions, attend)
    return tuple(k_pages), tuple(v_pages), seq_table, queries


@pytest.mark.parametrize("plan", ["none", "zack"])
def test_the_device_eviction_of_prefilled_prompts_keeps_the_reference_selection(plan):
    """``evict_prompts`` over a model's own prefill in per-sequence pages (two prompts of different lengths in one
    batch): each head keeps what ``eviction.reference`` selects for that prompt alone, and its per-head pages hold
    exactly those tokens' K and V rows, in order; ``HeadPages`` then gives back the rest. Uncompressed and ZACK at
    rate 0.5 (scored in the rotated, truncated space)."""
    from kvjax.eviction.prompt import evict_prompts
    from kvjax.ops import head_paging
    from kvjax.runtime.head_pages import HeadPages

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    if plan == "zack":
        model = kvjax.compress(model, removal_rate=0.5, seed=seed % 1000, max_context=64, **CALIBRATION)
    layouts = model.module.layouts
    lengths = np.array([44, 29])
    tokens = rng.integers(0, WIDE.vocab_size, (2, 44))
    k_pages, v_pages, seq_table, queries = _prefilled(model, tokens, 8, rng)
    for spec in (
        Eviction("kvcompress", budget=12, page_size=4, window=4, pool=3),
        Eviction("snapkv", ratio=2.0, page_size=4),
    ):
        w = spec.window
        rows = jnp.asarray(np.clip(lengths[:, None] - w + np.arange(w), 0, None))
        window = [jnp.take_along_axis(q, rows[..., None], axis=1) for q in queries]
        page_elems = 4 * 2 * model.config.head_dim
        per = np.stack([head_paging.layer_tokens_per_page(lay, page_elems) for lay in layouts])
        pages = HeadPages(400, per, max_pages=int(-(-48 // per.min())))
        for b, n in enumerate(lengths):
            assert pages.grow(b, int(n)) is not None  # the whole prompt: always enough
        tables = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))
        pool = jnp.asarray(rng.normal(size=(400, page_elems)), jnp.float32)
        pool, kept, keep, _ = evict_prompts(
            spec,
            window,
            k_pages,
            v_pages,
            seq_table,
            jnp.asarray(lengths),
            spec.sizes(lengths),
            layouts,
            pool,
            tables,
            page_elems,
        )
        for b, n in enumerate(lengths):
            want = prompt_keep(model, tokens[b : b + 1, :n], spec)
            context = f"seed {seed}, {plan}, {spec.name}, prompt {n}"
            np.testing.assert_array_equal(np.asarray(keep[b, :, :, :n]), np.stack([k[0] for k in want]), context)
            pages.shrink(b, np.asarray(kept[b]))
            for layer, lay in enumerate(layouts):
                k_seq = np.asarray(k_pages[layer])[np.asarray(seq_table[b])].reshape(-1, lay.k_cols)
                table = jnp.asarray(pages.table(b)[layer][None])
                for h in range(lay.num_kv_heads):
                    survivors = np.flatnonzero(want[layer][0, h])
                    got_k, _ = head_paging.read(pool, table, h, lay, page_elems, max(len(survivors), 1))
                    ko = HeadLayout.offsets(lay.k_widths)[h]
                    np.testing.assert_array_equal(
                        np.asarray(got_k[0, : len(survivors)]), k_seq[survivors, ko : ko + lay.k_widths[h]], context
                    )
        pages.check()


def test_quantized_survivors_are_compacted_then_paged_as_one_head_at_a_time_would_be():
    """``compacted_round_trip`` against loops: each head's survivors gathered in order, round-tripped through pages
    of 4 as a one-head cache would, put back; a decoded query reads a survivor quantized iff the survivor's slot
    page was full when the query was decoded, and the prompt's rows read nothing quantized."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 16, (16, 8), (8, 16))
    b, t, prompt = 2, 23, 17
    q = jnp.asarray(rng.normal(size=(b, t, 2 * 16 + 2 * 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, 24)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, 24)), jnp.float32)
    kept = rng.random((b, 2, t)) < 0.5
    kept[..., prompt:] = True
    scheme = kv_schemes.Kivi(4, page_size=4)
    kq, vq, quant = compacted_round_trip(scheme, q, k, v, layout, jnp.asarray(kept), prompt)
    kq, vq, quant = np.asarray(kq), np.asarray(vq), np.asarray(quant)
    ko, vo = HeadLayout.offsets(layout.k_widths), HeadLayout.offsets(layout.v_widths)
    for i in range(b):
        for h in range(2):
            one = HeadLayout(2, 1, 16, (layout.k_widths[h],), (layout.v_widths[h],))
            ks, vs = slice(ko[h], ko[h] + layout.k_widths[h]), slice(vo[h], vo[h] + layout.v_widths[h])
            rows = np.flatnonzero(kept[i, h])
            want_k, want_v = scheme.round_trip(None, k[i : i + 1, rows, ks], v[i : i + 1, rows, vs], one)
            full = len(rows) // 4 * 4  # a partial last page is never read quantized (below), so never compared
            np.testing.assert_allclose(kq[i, rows[:full], ks], want_k[0, :full], rtol=1e-6, err_msg=f"seed {seed}")
            np.testing.assert_allclose(vq[i, rows[:full], vs], want_v[0, :full], rtol=1e-6, err_msg=f"seed {seed}")
            survivors = int(kept[i, h, :prompt].sum())
            for m in range(t):
                cached = survivors + m - prompt + 1
                want = [m >= prompt and slot // 4 < cached // 4 for slot in range(len(rows))]
                assert quant[i, h, m, rows].tolist() == want, f"seed {seed}: head {h} query {m}"


def test_quantized_pages_with_nothing_evicted_serve_as_the_quantized_cache_does(tiny_config):
    """Everything kept: the compacted slots are the positions, so the decoded rows read what
    ``quantized_causal_attention`` serves a prompt prefilled in one chunk. The prompt's rows agree to float
    rounding; the decoded rows to a small part of what quantizing moves them (at most a quarter at the largest, a
    tenth on average), because the two paths compute the prompt's keys in another order and a 4-bit code on a
    rounding boundary can flip, which every later query of that head then reads: seed 4192278983 moved them 1.2e-4,
    seed 508154321 (llama3_tied) 6.6e-3 at most and 8e-4 on average, where quantizing moves them 0.06 and 0.015.
    A wrong page, scale or code moves them as much as quantizing does."""
    seed = fresh_seed()
    model = kvjax.Model.random(tiny_config, seed=seed % 1000)
    tokens = np.random.default_rng(seed).integers(0, tiny_config.vocab_size, (2, 40))
    scheme = kv_schemes.Kivi(4, page_size=4)
    kept = [np.ones((2, lay.num_kv_heads, 30), bool) for lay in model.layouts]
    got = hidden_after(model, tokens, kept, kv=scheme)

    module = model.module
    positions = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))

    def attend(i, q, k, v, rebuild=None, rotation=None):
        return quantized_causal_attention(q, k, v, module.layouts[i], scheme, prompt=30)

    want = module.hidden(jnp.asarray(tokens, jnp.int32), positions, attend)
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got[:, :30], want[:, :30], rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    plain = np.asarray(model.hidden(tokens))[:, 30:]
    moved, apart = np.abs(got[:, 30:] - want[:, 30:]), np.abs(want[:, 30:] - plain)
    assert moved.max() <= 0.25 * apart.max() and moved.mean() <= 0.1 * apart.mean(), f"seed {seed}"
    assert not np.allclose(got[:, 30:], plain, atol=1e-2)  # it quantizes
    with pytest.raises(ValueError, match="ZipCache"):
        hidden_after(model, tokens, kept, kv=kv_schemes.parse("zipcache"))


def test_a_cut_by_groups_keeps_whole_groups_by_their_summed_scores_and_never_quantizes_again():
    """``reference.group_cut`` (continual eviction's cut on quantized pages, scored by the eviction bench): each head
    keeps its slot count rounded up to whole groups plus its partial group, every group whole, its last
    ``recent`` slots, and then the groups of highest best-slot score; its survivors then read, through
    ``compacted_round_trip``, exactly what pages quantized in place would serve (no group is quantized again),
    while a slot cut's do not. A sliding-window layer is not cut."""
    from kvjax.eviction.continual import whole_groups
    from kvjax.eviction.reference import group_cut

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000)
    group, p, b = 8, int(rng.integers(40, 64)), 2
    spec = Eviction("snapkv", ratio=float(rng.choice([2.0, 3.0])), page_size=group)
    layouts = model.module.layouts
    scores = [rng.random((b, lay.num_kv_heads, p)).astype(np.float32) for lay in layouts]
    slots = keep(model, scores, spec)
    cut = group_cut(model, scores, slots, group, spec.recent)
    full = p // group * group
    for layer, (mask, by_slot, score) in enumerate(zip(cut, slots, scores)):
        for i, h in np.ndindex(b, mask.shape[1]):
            m, where = mask[i, h], f"seed {seed}, layer {layer}, row {i}, head {h}"
            marks = m[:full].reshape(-1, group)
            assert (marks.all(-1) | ~marks.any(-1)).all(), where  # whole groups
            assert m[full:].all() and m[p - spec.recent :].all(), where  # the partial group, the recent slots
            assert m.sum() == whole_groups(by_slot[i, h].sum(), p, group), where
            best = score[i, h, :full].reshape(-1, group).max(-1)
            protected = np.arange(len(best)) >= (p - spec.recent) // group
            kept_free, dropped = best[marks.all(-1) & ~protected], best[~marks.all(-1)]
            if len(kept_free) and len(dropped):
                assert dropped.max() <= kept_free.min(), where

    layout, scheme = layouts[0], kv_schemes.Kivi(4, page_size=group)
    cols = (layout.q_cols, layout.k_cols, layout.v_cols)
    q, k, v = (jnp.asarray(rng.normal(size=(b, p, c)), jnp.float32) for c in cols)
    in_place = np.asarray(scheme.round_trip(q, k, v, layout)[0])
    ko = HeadLayout.offsets(layout.k_widths)
    kq = np.asarray(compacted_round_trip(scheme, q, k, v, layout, jnp.asarray(cut[0]), p)[0])
    for i, h in np.ndindex(b, layout.num_kv_heads):
        rows = np.flatnonzero(cut[0][i, h])[: int(cut[0][i, h].sum()) // group * group]  # in full pages
        cols = slice(ko[h], ko[h] + layout.k_widths[h])
        np.testing.assert_array_equal(kq[i, rows, cols], in_place[i, rows, cols], err_msg=f"seed {seed}")
    anew = np.asarray(compacted_round_trip(scheme, q, k, v, layout, jnp.asarray(slots[0]), p)[0])
    assert not np.array_equal(anew, in_place), f"seed {seed}: a slot cut quantizes its survivors anew"

    windowed = kvjax.Model.random(TINY_CONFIGS["mistral"], seed=seed % 1000)
    scores = [rng.random((1, lay.num_kv_heads, p)).astype(np.float32) for lay in windowed.module.layouts]
    for mask, lay in zip(group_cut(windowed, scores, keep(windowed, scores, spec), group, 8), windowed.module.layouts):
        assert (mask == (np.arange(p) >= p - lay.sliding_window)).all(), f"seed {seed}"
