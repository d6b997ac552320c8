"""Tensor parallelism's first form (``kvjax.parallel.forward``): on 4 CPU devices
(``--xla_force_host_platform_device_count=4``, in a subprocess so the rest of the suite keeps one device), the
sharded forward gives the single-device model's greedy tokens at every position, its logits within float32's
all-reduce rounding, for Llama, Mistral (sliding window), Falcon (parallel block, biases) and Gemma 3 (q/k norms,
local and global layers), uncompressed and ZACK-compressed (heads of different widths on each device, padded to one
local layout), on 1, 2 and 4 devices; what this form cannot split is refused in one line."""

import os
import subprocess
import sys
import textwrap

from conftest import fresh_seed

SCRIPT = textwrap.dedent(
    """
    import dataclasses, sys
    import numpy as np
    import jax
    sys.path.insert(0, {tests!r})
    from conftest import TINY_CONFIGS, varied_plan_model
    from test_gemma3 import local_then_global
    import kvjax
    from kvjax.parallel.forward import logits, shard

    assert len(jax.devices()) == 4, jax.devices()
    seed = {seed}
    configs = dict(
        llama=dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=128),
        mistral=dataclasses.replace(TINY_CONFIGS["mistral"], sliding_window=6),
        falcon=TINY_CONFIGS["falcon_new"],
        gemma3=local_then_global(2, 64),
    )
    calibration = dict(calibration="random", num_tokens=128, seq_len=32, progress=False)
    models = {{}}
    for name, cfg in configs.items():
        models[name] = kvjax.Model.random(cfg, seed=seed % 1000, scale=2.0)
    models["llama zack"] = varied_plan_model(models["llama"])  # every head of a layer at its own K and V width
    models["gemma3 zack"] = varied_plan_model(models["gemma3"])
    for name, model in models.items():
        cfg = model.config
        tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 19))
        want = np.asarray(model.logits(tokens))
        for n in (1, 2, 4):
            if cfg.num_kv_heads % n:
                continue
            got = np.asarray(logits(shard(model, n), tokens))
            assert (got.argmax(-1) == want.argmax(-1)).all(), (name, n, seed)
            assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), (name, n, seed)
            print(name, n, "ok")
    model = kvjax.Model.random(configs["llama"], seed=1)
    for bad, message in ((3, "cannot be shared evenly"), (8, "tensor_parallel must be 1..4"), (0, "must be 1..4")):
        try:
            shard(model, bad)
        except ValueError as e:
            assert message in str(e) and "\\n" not in str(e), e
        else:
            raise AssertionError(bad)
    palu = kvjax.compress(model, removal_rate=0.5, method="palu", **calibration)
    try:
        shard(palu, 2)
    except ValueError as e:
        assert "not Palu or banded ones" in str(e)
    else:
        raise AssertionError("a Palu model was sharded")
    print("all ok")
    """
)


def test_the_sharded_forward_gives_the_single_device_tokens_on_four_cpu_devices():
    seed = fresh_seed()
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=tests, seed=seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(tests),
    )
    assert run.returncode == 0 and "all ok" in run.stdout, f"seed {seed}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
