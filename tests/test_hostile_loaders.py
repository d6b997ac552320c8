"""Corrupt, truncated, inconsistent or non-finite checkpoints: one short CheckpointError naming the file and part."""

import dataclasses
import glob
import json
import os
import re
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS
from safetensors.numpy import load_file, save_file

import kvjax
from kvjax.io.gguf_file import GGUFCheckpoint

gguf = pytest.importorskip("gguf")  # GGUF files are written with it; GPU machines may lack it

TOKENS = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab"]


def write_gguf(path, *, block_count=2, skip_key=None, change=None):
    """A tiny float32 GGUF of the llama architecture: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 30.

    ``change(name, array)`` may replace a tensor; ``skip_key`` leaves one llama.* metadata key out."""
    hidden, heads, kv, ffn, d = 64, 4, 2, 96, 16
    w = gguf.GGUFWriter(str(path), "llama")
    meta = {
        "block_count": (w.add_block_count, block_count),
        "context_length": (w.add_context_length, 256),
        "embedding_length": (w.add_embedding_length, hidden),
        "feed_forward_length": (w.add_feed_forward_length, ffn),
        "attention.head_count": (w.add_head_count, heads),
        "attention.head_count_kv": (w.add_head_count_kv, kv),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, 1e-5),
    }
    for key, (add, value) in meta.items():
        if key != skip_key:
            add(value)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {
        "token_embd.weight": (len(TOKENS), hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (len(TOKENS), hidden),
    }
    for i in range(2):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (hidden,),
                f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.attn_q.weight": (heads * d, hidden),
                f"blk.{i}.attn_k.weight": (kv * d, hidden),
                f"blk.{i}.attn_v.weight": (kv * d, hidden),
                f"blk.{i}.attn_output.weight": (hidden, heads * d),
                f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                f"blk.{i}.ffn_up.weight": (ffn, hidden),
                f"blk.{i}.ffn_down.weight": (hidden, ffn),
            }
        )
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        x = rng.normal(0, 0.02, shape).astype(np.float32)
        w.add_tensor(name, change(name, x) if change else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def raises(exc, match, fn, *args, **kwargs):
    """``fn(*args)`` raises ``exc`` matching ``match``, in one line."""
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)
    return info.value


def load(path, **kwargs):
    return kvjax.load(str(path), dtype=kwargs.pop("dtype", "float32"), progress=False, **kwargs)


