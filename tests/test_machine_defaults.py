"""Defaults that fit the machine at hand (``kvjax.machine``): the memory this process may use on a CPU (meminfo,
its cgroup, ``KVJAX_MEMORY``), the cache a share of it buys, a max_seq_len the cache cannot hold once refused, the
dtype a CPU answers in; and ``kvjax-serve`` started with its defaults on a machine that plays a small one."""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS, fresh_seed

import kvjax
from kvjax import machine
from kvjax.runtime import memory
from kvjax.runtime.engine import Engine

httpx = pytest.importorskip("httpx")


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_meminfo_and_cgroup_rooms_are_read_from_their_files(tmp_path):
    write(tmp_path / "meminfo", "MemTotal:       24000000 kB\nMemAvailable:    1000 kB\n")
    assert machine._meminfo_available(str(tmp_path / "meminfo")) == 1000 * 1024
    assert machine._meminfo_available(str(tmp_path / "missing")) is None
    root = tmp_path / "cg"
    write(root / "memory.max", "max\n")  # v2 with no limit: no room to report
    write(root / "memory.current", "123\n")
    assert machine._cgroup_room(str(root)) is None
    write(root / "memory.max", "1000\n")
    assert machine._cgroup_room(str(root)) == 877
    write(root / "memory.current", "5000\n")  # over its limit: nothing left, never negative
    assert machine._cgroup_room(str(root)) == 0
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", str(2**63 - 4096))  # v1's "no limit"
    write(v1 / "memory" / "memory.usage_in_bytes", "10")
    assert machine._cgroup_room(str(v1)) is None
    write(v1 / "memory" / "memory.limit_in_bytes", "4096")
    assert machine._cgroup_room(str(v1)) == 4086


def test_the_memory_cap_bounds_what_kvjax_takes_to_be_free(monkeypatch):
    found = machine.available_bytes()
    assert found is not None and found > 0  # /proc/meminfo on any Linux host
    monkeypatch.setenv(machine.ENV, "3MiB")
    assert machine.available_bytes() == min(found, 3 * 2**20) and memory.free_bytes() == 3 * 2**20
    for bad in ("lots", "0.5", "-5", "0"):
        monkeypatch.setenv(machine.ENV, bad)
        with pytest.raises(ValueError, match=machine.ENV):
            machine.available_bytes()


def test_a_cpu_answers_in_float32_while_the_weights_fit_a_quarter_of_the_memory(monkeypatch):
    params = 1_000_000
    monkeypatch.setenv(machine.ENV, str(16 * params + 4096))
    assert machine.default_dtype(params) == "float32"
    monkeypatch.setenv(machine.ENV, str(16 * params - 4096))
    assert machine.default_dtype(params) == "bfloat16"
    monkeypatch.delenv(machine.ENV)
    model = kvjax.load(os.path.join(FIXTURES, "llama"), progress=False)  # dtype "auto"
    assert np.dtype(model.dtype) == np.float32
    cfg = model.config
    exact = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.state))
    assert 0.95 * exact <= cfg.param_count() <= exact  # norms and biases are all it leaves out


def test_the_default_cache_takes_a_share_of_the_free_memory_and_refuses_a_sequence_it_cannot_hold(monkeypatch):
    """With no budget the cache gets SHARE of what is free, less the activations; a max_seq_len it cannot hold
    once is a CacheTooSmall naming both numbers; max_batch=100000 is a one-line error, not XLA's OOM."""
    seed = fresh_seed()
    config = dataclasses.replace(TINY_CONFIGS["llama"], max_position_embeddings=1024)
    model = kvjax.Model.random(config, seed=seed)
    settings = dict(max_batch=4, max_seq_len=1024, page_size=16, backend="reference")
    probe = Engine(model, num_pages=2, **settings)
    cap = int((probe.activation_bytes() + 20 * probe.cache.nbytes) / machine.SHARE["cpu"]) + 1  # 40 pages
    monkeypatch.setenv(machine.ENV, str(cap))
    with pytest.raises(memory.CacheTooSmall, match=r"holds 624 tokens .* fewer than the max_seq_len=1024") as e:
        Engine(model, **settings)
    assert e.value.tokens == 624, seed
    engine = Engine(model, **{**settings, "max_seq_len": 128})  # a smaller step's activations leave more pages
    assert engine.num_pages == 4 * 8 + 1 and "at most 50% of the" in engine.describe(), seed  # all it can use
    assert "up to 4 sequences at once of up to 128 positions" in engine.describe()
    wide = kvjax.Model.random(dataclasses.replace(config, vocab_size=50_000), seed=seed)
    monkeypatch.setenv(machine.ENV, "64MiB")
    with pytest.raises(ValueError, match=r"for a step's activations.*smaller max_batch") as e:
        kvjax.generate(wide, [[1, 2, 3]], max_new_tokens=2, max_batch=100_000)
    assert "\n" not in str(e.value)


def test_kvjax_serve_starts_with_defaults_that_fit_a_small_machine_and_says_what_it_chose():
    """A machine that plays one with little memory (``KVJAX_MEMORY``): the server's defaults (4 sequences, the
    model's 256 positions) get a cache of under 256 tokens, so it serves what the cache holds and says so; a request
    beyond that gets a 400 with the numbers, streamed or not; a --max-seq-len the cache cannot hold is refused at
    start with both numbers."""
    from test_serving import start_serve

    model = kvjax.load(os.path.join(FIXTURES, "llama"), progress=False)
    probe = Engine(model, max_batch=4, max_seq_len=256, num_pages=2, backend="reference")
    budget = probe.activation_bytes() + 10 * (probe.cache.nbytes // 2)  # about 9 usable pages: 144 tokens
    env = {**os.environ, machine.ENV: str(int(budget / machine.SHARE["cpu"]))}

    with pytest.raises(AssertionError, match="exited 2") as e:
        start_serve("--max-seq-len", "256", env=env)
    err = str(e.value)
    assert "fewer than the --max-seq-len=256" in err and "Traceback" not in err

    proc, base = start_serve(env=env)
    try:
        probe = httpx.post(base + "/v1/completions", json={"model": "llama", "prompt": [5], "max_tokens": 999})
        tokens = int(re.search(r"more than the (\d+) this server's cache holds", probe.text)[1])
        assert 16 <= tokens < 256
        for stream in (False, True):
            body = {"model": "llama", "prompt": [5, 6, 7], "max_tokens": tokens, "stream": stream}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 400, r.text
            assert f"it needs {tokens + 3} positions" in r.json()["error"]["message"]
        # ignore_eos: at the default temperature of 1 the random model may sample its end token first (CI, stop 46)
        fits = {**body, "max_tokens": 4, "stream": False, "ignore_eos": True}
        ok = httpx.post(base + "/v1/completions", json=fits, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "on cpu in float32 (reference attention): up to 4 sequences at once of up to" in err
    assert "does not fit the cache" in err and "positions a sequence instead" in err and "at most 50% of the" in err
