"""Hostile input to the Python API: every bad value gets a clear error naming it, never a NaN or a silent change."""

import math

import numpy as np
import pytest
from conftest import TINY_CONFIGS
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax
from kvjax import validate

MODEL = kvjax.Model.random(TINY_CONFIGS["llama"], seed=0, scale=3.0)
VOCAB = TINY_CONFIGS["llama"].vocab_size

NON_FINITE = [math.nan, math.inf, -math.inf, np.float32("nan")]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        *[(dict(temperature=v), ValueError, "temperature must be a finite number") for v in NON_FINITE],
        (dict(temperature=-0.5), ValueError, r"temperature must be in \[0, inf\), got -0.5"),
        (dict(temperature="0.7"), TypeError, "temperature must be a number, got '0.7'"),
        (dict(top_p=math.nan), ValueError, "top_p must be a finite number"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be positive, got 0"),
        (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an integer, got 2.0"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer, got True"),
        (dict(seed=-1), ValueError, "seed must be in"),
        (dict(seed=1.5), TypeError, "seed must be an integer"),
        (dict(max_batch=0), ValueError, "max_batch must be positive"),
        (dict(page_size=-16), ValueError, "page_size must be positive"),
        (dict(max_seq_len=0), ValueError, "max_seq_len must be positive"),
        (dict(stop=[b"\x00"]), TypeError, r"stop entries must be strings or token ids, got b'\\x00'"),
        (dict(stop=[1.5]), TypeError, "stop entries must be strings or token ids, got 1.5"),
        (dict(stop=[""]), ValueError, "stop strings must not be empty"),
        (dict(stop=-3), ValueError, "stop token id must be >= 0, got -3"),
        (dict(batch_invariant="no"), TypeError, "batch_invariant must be True or False, got 'no'"),
        (dict(chat=1), TypeError, "chat must be True or False, got 1"),
    ],
)
def test_generate_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kvjax.generate(MODEL, [[1, 2, 3]], **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        ([1.0, 2.0], TypeError, r"prompt 0 must hold integer token ids, got 1.0 \(float\)"),
        (b"ab", TypeError, "prompt 0 must be a sequence of integer token ids, got bytes"),
        (bytearray(b"ab"), TypeError, "prompt 0 must be a sequence of integer token ids, got bytearray"),
        ([True, 3], TypeError, r"got True \(bool\)"),
        ([[1, 2]], TypeError, r"got \[1, 2\] \(list\)"),
        (["a"], TypeError, r"got 'a' \(str\)"),
        (np.array([1.0, 2.0]), TypeError, "must be a 1-D integer array, got float64"),
        (np.array([[1, 2]]), TypeError, r"must be a 1-D integer array, got int64 of shape \(1, 2\)"),
        ([-1], ValueError, r"token ids must be in \[0, 97\), got -1"),
        ([VOCAB], ValueError, r"token ids must be in \[0, 97\), got 97"),
        ([], ValueError, "prompt 0 must have at least one token"),
        (None, TypeError, "got NoneType"),
        ("text", ValueError, "prompt 0 is a string, but this model has no tokenizer"),
    ],
)
def test_generate_refuses_bad_prompts(prompt, error, match):
    with pytest.raises(error, match=match):
        kvjax.generate(MODEL, [prompt], max_new_tokens=1)


@pytest.mark.parametrize("prompts", ["one string", [1, 2, 3], b"bytes", 7, None])
def test_generate_wants_a_list_of_prompts(prompts):
    with pytest.raises(TypeError, match="prompts must be a list of prompts"):
        kvjax.generate(MODEL, prompts, max_new_tokens=1)


def test_numpy_prompts_and_stop_ids_are_taken_as_their_values():
    plain = kvjax.generate(MODEL, [[5, 6, 7]], max_new_tokens=8)[0].tokens
    numpy = kvjax.generate(MODEL, [np.array([5, 6, 7], np.int32)], max_new_tokens=8)[0].tokens
    assert numpy == plain
    stop = plain[3]
    for s in (np.int64(stop), np.int32(stop), [np.int16(stop)]):
        r = kvjax.generate(MODEL, [[5, 6, 7]], max_new_tokens=8, stop=s)[0]
        assert r.tokens == plain[: plain.index(stop) + 1] and r.finish_reason == "stop"