def hf_copy(tmp_path, case="llama"):
    d = tmp_path / case
    shutil.copytree(os.path.join(FIXTURES, case), d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


def edit_tensors(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written by ``Model.save``: "plain" and "compressed" (with a plan.json)."""
    root = tmp_path_factory.mktemp("saved")
    cfg = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=32, hidden_size=128)
    model = kvjax.Model.random(cfg)
    small = kvjax.compress(model, removal_rate=0.3, calibration="random", num_tokens=64, seq_len=32, progress=False)
    return {"plain": model.save(str(root / "plain")), "compressed": small.save(str(root / "compressed"))}


def saved_copy(saved, tmp_path, kind="plain"):
    d = tmp_path / kind
    shutil.copytree(saved[kind], d)
    return d


def set_parts(d, parts):
    """Write (or, with None, remove) kvjax.json's "parts"."""
    meta = json.loads((d / "kvjax.json").read_text())
    meta.pop("parts", None)
    (d / "kvjax.json").write_text(json.dumps(meta if parts is None else {**meta, "parts": parts}))


# 1. a config with fewer layers than the weights hold


def test_hf_config_with_fewer_layers_than_the_weights(tmp_path):
    d = hf_copy(tmp_path)
    edit_config(d, num_hidden_layers=1)
    raises(
        kvjax.CheckpointError,
        r"model\.safetensors: config\.json's num_hidden_layers is 1, .*"
        r"'model\.layers\.1\.input_layernorm\.weight'",
        load,
        d,
    )


def test_gguf_block_count_below_its_tensors(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", block_count=1)
    raises(kvjax.CheckpointError, r"model\.gguf: llama\.block_count is 1, .*'blk\.1\.attn_k\.weight'", load, path)


def test_hf_config_with_more_layers_than_the_weights(tmp_path):
    d = hf_copy(tmp_path)
    edit_config(d, num_hidden_layers=3)
    err = raises(kvjax.CheckpointError, r"lacks tensors the config needs: 'model\.layers\.2\.", load, d)
    assert isinstance(err, KeyError)


# 2. every shape against the config


@pytest.mark.parametrize(
    "case, name, rows, needs",
    [
        ("llama", "model.layers.0.mlp.up_proj.weight", 7, r"\(128, 64\)"),
        ("llama", "model.embed_tokens.weight", 100, r"\(128, 64\)"),
        ("falcon_7b", "transformer.h.1.self_attention.query_key_value.weight", 7, r"\(64, \d+\) after conversion"),
    ],
)
def test_hf_tensor_of_the_wrong_shape(tmp_path, case, name, rows, needs):
    d = hf_copy(tmp_path, case)
    edit_tensors(d, lambda t: t.__setitem__(name, np.zeros((rows, 64), np.float32)))
    raises(
        kvjax.CheckpointError,
        rf"model\.safetensors: tensor '{re.escape(name)}' has shape \({rows}, 64\), the "
        rf"config needs {needs}$",
        load,
        d,
    )


def test_gguf_tensor_of_the_wrong_shape(tmp_path):
    path = write_gguf(
        tmp_path / "model.gguf", change=lambda n, x: np.zeros((5, 64), np.float32) if n == "blk.1.attn_q.weight" else x
    )
    raises(kvjax.CheckpointError, r"model\.gguf: tensor 'blk\.1\.attn_q\.weight' has shape \(5, 64\)", load, path)


# 3. non-finite weights


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_hf_non_finite_weight(tmp_path, bad):
    d = hf_copy(tmp_path)
    edit_tensors(d, lambda t: t["model.layers.1.self_attn.k_proj.weight"].__setitem__((0, 3), bad))
    raises(
        kvjax.CheckpointError,
        r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' holds 1 "
        "NaN or infinite values",
        load,
        d,
    )


def test_gguf_non_finite_weight(tmp_path):
    path = write_gguf(
        tmp_path / "model.gguf", change=lambda n, x: np.full_like(x, np.nan) if n == "blk.0.ffn_up.weight" else x
    )
    raises(kvjax.CheckpointError, r"model\.gguf: tensor 'blk\.0\.ffn_up\.weight' holds 6144 NaN", load, path)


def test_saved_non_finite_weight(tmp_path):
    model = kvjax.Model.random(TINY_CONFIGS["llama"])
    qkv = model.module.layers[1].attn.qkv  # saved as q, k and v: the first k column
    qkv.kernel.set_value(qkv.kernel.get_value().at[0, qkv.ends[0]].set(np.inf))
    path = model.save(str(tmp_path / "ckpt"))
    raises(
        kvjax.CheckpointError, r"ckpt/params: parameter layers\.1\.attn\.k\.kernel holds NaN or infinite", load, path
    )


def test_weight_beyond_float16_range(tmp_path):
    d = hf_copy(tmp_path)
    edit_tensors(d, lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    raises(
        kvjax.CheckpointError,
        r"tensor 'model\.norm\.weight' has values up to 1e\+06, beyond float16's range",
        load,
        d,
        dtype="float16",
    )


# 4. truncated and corrupt files


def test_gguf_fixture_loads(tmp_path):
    model = load(write_gguf(tmp_path / "model.gguf"))
    assert model.config.num_layers == 2 and model.config.vocab_size == len(TOKENS)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_gguf(tmp_path, keep):
    path = write_gguf(tmp_path / "model.gguf")
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))
    raises(
        kvjax.CheckpointError,
        rf"model\.gguf: truncated: tensor blk\.\d\.\w+\.weight needs bytes up to \d+, the "
        rf"file has {int(size * keep)}$",
        load,
        path,
    )


@pytest.mark.parametrize("content", [b"", b"GGUF" + bytes(range(256)) * 8, bytes(3000), "header"])
def test_garbage_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    if content == "header":  # a real file cut inside its metadata
        content = open(write_gguf(tmp_path / "whole.gguf"), "rb").read()[:600]
    path.write_bytes(content)
    raises(
        kvjax.CheckpointError,
        r"model\.gguf: not a readable GGUF file \(corrupt or truncated\): ",
        GGUFCheckpoint,
        str(path),
    )


def test_gguf_without_a_required_key(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", skip_key="embedding_length")
    raises(kvjax.CheckpointError, r"model\.gguf: GGUF metadata has no llama\.embedding_length", load, path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_corrupt_safetensors(tmp_path, damage):
    d = hf_copy(tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        data = data[:-1000]
    elif damage == "garbage":
        data = bytes(range(256)) * 8
    else:
        data = data[:8] + b"x" * 12 + data[20:]
    path.write_bytes(data)
    raises(kvjax.CheckpointError, r"model\.safetensors: corrupt or truncated safetensors file: ", load, d)


def test_safetensors_index_naming_a_missing_shard(tmp_path):
    d = hf_copy(tmp_path)
    names = list(load_file(d / "model.safetensors"))
    os.rename(d / "model.safetensors", d / "model-1-of-2.safetensors")
    weight_map = dict.fromkeys(names, "model-1-of-2.safetensors") | {names[0]: "model-2-of-2.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raises(
        kvjax.CheckpointError,
        r"model\.safetensors\.index\.json: names the file 'model-2-of-2\.safetensors', "
        "which is not in",
        load,
        d,
    )


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no data", "no _METADATA", "no manifest.ocdbt"])
def test_corrupt_orbax_params(saved, tmp_path, damage):
    d = saved_copy(saved, tmp_path)
    data = glob.glob(str(d / "params" / "ocdbt.process_0" / "d" / "*"))
    biggest = max(data, key=os.path.getsize)
    if damage == "truncate":
        os.truncate(biggest, os.path.getsize(biggest) // 2)
    elif damage == "garbage":
        with open(biggest, "wb") as f:
            f.write(bytes(os.path.getsize(biggest)))
    elif damage == "no data":
        for f in data:
            os.remove(f)
    else:
        os.remove(d / "params" / damage.split()[1])
    raises(kvjax.CheckpointError, r"plain/params: corrupt (or truncated )?orbax checkpoint: ", load, d)


# 5. invalid JSON


def test_invalid_config_json(tmp_path):
    d = hf_copy(tmp_path)
    (d / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64,,}')
    raises(kvjax.CheckpointError, r"llama/config\.json: invalid JSON at line 2 column 20: ", load, d)


@pytest.mark.parametrize("part", ["kvjax.json", "plan.json"])
def test_invalid_kvjax_json(saved, tmp_path, part):
    d = saved_copy(saved, tmp_path, "compressed")
    (d / part).write_text('{"format": 1,\n\n  oops}')
    raises(kvjax.CheckpointError, rf"compressed/{part}: invalid JSON at line 3 column 3: ", load, d)


# 6. kvjax checkpoints with parts missing


@pytest.mark.parametrize("kind, kept", [("plain", "params"), ("compressed", "plan.json")])
def test_kvjax_checkpoint_without_kvjax_json(saved, tmp_path, kind, kept):
    d = saved_copy(saved, tmp_path, kind)
    os.remove(d / "kvjax.json")
    if kept == "plan.json":
        shutil.rmtree(d / "params")
    raises(
        kvjax.CheckpointError,
        rf"{kind} looks like a kvjax checkpoint \(it has {kept}\) but is missing its "
        r"kvjax\.json",
        load,
        d,
    )


@pytest.mark.parametrize("part", ["params", "plan.json"])
def test_kvjax_checkpoint_missing_a_listed_part(saved, tmp_path, part):
    d = saved_copy(saved, tmp_path, "compressed")
    set_parts(d, ["params", "plan.json"])
    (os.remove if part == "plan.json" else shutil.rmtree)(d / part)
    raises(kvjax.CheckpointError, rf"kvjax checkpoint .*compressed is missing its {part}$", load, d)


def test_old_kvjax_checkpoint_missing_its_plan(saved, tmp_path):
    d = saved_copy(saved, tmp_path, "compressed")
    set_parts(d, None)
    os.remove(d / "plan.json")
    raises(
        kvjax.CheckpointError,
        r"compressed/params: parameters do not match the config in kvjax\.json \(unexpected "
        r"'layers\.0\.attn\.qk_rotation'.*\); the checkpoint's plan\.json may be missing",
        load,
        d,
    )


def test_old_kvjax_checkpoint_missing_its_params(saved, tmp_path):
    d = saved_copy(saved, tmp_path)
    set_parts(d, None)
    shutil.rmtree(d / "params")
    raises(kvjax.CheckpointError, r"kvjax checkpoint .*plain is missing its params$", load, d)


# 7. a bad dtype fails before anything is read


@pytest.mark.parametrize("dtype", ["foo", "int8", 3])
def test_bad_dtype_fails_first(tmp_path, dtype):
    raises(
        ValueError,
        r"dtype must be one of bfloat16, float16, float32",
        kvjax.load,
        str(tmp_path / "missing"),
        dtype=dtype,
    )
