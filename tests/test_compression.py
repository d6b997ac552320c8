import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS
from test_generate import argmax_continuation

import kvjax
from kvjax.cli import convert
from kvjax.compression import RankPlan, calibrate, calibration_tokens, fold, make_plan
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.engine import Engine

CASES = ["llama", "llama3_rope", "mistral", "falcon_7b", "falcon_new"]
WIDE = {name: dataclasses.replace(cfg, head_dim=64, hidden_size=128) for name, cfg in TINY_CONFIGS.items()}


@pytest.mark.parametrize("method", ["zack", "palu"])
@pytest.mark.parametrize("case", CASES)
def test_full_rank_compression_is_exact(case, method):
    """removal_rate=0 keeps every direction: the bases are invertible, so logits must not move."""
    model = kvjax.load(os.path.join(FIXTURES, case), dtype="float32", progress=False)
    tokens = np.load(os.path.join(FIXTURES, case, "reference.npz"))["tokens"]
    full = kvjax.compress(
        model, removal_rate=0.0, method=method, calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    assert full.plan.rate == 0.0
    np.testing.assert_allclose(np.asarray(full.logits(tokens)), np.asarray(model.logits(tokens)), atol=1e-4, rtol=0)


def _spectra(rng, layers=4, heads=4, d=128):
    decay = rng.uniform(0.9, 0.99, size=(layers, heads, 1))  # per-head variation
    return decay ** np.arange(d) * rng.uniform(1, 3, size=(layers, heads, 1))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.7])
def test_target_rate_is_hit_within_rounding(p):
    rng = np.random.default_rng(int(p * 100))
    s_qk, s_v = _spectra(rng), _spectra(rng)
    plan = RankPlan.for_target_rate("zack", s_qk, s_v, p)
    step = 16 / (2 * 4 * 128 * 4)  # one head one step of 16 columns, as a fraction of the cache
    assert p <= plan.rate <= p + 4 * step
    assert np.all(plan.k_qk % 16 == 0) and plan.k_qk.min() >= 16 and plan.k_v.max() <= 128
    assert len(set(plan.k_qk.ravel()) | set(plan.k_v.ravel())) > 1  # adaptive: ranks differ between heads
    uniform = RankPlan.for_target_rate("zack", s_qk, s_v, p, adaptive=False)
    assert len(set(uniform.k_qk.ravel())) == 1 and len(set(uniform.k_v.ravel())) == 1
    assert abs(uniform.rate - p) <= 8 / 256
    assert RankPlan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_removal_rate_rule():
    s = np.array([[[4.0, 3.0, 2.0, 1.0] + [0.0] * 28]])
    plan = RankPlan.from_removal_rate("zack", s, s, 0.0)
    assert plan.k_qk.tolist() == [[16]] and plan.rate == 0.5  # 4 directions round up to 16 of 32


def test_bad_rates_and_arguments():
    model = kvjax.Model.random(WIDE["llama"])
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
            kvjax.compress(model, target_rate=bad)
        with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
            kvjax.compress(model, removal_rate=bad)
    with pytest.raises(ValueError, match="exactly one"):
        kvjax.compress(model, target_rate=0.5, removal_rate=0.1)
    with pytest.raises(ValueError, match="method"):
        kvjax.compress(model, removal_rate=0.1, method="svd")
    with pytest.raises(ValueError, match="out of reach"):
        kvjax.compress(model, target_rate=0.9, calibration="random", num_tokens=64, seq_len=32, progress=False)


def test_calibration_text_too_short(tmp_path):
    model = kvjax.load("smollm2", dtype="float32", progress=False)
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    with pytest.raises(ValueError, match="fewer than the 1000 asked for"):
        calibration_tokens(model, f"text:{short}", num_tokens=1000)
    with pytest.raises(FileNotFoundError):
        calibration_tokens(model, f"text:{tmp_path / 'missing.txt'}")


