"""bench/accuracy.py's eval mode: the code source's parts, the per-window perplexity, KL and top-1 metrics, the
variants and --k-share rows, the --kv-bits rows (quantized pages) and their overall rates, and the largest rate at 99%
of baseline (bisection) and retrieval's tolerance summary."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from bench import accuracy  # noqa: E402
from kvjax.compression import make_plan
from kvjax.compression.text import CODE_PACKAGES, pydoc_text, stdlib_code, stdlib_code_files
from kvjax.ops.kv_schemes import Kivi
from kvjax.ops.quant import PageFormat

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)  # compressible heads
ROW_KEYS = {"source", "window", "tokens", "calibration", "variant", "max_context", "k_share", "target_rate", "rate"}
ROW_KEYS |= {"probe", "kv_bits", "overall_rate", "qk_basis", "qk_widths"}
GRID = [0.25, 0.375, 0.5]
SCORE_KEYS = {"ppl", "kl", "top1"}


def random_ids(rng, n: int) -> np.ndarray:
    return rng.integers(1, WIDE.vocab_size, n)  # never 0


def perturbed(model, rng, scale: float = 0.05, vocab: bool = False):
    """``model`` with every weight moved by ``scale`` times its own magnitude of random noise; the embedding and
    output weights too only if ``vocab`` (compression never moves them)."""

    def move(path, w):
        if not vocab and any(getattr(key, "key", None) in ("embed", "lm_head") for key in path):
            return w
        return w * (1 + scale * rng.standard_normal(w.shape).astype(w.dtype))

    state = jax.tree_util.tree_map_with_path(move, model.state)
    from flax import nnx

    return kvjax.Model(nnx.merge(model.graphdef, state))


def test_code_parts_are_disjoint_nonempty_and_deterministic():
    cal, held = stdlib_code_files("calibration"), stdlib_code_files("heldout")
    assert cal and held and not set(cal) & set(held)
    assert all(f.split("/")[0] in CODE_PACKAGES["calibration"] for f in cal)
    assert all(f.split("/")[0] in CODE_PACKAGES["heldout"] for f in held)
    assert cal == sorted(cal) and held == sorted(held) and len(set(cal)) == len(cal)
    for part, files in (("calibration", cal), ("heldout", held)):
        text = stdlib_code(part)
        assert len(text) > 100_000 and text == stdlib_code(part)
        assert all(f"# {f}\n" in text for f in files)
        other = held if part == "calibration" else cal
        assert not any(f"# {f}\n" in text for f in other)
    with pytest.raises(ValueError, match="part must be"):
        stdlib_code("train")
    with pytest.raises(ValueError, match="part must be"):
        pydoc_text("train")


def test_a_model_against_itself_has_zero_kl_and_full_agreement():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    ids = random_ids(rng, 96)
    own, again = accuracy.compare_windows(model, [lambda: model], ids, window=32)
    for s in (own, again):
        assert abs(s["kl"]) < 1e-6 and s["top1"] == 1.0, f"seed {seed}: {s}"
        assert len(s["per_window"]) == 3, f"seed {seed}"
    np.testing.assert_allclose(again["ppl"], own["ppl"], rtol=1e-6, err_msg=f"seed {seed}")
    # the same perplexity as the existing rates mode's, over the same windows
    np.testing.assert_allclose(own["ppl"], accuracy.perplexity(model, ids, 32), rtol=1e-5, err_msg=f"seed {seed}")


def base_and_perturbed():
    """(seed, its generator, a random model, the model perturbed) for one test."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    base = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    return seed, rng, base, perturbed(base, rng)


