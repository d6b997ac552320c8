import json
import os

import jax
import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS

import kvjax
from kvjax.cli import infer


def argmax_continuation(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.asarray(model.logits(np.array([tokens])))[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_through_the_cache_equals_repeated_argmax(name):
    model = kvjax.Model.random(TINY_CONFIGS[name], seed=3, scale=10.0)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (3, 17, 9)]  # 17 > one page, window 5 < 17
    results = kvjax.generate(model, prompts, max_new_tokens=12, max_batch=2, page_size=8)
    for prompt, r in zip(prompts, results):
        assert r.tokens == argmax_continuation(model, prompt, 12)
        assert r.finish_reason == "length" and r.prompt_tokens == len(prompt) and r.text is None


def test_new_prompt_lengths_reuse_compiled_steps():
    """Prompts of new lengths within one bucket compile nothing (counted by jax.monitoring's compile events)."""
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=0)
    kvjax.generate(model, [[1, 2, 3]], max_new_tokens=3)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        kvjax.generate(model, [[4, 5, 6, 7, 8]], max_new_tokens=3)
        kvjax.generate(model, [[9] * 11], max_new_tokens=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


def test_sampling_is_seeded_and_stop_tokens_stop():
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=1, scale=3.0)
    a = kvjax.generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5)[0].tokens
    b = kvjax.generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5)[0].tokens
    c = kvjax.generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=6)[0].tokens
    assert a == b and a != c
    stopped = kvjax.generate(model, [[1, 2]], max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5, stop=[a[3]])[0]
    assert stopped.tokens == a[: a.index(a[3]) + 1] and stopped.finish_reason == "stop"


def test_top_p_near_zero_is_greedy():
    model = kvjax.Model.random(TINY_CONFIGS["falcon_new"], seed=2, scale=10.0)
    greedy = kvjax.generate(model, [[5, 6, 7]], max_new_tokens=6)[0].tokens
    nucleus = kvjax.generate(model, [[5, 6, 7]], max_new_tokens=6, temperature=0.7, top_p=1e-6, seed=9)[0].tokens
    assert greedy == nucleus


def test_bad_generate_arguments():
    model = kvjax.Model.random(TINY_CONFIGS["llama"])
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        kvjax.generate(model, [[1]], max_new_tokens=0)
    for bad in (0, -3, float("nan"), "8", True):
        with pytest.raises((ValueError, TypeError), match="chunk_tokens"):
            kvjax.generate(model, [[1]], max_new_tokens=1, chunk_tokens=bad)
        with pytest.raises((ValueError, TypeError), match="chunk_tokens"):
            kvjax.generate_iter(model, [[1]], max_new_tokens=1, chunk_tokens=bad)
    with pytest.raises(ValueError, match="more than the cache"):
        kvjax.generate(model, [[1] * 200], max_new_tokens=100)  # max_position_embeddings is 256
    with pytest.raises(ValueError, match="more than the cache"):
        kvjax.generate(model, [[1] * 10], max_new_tokens=10, max_seq_len=16)
    with pytest.raises(ValueError, match="no tokenizer"):
        kvjax.generate(model, ["hello"], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        kvjax.generate(model, [[]], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        kvjax.generate(model, [[97]], max_new_tokens=1)
    with pytest.raises(TypeError):
        kvjax.generate(model, [1, 2, 3], max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        kvjax.generate(model, [[1]], max_new_tokens=1, temperature=-1)


def test_kvjax_infer_writes_results_atomically(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ([1, 2, 3], [4, 5], [6])))
    out = tmp_path / "out.jsonl"
    model_dir = os.path.join(FIXTURES, "llama")
    assert (
        infer.main(
            [
                "--model",
                model_dir,
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                "4",
                "--max-batch",
                "2",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [[1, 2, 3], [4, 5], [6]] and all(len(r["tokens"]) == 4 for r in rows)
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert "tok/s" in capsys.readouterr().out
    # a prompt longer than the cache gets an error record (exit 1) and the output is replaced whole, no temporary file
    prompts.write_text(json.dumps({"prompt": [1] * 300}) + "\n")
    status = infer.main(["--model", model_dir, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4"])
    assert status == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and "300 tokens" in rows[0]["error"] and "1 of 1 prompts failed" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]


def test_kvjax_infer_rejects_bad_paths(tmp_path, capsys):
    with pytest.raises(SystemExit):
        infer.main(
            ["--model", "smollm2", "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.jsonl")]
        )
    (tmp_path / "p.jsonl").write_text('{"text": "no prompt key"}\n')
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        infer.main(["--model", "smollm2", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")])
    assert e.value.code == 2 and "prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        infer.main(["--model", "smollm2", "--prompts", str(tmp_path / "p.jsonl"), "--out", "/nonexistent/o.jsonl"])
