"""Tensor parallelism over several processes (hosts), the batch path: two processes of two CPU devices each, joined
by ``jax.distributed.initialize`` (Gloo's CPU collectives), each running the same ``kvjax.generate(...,
tensor_parallel=4)`` over the four devices, give the single-device greedy tokens. Every process issues the same
jitted calls because the scheduler is deterministic given the same prompts; each process puts only its own devices'
shares of the weights (``parallel.forward.shard``)."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap

from conftest import TINY_CONFIGS, fresh_seed

import kvjax

LLAMA = dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=128)
SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id=int(sys.argv[1]))
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2, jax.devices()
    sys.path.insert(0, {tests!r})
    from test_multihost import LLAMA, prompts_of
    import kvjax

    model = kvjax.Model.random(LLAMA, seed={seed}, scale=2.0)
    kw = dict(max_new_tokens=8, max_seq_len=96, chunk_tokens=32, tensor_parallel=4)
    got = kvjax.generate(model, prompts_of({seed}), **kw)
    print("tokens", json.dumps([g.tokens for g in got]), flush=True)
    """
)


def prompts_of(seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, LLAMA.vocab_size, n).tolist() for n in (5, 37, 18)]


def test_two_processes_of_two_devices_give_the_single_device_tokens():
    seed = fresh_seed() % 1000
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = os.path.dirname(os.path.abspath(__file__))
    slow = "--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {slow}", JAX_PLATFORMS="cpu")
    script = SCRIPT.format(port=port, tests=tests, seed=seed)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=900)
            assert p.returncode == 0, f"seed {seed}\n{out[-2000:]}\n{err[-3000:]}"
            outs.append(json.loads(next(line for line in out.splitlines() if line.startswith("tokens "))[7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    model = kvjax.Model.random(LLAMA, seed=seed, scale=2.0)
    want = [
        g.tokens for g in kvjax.generate(model, prompts_of(seed), max_new_tokens=8, max_seq_len=96, chunk_tokens=32)
    ]
    assert outs[0] == outs[1] == want, f"seed {seed}"