def test_gram_of_v_matches_direct_computation():
    """Layer 0's V Gram equals the outer products of v rows computed straight from the weights; padding adds 0."""
    model = kvjax.Model.random(WIDE["llama"], seed=4)
    tokens = calibration_tokens(model, "random", num_tokens=40, seq_len=16, seed=1)  # 3 rows, 8 padded slots
    stats = calibrate(model, tokens, batch_size=2, progress=False)
    assert stats.num_tokens == 40
    block = model.module.layers[0]
    x = block.attn_norm(jnp.take(model.module.embed[...], tokens[tokens >= 0], axis=0))
    v = np.asarray(block.attn.project(x)[2], np.float64).reshape(40, 2, 64)
    np.testing.assert_allclose(stats.grams["v"][0], np.einsum("tgd,tge->gde", v, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["zack", "palu"])
def test_compressed_model_runs_everywhere(method, tmp_path):
    model = kvjax.Model.random(WIDE["mistral"], seed=5, scale=5.0)
    small = kvjax.compress(
        model, target_rate=0.5, method=method, calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    assert small.plan.rate >= 0.5
    # the cache spends exactly the plan's bytes
    assert bytes_per_token(small.layouts, jnp.bfloat16) == pytest.approx(
        (1 - small.plan.rate) * bytes_per_token(model.layouts, jnp.bfloat16)
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert kvjax.generate(small, [prompt], max_new_tokens=8)[0].tokens == argmax_continuation(small, prompt, 8)
    engine = Engine(small, max_batch=1, max_seq_len=32)
    assert [k.shape[-1] for k in engine.cache.k] == [sum(lay.k_widths) for lay in small.layouts]
    small.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32")
    assert back.plan.to_json() == small.plan.to_json()
    np.testing.assert_array_equal(np.asarray(back.logits([prompt])), np.asarray(small.logits([prompt])))
    with pytest.raises(FileExistsError):
        small.save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="already compressed"):
        kvjax.compress(small, removal_rate=0.1)


def test_a_format_1_checkpoint_loads_with_its_rotations_packed(tmp_path):
    """Format 1 stored a ZACK layer's rotation per group, zero-padded to the widest ([Hkv, d, W]); it loads into
    today's packed [d, k_cols] and gives the same logits."""
    import orbax.checkpoint as ocp
    from flax.traverse_util import unflatten_dict

    from kvjax.models.transformer import separate_params

    model = kvjax.Model.random(dataclasses.replace(WIDE["mistral"], num_heads=8, num_kv_heads=4), seed=3, scale=5.0)
    small = kvjax.compress(model, target_rate=0.4, calibration="random", num_tokens=256, seq_len=64, progress=False)
    assert any(len(set(lay.k_widths)) > 1 for lay in small.layouts)  # groups of other widths: padding shows
    small.save(str(tmp_path / "ckpt"))
    params = unflatten_dict(separate_params(small.module))
    for layout, layer in zip(small.layouts, params["layers"].values()):
        packed, width = np.asarray(layer["attn"]["qk_rotation"]), max(layout.k_widths)
        old = np.zeros((layout.num_kv_heads, layout.head_dim, width), packed.dtype)
        for g, (start, w) in enumerate(zip(kvjax.layout.HeadLayout.offsets(layout.k_widths), layout.k_widths)):
            old[g, :, :w] = packed[:, start : start + w]
        layer["attn"]["qk_rotation"] = old
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(str(tmp_path / "old" / "params"), params)
    checkpointer.wait_until_finished()
    for part in ("plan.json", "tokenizer"):
        if (tmp_path / "ckpt" / part).exists():
            os.rename(tmp_path / "ckpt" / part, tmp_path / "old" / part)
    meta = json.loads((tmp_path / "ckpt" / "kvjax.json").read_text())
    (tmp_path / "old" / "kvjax.json").write_text(json.dumps({**meta, "format": 1}))
    back = kvjax.load(str(tmp_path / "old"), dtype="float32")
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    np.testing.assert_array_equal(np.asarray(back.logits(prompt)), np.asarray(small.logits(prompt)))


@pytest.mark.parametrize("method", ["zack", "palu"])
@pytest.mark.parametrize("case", ["mistral", "falcon_new"])  # falcon_new: q/k/v biases
def test_head_order_leaves_the_output_unchanged(case, method):
    """Any order of the KV heads (with their query heads and W_o's rows) folds into the same function."""
    model = kvjax.Model.random(dataclasses.replace(WIDE[case], num_heads=8, num_kv_heads=4), seed=3, scale=5.0)
    stats = calibrate(model, calibration_tokens(model, "random", 128, 64), progress=False)
    plan, bases = make_plan(model, stats, target_rate=0.4, method=method, order_heads=False)
    rng = np.random.default_rng()
    order = np.stack([rng.permutation(4) for _ in range(plan.num_layers)])
    mixed = dataclasses.replace(plan, head_order=order)
    a, b = fold(model, plan, bases), fold(model, mixed, bases)
    for i, (lay_a, lay_b) in enumerate(zip(a.layouts, b.layouts)):
        assert lay_b.k_widths == tuple(lay_a.k_widths[h] for h in order[i])
        assert lay_b.v_widths == tuple(lay_a.v_widths[h] for h in order[i])
    tokens = [rng.integers(0, 97, 12).tolist()]
    # float32 sums in another order: logits of magnitude ~10 agree to ~1e-4; a wrong permutation moves them by ~1
    np.testing.assert_allclose(np.asarray(b.logits(tokens)), np.asarray(a.logits(tokens)), atol=1e-3, rtol=0)
    assert RankPlan.from_json(mixed.to_json()).layer_order(1) == tuple(order[1])
    with pytest.raises(ValueError, match="permutation"):
        dataclasses.replace(plan, head_order=np.zeros_like(order))


def test_plans_order_heads_for_the_decode_runs():
    """make_plan's default order: adjacent heads whose widths fill the kernel's tiles (search.order_heads)."""
    from kvjax.layout import HeadLayout
    from kvjax.ops.decode.config import DECODE
    from kvjax.ops.decode.search import order_heads

    k_qk, k_v = np.array([[48, 64, 80, 64]]), np.array([[96, 64, 32, 64]])
    s = np.ones((1, 4, 128))
    config = dataclasses.replace(DECODE, pack_tile=128)
    plan = RankPlan("zack", 128, k_qk, k_v, s, s).ordered_for_runs(group_size=4, config=config)
    assert plan.layer_order(0) == order_heads(HeadLayout(16, 4, 128, (48, 64, 80, 64), (96, 64, 32, 64)), config)
    assert plan.layer_order(0) != (0, 1, 2, 3)
    assert "reordered" in plan.summary()


def test_plans_fill_the_decode_runs_at_the_same_rate():
    """make_plan's default fill (RankPlan.filled_for_runs): a few columns move between heads, the rate stays."""
    from kvjax.layout import HeadLayout
    from kvjax.ops.decode.search import order_heads, permuted, runs_cost

    k_qk = np.array([[48, 32, 48, 80, 64, 112, 48, 80]] * 2)
    k_v = np.array([[96, 48, 64, 80, 64, 32, 96, 32]] * 2)
    s = np.sort(np.random.default_rng().random((2, 8, 128)), axis=-1)[..., ::-1] ** 3
    plan = RankPlan("zack", 128, k_qk, k_v, s, s, removal_rate=0.3)
    filled = plan.filled_for_runs(group_size=4)
    assert filled.rate == plan.rate
    assert np.abs(filled.k_qk - k_qk).max() <= 32 and np.abs(filled.k_v - k_v).max() <= 32
    assert filled.moved_columns == (np.abs(filled.k_qk - k_qk).sum() + np.abs(filled.k_v - k_v).sum()) // 2 > 0

    def cost(p, i):
        lay = HeadLayout(32, 8, 128, *p.layer_widths(i))
        return runs_cost(permuted(lay, order_heads(lay)))

    ordered = filled.ordered_for_runs(group_size=4)
    assert all(cost(ordered, i) < cost(plan.ordered_for_runs(group_size=4), i) for i in range(2))
    assert "moved between heads" in ordered.summary()
    assert RankPlan.from_json(ordered.to_json()).moved_columns == filled.moved_columns
    with pytest.raises(ValueError, match="before ordering"):
        ordered.filled_for_runs(group_size=4)


def test_converter_writes_atomically_and_rejects_bad_input(tmp_path, capsys):
    src = os.path.join(FIXTURES, "falcon_new")
    out = tmp_path / "out"
    flags = "--removal-rate 0.2 --calibration random --num-tokens 128 --seq-len 64 --fill-tiles".split()
    assert convert.main([src, str(out), *flags]) == 0
    assert "overall rate p" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["kvjax.json", "params", "plan.json"]
    assert kvjax.load(str(out)).plan.method == "zack"
    for argv in (
        [src, str(out), "--removal-rate", "0.2"],  # exists
        [src, str(tmp_path / "x"), "--target-rate", "1.2"],
        [src, "/nonexistent-dir/out", "--removal-rate", "0.2"],
        [src, str(tmp_path / "y"), "--removal-rate", "0.2", "--calibration", "text:/missing.txt"],
        [src, str(tmp_path / "z"), "--removal-rate", "0.2", "--calibration", "text"],
    ):  # no tokenizer
        with pytest.raises(SystemExit):
            convert.main(argv)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing half-written
