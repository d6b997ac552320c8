"""bench/accuracy.py's eval mode: the code source's parts, and the per-window perplexity, KL and top-1 metrics."""

import dataclasses
import json
import os
import sys

import jax
import numpy as np
import pytest
from conftest import TINY_CONFIGS

import kvjax
from kvjax.compression.text import CODE_PACKAGES, pydoc_text, stdlib_code, stdlib_code_files

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import accuracy  # noqa: E402

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)  # compressible heads
ROW_KEYS = {"source", "window", "tokens", "calibration", "variant", "max_context", "target_rate", "rate"}
SCORE_KEYS = {"ppl", "kl", "top1"}


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)


def random_ids(rng, n: int) -> np.ndarray:
    return rng.integers(1, WIDE.vocab_size, n)  # never 0


def perturbed(model, rng, scale: float = 0.05):
    """``model`` with every weight moved by ``scale`` times its own magnitude of random noise."""
    state = jax.tree.map(lambda w: w * (1 + scale * rng.standard_normal(w.shape).astype(w.dtype)), model.state)
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


def test_a_perturbed_model_has_positive_kl_and_agreement_in_range():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    base = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    other = perturbed(base, rng)
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


def test_eval_mode_writes_every_number_as_json(tmp_path, monkeypatch, capsys):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: model)
    monkeypatch.setattr(accuracy, "heldout_ids", lambda m, source, n: random_ids(rng, n))
    out = tmp_path / "eval.json"
    flags = ["--rates", "0.5", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    flags += ["--variants", "zack", "palu", "--windows", "32", "64", "--eval-tokens", "128"]
    accuracy.main(["eval", *flags, "--max-context", "none", "128", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["mode"] == "eval" and data["args"]["windows"] == [32, 64], f"seed {seed}"
    rows = data["rows"]
    # per source and window: uncompressed, zack without and with max_context, palu
    assert len(rows) == 2 * 2 * 4, f"seed {seed}: {len(rows)} rows"
    for row in rows:
        assert set(row) == ROW_KEYS | SCORE_KEYS | {"per_window"}, f"seed {seed}: {sorted(row)}"
        assert row["tokens"] == 128 and len(row["per_window"]) == 128 // row["window"], f"seed {seed}: {row}"
        assert all(set(w) == SCORE_KEYS for w in row["per_window"]), f"seed {seed}"
        assert row["kl"] >= 0 and 0 <= row["top1"] <= 1 and row["ppl"] > 1, f"seed {seed}: {row}"
    assert {(r["variant"], r["max_context"]) for r in rows} == {
        ("uncompressed", None),
        ("zack", None),
        ("zack", 128),
        ("palu", None),
    }, f"seed {seed}"
    for row in rows:
        if row["variant"] == "uncompressed":
            assert row["kl"] == 0 and row["top1"] == 1, f"seed {seed}: {row}"
        else:
            assert row["rate"] >= 0.5 and row["kl"] > 0, f"seed {seed}: {row}"
    printed = capsys.readouterr().out
    assert "| source | window | tokens |" in printed and "per_window" not in printed, f"seed {seed}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--windows", "0"], "--windows"),
        (["--eval-tokens", "-5"], "--eval-tokens"),
        (["--max-context", "lots"], "--max-context"),
        (["--windows", "512"], "--windows 512 exceeds"),
        (["--windows", "64", "--eval-tokens", "32"], "--eval-tokens 32"),
    ],
)
def test_eval_mode_refuses_bad_flags_by_name(flags, message, monkeypatch, capsys):
    model = kvjax.Model.random(WIDE)
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: model)
    with pytest.raises(SystemExit):
        accuracy.main(["eval", *flags])
    assert message in capsys.readouterr().err
