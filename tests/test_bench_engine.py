"""bench/engine.py: each step's first call split into trace, lower and compile from JAX's compile events."""

import numpy as np
import pytest
from jax._src import dispatch

from bench import engine  # noqa: E402


def test_compile_times_sum_each_steps_own_events_by_stage(monkeypatch):
    monkeypatch.setattr(engine, "COMPILES", [("compile", "jit(_decode_step)", 99.0)])  # before ``since``: not counted
    rng = np.random.default_rng()
    t = {k: float(v) for k, v in zip(("dt", "dl", "dc", "dc2", "pt", "pc", "inner"), rng.uniform(0.1, 9.0, 7))}
    events = [
        (dispatch.JAXPR_TRACE_EVENT, "_decode_step", t["dt"]),
        (dispatch.JAXPR_TRACE_EVENT, "paged_decode", t["inner"]),  # an inner function: inside the step's trace
        (dispatch.JAXPR_TO_MLIR_MODULE_EVENT, "jit(_decode_step)", t["dl"]),
        (dispatch.BACKEND_COMPILE_EVENT, "jit(_decode_step)", t["dc"]),
        (dispatch.BACKEND_COMPILE_EVENT, "jit(_decode_step)", t["dc2"]),  # a second variant
        (dispatch.JAXPR_TRACE_EVENT, "_prefill_step", t["pt"]),
        (dispatch.BACKEND_COMPILE_EVENT, "jit(_prefill_step)", t["pc"]),
        ("/jax/some/other_event", "jit(_decode_step)", 5.0),
    ]
    for event, name, seconds in events:
        engine._on_duration(event, seconds, fun_name=name)
    out = engine.compile_times(1)
    assert out["decode_trace_s"] == pytest.approx(t["dt"])
    assert out["decode_lower_s"] == pytest.approx(t["dl"])
    assert out["decode_compile_s"] == pytest.approx(t["dc"] + t["dc2"]) and out["decode_compiles"] == 2
    assert out["decode_first_call_s"] == pytest.approx(t["dt"] + t["dl"] + t["dc"] + t["dc2"])
    assert out["prefill_trace_s"] == pytest.approx(t["pt"]) and out["prefill_lower_s"] == 0.0
    assert out["prefill_compile_s"] == pytest.approx(t["pc"]) and out["prefill_compiles"] == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rates", "0,1.5"], "--rates must be in [0, 1)"),
        (["--shapes", "32x2048,8by32768"], "--shapes must be BxCTX"),
        (["--prefill-shape", "0x2048"], "--prefill-shape's batch must be positive"),
        (["--prefill-chunks", "512,0"], "--prefill-chunks must be positive"),
        (["--warm-steps", "-1"], "--warm-steps must be"),
        (["--steps", "two"], "--steps"),
        (["--tensor-parallel", "0"], "--tensor-parallel"),
        (["--model", "llama-7b"], "invalid choice"),
        (["--tensor-parallel", "2", "--evict", "snapkv:2x"], "--evict is not timed under --tensor-parallel"),
    ],
)
def test_bad_engine_arguments_are_usage_errors_before_any_model_is_built(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        engine.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
