"""``kvjax-infer`` against bad flags, paths, input files and prompts, failing batches and interruptions."""

import functools
import json
import os

import pytest
from conftest import FIXTURES

import kvjax
from kvjax.cli import infer
from kvjax.ops.kv_schemes import SERVED

MODEL = os.path.join(FIXTURES, "llama")
with open(os.path.join(MODEL, "config.json")) as _f:
    VOCAB = json.load(_f)["vocab_size"]
OLD = b'{"old": "results"}\n'


_real_load = kvjax.load


@functools.cache
def _load_once(path, dtype="bfloat16", **kwargs):
    return _real_load(path, dtype=dtype, **kwargs)


@pytest.fixture
def files(tmp_path):
    """A valid prompts file and an existing OUT holding ``OLD``."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ([1, 2, 3], [4, 5])))
    out.write_bytes(OLD)
    return prompts, out


@pytest.fixture
def no_model(monkeypatch):
    """Usage errors are found before the model is loaded."""
    monkeypatch.setattr(kvjax, "load", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.fixture
def shared_model(monkeypatch):
    """Load the fixture model once for the tests that generate, so its compiled steps are reused."""
    monkeypatch.setattr(kvjax, "load", _load_once)


def snapshot(root) -> dict:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def run(prompts, out, *flags, model=MODEL) -> int:
    return infer.main(
        ["--model", str(model), "--prompts", str(prompts), "--out", str(out), "--dtype", "float32", *flags]
    )


def usage_error(capsys, *args, **kwargs) -> str:
    """Run, expect a usage error (exit 2, no traceback) and return its one-line message."""
    with pytest.raises(SystemExit) as e:
        run(*args, **kwargs)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("kvjax-infer: error: ")
    return err.splitlines()[-1]


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "flag, value, shown",
    [
        ("--temperature", "nan", "nan"),
        ("--temperature", "-0.5", "-0.5"),
        ("--top-p", "0", "got 0"),
        ("--top-p", "2", "got 2"),
        ("--dtype", "foo", "'foo'"),
        ("--max-new-tokens", "0", "got 0"),
        ("--max-new-tokens", "1.5", "'1.5'"),
        ("--max-batch", "-1", "got -1"),
        ("--max-batch", "2.5", "'2.5'"),
        ("--page-size", "0", "got 0"),
        ("--page-size", "sixteen", "'sixteen'"),
        ("--seed", "-3", "got -3"),
        ("--max-seq-len", "0", "got 0"),
        ("--cache-memory", "0", "got 0"),
        ("--cache-memory", "1.5", "'1.5'"),
        ("--cache-memory", "12XB", "'12XB'"),
        ("--cache-memory", "lots", "'lots'"),
        ("--kv-bits", "3", f"must be {SERVED} or 'none', got '3'"),
        ("--kv-bits", "int4", f"must be {SERVED} or 'none', got 'int4'"),
        ("--kv-bits", "zipcache", "zipcache is scored teacher-forced only (bench/accuracy.py), not served"),
    ],
)
def test_bad_flag_is_a_usage_error(files, tmp_path, capsys, no_model, flag, value, shown):
    before = snapshot(tmp_path)
    message = usage_error(capsys, *files, flag, value)
    assert f"argument {flag}:" in message and shown in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", ["directory", "missing parent", "unwritable parent", "prompts file", "partial"])
def test_bad_out_path_is_a_usage_error(files, tmp_path, capsys, monkeypatch, no_model, case):
    prompts, out = files
    expected = {
        "directory": "is a directory",
        "missing parent": "does not exist",
        "unwritable parent": "not writable",
        "prompts file": "would overwrite --prompts",
        "partial": "would overwrite --prompts",
    }[case]
    if case == "directory":
        out = tmp_path / "a-directory"
        out.mkdir()
    elif case == "missing parent":
        out = tmp_path / "missing" / "out.jsonl"
    elif case == "unwritable parent":
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out = locked / "out.jsonl"
        if os.geteuid() == 0:  # root writes anywhere: make the check see what a user would
            access = os.access
            monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and os.fspath(p) != str(locked))
    elif case == "prompts file":
        out = prompts
    else:
        out = tmp_path / "prompts"
        prompts = prompts.rename(tmp_path / "prompts.partial")
    before = snapshot(tmp_path)
    message = usage_error(capsys, prompts, out)
    assert repr(str(out)) in message and expected in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file"),
        ("directory", "is not a regular file"),
        (b'{"prompt": [1]}\n\xff\xfe\n', ":2: not UTF-8 text (byte 0xff"),
        (b'{"prompt": [1]}\n\n{"prompt": [1,}\n', ":3: not valid JSON"),
        (b"[1, 2]\n", ':1: expected a JSON object with a "prompt" key, got array [1, 2]'),
        (b'{"text": "hi"}\n', ':1: no "prompt" key (keys: "text")'),
        (b'{"prompt": [1, 2.0]}\n', ':1: "prompt" must hold integer token ids, got 2.0 (float)'),
        (b'{"prompt": [1, true]}\n', ':1: "prompt" must hold integer token ids, got True (bool)'),
        (b'{"prompt": [[1, 2]]}\n', ':1: "prompt" must hold integer token ids, got [1, 2] (list)'),
        (b'{"prompt": 7}\n', ':1: "prompt" must be a string or a list of token ids, got number 7'),
        (b'{"prompt": {"type": "Buffer", "data": [104, 105]}}\n', ':1: "prompt" must be a string or a list'),
        (b'{"prompt": []}\n', ':1: "prompt" must have at least one token'),
        (b'{"prompt": [3, -3]}\n', ':1: "prompt": token ids must be >= 0, got -3'),
        (b'{"prompt": "\\ud800"}\n', ':1: "prompt" is not valid text: lone surrogate'),
        (
            b'{"prompt": [1]}\n{"prompt": 1.5}\n{"prompt": null}\n',
            ':2: "prompt" must be a string or a list of token ids, got number 1.5 (and 1 more bad line)',
        ),
        (b"\n  \n", ": no prompts"),
    ],
)
def test_bad_prompts_file_is_a_usage_error(files, tmp_path, capsys, no_model, content, expected):
    _, out = files
    prompts = tmp_path / "input.jsonl"
    if content == "directory":
        prompts.mkdir()
    elif content is not None:
        prompts.write_bytes(content)
    before = snapshot(tmp_path)
    message = usage_error(capsys, prompts, out)
    assert str(prompts) in message and expected in message
    assert snapshot(tmp_path) == before


def test_missing_model_is_a_usage_error(files, tmp_path, capsys):
    before = snapshot(tmp_path)
    assert "no such model file or directory" in usage_error(capsys, *files, model=tmp_path / "nope")
    assert snapshot(tmp_path) == before


def test_max_new_tokens_that_fill_the_cache_are_a_usage_error(files, tmp_path, capsys, shared_model):
    before = snapshot(tmp_path)
    message = usage_error(capsys, *files, "--max-seq-len", "16", "--max-new-tokens", "16")
    assert "--max-new-tokens 16 leaves no room" in message and "16 cache positions of --max-seq-len" in message
    assert snapshot(tmp_path) == before


def test_a_cache_budget_that_holds_no_pages_is_a_usage_error(files, tmp_path, capsys, shared_model):
    before = snapshot(tmp_path)
    message = usage_error(capsys, *files, "--cache-memory", "1000")
    assert "cache_memory budget of 1000 B" in message and "a cache needs at least 2" in message
    assert snapshot(tmp_path) == before


def test_help_explains_formats_partial_file_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        infer.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert all(s in text for s in ('"prompt"', '"index"', '"error"', "OUT.partial", "exit status", "130"))


def test_bad_prompts_in_later_batches_get_error_records(files, tmp_path, capsys, shared_model):
    prompts, out = files
    rows = [[1, 2, 3], [4, 5], [6, 7], [1] * 253, [VOCAB], "text needs a tokenizer", [8]]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    (tmp_path / "out.jsonl.partial").write_text("left by an interrupted run\n")
    assert run(prompts, out, "--max-new-tokens", "4", "--max-batch", "2", "--show") == 1
    got = records(out)
    assert [r["index"] for r in got] == list(range(7)) and [r["prompt"] for r in got] == rows
    assert "253 tokens" in got[3]["error"] and "needs 257 cache positions, more than the 256" in got[3]["error"]
    assert f"token ids must be in [0, {VOCAB}), got {VOCAB}" in got[4]["error"]
    assert "no tokenizer" in got[5]["error"]
    assert all(len(got[n]["tokens"]) == 4 and "error" not in got[n] for n in (0, 1, 2, 6))
    captured = capsys.readouterr()
    assert "error: prompt 4: token id" in captured.out and "tok/s" in captured.out
    assert "replacing" in captured.err and f"3 of 7 prompts failed; their records in {out}" in captured.err
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]


def failing_after(n: int, error: BaseException):
    """``kvjax.generate_iter`` that yields its first ``n`` results, then raises ``error``."""
    real = kvjax.generate_iter

    class Failing:
        def __init__(self, run):
            self.run, self.runner = run, run.runner  # kvjax-infer prints the engine's description from the runner

        def __iter__(self):
            for i, item in enumerate(self.run):
                if i == n:
                    raise error
                yield item

    def generate_iter(*args, **kwargs):
        return Failing(real(*args, **kwargs))

    return generate_iter


@pytest.mark.parametrize(
    "error, shown",
    [(kvjax.CacheFullError("no free pages"), "CacheFullError: no free pages"), (ValueError("bad run"), "bad run")],
)
def test_a_failed_run_gives_the_unfinished_prompts_error_records(
    files, tmp_path, capsys, monkeypatch, shared_model, error, shown
):
    prompts, out = files
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ([1], [2], [9, 9, 9], [3], [4])))
    monkeypatch.setattr(kvjax, "generate_iter", failing_after(2, error))
    assert run(prompts, out, "--max-new-tokens", "3", "--max-batch", "2") == 1
    got = records(out)
    assert [r["index"] for r in got] == list(range(5))
    finished = [n for n in range(5) if "error" not in got[n]]
    assert len(finished) == 2 and all(len(got[n]["tokens"]) == 3 for n in finished)
    assert all(got[n]["error"] == f"generation failed: {shown}" for n in range(5) if n not in finished)
    assert f"3 of 5 prompts failed; their records in {out}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]


def test_interrupted_run_keeps_finished_records_in_partial_file(files, tmp_path, capsys, monkeypatch, shared_model):
    prompts, out = files
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ([1], [2], [VOCAB + 5], [3], [4])))
    monkeypatch.setattr(kvjax, "generate_iter", failing_after(2, KeyboardInterrupt()))
    assert run(prompts, out, "--max-new-tokens", "3", "--max-batch", "2") == 130
    partial = tmp_path / "out.jsonl.partial"
    got = records(partial)
    assert [r["index"] for r in got] == [0, 1, 2] and "error" in got[2] and all(len(r["tokens"]) == 3 for r in got[:2])
    assert out.read_bytes() == OLD
    err = capsys.readouterr().err
    assert f"interrupted: the 3 finished records (of 5) are kept in {partial}" in err and "Traceback" not in err


# ---- the converter's flags: refused before anything is loaded or calibrated


@pytest.mark.parametrize(
    "flags, shown",
    [
        (["--target-rate", "nan"], "argument --target-rate: the rate must be a finite number, got nan"),
        (["--removal-rate", "1.0"], "argument --removal-rate: the rate must be in [0, 1), got 1"),
        (["--target-rate", "half"], "argument --target-rate: expected a number, got 'half'"),
        (["--target-rate", "0.5", "--dtype", "foo"], "dtype must be one of bfloat16, float16, float32, got 'foo'"),
        (["--target-rate", "0.5", "--num-tokens", "0"], "argument --num-tokens: the count must be positive, got 0"),
        (["--target-rate", "0.5", "--seq-len", "-8"], "argument --seq-len: the count must be positive, got -8"),
        (["--target-rate", "0.5", "--seed", "-1"], "argument --seed: seed must be in"),
        (
            ["--target-rate", "0.5", "--calibration", "wiki"],
            "--calibration must be 'text', 'prose', 'code', 'random' or 'text:FILE'",
        ),
        (["--target-rate", "0.5", "--max-context", "0"], "argument --max-context: the count must be positive, got 0"),
        (["--target-rate", "0.5", "--max-context", "all"], "takes 'model', 'calibration' or a number of positions"),
        (["--target-rate", "0.5", "--kv-bits", "3"], f"argument --kv-bits: must be {SERVED} or 'none', got '3'"),
        (
            ["--target-rate", "0.5", "--kv-bits", "model"],
            f"argument --kv-bits: must be {SERVED} or 'none', got 'model'",
        ),
        (["--target-rate", "0.5", "--ranks", "kl"], "argument --ranks: invalid choice: 'kl'"),
        (["--removal-rate", "0.2", "--ranks", "measured"], "--ranks measured takes --target-rate"),
        (["--target-rate", "0.5", "--uniform", "--ranks", "measured"], "--ranks measured takes --target-rate"),
        (["--target-rate", "0.5", "--k-share", "0.5", "--ranks", "measured"], "neither --uniform nor --k-share"),
        (["--target-rate", "0.5", "--band", "24"], "argument --band: band must be a power of two from 1 to 4096"),
        (["--target-rate", "0.5", "--band", "wide"], "argument --band: expected an integer, got 'wide'"),
        (["--target-rate", "0.5", "--band", "16", "--method", "palu"], "--band applies to --method zack"),
        (["--target-rate", "0.5", "--band", "16", "--max-context", "4096"], "--band serves every position"),
        (["--target-rate", "0.5", "--qk-basis", "both"], "argument --qk-basis: invalid choice: 'both'"),
        (
            ["--target-rate", "0.5", "--qk-basis", "pair", "--method", "palu"],
            "--qk-basis pair applies to --method zack",
        ),
        (["--target-rate", "0.5", "--qk-widths", "own"], "argument --qk-widths: invalid choice: 'own'"),
        (["--target-rate", "0.5", "--qk-widths", "pair"], "--qk-widths pair applies to --qk-basis pair"),
        (["--target-rate", "0.5", "--qk-widths", "pair", "--qk-basis", "measured"], "picks the widths itself"),
        (["--target-rate", "0.5", "--qk-widths", "pair", "--qk-basis", "pair", "--uniform"], "no --uniform"),
        (
            ["--target-rate", "0.5", "--qk-widths", "pair", "--qk-basis", "pair", "--ranks", "measured"],
            "--qk-widths pair applies to --qk-basis pair",
        ),
        (
            ["--target-rate", "0.5", "--band", "16", "--kv-bits", "4"],
            "--kv-bits 4 with --method zack --band 16: quantized pages are not supported on banded ZACK models yet",
        ),
        (
            ["--target-rate", "0.5", "--method", "palu", "--kv-bits", "4"],
            "--kv-bits 4 with --method palu: quantized pages are not supported on Palu models yet (their cache holds a "
            "latent K that every read rebuilds); quantize an uncompressed or ZACK model",
        ),
    ],
)
def test_convert_refuses_bad_flags_before_loading(tmp_path, capsys, no_model, flags, shown):
    from kvjax.cli import convert

    with pytest.raises(SystemExit) as e:
        convert.main([MODEL, str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and shown in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []
