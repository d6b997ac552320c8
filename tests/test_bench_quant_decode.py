"""bench/quant_decode.py on the CPU (interpret mode, host timer): every row checked against its reference, and the
JSON written after every row, whole, marked complete only at the end."""

import json
import os

import pytest

from bench import quant_decode  # noqa: E402


def test_one_width_layer_rows_and_their_json(tmp_path, capsys):
    out = tmp_path / "qd.json"
    argv = ["--interpret", "--timer", "host", "--shape", "2x128", "--rates", "", "--widths", "32", "--bits", "4"]
    quant_decode.main([*argv, "--one-schedule", "--gear", "gear2-p16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] and [r["kernel"] for r in data["rows"]] == ["kvjax bf16", "kvjax int4", "kvjax gear2-p16"]
    assert all(r["max_rel_err"] < 2e-2 for r in data["rows"]) and data["rows"][1]["rate"] == "u32"
    assert "| u32 | kvjax int4 |" in (printed := capsys.readouterr().out) and "| u32 | kvjax gear2-p16 |" in printed
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rates", ""], "nothing to measure"),
        (["--widths", "24"], "multiple of 16"),
        (["--bits", "3"], "one of 4, 2"),
        (["--gear", "4"], "a GEAR scheme"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, words, capsys):
    with pytest.raises(SystemExit):
        quant_decode.main(["--interpret", *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err and words in err, err
