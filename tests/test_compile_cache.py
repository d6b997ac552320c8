"""JAX's persistent compilation cache, on by default for ``kvjax.generate``, ``kvjax-infer`` and ``kvjax-serve``
(``kvjax.runtime.compile_cache``): a second process finds the first one's compiled steps and gives the same tokens;
the directory is the documented default, private, movable, and "off" leaves JAX alone; a directory that cannot be
made is refused in one line."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import jax
import pytest
from conftest import fresh_seed

from kvjax.runtime import compile_cache

RUN = textwrap.dedent(
    """
    import json, sys
    import jax
    sys.path.insert(0, {tests!r})
    from conftest import TINY_CONFIGS
    import kvjax

    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed={seed})
    out = kvjax.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, max_seq_len=32)
    print(json.dumps(dict(tokens=[g.tokens for g in out], hits=len(hits), dir=jax.config.jax_compilation_cache_dir)))
    """
)


@pytest.fixture
def jax_cache():
    """JAX's cache settings restored after the test (``use`` changes them for the process)."""
    from jax._src import compilation_cache

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_enable_compilation_cache", saved[1])
    compilation_cache.reset_cache()


def test_a_second_process_reads_the_first_ones_compiled_steps(tmp_path):
    seed = fresh_seed() % 1000
    env = dict(os.environ, KVJAX_COMPILE_CACHE=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    script = RUN.format(tests=os.path.dirname(__file__), seed=seed)
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["dir"] == str(tmp_path / "cache") and any((tmp_path / "cache").iterdir())
    assert first["hits"] == 0 and second["hits"] > 0, (first["hits"], second["hits"])
    assert second["tokens"] == first["tokens"], f"seed {seed}"


def test_the_default_directory_is_private_and_movable(tmp_path, monkeypatch, jax_cache):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    jax.config.update("jax_compilation_cache_dir", None)
    path = compile_cache.use()
    assert path == tmp_path / "xdg" / "kvjax" / "jax" and jax.config.jax_compilation_cache_dir == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert compile_cache.use() == path  # a directory JAX already has is kept
    moved = compile_cache.use(tmp_path / "elsewhere")
    assert moved == tmp_path / "elsewhere" and jax.config.jax_compilation_cache_dir == str(moved)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.default_dir() == tmp_path / "env"


def test_off_leaves_jax_alone(tmp_path, monkeypatch, jax_cache):
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.use("off") is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.use() is None and jax.config.jax_compilation_cache_dir is None
    assert compile_cache.use(tmp_path / "given") == tmp_path / "given"  # an explicit directory wins


def test_a_directory_that_cannot_be_made_is_refused_in_one_line(tmp_path, jax_cache):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    jax.config.update("jax_compilation_cache_dir", None)
    for bad in (blocker, blocker / "below"):
        with pytest.raises(ValueError) as e:
            compile_cache.use(bad)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert jax.config.jax_compilation_cache_dir is None
    for bad in (3, "", b"x"):
        with pytest.raises(TypeError, match="compile_cache must be a directory or 'off'"):
            compile_cache.use(bad)


def test_the_commands_refuse_a_bad_directory_before_loading_anything(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = dict(os.environ, KVJAX_COMPILE_CACHE="off")
    cmd = [sys.executable, "-m", "kvjax.cli.serve", "--model", "smollm2", "--compile-cache", str(blocker / "x")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--compile-cache" in done.stderr, done.stderr[-2000:]
