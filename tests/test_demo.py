"""`make demo`'s compression half (examples/demo.py) runs on a fresh clone: it builds the compressed checkpoint once,
loads it the second time, and prints both answers, the KV bytes a token and the accuracy line."""

import os
import runpy
import sys

import pytest

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")


def test_demo_compresses_once_then_loads(tmp_path, capsys, monkeypatch):
    argv = [DEMO, "--cache", str(tmp_path), "--calibration-tokens", "2048", "--window", "256", "--max-new-tokens", "8"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path(DEMO, run_name="__main__")
    assert done.value.code == 0
    first = capsys.readouterr().out
    assert "compressing the model once" in first and "[uncompressed]" in first and "[ZACK, rate 0.5" in first
    assert "bytes a token uncompressed" in first and "top-1 agreement" in first
    assert os.listdir(tmp_path) == ["smollm2-zack-50-text-2048"]
    with pytest.raises(SystemExit):
        runpy.run_path(DEMO, run_name="__main__")
    assert "compressing the model once" not in capsys.readouterr().out