def test_a_perturbed_model_has_positive_kl_and_agreement_in_range():
    seed, rng, base, other = base_and_perturbed()
    ids = random_ids(rng, 80)
    _, s = accuracy.compare_windows(base, [lambda: other], ids, window=40)
    assert s["kl"] > 0 and 0.0 <= s["top1"] <= 1.0 and s["ppl"] > 1.0, f"seed {seed}: {s}"
    # KL and top-1 of one window, straight from the definition in float64
    window = ids[:40]
    p = np.asarray(jax.nn.log_softmax(np.asarray(base.logits(window[None]), np.float64)[0, :-1], axis=-1))
    q = np.asarray(jax.nn.log_softmax(np.asarray(other.logits(window[None]), np.float64)[0, :-1], axis=-1))
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    top1 = float(np.mean(p.argmax(-1) == q.argmax(-1)))
    first = s["per_window"][0]
    np.testing.assert_allclose(first["kl"], kl, rtol=1e-3, atol=1e-6, err_msg=f"seed {seed}")
    assert first["top1"] == top1, f"seed {seed}: {first['top1']} != {top1}"
    assert len(s["per_window"]) == 2, f"seed {seed}"


def test_log_probs_a_few_rows_at_a_time_give_the_whole_windows_numbers():
    seed, rng, base, other = base_and_perturbed()
    ids = random_ids(rng, 80)
    whole = accuracy.compare_windows(base, [lambda: other], ids, window=40, rows=64)
    blocks = accuracy.compare_windows(base, [lambda: other], ids, window=40, rows=int(rng.integers(3, 12)))
    for a, b in zip(whole, blocks, strict=True):
        for key in ("ppl", "kl", "top1"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=f"seed {seed}: {key}")


def test_a_model_with_other_vocabulary_weights_is_refused():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    base = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    other = perturbed(base, rng, vocab=True)
    with pytest.raises(ValueError, match="embedding and output weights"):
        accuracy.compare_windows(base, [lambda: other], random_ids(rng, 40), window=40)


