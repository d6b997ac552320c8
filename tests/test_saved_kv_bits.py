"""The quantized-page choice saved with a checkpoint (``kvjax-convert --kv-bits``, kvjax.json's "serving"): it comes
back as ``Model.kv_bits``, survives copies and saves, and ``kvjax.generate``, ``kvjax-infer`` and ``kvjax-serve``
serve from it unless told otherwise (``kv_bits=None``, ``--kv-bits none``)."""

import json
import os

import pytest
from conftest import FIXTURES, TINY_CONFIGS

import kvjax
from kvjax.cli import convert, infer, serve
from kvjax.compression import pipeline
from kvjax.compression.plan import PALU_KV_BITS
from kvjax.runtime.config import EngineConfig
from kvjax.runtime.engine import Engine

RANDOM = dict(calibration="random", num_tokens=64, seq_len=32, progress=False)


def engine_of(model) -> Engine:
    """The engine ``kvjax.generate`` built last for ``model`` (it keeps one)."""
    (engine,) = model._engines.values()
    return engine


def test_convert_saves_kv_bits_and_generate_serves_from_it_by_default(tmp_path, capsys):
    out = tmp_path / "out"
    flags = "--removal-rate 0.2 --calibration random --num-tokens 64 --seq-len 32 --kv-bits 4".split()
    assert convert.main([os.path.join(FIXTURES, "llama"), str(out), *flags]) == 0  # stored in bfloat16: astype
    assert "int4 KV pages" in capsys.readouterr().out
    meta = json.loads((out / "kvjax.json").read_text())
    assert meta["serving"] == {"kv_bits": 4} and meta["format"] == 2
    model = kvjax.load(str(out), dtype="float32", progress=False)
    assert model.kv_bits == 4 and model.plan.method == "zack"
    prompts = [[1, 2, 3, 4, 5]]
    default = kvjax.generate(model, prompts, max_new_tokens=3, max_batch=1)
    assert engine_of(model).kv_bits == 4 and engine_of(model).formats is not None
    assert engine_of(model).config.page_size == 32  # a quantized page's default
    plain = kvjax.generate(model, prompts, max_new_tokens=3, max_batch=1, kv_bits=None)  # explicitly unquantized
    assert engine_of(model).formats is None and engine_of(model).config.kv_bits is None
    assert len(default[0].tokens) == len(plain[0].tokens) == 3


def test_kv_bits_survives_save_load_astype_and_compress(tmp_path):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=0)
    plain = tmp_path / "plain"
    model.save(str(plain))
    assert "serving" not in json.loads((plain / "kvjax.json").read_text())  # as before: nothing asked for
    assert kvjax.load(str(plain), progress=False).kv_bits is None

    model.kv_bits = 2
    model.save(str(tmp_path / "a"))
    again = kvjax.load(str(tmp_path / "a"), progress=False)
    assert again.kv_bits == 2 and again.astype("bfloat16").kv_bits == 2
    again.save(str(tmp_path / "b"))  # a loaded model saves its choice again
    assert kvjax.load(str(tmp_path / "b"), progress=False).kv_bits == 2

    assert kvjax.compress(model, removal_rate=0.2, **RANDOM).kv_bits == 2  # "model": the model's own, kept
    model.kv_bits = "GEAR2-r1-o0.010"  # GEAR pages: saved under their canonical name
    model.save(str(tmp_path / "g"))
    assert json.loads((tmp_path / "g" / "kvjax.json").read_text())["serving"] == {"kv_bits": "gear2-r1-o0.01"}
    gear = kvjax.load(str(tmp_path / "g"), progress=False)
    assert gear.kv_bits == "gear2-r1-o0.01" and "gear2-r1-o0.01 KV pages" in repr(gear)
    model.kv_bits = 2
    assert kvjax.compress(model, removal_rate=0.2, kv_bits=None, **RANDOM).kv_bits is None
    assert kvjax.compress(model, removal_rate=0.2, kv_bits=4, **RANDOM).kv_bits == 4


def test_bad_kv_bits_are_refused_before_any_work(tmp_path, monkeypatch):
    """compress refuses before calibrating, save before writing, each in one line; Palu's refusal is the engine's."""
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=0)
    small = kvjax.compress(model, removal_rate=0.0, method="palu", **RANDOM)
    with pytest.raises(ValueError) as engine_err:
        Engine(small, EngineConfig(max_batch=1, max_seq_len=32, kv_bits=4, num_pages=4))
    assert str(engine_err.value) == PALU_KV_BITS  # the same words everywhere

    monkeypatch.setattr(pipeline, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    with pytest.raises(ValueError) as e:
        kvjax.compress(model, removal_rate=0.2, method="palu", kv_bits=4, **RANDOM)
    assert str(e.value) == PALU_KV_BITS
    with pytest.raises(ValueError, match="quantization bits must be one of 4, 2, got 3"):
        kvjax.compress(model, removal_rate=0.2, kv_bits=3, **RANDOM)
    model.kv_bits = 4  # the model's own choice, carried over by default, is refused too, saying whence it came
    with pytest.raises(ValueError) as e:
        kvjax.compress(model, removal_rate=0.2, method="palu", **RANDOM)
    assert str(e.value) == f"{PALU_KV_BITS} (kv_bits=4 is the model's own: pass kv_bits=None)"

    small.kv_bits = 4
    with pytest.raises(ValueError) as e:
        small.save(str(tmp_path / "palu"))
    assert str(e.value) == PALU_KV_BITS
    model.kv_bits = 3
    with pytest.raises(ValueError, match="quantization bits must be one of 4, 2, got 3"):
        model.save(str(tmp_path / "three"))
    assert os.listdir(tmp_path) == []


def test_the_commands_default_to_the_checkpoints_choice(tmp_path, capsys):
    ckpt, prompts, out = tmp_path / "ckpt", tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=0)
    model.kv_bits = 4
    model.save(str(ckpt))
    prompts.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n")
    argv = ["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--dtype", "float32"]
    for flags, pages in (([], "int4 pages"), (["--kv-bits", "none"], None), (["--kv-bits", "2"], "int2 pages")):
        assert infer.main([*argv, "--max-new-tokens", "2", "--max-batch", "1", *flags]) == 0
        line = next(s for s in capsys.readouterr().err.splitlines() if s.startswith("kvjax-infer: on "))
        assert (pages in line) if pages else (" pages of " not in line), line

    loaded = kvjax.load(str(ckpt), dtype="float32", progress=False)
    parser = serve._parser()
    for flags, bits in (([], 4), (["--kv-bits", "none"], None), (["--kv-bits", "NONE"], None), (["--kv-bits", "2"], 2)):
        args = parser.parse_args(["--model", str(ckpt), "--max-batch", "1", "--max-seq-len", "64", *flags])
        engine = serve.build_engine(args, loaded)
        assert engine.config.kv_bits == bits and (engine.formats is None) == (bits is None)
        assert (f"int{bits} pages" in serve.capacity_line(engine, loaded)) == (bits is not None)
        del engine


@pytest.mark.parametrize("command", [infer, serve])
def test_help_says_the_default_is_the_checkpoints_choice(command, capsys):
    with pytest.raises(SystemExit):
        command._parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps lines at hyphens too
    assert "--kv-bits {4,2,gear2,...,none}" in text and "gear2-r1-o0.01-p128" in text
    assert "default: the checkpoint's choice, saved by kvjax-convert --kv-bits" in text
