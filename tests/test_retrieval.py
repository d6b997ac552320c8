"""bench/retrieval.py and bench/accuracy.py's retrieval mode: scoring, prompts, the runner, heat maps and the CLI."""

import json
import os
import re

import numpy as np
import pytest
from conftest import fresh_seed
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax
from bench import (
    accuracy,  # noqa: E402
    retrieval,  # noqa: E402
)
from kvjax.runtime.generate import Generation

LONGEST_SENTENCE = 16  # tokens: no FILLER sentence of SmolLM2's tokenizer is longer


@pytest.fixture(scope="module")
def smollm2():
    return kvjax.load("smollm2", dtype="float32", progress=False)


def encode(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def find(ids: list[int], part: list[int]) -> list[int]:
    """Every index where ``part`` starts in ``ids``."""
    return [i for i in range(len(ids) - len(part) + 1) if ids[i : i + len(part)] == part]


def reader(model, answer=None, calls=None):
    """A stand-in for ``kvjax.generate``: answers every prompt with the key it asks for read off its text (or with
    ``answer``), and records each call's model, prompt count and keyword arguments in ``calls``."""

    def generate(m, prompts, **kwargs):
        if calls is not None:
            calls.append((m, len(prompts), kwargs))
        out = []
        for ids in prompts:
            assert len(ids) + kwargs["max_new_tokens"] <= kwargs["max_seq_len"]
            text = model.tokenizer.decode(ids)
            asked = re.search(r"What is the pass key for (\w+)\?", text)
            line = rf"The pass key for {asked.group(1)} is (\d+)\." if asked else r"The pass key is (\d+)\."
            key = re.search(line, text).group(1)
            out.append(Generation([], f" {answer if answer is not None else key}. The", len(ids), "length"))
        return out

    return generate


@pytest.mark.parametrize(
    "text, expected, correct",
    [
        (" 71432. Remember it.", "71432", True),
        ("71432", 71432, True),
        ("   \n 71432", "71432", True),
        (" the number 71432 is the key", "71432", True),
        (" 12345, no: 71432", "71432", False),
        (" a key that opens doors", "71432", False),
        ("", "71432", False),
        (None, "71432", False),
        (" 714321", "71432", False),
        (" 7143", "71432", False),
        (" 71,432", "71432", False),
        (" 071432", "71432", False),
    ],
)
def test_score_takes_the_first_run_of_digits(text, expected, correct):
    assert retrieval.score(text, expected) is correct


@pytest.mark.parametrize("context", [256, 1024, 4096])
def test_passkey_prompt_has_the_length_and_puts_the_key_at_the_depth(smollm2, context):
    seed = fresh_seed()
    intro = retrieval.INTRO["passkey"] + " The pass key is "
    question = " What is the pass key? The pass key is"
    for depth in (0.0, 0.5, 1.0):
        p = retrieval.passkey_prompt(smollm2.tokenizer, context, depth, np.random.default_rng(seed))
        assert len(p.ids) == context and len(p.expected) == 5 and p.keys == {"": p.expected}, f"seed {seed}"
        text = smollm2.tokenizer.decode(p.ids)
        assert text.count(p.expected) == 2 and text.endswith(question), f"seed {seed}"
        digits = encode(smollm2, p.expected)
        assert find(p.ids, digits)[0] == p.number_position, f"seed {seed}"
        before = smollm2.tokenizer.decode(p.ids[: p.number_position])
        after = smollm2.tokenizer.decode(p.ids[p.number_position :])
        if depth == 0.0:
            assert before == intro, f"seed {seed}: {before!r}"
        if depth == 1.0:
            assert after == f"{p.expected}. Remember it. {p.expected} is the pass key.{question}", f"seed {seed}"
        # the tokens of filler before the key line, counted from the token ids alone
        line_start = p.number_position - len(encode(smollm2, " The pass key is "))
        filler_before = line_start - len(encode(smollm2, retrieval.INTRO["passkey"]))
        assert filler_before == p.filler_before, f"seed {seed}"
        assert abs(filler_before - depth * p.filler_tokens) <= LONGEST_SENTENCE / 2, f"seed {seed}: {depth}"


@pytest.mark.parametrize("task", retrieval.TASKS)
def test_no_intro_holds_the_words_the_answer_follows(smollm2, task):
    """A model that copies the intro where the number belongs must score nothing, not the intro (Gemma 3 did)."""
    seed = fresh_seed()
    p = retrieval.build_prompt(task, smollm2.tokenizer, 512, 0.5, np.random.default_rng(seed))
    text = smollm2.tokenizer.decode(p.ids)
    stem = text[text.rindex("The pass key") :]  # the question's last sentence, up to where the answer goes
    intro = retrieval.INTRO[task].lower()
    assert stem.lower() not in intro and " ".join(stem.split()[-3:]).lower() not in intro, f"seed {seed}: {stem!r}"


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_multikey_prompt_holds_each_key_once_and_asks_for_the_target(smollm2, depth):
    seed = fresh_seed()
    p = retrieval.multikey_prompt(smollm2.tokenizer, 1024, depth, np.random.default_rng(seed))
    text = smollm2.tokenizer.decode(p.ids)
    assert len(p.ids) == 1024 and len(p.keys) == retrieval.KEYS, f"seed {seed}"
    assert len(set(p.keys.values())) == retrieval.KEYS and all(re.fullmatch(r"\d{5}", n) for n in p.keys.values())
    assert p.target in p.keys and p.expected == p.keys[p.target], f"seed {seed}"
    for word, number in p.keys.items():
        assert text.count(f"The pass key for {word} is {number}.") == 1 and text.count(number) == 1, f"seed {seed}"
    assert text.count("The pass key for") == retrieval.KEYS + 1, f"seed {seed}"  # the key lines and the question
    assert text.endswith(f" What is the pass key for {p.target}? The pass key for {p.target} is"), f"seed {seed}"
    assert find(p.ids, encode(smollm2, p.expected)) == [p.number_position], f"seed {seed}"
    assert abs(p.filler_before - depth * p.filler_tokens) <= LONGEST_SENTENCE / 2, f"seed {seed}"


def test_trials_are_reproducible_and_fresh(smollm2):
    tok = smollm2.tokenizer
    again = retrieval.build_prompt("passkey", tok, 300, 0.5, retrieval.trial_rng(3, "passkey", 300, 0.5, 7))
    first = retrieval.build_prompt("passkey", tok, 300, 0.5, retrieval.trial_rng(3, "passkey", 300, 0.5, 7))
    assert again == first
    numbers = {retrieval.trial_rng(3, "passkey", 300, 0.5, t).integers(10**9) for t in range(20)}
    numbers |= {retrieval.trial_rng(s, task, 300, 0.5, 0).integers(10**9) for s in (4, 5) for task in retrieval.TASKS}
    assert len(numbers) == 24


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda tok: retrieval.build_prompt("passkey", tok, 1024, 1.5, np.random.default_rng(0)), "depth"),
        (lambda tok: retrieval.build_prompt("passkey", tok, 1024, -0.1, np.random.default_rng(0)), "depth"),
        (lambda tok: retrieval.build_prompt("passkey", tok, 30, 0.5, np.random.default_rng(0)), "too short"),
        (lambda tok: retrieval.build_prompt("multikey", tok, 80, 0.5, np.random.default_rng(0)), "too short"),
        (lambda tok: retrieval.build_prompt("passkey", tok, 0, 0.5, np.random.default_rng(0)), "context"),
        (lambda tok: retrieval.build_prompt("needle", tok, 1024, 0.5, np.random.default_rng(0)), "task"),
        (lambda tok: retrieval.build_prompt("passkey", None, 1024, 0.5, np.random.default_rng(0)), "tokenizer"),
    ],
)
def test_prompt_builders_refuse_bad_arguments(smollm2, call, message):
    with pytest.raises(ValueError, match=message):
        call(smollm2.tokenizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(trials=-3), "trials"),
        (dict(trials=0), "trials"),
        (dict(depths=[0.5, 2.0]), "depth"),
        (dict(contexts=[]), "contexts"),
        (dict(contexts=[-256]), "contexts"),
        (dict(tasks="needle"), "tasks"),
        (dict(tasks=["passkey", "multikey", "passkey"]), "tasks must be distinct"),
        (dict(depths=[0.5, 0.25, 0.5]), "depths must be distinct"),
        (dict(contexts=[256, 256]), "contexts must be distinct"),
        (dict(seed=-1), "seed"),
    ],
)
def test_runner_refuses_bad_grids(smollm2, kwargs, message):
    args = dict(tasks="passkey", contexts=[256], depths=[0.5], trials=2) | kwargs
    with pytest.raises(ValueError, match=message):
        retrieval.run(smollm2, **args)


def test_runner_end_to_end_on_smollm2(smollm2):
    out = retrieval.run(smollm2, "passkey", [256], [0.0, 1.0], 2, max_batch=4, backend="reference", progress=False)
    assert list(out) == ["passkey"]
    results = out["passkey"]
    assert results["contexts"] == [256] and results["skipped"] == [] and results["depths"] == [0.0, 1.0]
    assert [(c["context"], c["depth"], c["trials"]) for c in results["cells"]] == [(256, 0.0, 2), (256, 1.0, 2)]
    assert len(results["records"]) == 4 and results["seconds"][256] > 0
    for record in results["records"]:
        assert isinstance(record["answer"], str) and record["prompt_tokens"] == 256
        assert record["correct"] == retrieval.score(record["answer"], record["expected"])
    for cell in results["cells"]:
        hits = [r["correct"] for r in results["records"] if r["depth"] == cell["depth"]]
        assert cell["correct"] == sum(hits) and cell["accuracy"] == sum(hits) / 2
    json.dumps(results)


@settings(max_examples=12, deadline=None)
@given(
    task=st.sampled_from(retrieval.TASKS),
    contexts=st.lists(st.integers(160, 700), min_size=1, max_size=2, unique=True),
    depths=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3, unique=True),
    trials=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_a_perfect_reader_scores_one_and_a_constant_answer_scores_only_its_own_key(
    smollm2, task, contexts, depths, trials, seed
):
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(retrieval.kvjax, "generate", reader(smollm2, calls=calls))
        perfect = retrieval.run(smollm2, task, contexts, depths, trials, seed=seed, max_batch=3, progress=False)[task]
        mp.setattr(retrieval.kvjax, "generate", reader(smollm2, answer="12345"))
        constant = retrieval.run(smollm2, task, contexts, depths, trials, seed=seed, progress=False)[task]
    assert all(c["accuracy"] == 1.0 for c in perfect["cells"])
    assert len(perfect["cells"]) == len(contexts) * len(depths)
    assert len(perfect["records"]) == len(contexts) * len(depths) * trials
    assert len(calls) == len(contexts)  # one generate call per context
    assert all(m is smollm2 for m, _, _ in calls)
    assert all(n == len(depths) * trials and kw["max_batch"] == 3 and kw["max_new_tokens"] == 8 for _, n, kw in calls)
    expected = [r["expected"] for r in perfect["records"]]
    assert [r["expected"] for r in constant["records"]] == expected  # the same prompts for every model
    assert sum(r["correct"] for r in constant["records"]) == expected.count("12345")


