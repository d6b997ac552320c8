"""bench/quant_head_decode.py on the CPU (interpret mode, host timer): its rows, each checked against its own
reference, and its JSON."""

import json

from bench import quant_head_decode


def test_quantized_and_bf16_rows_and_their_json(tmp_path, capsys):
    out = tmp_path / "qhd.json"
    argv = ["--interpret", "--timer", "host", "--shape", "2x96", "--rates", "0.5", "--keep", "0.5", "--bits", "2"]
    quant_head_decode.main([*argv, "--group", "8", "--launches", "layer", "class", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["complete"]
    assert [(r["kernel"], r["group"], r["step_groups"], r["launches"], r["merge"]) for r in rows] == [
        ("int2 per-head", 8, "default", "layer", "kernel"),
        ("int2 per-head", 8, "default", "class", "kernel"),
        ("bf16 per-head", "-", "-", "-", "kernel"),
    ]
    assert all(r["rel_err"] < 2e-2 for r in rows) and rows[0]["bytes"] < rows[-1]["bytes"] / 3
    assert "| int2 per-head |" in capsys.readouterr().out
