"""bench/eviction.py: eval rows for every plan and policy with their overall rates, the within-1% summary, the
teacher-forced retrieval check, and refusals of bad flags before any model loads."""

import dataclasses
import itertools
import json
import types

import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed, tiny_tokenizer

import kvjax
from bench import (
    accuracy,  # noqa: E402
    eviction,  # noqa: E402
)

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)


def _random_heldout(monkeypatch):
    """(seed, model): a random model that ``kvjax.load`` returns, and random held-out text for it."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=3.0)
    monkeypatch.setattr(eviction.kvjax, "load", lambda *a, **k: model)
    monkeypatch.setattr(accuracy, "heldout_ids", lambda m, source, n: rng.integers(1, WIDE.vocab_size, n))
    return seed, model


def test_eval_scores_the_continuation_of_every_plan_and_policy(tmp_path, monkeypatch, capsys):
    seed, model = _random_heldout(monkeypatch)
    out = tmp_path / "ev.json"
    flags = ["--windows", "48", "--continuation", "16", "--eval-tokens", "96", "--sources", "prose"]
    flags += ["--methods", "kvcompress", "h2o", "--budgets", "8", "32", "--ratios", "2", "--page-size", "4"]
    flags += ["--plans", "none", "zack:0.5", "--calibration", "random", "--num-tokens", "128", "--seq-len", "32"]
    writes, write = [], eviction.write_json
    monkeypatch.setattr(eviction, "write_json", lambda path, data, **kw: (writes.append(data), write(path, data, **kw)))
    eviction.main(["eval", *flags, "--evict", "snapkv:4x:global", "--json", str(out)])
    # each of the two windows saved the rows so far (a run cut short keeps them), then the whole run
    assert [w.get("partial", False) for w in writes] == [True, True, False], f"seed {seed}"
    assert len(writes[0]["rows"]) == len(writes[-1]["rows"])  # one source: every key after its first window
    data = json.loads(out.read_text())
    rows = {(r["plan"], r["evict"]): r for r in data["rows"]}
    policies = ["none", "kvcompress:8", "kvcompress:32", "kvcompress:2x", "h2o:8", "h2o:32", "h2o:2x"]
    policies.append("snapkv:4x:global")
    assert set(rows) == {(plan, p) for plan in ("none", "zack:0.5") for p in policies}, f"seed {seed}"
    base = rows[("none", "none")]
    assert base["kl"] == 0 and base["top1"] == 1 and base["overall_rate"] == 0, f"seed {seed}"
    assert rows[("none", "kvcompress:32")]["overall_rate"] == 0  # the whole 32-token prompt fits the budget
    # float32 rounding only: the cut's prompt runs alone (``prompt_prefix``), the base as one whole forward
    assert rows[("none", "kvcompress:32")]["kl"] < 1e-7, f"seed {seed}"
    assert rows[("none", "h2o:8")]["overall_rate"] == pytest.approx(1 - 8 / 32)  # uniform: 8 of 32 a head
    zack = rows[("zack:0.5", "none")]
    assert zack["overall_rate"] == zack["plan_rate"] >= 0.5
    stacked = rows[("zack:0.5", "h2o:8")]
    assert stacked["overall_rate"] > rows[("none", "h2o:8")]["overall_rate"]  # narrower heads, same tokens
    assert all(r["prompt"] == 32 and r["window"] == 48 for r in data["rows"])
    summary = {s["what"]: s for s in data["within_one_percent"]}
    assert set(summary) == {"plan", "kvcompress", "kvcompress + plan", "h2o", "h2o + plan", "snapkv", "snapkv + plan"}
    assert summary["kvcompress"]["largest_overall_rate"] >= 0  # at least the budget that keeps everything passes
    assert "largest overall rate within 1%" in capsys.readouterr().out


def test_eval_builds_plans_of_measured_ranks_probing_each_variant_once(tmp_path, monkeypatch):
    """A ``-measured`` plan (ranks by each head's probed effect) is scored like any other, and its probes run once
    per variant, whatever its rates."""
    seed, model = _random_heldout(monkeypatch)
    probed, measure = [], eviction.measure_sensitivity
    monkeypatch.setattr(eviction, "measure_sensitivity", lambda *a, **k: (probed.append(k), measure(*a, **k))[1])
    out = tmp_path / "ev.json"
    flags = ["--windows", "48", "--continuation", "16", "--eval-tokens", "48", "--sources", "prose"]
    flags += ["--methods", "kvcompress", "--ratios", "2", "--page-size", "4", "--calibration", "random"]
    flags += ["--plans", "none", "zack-band16-measured:0.3", "zack-band16-measured:0.5", "--num-tokens", "128"]
    eviction.main(["eval", *flags, "--seq-len", "32", "--json", str(out)])
    rows = {(r["plan"], r["evict"]): r for r in json.loads(out.read_text())["rows"]}
    plans = ("none", "zack-band16-measured:0.3", "zack-band16-measured:0.5")
    assert set(rows) == {(p, e) for p in plans for e in ("none", "kvcompress:2x")}, f"seed {seed}"
    assert [k["band"] for k in probed] == [16], f"seed {seed}"
    assert 0 < rows[(plans[1], "none")]["plan_rate"] < rows[(plans[2], "none")]["plan_rate"], f"seed {seed}"


def test_eval_with_quantized_pages_scores_every_plan_and_policy_on_them_too(tmp_path, monkeypatch):
    """--kv-bits none 4: every model also from 4-bit pages, its overall rate counting the pages' bytes; a budget that
    keeps the whole prompt on 4-bit pages is exactly the 4-bit model without eviction."""
    seed, model = _random_heldout(monkeypatch)
    out = tmp_path / "ev.json"
    flags = ["--windows", "48", "--continuation", "16", "--eval-tokens", "48", "--sources", "prose"]
    flags += ["--methods", "h2o", "--budgets", "8", "32", "--page-size", "4", "--kv-bits", "none", "4"]
    flags += ["--plans", "none", "zack:0.5", "--calibration", "random", "--num-tokens", "128", "--seq-len", "32"]
    eviction.main(["eval", *flags, "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {(r["plan"], r["kv_bits"], r["evict"]): r for r in data["rows"]}
    plans = [("none", None), ("none", 4), ("zack:0.5", None), ("zack:0.5", 4)]
    assert set(rows) == {(p, kv, e) for (p, kv), e in itertools.product(plans, ["none", "h2o:8", "h2o:32"])}
    four = rows[("none", 4, "none")]
    assert four["overall_rate"] == pytest.approx(accuracy.overall_rate(model, None, 4, 4)) and four["kl"] > 0
    assert rows[("none", 4, "h2o:32")]["kl"] == four["kl"]  # nothing evicted: the same pages, the same reads
    assert rows[("none", 4, "h2o:32")]["overall_rate"] == pytest.approx(four["overall_rate"])
    for plan in ("none", "zack:0.5"):
        assert rows[(plan, 4, "h2o:8")]["overall_rate"] > rows[(plan, None, "h2o:8")]["overall_rate"] > 0
    zack4 = rows[("zack:0.5", 4, "none")]
    assert zack4["overall_rate"] > rows[("zack:0.5", None, "none")]["overall_rate"]
    summary = {s["what"] for s in data["within_one_percent"]}
    assert {"4-bit", "plan + 4-bit", "h2o + 4-bit", "h2o + plan + 4-bit"} <= summary, f"seed {seed}"


def test_group_cuts_score_each_quantized_model_cut_by_whole_groups_beside_its_slot_cut(tmp_path, monkeypatch):
    """--group-cuts: each quantized model also cut by whole groups (continual eviction's cut), for the
    observation-window methods only, in a stack of its own; a budget that keeps the whole prompt cuts nothing either
    way, and a group cut keeps at least the slot cut's bytes (its counts are rounded up to whole groups)."""
    seed, model = _random_heldout(monkeypatch)
    out = tmp_path / "ev.json"
    flags = ["--windows", "48", "--continuation", "16", "--eval-tokens", "48", "--sources", "prose"]
    flags += ["--methods", "snapkv", "h2o", "--budgets", "32", "--ratios", "3", "--page-size", "4"]
    flags += ["--kv-bits", "none", "4", "--group-cuts", "--plans", "none", "--json", str(out)]
    eviction.main(["eval", *flags])
    data = json.loads(out.read_text())
    rows = {(r["kv_bits"], r["cut"], r["evict"]): r for r in data["rows"]}
    policies = ["none", "snapkv:32", "snapkv:3x", "h2o:32", "h2o:3x"]
    want = {(kv, "slots", e) for kv in (None, 4) for e in policies}
    want |= {(4, "groups", "snapkv:32"), (4, "groups", "snapkv:3x")}
    assert set(rows) == want, f"seed {seed}"
    four = rows[(4, "slots", "none")]
    assert rows[(4, "groups", "snapkv:32")]["kl"] == rows[(4, "slots", "snapkv:32")]["kl"] == four["kl"], f"seed {seed}"
    groups, slots = rows[(4, "groups", "snapkv:3x")], rows[(4, "slots", "snapkv:3x")]
    assert four["overall_rate"] < groups["overall_rate"] <= slots["overall_rate"], f"seed {seed}"
    summary = {s["what"] for s in data["within_one_percent"]}
    assert {"snapkv + 4-bit", "snapkv + 4-bit by groups", "h2o + 4-bit"} <= summary, f"seed {seed}"
    assert "h2o + 4-bit by groups" not in summary


def test_retrieval_is_right_when_every_answer_token_is_the_greedy_choice():
    model = kvjax.Model.random(WIDE, seed=1)
    tokens = np.random.default_rng(0).integers(1, WIDE.vocab_size, (1, 30))
    hidden = model.hidden(tokens)
    greedy = np.asarray(model.project(hidden[0])).argmax(-1)
    prompt = 20
    answer = greedy[prompt - 1 : prompt + 2].tolist()
    forced = np.concatenate([tokens[:, :prompt], np.asarray([answer])], axis=1)
    assert eviction.answered(model, model.hidden(forced), prompt, answer) == (
        bool((np.asarray(model.project(model.hidden(forced)[0])).argmax(-1)[prompt - 1 : prompt + 2] == answer).all())
    )
    wrong = [(answer[0] + 1) % WIDE.vocab_size, *answer[1:]]
    assert not eviction.answered(model, model.hidden(forced), prompt, wrong)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["eval", "--plans", "zack:1.5"], "--plans: must be 'none' or VARIANT:RATE"),
        (["eval", "--plans", "lru:0.5"], "--plans: must be 'none' or VARIANT:RATE"),
        (["eval", "--evict", "snapkv"], "--evict: eviction must look like METHOD:BUDGET"),
        (["eval", "--evict", "snapkv:lots"], "is neither a token budget nor a ratio"),
        (["eval", "--evict", "snapkv:0"], "eviction budget must be a positive number"),
        (["eval", "--ratios", "0.5"], "--ratios: must be a number >= 1"),
        (["eval", "--methods", "lru"], "--methods: invalid choice"),
        (["eval", "--windows", "64", "--continuation", "64"], "--continuation 64 leaves no prompt"),
        (["eval", "--served"], "--served runs retrieval through the engine"),
        (["retrieval", "--served", "--kv-bits", "gear4"], "the evicting engine serves KIVI-style 4 or 2 bits only"),
        (["eval", "--kv-bits", "zipcache"], "--kv-bits: ZipCache ranks tokens"),
        (["eval", "--kv-bits", "4", "--plans", "palu:0.5"], "not ['palu']"),
        (["eval", "--kv-bits", "3"], "--kv-bits"),
        (["eval", "--group-cuts"], "--group-cuts cuts quantized pages by whole groups"),
        (["retrieval", "--kv-bits", "4", "--group-cuts"], "--group-cuts: eval mode only"),
    ],
)
def test_bad_flags_are_one_line_usage_errors_before_any_model_loads(flags, message, monkeypatch, capsys):
    monkeypatch.setattr(eviction.kvjax, "load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as e:
        eviction.main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_device_cost_bench_writes_its_tables_on_a_cpu(tmp_path, capsys):
    """bench/eviction_cost.py's compaction and metric rows on a CPU (plumbing: host timer, a tiny context); the
    compaction row's evicted bytes follow the ratio, and a ratio under 1 is refused before any work."""
    from bench import eviction_cost

    out = tmp_path / "cost.json"
    flags = ["--timer", "host", "--context", "64", "--batch", "1", "--rates", "0.5", "--ratios", "2", "8"]
    eviction_cost.main(
        [*flags, "--methods", "kvcompress", "--no-ttft", "--continual-bits", "none", "4", "--json", str(out)]
    )
    data = json.loads(out.read_text())
    two, eight = data["compaction"]
    assert 0 < two["evicted_gib"] < eight["evicted_gib"] < two["pages_gib"]
    assert [r["method"] for r in data["metrics"]] == ["kvcompress"] and not data["ttft"]
    # every head halved (64 tokens: each keeps 32, its window among them), on bf16 pages and by a whole group of 32 on
    # 4-bit pages, where a freed slot is 3-4x fewer bytes
    cut, groups = data["continual"]
    assert (cut["kv_bits"], groups["kv_bits"]) == ("-", 4)
    assert cut["kept_share"] == groups["kept_share"] == 0.5 and 0 < 3 * groups["freed_gib"] < cut["freed_gib"]
    assert "compaction" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        eviction_cost.main(["--ratios", "0.5"])
    assert "--ratios and --engine-ratio must be at least 1" in capsys.readouterr().err


def test_the_engine_ttft_rows_time_each_method_through_the_evicting_engine():
    """``eviction_cost.engine_row`` on a tiny model (plumbing): one row a method, each beside the plain engine's
    TTFT, the windowed and the full-history methods alike served."""
    from bench import eviction_cost

    model = kvjax.Model.random(WIDE, seed=fresh_seed() % 1000)
    plain = eviction_cost.ttft_seconds(model, 40, 16)
    rows = [eviction_cost.engine_row(0.0, model, 40, 16, plain, m, 2.0) for m in ("kvcompress", "h2o")]
    assert [r["eviction"] for r in rows] == ["kvcompress:2x", "h2o:2x"]
    assert all(r["ttft_ms"] > 0 and r["plain_ttft_ms"] > 0 for r in rows)


def test_a_retrieval_run_cut_short_keeps_the_trials_it_finished(tmp_path, monkeypatch):
    """The JSON is written after every trial, marked partial until the run ends: a run killed by a device call's
    time limit keeps what it measured (a 2026-12-02 GPU run lost nine minutes of trials)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000)
    monkeypatch.setattr(eviction.kvjax, "load", lambda *a, **k: model)
    monkeypatch.setattr(eviction.retrieval, "build_prompt", lambda *a: _prompt(rng, a[2]))
    monkeypatch.setattr(eviction, "answer_ids", lambda tokenizer, expected: [5, 6])
    calls = {"n": 0}
    real = eviction.answered

    def answered(*a):
        calls["n"] += 1
        if calls["n"] > 4:  # two policies a trial: the third trial is cut
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(eviction, "answered", answered)
    out = tmp_path / "r.json"
    flags = ["retrieval", "--contexts", "40", "--depths", "0.5", "--trials", "5", "--task", "passkey"]
    flags += ["--methods", "kvcompress", "--ratios", "2", "--page-size", "4", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt):
        eviction.main(flags)
    data = json.loads(out.read_text())
    assert data["partial"] is True
    assert {r["evict"]: r["trials"] for r in data["rows"]} == {"none": 2, "kvcompress:2x": 2}, f"seed {seed}"


def test_every_retrieval_trial_of_a_context_runs_at_one_length(tmp_path, monkeypatch):
    """Answers of different lengths are padded to one length a context, so the compiled forwards are reused; the
    padding comes after the answer, so every forward's rows up to the answer's end are the unpadded forward's, to
    float rounding (the greedy verdicts compared instead failed CI once: an argmax flips between near-equal logits)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000)
    monkeypatch.setattr(eviction.kvjax, "load", lambda *a, **k: model)
    prompts = []
    monkeypatch.setattr(
        eviction.retrieval, "build_prompt", lambda *a: prompts.append(_prompt(rng, a[2])) or prompts[-1]
    )
    lengths, answers = iter([1, 3, 2, 5]), []
    monkeypatch.setattr(
        eviction, "answer_ids", lambda tokenizer, expected: answers.append([7] * next(lengths)) or answers[-1]
    )
    real_hidden, seen = eviction._hidden, []

    def hidden(model, tokens, prompt, scheme, cut=None, prefix=None):  # each beside the same one without the padding
        got = np.asarray(real_hidden(model, tokens, prompt, scheme, cut, prefix))
        n = prompt + len(answers[-1])
        want = np.asarray(real_hidden(model, tokens[:, :n], prompt, scheme, cut, prefix))
        np.testing.assert_allclose(
            got[:, :n], want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}, cut {cut is not None}"
        )
        return got

    real = eviction.answered

    def answered(m, hidden, prompt, answer):
        seen.append((hidden.shape[1], len(answer)))
        return real(m, hidden, prompt, answer)

    monkeypatch.setattr(eviction, "_hidden", hidden)
    monkeypatch.setattr(eviction, "answered", answered)
    flags = ["retrieval", "--contexts", "40", "--depths", "0.5", "--trials", "4", "--task", "passkey"]
    eviction.main(
        [*flags, "--methods", "kvcompress", "--ratios", "2", "--page-size", "4", "--json", str(tmp_path / "r")]
    )
    assert {n for n, _ in seen} == {40 + eviction.ANSWER_ROOM} and {a for _, a in seen} == {1, 2, 3, 5}