def random_eval_model(monkeypatch) -> int:
    """Make ``accuracy.main`` load a fresh random model and score random held-out ids; returns the seed."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: model)
    monkeypatch.setattr(accuracy, "heldout_ids", lambda m, source, n: random_ids(rng, n))
    return seed


def test_eval_mode_writes_every_number_as_json(tmp_path, monkeypatch, capsys):
    seed = random_eval_model(monkeypatch)
    writes: list = []

    def write_json(path, data, **kwargs):
        writes.append((data["complete"], len(data["rows"])))
        real_write_json(path, data, **kwargs)

    real_write_json = accuracy.write_json
    monkeypatch.setattr(accuracy, "write_json", write_json)
    out = tmp_path / "eval.json"
    flags = ["--rates", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "zack", "palu", "--windows", "32", "64", "--eval-tokens", "128"]
    accuracy.main(["eval", *flags, "--max-context", "none", "128", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["mode"] == "eval" and data["args"]["windows"] == [32, 64], f"seed {seed}"
    # rewritten after each group (zack without and with max_context, palu), the uncompressed rows with the first
    assert writes == [(False, 8), (False, 12), (False, 16), (True, 16)], f"seed {seed}: {writes}"
    assert data["complete"] and data["at_99"] == [], f"seed {seed}"
    rows = data["rows"]
    # per source and window: uncompressed, zack without and with max_context, palu
    assert len(rows) == 2 * 2 * 4, f"seed {seed}: {len(rows)} rows"
    for row in rows:
        assert set(row) == ROW_KEYS | SCORE_KEYS | {"per_window"}, f"seed {seed}: {sorted(row)}"
        assert row["tokens"] == 128 and len(row["per_window"]) == 128 // row["window"], f"seed {seed}: {row}"
        assert row["k_share"] is None and row["probe"] is False, f"seed {seed}: {row}"
        assert row["kv_bits"] is None and row["overall_rate"] == row["rate"], f"seed {seed}: {row}"
        assert all(set(w) == SCORE_KEYS for w in row["per_window"]), f"seed {seed}"
        assert row["kl"] >= 0 and 0 <= row["top1"] <= 1 and row["ppl"] > 1, f"seed {seed}: {row}"
    assert {(r["variant"], r["max_context"]) for r in rows} == {
        ("uncompressed", None),
        ("zack", None),
        ("zack", 128),
        ("palu", None),
    }, f"seed {seed}"
    qk = {"uncompressed": (None, None), "zack": ("shared", "shared"), "palu": (None, None)}
    assert all((r["qk_basis"], r["qk_widths"]) == qk[r["variant"]] for r in rows), f"seed {seed}"
    for row in rows:
        if row["variant"] == "uncompressed":
            assert row["kl"] == 0 and row["top1"] == 1, f"seed {seed}: {row}"
        else:
            assert row["rate"] >= 0.5 and row["kl"] > 0, f"seed {seed}: {row}"
    printed = capsys.readouterr().out
    assert "| source | window | tokens |" in printed and "per_window" not in printed, f"seed {seed}"
    assert "| k_share | kv_bits | target_rate | rate | overall_rate |" in printed, f"seed {seed}"


def test_measured_variants_probe_once_a_group_and_plan_by_it(tmp_path, monkeypatch):
    """A -measured variant probes its heads once (every rate of the group reuses the probes), is banded where its
    name says so, and takes no --k-share rows; other modes refuse it by name."""
    random_eval_model(monkeypatch)
    seen = []
    real = accuracy.measure_sensitivity

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(accuracy, "measure_sensitivity", spy)
    out = tmp_path / "eval.json"
    flags = ["--rates", "0.3", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "zack-band16-measured", "--windows", "64", "--eval-tokens", "128", "--k-share", "none"]
    accuracy.main(["eval", *flags, "0.4", "--json", str(out)])
    assert [kw["band"] for kw in seen] == [16]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["variant"] != "uncompressed"]
    assert sorted({r["target_rate"] for r in rows}) == [0.3, 0.5] and {r["k_share"] for r in rows} == {None}
    assert all(r["rate"] >= r["target_rate"] for r in rows)
    with pytest.raises(SystemExit):
        accuracy.main(["rates", "--variants", "palu-measured"])


def test_pick_variants_keep_the_basis_the_library_picks_at_each_rate(tmp_path, monkeypatch):
    """A -pick variant asks ``pipeline.pick_qk_basis`` once a rate, at its band and rate on the calibration source,
    and its rows are the plans of that pick, which they record."""
    seed = random_eval_model(monkeypatch)
    seen = []
    real = accuracy.pick_qk_basis

    def spy(model, stats, calibration, tokens, pick_seed, settings, widths):
        picked = real(model, stats, calibration, tokens, pick_seed, settings, widths)
        seen.append((calibration, settings["band"], settings["target_rate"], widths, picked))
        return picked

    monkeypatch.setattr(accuracy, "pick_qk_basis", spy)
    out = tmp_path / "eval.json"
    flags = ["--rates", "0.3", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "zack-band16-pick", "--windows", "64", "--eval-tokens", "128"]
    accuracy.main(["eval", *flags, "--json", str(out)])
    assert [s[:4] for s in seen] == [("random", 16, 0.3, True), ("random", 16, 0.5, True)], f"seed {seed}: {seen}"
    rows = [r for r in json.loads(out.read_text())["rows"] if r["variant"] != "uncompressed"]
    picks = {p: picked for *_, p, _, picked in seen}
    assert rows and all((r["qk_basis"], r["qk_widths"]) == picks[r["target_rate"]] for r in rows), f"seed {seed}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--windows", "0"], "--windows"),
        (["--eval-tokens", "-5"], "--eval-tokens"),
        (["--max-context", "lots"], "--max-context"),
        (["--windows", "512"], "--windows 512 exceeds"),
        (["--windows", "64", "--eval-tokens", "32"], "--eval-tokens 32"),
        (["--k-share", "0"], "--k-share: must be a number strictly between 0 and 1 or 'none', got '0'"),
        (["--k-share", "none", "1"], "must be a number strictly between 0 and 1 or 'none'"),
        (["--k-share", "lots"], "--k-share"),
        (["--bisect-steps", "-1"], "--bisect-steps: must be a non-negative integer, got '-1'"),
        (
            ["--windows", "64", "--bisect-steps", "2", "--max-rate", "1.5"],
            "--max-rate must lie strictly between 0 and 1",
        ),
        (["--windows", "64", "--json", "/nonexistent/dir/eval.json"], "--json /nonexistent"),
    ],
)
def test_eval_mode_refuses_bad_flags_by_name(flags, message, monkeypatch, capsys):
    model = kvjax.Model.random(WIDE)
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: model)
    with pytest.raises(SystemExit):
        accuracy.main(["eval", *flags])
    assert message in capsys.readouterr().err


def probe_counting(calls: list):
    """A probe whose result is its rate, recording every rate it is asked."""

    def probe(rate):
        calls.append(rate)
        return rate

    return probe


@pytest.mark.parametrize("steps", [0, 1, 6])
@pytest.mark.parametrize(
    "threshold, lower, upper, grid_probes",
    [
        (0.43, 0.375, 0.5, 3),  # between two grid rates
        (0.3, 0.25, 0.375, 2),
        (0.1, 0.0, 0.25, 1),  # below the grid: the bracket starts at 0
        (0.9, 0.5, 0.75, 3),  # every grid rate passes: the bracket ends at the upper bound
        (0.5, 0.5, 0.75, 3),  # the largest grid rate exactly
    ],
)
def test_largest_passing_bisects_the_grid_bracket(steps, threshold, lower, upper, grid_probes):
    calls: list = []
    grid = GRID[::-1]  # any order
    target, result = accuracy.largest_passing(probe_counting(calls), grid, lambda r: r <= threshold, steps, 0.75)
    truth = min(threshold, upper)
    assert lower <= target <= truth and truth - target <= (upper - lower) / 2**steps + 1e-12, (target, truth)
    assert result == (target if target > 0 else None)
    # the grid up to its first failure, then one probe a step, never a rate twice
    assert calls[:grid_probes] == sorted(GRID)[:grid_probes] and len(calls) == grid_probes + steps
    assert len(set(calls)) == len(calls)


def test_largest_passing_when_nothing_passes_and_on_a_non_monotone_grid():
    for steps in (0, 4):
        calls: list = []
        assert accuracy.largest_passing(probe_counting(calls), GRID, lambda r: False, steps, 0.75) == (0.0, None)
        assert len(calls) == 1 + steps and all(0 < r <= 0.25 for r in calls)
    # 0.375 fails: 0.5 passing above it does not count; the bracket is [0.25, 0.375]
    target, _ = accuracy.largest_passing(lambda r: r, GRID, lambda r: r != 0.375 and r < 0.3, 3, 0.75)
    assert 0.25 <= target < 0.3
    # an upper bound not above the grid: no bisection past it
    calls = []
    assert accuracy.largest_passing(probe_counting(calls), GRID, lambda r: True, 5, 0.5) == (0.5, 0.5)
    assert calls == GRID


def test_cached_probes_are_shared_across_predicates():
    calls: list = []
    probe = accuracy.cached(probe_counting(calls), known={0.25: 0.25, 0.5: 0.5})
    first = accuracy.largest_passing(probe, [0.25, 0.5], lambda r: r <= 0.6, 3, 0.75)
    assert first == (0.59375, 0.59375) and calls == [0.625, 0.5625, 0.59375]  # the grid came from the cache
    assert accuracy.largest_passing(probe, [0.25, 0.5], lambda r: r <= 0.6, 3, 0.75) == first
    assert len(calls) == 3
    # a looser test walks 0.625 (cached), 0.6875 and 0.71875 (new)
    assert accuracy.largest_passing(probe, [0.25, 0.5], lambda r: r <= 0.7, 3, 0.75)[0] == 0.6875
    assert calls[3:] == [0.6875, 0.71875] and set(probe.results) == {0.25, 0.5, *calls}


@pytest.mark.parametrize("k_share", [None, 0.4])
def test_palu_uniform_gives_every_head_of_a_layer_one_width(k_share):
    model = kvjax.Model.random(WIDE, seed=0, scale=3.0)
    stats = accuracy._calibrate(model, "random", 128, 64)
    method, adaptive = accuracy.VARIANTS["palu-uniform"]
    plan, _ = make_plan(model, stats, target_rate=0.5, method=method, adaptive=adaptive, k_share=k_share)
    assert plan.method == "palu" and not plan.adaptive and plan.rate >= 0.5 and plan.k_share == k_share
    assert plan.k_qk.shape == (WIDE.num_layers, WIDE.num_kv_heads) and WIDE.num_kv_heads > 1
    for layer in range(plan.num_layers):
        k, v = plan.layer_widths(layer)
        assert len(set(k)) == 1 and len(set(v)) == 1, (layer, k, v)


def test_k_share_values_parse():
    args = accuracy.parser().parse_args(["eval", "--k-share", "none", "0.4", "NONE", "0.75"])
    assert args.k_share == [None, 0.4, None, 0.75]
    assert accuracy.parser().parse_args(["eval"]).k_share == [None]


def test_eval_bisects_for_the_largest_rate_at_99_percent(tmp_path, monkeypatch, capsys):
    seed = random_eval_model(monkeypatch)
    out = tmp_path / "eval.json"
    flags = ["--rates", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "palu-uniform", "--k-share", "0.4", "--windows", "32", "64", "--eval-tokens", "128"]
    accuracy.main(["eval", *flags, "--bisect-steps", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    rows, at_99 = data["rows"], data["at_99"]
    assert data["complete"], f"seed {seed}"
    for row in rows:
        assert set(row) == ROW_KEYS | SCORE_KEYS | {"per_window"}, f"seed {seed}: {sorted(row)}"
    base = {(r["source"], r["window"]): r for r in rows if r["variant"] == "uncompressed"}
    assert len(base) == 4 and all(not r["probe"] and r["k_share"] is None for r in base.values()), f"seed {seed}"
    mine = [r for r in rows if r["variant"] == "palu-uniform"]
    assert all(r["k_share"] == 0.4 for r in mine), f"seed {seed}"
    grid = {r["target_rate"] for r in mine if not r["probe"]}
    probes = {r["target_rate"] for r in mine if r["probe"]}
    # one bisection step of a bracket from the grid, [0, 0.5] or [0.5, 0.75]; each probe scores every source and window
    assert grid == {0.5} and probes and probes <= {0.25, 0.625}, f"seed {seed}: {probes}"
    assert len(mine) == (len(grid) + len(probes)) * 2 * 2, f"seed {seed}"
    assert {(e["source"], e["metric"]) for e in at_99} == {
        (s, m) for s in ("prose", "code") for m in ("ppl", "top1")
    }, f"seed {seed}"
    for e in at_99:
        test = accuracy.AT_99[e["metric"]]
        assert e["window"] == 64 and e["variant"] == "palu-uniform" and e["k_share"] == 0.4, f"seed {seed}: {e}"
        assert e["base"] == base[(e["source"], 64)][e["metric"]], f"seed {seed}: {e}"
        at = {r["target_rate"]: r for r in mine if (r["source"], r["window"]) == (e["source"], 64)}
        passing = {t for t, r in at.items() if test(r[e["metric"]], e["base"])}
        if 0.5 in passing:  # the bracket [0.5, 0.75]
            assert e["target_rate"] == (0.625 if 0.625 in passing else 0.5), f"seed {seed}: {e}"
        else:  # the bracket [0, 0.5]
            assert e["target_rate"] == (0.25 if 0.25 in passing else 0.0), f"seed {seed}: {e}"
        if e["target_rate"] == 0.0:
            assert e["rate"] == 0.0 and e["value"] == e["base"], f"seed {seed}: {e}"
        else:
            there = at[e["target_rate"]]
            assert there["rate"] == e["rate"] >= e["target_rate"] and there[e["metric"]] == e["value"], f"seed {seed}"
    printed = capsys.readouterr().out
    assert "largest rate at 99% of baseline" in printed
    assert "| metric | target_rate | rate | overall_rate | value | base |" in printed


def page_bytes_by_hand(k_widths, v_widths, page: int, bits: int) -> int:
    """One layer's quantized page from first principles: ``bits`` a code, a float16 scale and zero per key column
    and per value token and head, each of the four parts padded to 16 bytes."""

    def pad(n):
        return -(-n // 16) * 16

    k, v = sum(k_widths), sum(v_widths)
    return pad(page * k * bits // 8) + pad(page * v * bits // 8) + pad(2 * k * 2) + pad(2 * page * len(v_widths) * 2)


def expected_overall(base, layouts, bits, page: int) -> float:
    """1 - cache bytes per token of ``layouts`` (``bits``-bit pages, or bfloat16) / ``base``'s in bfloat16."""
    full = 2 * sum(lay.k_cols + lay.v_cols for lay in base.layouts)
    if bits is None:
        return 1 - 2 * sum(lay.k_cols + lay.v_cols for lay in layouts) / full
    pages = sum(PageFormat.for_layout(lay, page, bits).page_bytes for lay in layouts)
    assert pages == sum(page_bytes_by_hand(lay.k_widths, lay.v_widths, page, bits) for lay in layouts)
    return 1 - pages / page / full


