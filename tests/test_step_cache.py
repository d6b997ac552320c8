"""Steps kept traced and lowered on disk (``kvjax.runtime.step_cache``), beside JAX's compilation cache: a second
engine (or process) of the same model and configuration reads every step back instead of tracing it, gives the same
tokens, and its stored modules are the ones a fresh trace gives; anything that changes a trace changes the key; a
file cut short is traced again and replaced; the cache stays donated; a store that cannot be written costs nothing."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax.runtime import compile_cache, step_cache
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request

SETTINGS = dict(max_batch=4, max_seq_len=64, num_pages=32, chunk_tokens=32, backend="reference")


@pytest.fixture
def store(tmp_path):
    """The compilation cache (and so the step store) in a fresh directory, JAX's settings restored after."""
    from jax._src import compilation_cache

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    compile_cache.use(tmp_path / "cache")
    yield tmp_path / "cache" / step_cache.FOLDER
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_enable_compilation_cache", saved[1])
    compilation_cache.reset_cache()


def _tokens(engine: Engine, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    runner = Runner(engine)
    requests = [
        runner.add(Request(rng.integers(3, 90, n).tolist(), max_new_tokens=6, temperature=t, seed=seed))
        for n, t in ((9, 0.0), (3, 0.8), (20, 0.0))
    ]
    list(runner.run())
    return [r.tokens for r in requests]


def test_a_second_engine_reads_every_step_back_and_gives_the_same_tokens(store):
    seed = fresh_seed()
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=seed % 1000)
    first = Engine(model, **SETTINGS)
    assert first.compile_ahead(threads=2) > 0
    assert not any(step.stored for step in first._compiled.values())
    written = sorted(store.iterdir())
    assert written and all(p.suffix == ".step" for p in written)
    second = Engine(model, **SETTINGS)
    second.compile_ahead(threads=2)
    assert all(step.stored for step in second._compiled.values()) and sorted(store.iterdir()) == written
    reference = Engine(model, **SETTINGS)  # the store off: the jitted steps
    jax.config.update("jax_enable_compilation_cache", False)
    assert reference._store() is None
    assert _tokens(second, seed) == _tokens(reference, seed), f"seed {seed}"


def test_steps_compiled_on_demand_are_stored_too(store):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=fresh_seed() % 1000)
    engine = Engine(model, **SETTINGS)
    tokens = _tokens(engine, 1)
    assert engine._compiled and not any(step.stored for step in engine._compiled.values())
    again = Engine(model, **SETTINGS)
    assert _tokens(again, 1) == tokens
    assert again._compiled.keys() == engine._compiled.keys() and all(s.stored for s in again._compiled.values())


def test_the_key_follows_whatever_changes_a_trace(store):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=3)
    other = kvjax.Model.random(TINY_CONFIGS["mistral"], seed=3)
    a, b = Engine(model, **SETTINGS), Engine(model, **SETTINGS)
    assert a.fingerprint == b.fingerprint
    assert Engine(model, **{**SETTINGS, "max_batch": 2}).fingerprint != a.fingerprint
    assert Engine(model, **{**SETTINGS, "prefill_min_tokens": 32}).fingerprint != a.fingerprint
    assert Engine(other, **SETTINGS).fingerprint != a.fingerprint
    x = (np.zeros(4, np.int32), {"a": np.ones((2, 3), np.float32)})
    k = step_cache.key(("s",), a.fingerprint, x)
    assert k == step_cache.key(("s",), a.fingerprint, (np.ones(4, np.int32), {"a": np.zeros((2, 3), np.float32)}))
    assert k != step_cache.key(("t",), a.fingerprint, x)
    assert k != step_cache.key(("s",), b"other", x)
    assert k != step_cache.key(("s",), a.fingerprint, (np.zeros(5, np.int32), x[1]))
    assert k != step_cache.key(("s",), a.fingerprint, (np.zeros(4, np.float32), x[1]))
    assert k != step_cache.key(("s",), a.fingerprint, (np.zeros(4, np.int32), {"b": x[1]["a"]}))


def test_a_file_cut_short_is_traced_again_and_replaced(store):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=fresh_seed() % 1000)
    Engine(model, **SETTINGS).compile_ahead(threads=1)
    files = sorted(store.iterdir())
    whole = {p: p.read_bytes() for p in files}
    files[0].write_bytes(whole[files[0]][:100])
    files[1].write_bytes(b"")
    engine = Engine(model, **SETTINGS)
    engine.compile_ahead(threads=1)
    assert sum(not s.stored for s in engine._compiled.values()) == 2
    assert {p: p.read_bytes() for p in sorted(store.iterdir())}.keys() == whole.keys()
    assert files[0].stat().st_size == len(whole[files[0]]) and files[1].stat().st_size == len(whole[files[1]])
    assert not [p for p in store.iterdir() if p.name.startswith(".")]  # no temporary file left beside


def test_a_stored_step_still_updates_the_cache_in_place_and_checks_its_inputs(store):
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=5)
    Engine(model, **SETTINGS).compile_ahead(threads=2)
    engine = Engine(model, **SETTINGS)
    engine.compile_ahead(threads=2)
    before = jax.tree.leaves(engine.cache)
    _tokens(engine, 2)
    assert all(leaf.is_deleted() for leaf in before)
    step = engine._compiled["decode", True]
    with pytest.raises(TypeError, match="a step compiled for inputs"):
        step(engine.weights, engine.cache)


def test_a_store_that_cannot_be_written_costs_only_the_trace(store):
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text("not a directory")
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=7)
    engine = Engine(model, **SETTINGS)
    engine.compile_ahead(threads=1)
    assert _tokens(engine, 3) and store.read_text() == "not a directory"


VERIFY = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from conftest import TINY_CONFIGS
    import kvjax
    from kvjax.runtime import compile_cache
    from kvjax.runtime.engine import Engine

    compile_cache.use()
    model = kvjax.Model.random(TINY_CONFIGS["mistral"], seed={seed})
    engine = Engine(model, max_batch=2, max_seq_len=48, num_pages=16, chunk_tokens=16, backend="reference")
    engine.compile_ahead(threads=2, processes={processes})
    out = kvjax.generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=4, max_seq_len=48)
    print(json.dumps(dict(stored=[s.stored for s in engine._compiled.values()], tokens=[g.tokens for g in out])))
    """
)


def test_another_process_reads_the_steps_and_they_are_what_a_fresh_trace_gives(tmp_path):
    """The first process traces its steps in two processes of its own (``step_cache.trace_apart``); the second
    traces every step again (``KVJAX_STEP_CACHE_VERIFY``) and finds the stored modules."""
    seed = fresh_seed() % 1000
    env = dict(os.environ, KVJAX_COMPILE_CACHE=str(tmp_path / "cache"))
    runs = []
    for verify, processes in (("0", 2), ("1", 0)):
        script = VERIFY.format(tests=os.path.dirname(__file__), seed=seed, processes=processes)
        env[step_cache.VERIFY] = verify
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert all(first["stored"]) and all(second["stored"]), (first["stored"], second["stored"])
    assert second["tokens"] == first["tokens"], f"seed {seed}"


GPU = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from conftest import varied_plan_model
    import kvjax
    from kvjax.models.config import ModelConfig
    from kvjax.runtime import compile_cache
    from kvjax.runtime.engine import Engine
    from test_step_cache import _tokens

    where = compile_cache.use()
    shape = ModelConfig(
        arch="llama", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=256,
        intermediate_size=512, vocab_size=128, norm_eps=1e-5, max_position_embeddings=4096,
    )
    model = varied_plan_model(kvjax.Model.random(shape, seed={seed}))
    settings = dict(max_batch=4, max_seq_len=64, num_pages=32, chunk_tokens=32, backend={backend!r})
    engine = Engine(model, **settings)
    engine.compile_ahead(threads=4, processes={processes})
    stored = [getattr(s, "stored", None) for s in engine._compiled.values()]
    print(json.dumps(dict(stored=stored, tokens=_tokens(engine, {seed}))))
    """
)


@pytest.mark.gpu
def test_on_a_gpu_steps_traced_apart_are_the_kernels_own_and_give_the_jitted_tokens(tmp_path):
    """Pallas's Triton kernels lowered in CPU processes for this GPU: a second process's fresh trace finds the same
    modules, and the tokens equal the jitted steps' (the store off)."""
    seed = fresh_seed() % 1000
    env = dict(os.environ, KVJAX_COMPILE_CACHE=str(tmp_path / "cache"))
    runs = []
    for verify, processes, cache in (("0", 2, None), ("1", 0, None), ("0", 0, "off")):
        env[step_cache.VERIFY] = verify
        env["KVJAX_COMPILE_CACHE"] = cache or str(tmp_path / "cache")
        script = GPU.format(tests=os.path.dirname(__file__), seed=seed, processes=processes, backend="pallas")
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    apart, verified, jitted = runs
    assert all(apart["stored"]) and all(verified["stored"]) and not any(jitted["stored"])
    assert apart["tokens"] == verified["tokens"] == jitted["tokens"], f"seed {seed}"


def test_a_model_that_cannot_be_fingerprinted_runs_unstored(store, monkeypatch):
    import pickle

    def refuse(self):
        raise pickle.PicklingError("a static attribute pickle cannot take")

    monkeypatch.setattr(Engine, "fingerprint", property(refuse))
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=11)
    engine = Engine(model, **SETTINGS)
    assert engine._store() is None and _tokens(engine, 4)
    assert not store.exists()


def test_compile_ahead_refuses_a_bad_process_count_before_any_work(store):
    engine = Engine(kvjax.Model.random(TINY_CONFIGS["llama"], seed=13), **SETTINGS)
    for bad, error in ((-1, ValueError), (float("nan"), TypeError), ("2", TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="processes"):
            engine.compile_ahead(processes=bad)
    assert not engine._compiled and not store.exists()


def test_a_stored_steps_trace_and_compile_are_named_after_its_step(store):
    """JAX names a jitted function's trace, lowering and compile events after it: a step through the store is named
    ``_decode_step``/``_prefill_step`` (through the engine's ``functools.partial``s), traced or read back, so that
    ``bench.engine.compile_times`` counts its compiles (it read 0 for a stored step named ``flat`` and ``call``)."""
    from jax._src import dispatch

    events: list[tuple[str, str]] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event in (dispatch.JAXPR_TRACE_EVENT, dispatch.BACKEND_COMPILE_EVENT):
            events.append((event, str(kwargs.get("fun_name", ""))))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=fresh_seed() % 1000)
        for _ in range(2):  # traced and stored, then read back
            events.clear()
            Engine(model, **SETTINGS).compile_ahead(threads=1)
            names = {name.removeprefix("jit(").rstrip(")") for event, name in events}
            compiled = {name for event, name in events if event == dispatch.BACKEND_COMPILE_EVENT}
            assert {"_decode_step", "_prefill_step"} <= names and not names & {"flat", "call", "named"}
            assert any("_decode_step" in n for n in compiled) and any("_prefill_step" in n for n in compiled)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