def test_a_long_stop_string_stops_generation_when_it_appears():
    model = kvjax.load("smollm2", dtype="float32", progress=False)
    prompt = "Repeat exactly: one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    full = kvjax.generate(model, [prompt], max_new_tokens=40, chat=True)[0]
    words = full.text.split()
    assert len(words) > 8
    stop = " ".join(words[1:8])  # more than 16 tokens of text is not needed: longer than the old 16-token window
    stop = stop if len(model.tokenizer(stop)["input_ids"]) > 4 else full.text[:60]
    r = kvjax.generate(model, [prompt], max_new_tokens=40, chat=True, stop=[stop])[0]
    assert r.finish_reason == "stop" and stop not in r.text and len(r.tokens) < len(full.tokens)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(target_rate=math.nan), ValueError, "target_rate must be a finite number"),
        (dict(removal_rate=math.inf), ValueError, "removal_rate must be a finite number"),
        (dict(target_rate="0.5"), TypeError, "target_rate must be a number"),
        (dict(target_rate=0.5, num_tokens=0), ValueError, "num_tokens must be positive"),
        (dict(target_rate=0.5, seq_len=-4), ValueError, "seq_len must be positive"),
        (dict(target_rate=0.5, batch_size=0), ValueError, "batch_size must be positive"),
        (dict(target_rate=0.5, seed=-2), ValueError, "seed must be in"),
        (
            dict(target_rate=0.5, calibration=[1, 2, VOCAB + 5] * 10, num_tokens=30),
            ValueError,
            r"calibration tokens: token ids must be in \[0, 97\), got 102",
        ),
        (dict(target_rate=0.5, calibration=[-1] * 40, num_tokens=30), ValueError, "token ids must be in .*, got -1"),
        (dict(target_rate=0.5, calibration=[0.5] * 40, num_tokens=30), TypeError, "must hold integer token ids"),
        (dict(target_rate=0.5, calibration="wikipedia"), ValueError, "calibration must be 'random', 'text'"),
        (dict(target_rate=0.5), ValueError, "this model has no tokenizer: pass calibration='random'"),
        (dict(target_rate=0.5, calibration="code"), ValueError, "this model has no tokenizer"),
    ],
)
def test_compress_refuses_bad_arguments_before_calibrating(kwargs, error, match):
    with pytest.raises(error, match=match):
        kvjax.compress(MODEL, progress=False, **kwargs)


@pytest.mark.parametrize("dtype", ["foo", "int8", "float64", None, 3])
def test_bad_dtypes_are_named(dtype):
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
        MODEL.astype(dtype)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kvjax.load("smollm2", dtype=dtype)


@pytest.mark.parametrize(
    "tokens, match", [([[1.5, 2.0]], "integer array"), ([[97]], r"\[0, 97\)"), ([1, 2, 3], r"\[batch, time\]")]
)
def test_logits_refuses_bad_tokens(tokens, match):
    with pytest.raises(ValueError, match=match):
        MODEL.logits(tokens)
    with pytest.raises(ValueError, match=match):
        MODEL.hidden(tokens)


@pytest.mark.parametrize(
    "hidden",
    [np.ones((2, MODEL.config.hidden_size + 1), np.float32), np.ones((MODEL.config.hidden_size,), np.int32), 1.0],
)
def test_project_refuses_what_is_not_a_hidden_state(hidden):
    with pytest.raises(ValueError, match="hidden must be floating"):
        MODEL.project(hidden)


# ---- properties of the one validation module


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_rates_are_finite_numbers_in_zero_one(x):
    if math.isfinite(x) and 0 <= x < 1:
        assert validate.rate("r", x) == x
    else:
        with pytest.raises(ValueError, match="r must be"):
            validate.rate("r", x)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 120), st.floats(), st.booleans(), st.text(max_size=2)), max_size=6))
def test_token_ids_are_exactly_the_in_range_integers(ids):
    ok = ids and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB for t in ids)
    if ok:
        assert validate.token_ids("p", ids, VOCAB) == ids
        assert validate.token_ids("p", np.array(ids), VOCAB) == ids
    else:
        with pytest.raises((TypeError, ValueError), match=r"^p\b"):
            validate.token_ids("p", ids, VOCAB)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.floats(), st.integers(-3, 3), st.booleans(), st.none(), st.text(max_size=3)))
def test_temperature_is_a_finite_non_negative_number(x):
    good = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
    if good:
        assert validate.temperature(x) == float(x)
    else:
        with pytest.raises((TypeError, ValueError), match="temperature must be"):
            validate.temperature(x)


@pytest.mark.parametrize(
    "make, field, value, message",
    [
        ("decode", "block_tokens", 0, "block_tokens must be at least 1, got 0"),
        ("decode", "pack_tile", -16, "pack_tile must be at least 0, got -16"),
        ("decode", "num_warps", True, "num_warps must be an integer, got True"),
        ("decode", "token_cost", 2.5, "token_cost must be an integer, got 2.5"),
        ("decode", "auto_balance", float("nan"), r"auto_balance must be in \[0, 1\], got nan"),
        ("decode", "order", "fastest", "order must be one of"),
        ("decode", "head_schedule", "busy", "head_schedule must be one of"),
        ("decode", "quant_head_launches", "pair", "quant_head_launches must be one of"),
        ("decode", "unmasked_steps", 1, "unmasked_steps must be a bool, got 1"),
        ("decode", "kernel_classes", 0, "kernel_classes must be at least 1, got 0"),
        ("prefill", "block_q", 48, "block_q must be a power of two of at least 16, got 48"),
        ("prefill", "num_stages", 0, "num_stages must be at least 1, got 0"),
        ("prefill", "balanced", "yes", "balanced must be a bool, got 'yes'"),
        ("prefill", "tile_widths", (48, 128), r"tile_widths must be a non-empty tuple of powers of two"),
        ("prefill", "tile_widths", (), r"tile_widths must be a non-empty tuple of powers of two"),
    ],
)
def test_op_configs_refuse_bad_fields(make, field, value, message):
    """A decode or prefill config with a field no kernel or scheduling step can run is refused when it is made."""
    from kvjax.ops.decode.config import DecodeConfig
    from kvjax.ops.prefill.config import PrefillConfig

    cls = DecodeConfig if make == "decode" else PrefillConfig
    with pytest.raises(ValueError, match=message):
        cls(**{field: value})