def zack_plan(model, rate: float = 0.5):
    """The zack plan and bases eval builds for ``model`` at ``rate`` from 128 random calibration tokens, rows of 64."""
    stats = accuracy._calibrate(model, "random", 128, 64)
    return make_plan(model, stats, target_rate=rate, method="zack", adaptive=True)


def test_overall_rate_counts_every_byte_of_a_page():
    model = kvjax.Model.random(WIDE, seed=0, scale=3.0)
    # uncompressed WIDE: 2 layers of 2 KV heads of 64 columns, 1024 bfloat16 bytes a token; a 4-bit page of 32
    # tokens is 2048 + 2048 code bytes + 512 key and 256 value scale/zero bytes a layer: 304 bytes a token
    hand = {(4, 32): 1 - 304 / 1024, (2, 32): 1 - 176 / 1024, (4, 16): 1 - 336 / 1024, (2, 16): 1 - 208 / 1024}
    for (bits, page), rate in hand.items():
        assert accuracy.overall_rate(model, None, bits, page) == pytest.approx(rate, abs=1e-12), (bits, page)
    assert accuracy.overall_rate(model, None, None, 32) == 0.0
    plan, bases = zack_plan(model)
    layouts = accuracy.fold(model, plan, bases).layouts
    assert accuracy.overall_rate(model, plan, None, 32) == plan.rate
    assert plan.rate == pytest.approx(expected_overall(model, layouts, None, 32), abs=1e-12)
    for bits in (4, 2):
        for page in (16, 32, 48):
            got = accuracy.overall_rate(model, plan, bits, page)
            assert got == pytest.approx(expected_overall(model, layouts, bits, page), abs=1e-12), (bits, page)
            assert got > accuracy.overall_rate(model, None, bits, page) and got > plan.rate, (bits, page)


