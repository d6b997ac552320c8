"""Tensor parallelism's first form (``kvjax.parallel.forward``): on 4 CPU devices
(``--xla_force_host_platform_device_count=4``, in a subprocess so the rest of the suite keeps one device), the
sharded forward gives the single-device model's greedy tokens at every position, its logits within float32's
all-reduce rounding, for Llama, Mistral (sliding window), Falcon (parallel block, biases) and Gemma 3 (q/k norms,
local and global layers), uncompressed and ZACK-compressed (heads of different widths on each device, padded to one
local layout), on 1, 2 and 4 devices (fewer KV heads than devices: each head replicated, its query heads split
among its devices); what this form cannot split is refused in one line. The engine
(``EngineConfig.tensor_parallel``, through ``kvjax.generate``) gives the single-device greedy tokens on 2 and 4
devices: its steps inside one ``shard_map``, each device's cache holding its heads' columns of every page, with the
jnp reference and with the Pallas kernels interpreted, in pages of the model's dtype and 4-bit pages, and with
eviction (a pool of per-head pages a device, of bf16 or of 4-bit groups, KV-Compress's budget ranked across every
device's heads), a tight pool cutting the same heads at the same steps, on bf16 pages and by whole groups of
4-bit pages; a checkpoint loaded for tensor parallelism
is read by the devices, each its share, and gives the same tokens; a model of shapes only runs on random shares."""

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

    def splittable(cfg, n):  # KV heads shared out evenly, or fewer than devices and replicated evenly
        kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        return kv % n == 0 if kv >= n else n % kv == 0 and group % (n // kv) == 0

    configs = dict(
        llama=dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=128),
        mistral=dataclasses.replace(TINY_CONFIGS["mistral"], sliding_window=6),
        falcon=TINY_CONFIGS["falcon_new"],
        falcon_7b=TINY_CONFIGS["falcon_7b"],  # one KV head: replicated on every device
        gemma3=local_then_global(2, 64),
    )
    calibration = dict(calibration="random", num_tokens=128, seq_len=32, progress=False)
    models = {{}}
    for name, cfg in configs.items():
        models[name] = kvjax.Model.random(cfg, seed=seed % 1000, scale=2.0)
    models["llama zack"] = varied_plan_model(models["llama"])  # every head of a layer at its own K and V width
    models["gemma3 zack"] = varied_plan_model(models["gemma3"])
    models["llama zack pair"] = varied_plan_model(models["llama"], qk_basis="pair")  # queries on their own columns
    for name, model in models.items():
        cfg = model.config
        tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 19))
        want = np.asarray(model.logits(tokens))
        for n in (1, 2, 4):
            if not splittable(cfg, n):
                continue
            for placement in ("bytes", "even") if n > 1 else ("bytes",):
                got = np.asarray(logits(shard(model, n, placement=placement), tokens))
                assert (got.argmax(-1) == want.argmax(-1)).all(), (name, n, placement, seed)
                assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), (name, n, placement, seed)
            print(name, n, "ok")
    model = kvjax.Model.random(configs["llama"], seed=1)
    one_each = kvjax.Model.random(dataclasses.replace(configs["llama"], num_heads=2, num_kv_heads=2), seed=1)
    for bad, n, message in (
        (model, 3, "cannot be shared evenly"),
        (model, 8, "tensor_parallel must be 1..4"),
        (model, 0, "must be 1..4"),
        (one_each, 4, "cannot be replicated on 4 devices"),  # one query head a KV head: nothing to split
    ):
        try:
            shard(bad, n)
        except ValueError as e:
            assert message in str(e) and "\\n" not in str(e), e
        else:
            raise AssertionError(n)
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


