import json
import os
import shutil

import pytest
from conftest import FIXTURES

import kvjax


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no such model file or directory"):
        kvjax.load("/nonexistent/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        kvjax.load(str(tmp_path))


def test_not_a_checkpoint_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="expected a Hugging Face checkpoint directory or a .gguf file"):
        kvjax.load(str(tmp_path / "weights.bin"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(kvjax.UnsupportedModelError, match="'gpt2' is not supported; kvjax supports llama"):
        kvjax.load(str(tmp_path))


def test_alibi_falcon_is_rejected(tmp_path):
    shutil.copytree(os.path.join(FIXTURES, "falcon_7b"), tmp_path, dirs_exist_ok=True)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["alibi"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kvjax.UnsupportedModelError, match="ALiBi"):
        kvjax.load(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(os.path.join(FIXTURES, "llama"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        kvjax.load(str(tmp_path))