def _prompt(rng, context):
    """A retrieval prompt of random tokens (the harness's text needs a tokenizer the random model lacks)."""
    return types.SimpleNamespace(ids=rng.integers(1, WIDE.vocab_size, context).tolist(), expected="7")


def test_served_retrieval_generates_every_trial_through_the_evicting_engine(tmp_path, monkeypatch):
    """--served: each plan and policy's trials (an observation-window one and a full-history one) are answered by
    ``kvjax.generate`` with that eviction (a random model
    with a tokenizer, prompts of random tokens), on bf16 and 4-bit pages, every trial counted once, the rate nominal
    (2x keeps half)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(WIDE, seed=seed % 1000)
    model.tokenizer = tiny_tokenizer(WIDE.vocab_size)
    monkeypatch.setattr(eviction.kvjax, "load", lambda *a, **k: model)

    def prompt(task, tokenizer, context, depth, trial_rng):
        ids = rng.integers(1, WIDE.vocab_size, context).tolist()
        return types.SimpleNamespace(ids=ids, expected="7", target="7", number_position=0)

    monkeypatch.setattr(eviction.retrieval, "build_prompt", prompt)
    out = tmp_path / "served.json"
    flags = ["retrieval", "--served", "--contexts", "48", "--depths", "0.5", "--trials", "3", "--task", "passkey"]
    flags += ["--methods", "kvcompress", "h2o", "--ratios", "2", "--kv-bits", "none", "4", "--json", str(out)]
    eviction.main(flags)
    rows = json.loads(out.read_text())["rows"]
    four = accuracy.overall_rate(model, None, 4, 32)  # the engine's quantized pages: groups of 32
    want = {(None, "none"): (3, 0.0), (None, "kvcompress:2x"): (3, 0.5), (None, "h2o:2x"): (3, 0.5)}
    halved = 1 - (1 - four) / 2
    want |= {(4, "none"): (3, four), (4, "kvcompress:2x"): (3, halved), (4, "h2o:2x"): (3, halved)}
    got = {(r["kv_bits"], r["evict"]): (r["trials"], r["overall_rate"]) for r in rows}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in want)
    assert all(r["served"] and 0.0 <= r["accuracy"] <= 1.0 for r in rows)


def test_the_host_cost_bench_times_window_releases(tmp_path):
    """``bench/head_pages.py --window``: every sequence evicted and decoded past its window, each step gives back
    what the windows passed (the pages still add up after it) and the row times it beside the growth."""
    from bench import head_pages

    out = tmp_path / "host.json"
    head_pages.main(["--rates", "0.5", "--batch", "3", "--contexts", "256", "--steps", "20", "--window", "48",
                     "--json", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["window"] == 48 and row["release_step_us"] > 0 and row["release_step_max_us"] >= row["release_step_us"]
    assert head_pages.measure(0.0, 2, 128, 16, 4)["release_step_us"] is None


def test_the_window_pages_bench_gives_back_local_pages_and_the_same_tokens():
    """``bench/head_windows.py``'s two runs on a tiny local + global model (windows of 32): once the window has passed
    the kept prompt, its local layers hold fewer pages with release than without, never more, and the tokens agree;
    the global layers hold the same either way."""
    from test_engine_eviction import SLIDING

    from bench import head_windows

    seed = fresh_seed()
    model = kvjax.Model.random(SLIDING["local-global"], seed=seed % 1000, scale=0.5)
    prompt = np.random.default_rng(seed).integers(0, 97, 60).tolist()
    kept, kept_tokens = head_windows.run(model, prompt, 50, "kvcompress:2x", False, "reference")
    freed, freed_tokens = head_windows.run(model, prompt, 50, "kvcompress:2x", True, "reference")
    assert kept_tokens == freed_tokens and len(kept) == len(freed), f"seed {seed}"
    assert all(f[0] <= k[0] and f[1] == k[1] for k, f in zip(kept, freed)), f"seed {seed}"
    assert freed[-1][0] < kept[-1][0], f"seed {seed}"