def test_eval_kv_bits_rows_quantize_every_model_against_the_unquantized_base(tmp_path, monkeypatch, capsys):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    ids = random_ids(rng, 128)
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: model)
    monkeypatch.setattr(accuracy, "heldout_ids", lambda m, source, n: ids[:n])
    flags = ["--rates", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "zack", "--sources", "prose", "--windows", "64", "--eval-tokens", "128"]
    plain, quant = tmp_path / "plain.json", tmp_path / "quant.json"
    accuracy.main(["eval", *flags, "--json", str(plain)])
    capsys.readouterr()
    kv = ["--kv-bits", "4", "none", "2", "--kv-page", "16"]
    accuracy.main(["eval", *flags, *kv, "--bisect-steps", "1", "--json", str(quant)])
    printed = capsys.readouterr().out
    data = json.loads(quant.read_text())
    rows, at_99 = data["rows"], data["at_99"]
    assert data["complete"] and data["args"]["kv_bits"] == [4, None, 2] and data["args"]["kv_page"] == 16
    for row in rows:
        assert set(row) == ROW_KEYS | SCORE_KEYS | {"per_window"}, f"seed {seed}: {sorted(row)}"
    grid = [r for r in rows if not r["probe"]]
    # the unquantized base first, then it over 4- and 2-bit pages, then zack's groups in --kv-bits order
    assert [(r["variant"], r["kv_bits"]) for r in grid] == [
        ("uncompressed", None),
        ("uncompressed", 4),
        ("uncompressed", 2),
        ("zack", 4),
        ("zack", None),
        ("zack", 2),
    ], f"seed {seed}"
    # kv_bits none: the very rows of a run without --kv-bits
    before = json.loads(plain.read_text())["rows"]
    assert [r for r in grid if r["kv_bits"] is None] == before, f"seed {seed}"
    plan, bases = zack_plan(model)
    layouts = accuracy.fold(model, plan, bases).layouts
    for row in grid:
        own = model.layouts if row["variant"] == "uncompressed" else layouts
        assert row["overall_rate"] == pytest.approx(expected_overall(model, own, row["kv_bits"], 16), abs=1e-12)
        assert row["rate"] == (0.0 if row["variant"] == "uncompressed" else plan.rate), f"seed {seed}: {row}"
        if row["kv_bits"] is not None:  # scored against the unquantized base
            assert row["kl"] > 0, f"seed {seed}: {row}"
    # the uncompressed model over 4-bit pages of 16 tokens, straight from Model.hidden, window by window
    row = grid[1]
    for w, scores in enumerate(row["per_window"]):
        window = ids[64 * w : 64 * (w + 1)][None]
        p = np.asarray(jax.nn.log_softmax(np.asarray(model.logits(window), np.float64)[0, :-1], axis=-1))
        hidden = model.hidden(window, kv=Kivi(4, 16))
        q = np.asarray(jax.nn.log_softmax(np.asarray(model.project(hidden), np.float64)[0, :-1], axis=-1))
        kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
        np.testing.assert_allclose(scores["kl"], kl, rtol=1e-3, atol=1e-6, err_msg=f"seed {seed}: window {w}")
    # bisection per group, kv_bits included; each entry's overall rate is its target's row's
    assert {(e["kv_bits"], e["metric"]) for e in at_99} == {(b, m) for b in (4, None, 2) for m in ("ppl", "top1")}
    for e in at_99:
        there = [
            r
            for r in rows
            if r["variant"] == "zack" and (r["kv_bits"], r["target_rate"]) == (e["kv_bits"], e["target_rate"])
        ]
        assert e["overall_rate"] == (there[0]["overall_rate"] if there else 0.0), f"seed {seed}: {e}"
    assert "quantized pages of 16 tokens" in printed and "| kv_bits | target_rate | rate | overall_rate |" in printed


