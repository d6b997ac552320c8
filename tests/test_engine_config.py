"""One frozen engine configuration (``kvjax.EngineConfig``): every setting checked once, at construction, with a
one-line error; ``Engine`` takes it (or its fields as keywords, the same thing); ``kvjax.generate`` caches its
engines by it; ``for_machine`` fills the batch and positions of the machine at hand."""

import dataclasses

import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax import machine
from kvjax.runtime.engine import Engine


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("max_batch", 0, ValueError, "max_batch"),
        ("max_seq_len", 2.5, TypeError, "max_seq_len"),
        ("page_size", True, TypeError, "page_size"),
        ("chunk_tokens", -1, ValueError, "chunk_tokens"),
        ("num_pages", 1, ValueError, "num_pages"),
        ("cache_memory", 1.5, ValueError, "cache_memory"),
        ("cache_dtype", "int8", ValueError, "dtype must be one of"),
        ("backend", "cuda", ValueError, "attention backend must be one of"),
        ("batch_invariant", "yes", TypeError, "batch_invariant"),
        ("decode_config", {}, TypeError, "decode_config must be a DecodeConfig"),
        ("prefill_min_tokens", 0, ValueError, "prefill_min_tokens"),
        ("prefill_max_rows", "8", TypeError, "prefill_max_rows"),
        ("tensor_parallel", 0, ValueError, "tensor_parallel"),
        ("tensor_parallel", True, TypeError, "tensor_parallel"),
        ("tensor_parallel", 2.0, TypeError, "tensor_parallel"),
    ],
)
def test_every_field_is_checked_once_with_a_one_line_error(field, value, error, message):
    with pytest.raises(error, match=message) as e:
        kvjax.EngineConfig(**{field: value})
    assert "\n" not in str(e.value)
    with pytest.raises(error, match=message):  # replace checks again
        kvjax.EngineConfig().replace(**{field: value})


def test_it_is_frozen_hashable_and_one_of_num_pages_or_cache_memory():
    config = kvjax.EngineConfig(max_batch=3, cache_dtype="float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 4  # type: ignore[misc]
    assert hash(config) == hash(kvjax.EngineConfig(max_batch=3, cache_dtype="float32"))
    with pytest.raises(ValueError, match="not both"):
        kvjax.EngineConfig(num_pages=9, cache_memory=2**20)


def test_the_engine_takes_a_config_or_its_fields_alike():
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=fresh_seed())
    config = kvjax.EngineConfig(max_batch=2, max_seq_len=64, num_pages=9, backend="reference")
    a, b = Engine(model, config), Engine(model, max_batch=2, max_seq_len=64, num_pages=9, backend="reference")
    assert a.config == b.config == config and a.num_pages == b.num_pages == 9
    with pytest.raises(TypeError, match="not both"):
        Engine(model, config, max_batch=2)
    with pytest.raises(TypeError, match="must be an EngineConfig"):
        Engine(model, {"max_batch": 2})


def test_generate_reuses_the_engine_of_an_equal_config():
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=fresh_seed())
    kvjax.generate(model, [[1, 2, 3]], max_new_tokens=2, max_batch=2)
    (first,) = model._engines.values()
    kvjax.generate(model, [[4, 5, 6]], max_new_tokens=2, max_batch=2)
    assert list(model._engines.values()) == [first]
    kvjax.generate(model, [[4, 5, 6]], max_new_tokens=2, max_batch=3)
    (other,) = model._engines.values()
    assert other is not first and other.config.max_batch == 3


def test_for_machine_fills_only_what_is_left_open():
    cpu = machine.platform() == "cpu"
    config = kvjax.EngineConfig.for_machine(100_000)
    assert (config.max_batch, config.max_seq_len) == ((4, 2048) if cpu else (32, 8192))
    assert kvjax.EngineConfig.for_machine(256).max_seq_len == 256  # never past the model's context
    given = kvjax.EngineConfig.for_machine(100_000, max_batch=7, max_seq_len=99, chunk_tokens=64)
    assert (given.max_batch, given.max_seq_len, given.chunk_tokens) == (7, 99, 64)
