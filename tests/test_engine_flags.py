"""One flag per engine setting (issue 40, item 1): kvjax-infer and kvjax-serve read --max-batch and --page-size (and
the rest of ``options.add_engine``) the same way, with the same machine defaults as ``kvjax.generate``; the old
--batch-size still works; the GPU kernels refuse pages they do not take in one line."""

import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax import machine
from kvjax.cli import infer, serve
from kvjax.runtime.config import EngineConfig
from kvjax.runtime.engine import Engine

BOTH = {
    "kvjax-infer": (infer._parser, ["--model", "m", "--prompts", "p", "--out", "o"]),
    "kvjax-serve": (serve._parser, ["--model", "m"]),
}


@pytest.mark.parametrize("command", sorted(BOTH))
def test_both_commands_read_the_engine_flags_alike(command, capsys):
    parser, required = BOTH[command]
    args = parser().parse_args([*required, "--max-batch", "3", "--page-size", "32"])
    assert (args.max_batch, args.page_size) == (3, 32)
    default = parser().parse_args(required)
    assert (default.max_batch, default.page_size) == (None, None)  # the machine's and the format's, resolved later
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--max-batch" in text and "--page-size" in text and "--batch-size" not in text


def test_both_commands_hand_the_engine_the_same_settings_by_the_configs_names():
    import dataclasses

    from kvjax.cli import options

    flags = ["--max-batch", "3", "--page-size", "32", "--chunk-tokens", "64", "--kv-bits", "4", "--no-prefix-caching"]
    got = {c: options.engine_settings(p().parse_args([*req, *flags])) for c, (p, req) in BOTH.items()}
    assert got["kvjax-infer"] == got["kvjax-serve"]
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(got["kvjax-infer"]) <= fields
    config = EngineConfig(**got["kvjax-infer"])
    assert (config.max_batch, config.page_size, config.chunk_tokens, config.kv_bits) == (3, 32, 64, 4)
    assert config.prefix_caching is False


def test_the_old_batch_flag_of_kvjax_infer_still_sets_max_batch():
    parser, required = BOTH["kvjax-infer"]
    assert parser().parse_args([*required, "--batch-size", "5"]).max_batch == 5


def test_generate_defaults_to_the_machines_batch():
    model = kvjax.Model.random(TINY_CONFIGS[sorted(TINY_CONFIGS)[0]], seed=fresh_seed())
    run = kvjax.generate_iter(model, [[1, 2, 3]], 2, compile_cache="off")
    assert machine.default_max_batch() == machine.CPU_MAX_BATCH  # this suite runs on a CPU
    assert run.runner.engine.max_batch == machine.CPU_MAX_BATCH
    assert len(list(run)) == 1


def test_an_engine_built_directly_takes_the_machines_batch_too():
    """``EngineConfig`` resolves an open ``max_batch`` as the entry points do, so ``Engine(model)`` is the engine
    ``kvjax.generate`` would build; ``replace(max_batch=None)`` resolves again."""
    model = kvjax.Model.random(TINY_CONFIGS[sorted(TINY_CONFIGS)[0]], seed=fresh_seed())
    assert EngineConfig().max_batch == machine.default_max_batch() == machine.CPU_MAX_BATCH
    assert Engine(model, max_seq_len=64, num_pages=8).max_batch == machine.CPU_MAX_BATCH
    assert EngineConfig(max_batch=3).replace(max_batch=None).max_batch == machine.CPU_MAX_BATCH
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=0)


@pytest.mark.parametrize("page_size", [8, 24, 48])
def test_gpu_kernels_refuse_pages_they_do_not_take_before_any_memory(page_size):
    model = kvjax.Model.random(TINY_CONFIGS[sorted(TINY_CONFIGS)[0]], seed=fresh_seed())
    with pytest.raises(ValueError, match=f"page_size={page_size}: the GPU kernels take pages of a power of two"):
        Engine(model, EngineConfig(page_size=page_size, backend="pallas", max_seq_len=64, num_pages=8))


def test_any_page_size_runs_on_the_reference_and_interpreted_paths():
    model = kvjax.Model.random(TINY_CONFIGS[sorted(TINY_CONFIGS)[0]], seed=fresh_seed(), scale=10.0)
    rng = np.random.default_rng(fresh_seed())
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (3, 21)]
    settings = dict(max_new_tokens=5, max_batch=2, compile_cache="off")
    want = [g.tokens for g in kvjax.generate(model, prompts, page_size=16, backend="reference", **settings)]
    for backend, page_size in (("reference", 24), ("interpret", 8)):
        got = kvjax.generate(model, prompts, page_size=page_size, backend=backend, **settings)
        assert [g.tokens for g in got] == want, (backend, page_size)