ENGINE = textwrap.dedent(
    """
    import dataclasses, sys
    import numpy as np
    import jax
    sys.path.insert(0, {tests!r})
    from conftest import TINY_CONFIGS, varied_plan_model
    from test_gemma3 import local_then_global
    import kvjax
    import jax.numpy as jnp
    from flax import nnx
    from kvjax.models.transformer import Transformer
    from kvjax.runtime.engine import Engine
    from test_engine_eviction import run_tight

    seed = {seed}
    rng = np.random.default_rng(seed)
    llama = dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=128)
    base = kvjax.Model.random(llama, seed=seed % 1000, scale=2.0)
    gemma = kvjax.Model.random(local_then_global(2, 64), seed=seed % 1000, scale=2.0)
    models = dict(llama=base, zack=varied_plan_model(base), gemma3=varied_plan_model(gemma))
    runs = [
        ("llama", dict()),
        ("zack", dict()),
        ("zack", dict(kv_bits=4)),
        ("zack", dict(backend="interpret")),
        ("llama", dict(kv_bits=4, backend="interpret")),
        ("gemma3", dict()),
        ("llama", dict(eviction="kvcompress:2x")),
        ("zack", dict(eviction="kvcompress:2x")),
        ("zack", dict(eviction="snapkv:2x", backend="interpret")),
        ("zack", dict(eviction="h2o:2x")),
        ("zack", dict(eviction="snapkv:2x", kv_bits=4)),  # each device's survivors on 4-bit per-head pages
    ]
    for name, extra in runs:
        model = models[name]
        prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in (5, 37, 18)]
        kw = dict(max_new_tokens=8, max_seq_len=96, chunk_tokens=32, **extra)
        want = [g.tokens for g in kvjax.generate(model, prompts, **kw)]
        for n in (2, 4) if not extra or "eviction" in extra else (2,):
            if model.config.num_kv_heads % n:  # gemma3: two KV heads, each replicated on two of four devices
                assert name == "gemma3" and n == 4 and not extra, (name, extra, n)
            got = [g.tokens for g in kvjax.generate(model, prompts, tensor_parallel=n, **kw)]
            assert got == want, (name, extra, n, seed, got, want)
            print(name, extra, n, "ok", flush=True)
    engine = Engine(base, max_batch=2, max_seq_len=64, tensor_parallel=2)
    assert engine.cache.k[0].sharding.spec[0] == "tp" and engine.cache.k[0].shape[0] == 2, engine.cache.k[0].sharding
    assert "2 cpu devices (tensor parallel" in engine.describe(), engine.describe()
    assert engine.token_bytes() == Engine(base, max_batch=2, max_seq_len=64).token_bytes()  # no padding: equal heads
    for bad, message in (
        (dict(tensor_parallel=3), "cannot be shared evenly"),
        (dict(tensor_parallel=8), "tensor_parallel must be 1..4"),
        (dict(tensor_parallel=2, kv_bits="gear2"), "not supported yet"),
        (dict(tensor_parallel=2, head_placement="lpt"), "head_placement must be"),
        (dict(tensor_parallel=4, eviction="snapkv:16", model=models["gemma3"]), "eviction with tensor_parallel=4"),
        (dict(tensor_parallel=2, eviction="keyformer:2x"), "Keyformer's noise is drawn per query head"),
    ):
        try:
            Engine(bad.pop("model", base), max_batch=2, max_seq_len=64, **bad)
        except ValueError as e:
            assert message in str(e) and "\\n" not in str(e), e
        else:
            raise AssertionError(bad)

    def tight(n, model=base, new=30, **extra):  # a per-head pool of two sequences a device, four requests that
        # outgrow it: heads are cut, each device's counts the host's after every cut (``exact_cuts``)
        settings = dict(max_batch=4, max_seq_len=96, chunk_tokens=32, eviction="snapkv:16", tensor_parallel=n)
        engine, runner, requests, cuts = run_tight(model, seed, new, exact_cuts=True, **settings, **extra)
        assert runner.scheduler.pages.heads.free_per_device.tolist() == [engine.head_pages - 1] * n
        return [r.tokens for r in requests], [(slot, last, target.tolist()) for slot, last, target in cuts]

    def build():  # a module of shapes only: the engine draws each device's shares, never the whole model
        module = Transformer(base.config, plan=models["zack"].plan, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        module.join()
        return module

    shapes = kvjax.Model(nnx.eval_shape(build), plan=models["zack"].plan)
    engine = Engine(shapes, max_batch=2, max_seq_len=64, tensor_parallel=2)
    assert all(w.sharding.spec[0] == "tp" for w in engine.weights) and float(abs(engine.weights[-1]).max()) > 0
    (out,) = kvjax.generate(shapes, [[1, 2, 3]], max_new_tokens=4, max_seq_len=64, tensor_parallel=2)
    assert len(out.tokens) == 4
    try:
        Engine(shapes, max_batch=2, max_seq_len=64)
    except ValueError as e:
        assert "give tensor_parallel > 1" in str(e), e
    else:
        raise AssertionError("a model of shapes only ran on one device")

    import os
    import tempfile
    from kvjax.io.saved import restore_sharded

    with tempfile.TemporaryDirectory() as folder:  # a checkpoint read sharded: each device its share from disk
        models["zack"].save(folder + "/ck")
        prompts = [list(rng.integers(0, 97, n)) for n in (7, 3)]
        kw = dict(max_new_tokens=6, max_seq_len=64)
        want = [g.tokens for g in kvjax.generate(kvjax.load(folder + "/ck"), prompts, **kw)]
        for n in (2, 4):
            lazy = kvjax.load(folder + "/ck", tensor_parallel=n)
            assert lazy.tensor_parallel == n and isinstance(lazy.module.embed.get_value(), jax.ShapeDtypeStruct)
            assert [g.tokens for g in kvjax.generate(lazy, prompts, **kw)] == want, (n, seed)
        read = restore_sharded(folder + "/ck", jnp.float32, jax.devices()[:4])
        embed = read[("embed",)]
        assert all(x.data.size * 4 == embed.size for x in embed.addressable_shards), embed.sharding  # a quarter each
        try:
            kvjax.generate(lazy, prompts, tensor_parallel=1, **kw)
        except ValueError as e:
            assert "give tensor_parallel > 1" in str(e), e
        else:
            raise AssertionError("a model loaded for tensor parallelism ran on one device")
        for what, call in (
            ("model.logits", lambda: lazy.logits([[1, 2]])),
            ("model.save", lambda: lazy.save(folder + "/again")),
            ("kvjax.compress", lambda: kvjax.compress(lazy, removal_rate=0.5)),
        ):
            try:
                call()
            except ValueError as e:
                assert what in str(e) and "load it without tensor_parallel" in str(e), e
            else:
                raise AssertionError(what)
        assert not os.path.exists(folder + "/again")
        for bad in (0, True):
            try:
                kvjax.load(folder + "/ck", tensor_parallel=bad)
            except (TypeError, ValueError) as e:
                assert "tensor_parallel" in str(e), e
            else:
                raise AssertionError(bad)

    want, cuts = tight(1)
    assert cuts and tight(2) == (want, cuts), (seed, cuts)
    quantized = dict(model=models["zack"], new=50, kv_bits=4)  # cut by whole groups of 4-bit pages on each device
    want, cuts = tight(1, **quantized)
    assert cuts and tight(2, **quantized) == (want, cuts), (seed, cuts)
    print("all ok")
    """
)


def _run_on_four_devices(script: str) -> None:
    seed = fresh_seed()
    tests = os.path.dirname(os.path.abspath(__file__))
    # XLA's CPU collectives abort a process whose devices' threads meet more than 40 s apart, which a loaded
    # 2-core machine running four devices' compiles and steps can exceed (seen once beside a full test run)
    slow = "--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {slow}", JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", script.format(tests=tests, seed=seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(tests),
    )
    assert run.returncode == 0 and "all ok" in run.stdout, f"seed {seed}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def test_the_sharded_forward_gives_the_single_device_tokens_on_four_cpu_devices():
    _run_on_four_devices(SCRIPT)


def test_the_tensor_parallel_engine_gives_the_single_device_greedy_tokens():
    _run_on_four_devices(ENGINE)
