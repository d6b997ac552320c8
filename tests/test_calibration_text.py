"""The default calibration corpus ("text": rows alternating prose and code, ``kvjax.compression.text``), its single
domains, and the refusal of text for a model without a tokenizer (``kvjax.compress``, ``kvjax-convert``)."""

import os

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS

import kvjax
from kvjax.cli import convert
from kvjax.compression import calibration_tokens
from kvjax.compression.text import domain_text

SEQ = 512


class _MemoTokenizer:
    """The model's tokenizer, each text tokenized once (the corpus takes ~3 s): the module's calls share it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.memo = tokenizer, {}

    def __call__(self, text, **kwargs):
        key = (text, tuple(sorted(kwargs.items())))
        if key not in self.memo:
            self.memo[key] = self.tokenizer(text, **kwargs)
        return self.memo[key]


@pytest.fixture(scope="module")
def smollm2():
    model = kvjax.load("smollm2", dtype="float32", progress=False)
    model.tokenizer = _MemoTokenizer(model.tokenizer)
    return model


@pytest.fixture(scope="module")
def domains(smollm2):
    """Each domain's calibration part as token ids, tokenized here (not through ``calibration_tokens``)."""
    return {
        d: np.asarray(smollm2.tokenizer(domain_text(d, "calibration"), add_special_tokens=False)["input_ids"])
        for d in ("prose", "code")
    }


def test_text_rows_alternate_prose_and_code(smollm2, domains):
    tokens = calibration_tokens(smollm2, "text", 65536, SEQ)  # the corpus offers at least 64K tokens
    assert tokens.shape == (128, SEQ) and tokens.dtype == np.int64 and (tokens >= 0).all()
    prose, code = domains["prose"], domains["code"]
    np.testing.assert_array_equal(tokens[0], prose[:SEQ])
    np.testing.assert_array_equal(tokens[1], code[:SEQ])
    np.testing.assert_array_equal(tokens[2], prose[SEQ : 2 * SEQ])
    np.testing.assert_array_equal(tokens[0::2].ravel(), prose[: 64 * SEQ])
    np.testing.assert_array_equal(tokens[1::2].ravel(), code[: 64 * SEQ])
    assert len(prose) > 50_000 and len(code) > 150_000


def test_the_last_row_takes_its_domains_next_slice_then_pads(smollm2, domains):
    tokens = calibration_tokens(smollm2, "text", 2 * SEQ + 100, SEQ)
    assert tokens.shape == (3, SEQ)
    np.testing.assert_array_equal(tokens[2, :100], domains["prose"][SEQ : SEQ + 100])
    assert (tokens[2, 100:] == -1).all()


@pytest.mark.parametrize("domain", ["prose", "code"])
def test_one_domain_is_its_token_stream(smollm2, domains, domain):
    tokens = calibration_tokens(smollm2, domain, 3 * SEQ, SEQ)
    np.testing.assert_array_equal(tokens.ravel(), domains[domain][: 3 * SEQ])


def test_a_domain_that_runs_out_is_named(smollm2, domains):
    prose, code = len(domains["prose"]), len(domains["code"])
    too_many = 2 * (prose // SEQ + 1) * SEQ  # half the rows are prose: one row more than it has
    with pytest.raises(ValueError, match=rf"'text': its prose domain has {prose} tokens, fewer than the \d+ asked"):
        calibration_tokens(smollm2, "text", too_many, SEQ)
    with pytest.raises(ValueError, match=rf"calibration code has {code} tokens, fewer than the {code + 1} asked"):
        calibration_tokens(smollm2, "code", code + 1, SEQ)


@pytest.mark.parametrize("source", ["text", "prose", "code", "text:/nonexistent.txt"])
def test_compress_refuses_text_without_a_tokenizer_before_calibrating(monkeypatch, source):
    model = kvjax.Model.random(TINY_CONFIGS["llama"])
    for step in ("calibration_tokens", "calibrate"):
        monkeypatch.setattr(f"kvjax.compression.pipeline.{step}", lambda *a, **k: pytest.fail("calibration began"))
    with pytest.raises(ValueError, match=r"has no tokenizer: pass calibration='random' \(random token ids\) or token"):
        kvjax.compress(model, target_rate=0.5, calibration=source, progress=False)
    if source == "text":
        with pytest.raises(ValueError, match="has no tokenizer"):
            kvjax.compress(model, target_rate=0.5, progress=False)  # the default


def test_converter_calibrates_on_text_by_default(tmp_path):
    _, args = convert.parse_args(["smollm2", str(tmp_path / "out"), "--target-rate", "0.5"])
    assert args.calibration == "text"
    for source in ("prose", "code", "random"):
        assert convert.parse_args(["smollm2", str(tmp_path / "o"), "--target-rate", "0.5", "--calibration", source])
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("flags", [[], ["--calibration", "prose"], ["--calibration", "code"]])
@pytest.mark.parametrize("src", ["hf", "kvjax"])
def test_converter_refuses_text_without_a_tokenizer_before_loading(tmp_path, capsys, monkeypatch, src, flags):
    if src == "hf":
        src = os.path.join(FIXTURES, "llama")  # config.json and weights, no tokenizer files
    else:
        src = kvjax.Model.random(TINY_CONFIGS["llama"]).save(str(tmp_path / "src"))  # a checkpoint without tokenizer/
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(kvjax, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        convert.main([src, str(tmp_path / "out"), "--target-rate", "0.5", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "has no tokenizer" in err and "pass --calibration random" in err
    assert sorted(os.listdir(tmp_path)) == before
    _, args = convert.parse_args([src, str(tmp_path / "out"), "--target-rate", "0.5", "--calibration", "random"])
    assert args.calibration == "random"


def test_converter_sees_a_hugging_face_tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(FIXTURES, "llama", name), src / name)
    (src / "tokenizer_config.json").write_text("{}")
    _, args = convert.parse_args([str(src), str(tmp_path / "out"), "--target-rate", "0.5"])
    assert args.calibration == "text"