def test_contexts_past_the_model_are_skipped_with_a_message(smollm2, monkeypatch):
    monkeypatch.setattr(retrieval.kvjax, "generate", reader(smollm2))
    messages: list[str] = []
    limit = smollm2.config.max_position_embeddings
    out = retrieval.run(smollm2, retrieval.TASKS, [256, 2 * limit], [0.5], 1, progress=False, log=messages.append)
    for results in out.values():
        assert results["contexts"] == [256] and results["skipped"] == [2 * limit]
    results = out["multikey"]
    assert results["contexts"] == [256] and results["skipped"] == [2 * limit]
    assert len(messages) == 1 and str(2 * limit) in messages[0] and str(limit) in messages[0]


def test_heatmap_writes_a_png_and_leaves_nothing_behind_on_failure(smollm2, monkeypatch, tmp_path):
    monkeypatch.setattr(retrieval.kvjax, "generate", reader(smollm2))
    results = retrieval.run(smollm2, "passkey", [200, 300], [0.0, 0.5, 1.0], 1, progress=False)["passkey"]
    path = tmp_path / "map.png"
    retrieval.heatmap(results, str(path), "passkey, uncompressed")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["map.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask

    def broken(f):
        f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        retrieval.write_atomic(str(path), broken)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["map.png"]
    with pytest.raises(ValueError, match="nothing to plot"):
        retrieval.heatmap(results | {"contexts": []}, str(tmp_path / "empty.png"), "none")
    assert os.listdir(tmp_path) == ["map.png"]


def test_retrieval_mode_writes_table_json_and_heat_maps(smollm2, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: smollm2)
    calls: list = []
    monkeypatch.setattr(retrieval.kvjax, "generate", reader(smollm2, calls=calls))
    out, pngs = tmp_path / "ret.json", tmp_path / "maps"
    limit = smollm2.config.max_position_embeddings
    flags = ["--task", "passkey", "multikey", "--contexts", "256", str(2 * limit), "--depths", "0", "1"]
    flags += ["--trials", "2", "--rates", "0.5", "--variants", "zack", "--calibrations", "random"]
    flags += ["--num-tokens", "128", "--seq-len", "64", "--json", str(out), "--png-dir", str(pngs)]
    accuracy.main(["retrieval", *flags])
    data = json.loads(out.read_text())
    assert data["mode"] == "retrieval" and data["complete"] and data["args"]["trials"] == 2
    assert [(r["task"], r["variant"]) for r in data["runs"]] == [
        ("passkey", "uncompressed"),
        ("multikey", "uncompressed"),
        ("passkey", "zack"),
        ("multikey", "zack"),
    ]
    for run in data["runs"]:
        assert run["results"]["skipped"] == [2 * limit] and len(run["results"]["records"]) == 4
    assert len(data["rows"]) == 4
    # one call per model and context run, both tasks' prompts together; one compressed model serves both tasks
    assert [n for _, n, _ in calls] == [8, 8] and calls[0][0] is smollm2 and calls[1][0] is not smollm2
    assert calls[1][0].plan is not None and calls[1][0].plan.rate >= 0.5
    for row in data["rows"]:
        assert row["context"] == 256 and row["depth 0"] == row["depth 1"] == row["mean"] == 1.0 and row["vs_base"] == 0
    # every answer right: the grid's rate is within 2 points of the uncompressed model's on both tasks
    assert [(e["task"], e["context"], e["target_rate"]) for e in data["within_tolerance"]] == [
        ("passkey", 256, 0.5),
        ("multikey", 256, 0.5),
    ]
    assert sorted(os.listdir(pngs)) == [
        "multikey-uncompressed.png",
        "multikey-zack-random-p0.5.png",
        "passkey-uncompressed.png",
        "passkey-zack-random-p0.5.png",
    ]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    printed = capsys.readouterr()
    assert "| task | calibration | variant |" in printed.out and "| depth 0 | depth 1 | mean | vs_base |" in printed.out
    assert "largest rate within 2 points of base" in printed.out
    assert f"skipping context {2 * limit}" in printed.err


def test_retrieval_kv_bits_serves_each_model_from_quantized_pages_against_the_unquantized_base(
    smollm2, monkeypatch, tmp_path
):
    """``retrieval --kv-bits none 4``: the uncompressed model and each compressed one run once per cache format, the
    engine asked for int4 pages of ``--kv-page`` tokens, and every row compared with the unquantized uncompressed
    model's accuracy."""
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: smollm2)
    calls: list = []
    monkeypatch.setattr(retrieval.kvjax, "generate", reader(smollm2, calls=calls))
    out = tmp_path / "ret.json"
    flags = ["--task", "passkey", "--contexts", "256", "--depths", "0", "--trials", "2", "--rates", "0.5"]
    flags += ["--variants", "zack", "--calibrations", "random", "--num-tokens", "128", "--seq-len", "64"]
    accuracy.main(["retrieval", *flags, "--kv-bits", "none", "4", "--kv-page", "16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [(r["variant"], r["kv_bits"]) for r in data["runs"]] == [
        ("uncompressed", None),
        ("uncompressed", 4),
        ("zack", None),
        ("zack", 4),
    ]
    assert [(c[2]["kv_bits"], c[2]["page_size"]) for c in calls] == [(None, None), (4, 16), (None, None), (4, 16)]
    int4 = [r for r in data["rows"] if r["kv_bits"] == 4]
    assert len(int4) == 2 and all(r["overall_rate"] > 0.6 and r["vs_base"] == 0 for r in int4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trials", "-5"], "--trials"),
        (["--depths", "0", "1.5"], "--depths"),
        (["--contexts", "0"], "--contexts"),
        (["--contexts", "40"], "--contexts 40"),
        (["--task", "needle"], "--task"),
        (["--task", "passkey", "passkey"], "--task values must be distinct"),
        (["--depths", "0", "0.5", "0"], "--depths values must be distinct"),
        (["--seed", "-1"], "--seed"),
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (["--json", "/nonexistent/dir/ret.json"], "--json"),
    ],
)
def test_retrieval_mode_refuses_bad_flags_by_name(smollm2, flags, message, monkeypatch, capsys):
    monkeypatch.setattr(accuracy.kvjax, "load", lambda *a, **k: smollm2)
    with pytest.raises(SystemExit):
        accuracy.main(["retrieval", *flags])
    assert message in capsys.readouterr().err
