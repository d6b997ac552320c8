"""Stopping the commands mid-run, as their users do: SIGTERM or Ctrl-C on ``kvjax-serve`` with a stream that outlasts
--grace (it ends with an "abort" chunk and [DONE], the server exits 0), and Ctrl-C on ``kvjax-infer`` (exit 130,
the finished records kept in OUT.partial). Neither may die in the runtime on the way out: "terminate called without an
active exception" is a step still computing on the device when the interpreter exits."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import FIXTURES

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_hostile_cli import OLD, records  # noqa: E402
from test_serving import start_serve  # noqa: E402

CRASHES = ("Traceback", "Event loop is closed", "terminate called", "Cancel 1 running task")


def crashes(err: str) -> list[str]:
    return [s for s in CRASHES if s in err]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stream_that_outlasts_the_grace_ends_with_its_abort_chunk_and_the_server_exits_0(sig):
    """The fixture checkpoint with room for 4000 new tokens (seconds of decoding, far more than --grace 1); a plain
    request runs beside the stream and gets its whole answer, cut short too."""
    proc, base = start_serve("--max-seq-len", "4096", "--max-batch", "2", "--dtype", "float32", "--grace", "1")
    deadline = time.monotonic() + 30
    try:
        body = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        whole: dict = {}
        plain = threading.Thread(
            target=lambda: whole.update(httpx.post(base + "/v1/completions", json=body, timeout=60).json())
        )
        plain.start()
        streamed = body | {"stream": True, "return_token_ids": True}  # an event per step: the first comes at once
        events, signalled = [], None
        with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=streamed) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and signalled is None:
                    while httpx.get(base + "/health").json()["running"] < 2:  # the plain one runs too
                        assert time.monotonic() < deadline, "the plain request never ran"
                        time.sleep(0.05)
                    proc.send_signal(sig)  # mid-stream: thousands of tokens to go
                    signalled = time.monotonic()
                if line:
                    events.append(line)
        took = time.monotonic() - signalled
        plain.join(timeout=30)
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "abort" and 0 < last["usage"]["completion_tokens"] < 4000
        assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert 1.0 <= took < 20, took  # --grace 1, then the abort
        assert whole["choices"][0]["finish_reason"] == "abort" and 0 < whole["usage"]["completion_tokens"] < 4000
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Shutting down" in err and not crashes(err), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# kvjax-infer on the fixture checkpoint, each decode step slowed to a large model's pace (a few tenths of a second of
# work on the device, chained into the engine's state): Ctrl-C lands while the step after the one read is computing.
SLOW_INFER = """
import sys, jax, jax.numpy as jnp
from kvjax.runtime.engine import Engine

@jax.jit
def slow(tokens):
    x = jnp.full((384, 384), 1.0 / 384, jnp.float32)
    y = jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ x), x)
    return jnp.where(jnp.isnan(y[0, 0]), 0, tokens)

decode = Engine.decode

def slow_decode(self, *args, **kwargs):
    self.slot_tokens = slow(decode(self, *args, **kwargs))
    return self.slot_tokens

Engine.decode = slow_decode
from kvjax.cli import infer
sys.exit(infer.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("batch_size", [1, 2])
def test_ctrl_c_on_infer_exits_130_keeping_the_partial_file(tmp_path, batch_size):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [5 + n, 6, 7]}) + "\n" for n in range(8)))
    out.write_bytes(OLD)
    partial = tmp_path / "out.jsonl.partial"
    cmd = [sys.executable, "-c", SLOW_INFER, "--model", os.path.join(FIXTURES, "llama"), "--dtype", "float32"]
    cmd += ["--prompts", str(prompts), "--out", str(out), "--max-batch", str(batch_size), "--max-new-tokens", "12"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (partial.exists() and partial.stat().st_size):  # a first record written: decoding goes on
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no record was written"
            time.sleep(0.02)
        time.sleep(0.5)  # into the next prompts' decode steps
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
        kept = records(partial)
        assert 1 <= len(kept) < 8 and [r["index"] for r in kept] == list(range(len(kept)))
        assert all(len(r["tokens"]) == 12 for r in kept if "error" not in r)
        assert f"interrupted: the {len(kept)} finished records (of 8) are kept in {partial}" in err
        assert out.read_bytes() == OLD and not crashes(err), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