def test_kv_bits_values_parse():
    assert accuracy.parser().parse_args(["eval", "--kv-bits", "NONE", "2", "4"]).kv_bits == [None, 2, 4]
    args = accuracy.parser().parse_args(["eval"])
    assert args.kv_bits == [None] and args.kv_page == 32


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--kv-bits", "3"], "--kv-bits: must be 4, 2, gear4, gear2, zipcache or 'none', got '3'"),
        (["eval", "--kv-bits", "none", "8"], "--kv-bits: must be 4, 2, gear4, gear2, zipcache or 'none', got '8'"),
        (["eval", "--kv-page", "0"], "--kv-page: must be a positive integer, got '0'"),
        (["eval", "--kv-page", "-32"], "--kv-page: must be a positive integer"),
        (["eval", "--kv-bits", "4", "4", "--variants", "zack"], "--kv-bits values must be distinct, got 4 4"),
        (["eval", "--kv-bits", "4"], "not palu palu-uniform (their K is rebuilt as it is read)"),
        (
            ["eval", "--kv-bits", "none", "2", "--variants", "zack", "palu"],
            "not palu (their K is rebuilt as it is read)",
        ),
        (["eval", "--kv-bits", "4", "--variants", "zack-band16"], "not zack-band16 (their K is rebuilt as it is read)"),
        (["retrieval", "--kv-bits", "zipcache", "--variants", "zack"], "ZipCache is scored by eval only"),
        (["search", "--kv-bits", "4"], "--kv-bits applies to eval and retrieval only"),
    ],
)
def test_kv_flags_are_one_line_usage_errors_before_any_model_loads(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: pytest.fail("loaded a model for bad flags"))
    with pytest.raises(SystemExit) as exit_:
        accuracy.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err, err


def fake_run(variant: str, target: float, accuracies: dict, task: str = "passkey", k_share=None) -> dict:
    """A ``run_retrieval`` run: per context, the accuracy at depths 0 and 1."""
    depths = [0.0, 1.0]
    cells = [
        {"context": c, "depth": d, "trials": 50, "correct": round(a * 50), "accuracy": a}
        for c, accs in accuracies.items()
        for d, a in zip(depths, accs, strict=True)
    ]
    results = {"contexts": list(accuracies), "depths": depths, "cells": cells}
    if variant == "uncompressed":
        fields = accuracy.UNCOMPRESSED
    else:
        fields = {"calibration": "random", "variant": variant, "max_context": None, "k_share": k_share}
        fields |= {"kv_bits": None, "target_rate": target, "rate": target + 0.01, "overall_rate": target + 0.01}
        fields |= {"qk_basis": "shared", "qk_widths": "shared"}
    return fields | {"task": task, "results": results}


def test_retrieval_tolerance_summary_takes_the_grid_up_to_the_first_failure():
    runs = [
        fake_run("uncompressed", 0.0, {1024: (1.0, 1.0), 2048: (1.0, 0.9)}),
        fake_run("uncompressed", 0.0, {1024: (0.5, 0.5)}, task="multikey"),
        fake_run("zack", 0.5, {1024: (0.9, 0.9), 2048: (0.92, 0.92)}),  # grid order does not matter
        fake_run("zack", 0.25, {1024: (1.0, 0.98), 2048: (0.92, 0.94)}),
        fake_run("zack", 0.375, {1024: (0.98, 0.98), 2048: (0.9, 0.9)}),  # exactly 2 points down at 1024
        fake_run("zack", 0.625, {1024: (1.0, 1.0), 2048: (1.0, 1.0)}),  # passes, but 0.5 below it failed
        fake_run("zack", 0.25, {1024: (0.5, 0.46)}, task="multikey"),
        fake_run("palu", 0.25, {1024: (0.9, 1.0), 2048: (0.5, 0.5)}),
        fake_run("palu", 0.25, {1024: (1.0, 1.0), 2048: (1.0, 1.0)}, k_share=0.4),
    ]
    summary = accuracy.within_tolerance(runs, 0.02)
    got = {(e["task"], e["variant"], e["k_share"], e["context"]): e for e in summary}
    expected = {  # (target rate, mean there, base mean)
        ("passkey", "zack", None, 1024): (0.375, 0.98, 1.0),
        ("passkey", "zack", None, 2048): (0.25, 0.93, 0.95),
        ("multikey", "zack", None, 1024): (0.25, 0.48, 0.5),
        ("passkey", "palu", None, 1024): (0.0, 1.0, 1.0),  # 5 points down: nothing passes
        ("passkey", "palu", None, 2048): (0.0, 0.95, 0.95),
        ("passkey", "palu", 0.4, 1024): (0.25, 1.0, 1.0),
        ("passkey", "palu", 0.4, 2048): (0.25, 1.0, 0.95),
    }
    assert set(got) == set(expected)
    for key, (target, mean, base) in expected.items():
        e = got[key]
        assert e["target_rate"] == target and e["rate"] == (target + 0.01 if target else 0.0), (key, e)
        np.testing.assert_allclose([e["mean"], e["base"]], [mean, base], err_msg=str(key))
        assert e["calibration"] == "random" and e["max_context"] is None
    # no tolerance: only rates as good as the uncompressed model
    strict = {(e["task"], e["variant"], e["k_share"], e["context"]): e for e in accuracy.within_tolerance(runs, 0.0)}
    assert strict[("passkey", "zack", None, 1024)]["target_rate"] == 0.0
    assert strict[("passkey", "palu", 0.4, 2048)]["target_rate"] == 0.25


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bisect-steps", "2"], "--bisect-steps applies to eval only"),
        (["--retrieval-tolerance", "1.5"], "--retrieval-tolerance"),
        (["--k-share", "2"], "--k-share"),
    ],
)
def test_retrieval_mode_refuses_bisection_and_bad_tolerances(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: pytest.fail("loaded a model for bad flags"))
    with pytest.raises(SystemExit):
        accuracy.main(["retrieval", *flags])
    assert message in capsys.readouterr().err
