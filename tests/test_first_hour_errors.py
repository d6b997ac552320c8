"""What a new user meets in their first hour: each mistake or mishap gives one clear line, or the right behaviour."""

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS, tiny_tokenizer
from flax import nnx

import kvjax
from kvjax.cli import convert
from kvjax.io import saved
from kvjax.ops.kv_schemes import SERVED
from kvjax.runtime.text import chat_ids

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
RANDOM = dict(calibration="random", num_tokens=64, seq_len=32, progress=False)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_tokenizer(config=TINY_CONFIGS["llama"]):
    model = kvjax.Model.random(config, seed=1)
    model.tokenizer = tiny_tokenizer(model.config.vocab_size)
    return model


def edit_param(model, name: str, fn) -> None:
    """Replace the parameter ``name`` ("layers.1.attn.o.kernel") of ``model`` by ``fn`` of it, in place."""
    for path, var in nnx.to_flat_state(nnx.state(model.module, nnx.Param)):
        if ".".join(map(str, path)) == name:
            var.set_value(fn(var.get_value()))
            return
    raise KeyError(name)


def one_error_line(capsys, code, argv) -> str:
    """Run kvjax-convert, expect exit ``code`` and return the last line of stderr (its one error line)."""
    with pytest.raises(SystemExit) as e:
        convert.main(argv)
    assert e.value.code == code
    return capsys.readouterr().err.strip().splitlines()[-1]


# 1. NaN weights, and statistics that cannot give a plan


def test_compress_refuses_nan_weights_naming_the_tensor():
    model = kvjax.Model.random(WIDE, seed=1)
    edit_param(model, "layers.1.attn.o.kernel", lambda w: w.at[3, 5].set(np.nan))
    with pytest.raises(
        ValueError,
        match=r"^model parameter layers\.1\.attn\.o\.kernel holds NaN or infinite values: kvjax\.compress needs "
        "finite weights$",
    ):
        kvjax.compress(model, target_rate=0.5, **RANDOM)


def test_compress_refuses_statistics_that_are_not_finite_or_all_zero():
    overflowing = kvjax.Model.random(WIDE, seed=1, scale=1e15)  # finite weights, infinite activations
    with pytest.raises(ValueError, match=r"^calibration statistics of layer 0 \(the 'q' Gram of KV head 0\) hold NaN"):
        kvjax.compress(overflowing, target_rate=0.5, **RANDOM)
    silent = kvjax.Model.random(WIDE, seed=1)
    edit_param(silent, "layers.0.attn.qkv.kernel", lambda w: w * 0)  # q and k all zero: no Q/K directions
    with pytest.raises(ValueError, match=r"^calibration statistics of layer 0 \(KV head 0\) give no 'qk' basis"):
        kvjax.compress(silent, target_rate=0.5, **RANDOM)


def test_compress_warns_when_the_rate_is_far_above_the_target():
    model = kvjax.Model.random(WIDE, seed=1)
    for layer in range(WIDE.num_layers):  # V all zero: every head keeps its 16 V columns, the least there is
        edit_param(model, f"layers.{layer}.attn.qkv.kernel", lambda w: w.at[:, -WIDE.num_kv_heads * 64 :].set(0))
    with pytest.warns(UserWarning, match=r"reached an overall rate of 0\.3750, far above the target_rate 0\.05"):
        small = kvjax.compress(model, target_rate=0.05, **RANDOM)
    assert small.plan.rate == 0.375


# 2. a lone surrogate in a prompt or a chat message


def test_a_lone_surrogate_in_a_prompt_or_message_is_one_value_error():
    model = with_tokenizer()
    for chat in (False, True):
        with pytest.raises(ValueError, match=r"^prompt 1 is not valid Unicode text: lone surrogate '\\ud800' at char"):
            kvjax.generate(model, ["fine", "abc\ud800"], max_new_tokens=2, chat=chat)
    with pytest.raises(ValueError, match=r"^message 1's content is not valid Unicode text: .* at character 1$"):
        chat_ids(model.tokenizer, [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\udfffy"}])
    assert kvjax.generate(model, ["abc"], max_new_tokens=1)[0].prompt_tokens == 3  # valid text still works


# 3. and 4. a calibration file that is not UTF-8, or a directory


def test_a_calibration_file_that_is_not_utf8_names_the_file_and_the_offset(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"hello world \xff\xfe more")
    message = f"calibration text file '{bad}' is not UTF-8 text: byte 0xff at offset 12 (invalid start byte)"
    with pytest.raises(ValueError) as e:
        kvjax.compress(with_tokenizer(), removal_rate=0.2, calibration=f"text:{bad}", num_tokens=8, progress=False)
    assert str(e.value) == message
    argv = [os.path.join(FIXTURES, "llama"), str(tmp_path / "out"), "--removal-rate", "0.2"]
    assert one_error_line(capsys, 2, [*argv, "--calibration", f"text:{bad}"]) == f"kvjax-convert: error: {message}"


def test_a_calibration_directory_is_not_called_missing(tmp_path, capsys):
    with pytest.raises(IsADirectoryError, match=f"^calibration text file '{tmp_path}' is a directory, not a file$"):
        kvjax.compress(with_tokenizer(), removal_rate=0.2, calibration=f"text:{tmp_path}", progress=False)
    argv = [os.path.join(FIXTURES, "llama"), str(tmp_path / "out"), "--removal-rate", "0.2"]
    line = one_error_line(capsys, 2, [*argv, "--calibration", f"text:{tmp_path}"])
    assert line == f"kvjax-convert: error: calibration text file '{tmp_path}' is a directory, not a file"


# 5. a full disk while saving

ORBAX_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "layers.0.attn.o.kernel/0.0" in OCDBT database at local file "{0}/": '
    "Failed to write 134142 bytes to file 7: No space left on device [os_error_code='28']"
)


@pytest.mark.parametrize("where", ["params", "kvjax.json"])
def test_a_full_disk_during_save_is_one_oserror_and_leaves_nothing(tmp_path, monkeypatch, where):
    import orbax.checkpoint as ocp

    def orbax_full(self, path, *a, **k):  # orbax reports TensorStore's failed write as a ValueError
        raise ValueError(ORBAX_ENOSPC.format(path))

    def python_full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    if where == "params":
        monkeypatch.setattr(ocp.StandardCheckpointer, "save", orbax_full)
    else:
        monkeypatch.setattr(saved, "_write", python_full)
    out = tmp_path / "ckpt"
    with pytest.raises(OSError) as e:
        kvjax.Model.random(TINY_CONFIGS["llama"]).save(str(out))
    assert str(e.value) == f"no space left on device while writing {out}; nothing there was changed"
    assert e.value.errno == errno.ENOSPC and e.value.__suppress_context__ and os.listdir(tmp_path) == []


def test_convert_on_a_full_disk_prints_one_line_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(saved, "_write", lambda path, text: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    out = tmp_path / "out"
    argv = [os.path.join(FIXTURES, "llama"), str(out), "--removal-rate", "0.2", "--num-tokens", "32"]
    assert convert.main([*argv, "--seq-len", "32", "--calibration", "random"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"kvjax-convert: error: no space left on device while writing {out}; nothing there was changed"
    assert "Traceback" not in "\n".join(err) and os.listdir(tmp_path) == []


SAVE_ON_A_SMALL_DISK = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
import kvjax
from kvjax.io import saved
from conftest import TINY_CONFIGS
if sys.argv[2] == "no-precheck":
    saved._check_room = lambda params, directory: None  # a disk that fills while orbax writes
kvjax.Model.random(TINY_CONFIGS["llama"]).save(sys.argv[1] + "/ckpt")
"""


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d; rmdir $d"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


def _save_on_a_small_disk(tmp_path, mode: str) -> tuple[str, list[str]]:
    """Save the tiny model (300 KiB of parameters) onto a 100 KiB tmpfs: (the directory, stderr's lines)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    save = f'{sys.executable} -c "$0" {disk} {mode}'
    script = f"mount -t tmpfs -o size=100k tmpfs {disk} && {save}; echo rc=$?; ls -A {disk}"
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script, SAVE_ON_A_SMALL_DISK], capture_output=True, text=True)
    assert run.stdout.split() == ["rc=1"], (run.stdout, run.stderr)  # failed, and nothing left on the disk
    return str(disk), run.stderr.strip().splitlines()


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare and a tmpfs mount in a user namespace")
def test_a_real_full_disk_is_refused_in_one_line_before_writing(tmp_path):
    disk, lines = _save_on_a_small_disk(tmp_path, "precheck")
    want = f"OSError: no space left on device while writing {disk}/ckpt: it needs at least 145 KiB, 100 KiB are free"
    assert lines[-1] == want + "; nothing there was changed", lines
    assert lines[0] == "Traceback (most recent call last):" and len(lines) < 12, lines  # our own traceback only


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare and a tmpfs mount in a user namespace")
def test_a_disk_that_fills_while_orbax_writes_gives_our_line_and_leaves_nothing(tmp_path):
    """TensorStore fails the write: its ValueError becomes our OSError, the copies its other writes report are
    dropped (``saved._drop_echoes``), and the half-written directory is gone."""
    disk, lines = _save_on_a_small_disk(tmp_path, "no-precheck")
    assert f"OSError: no space left on device while writing {disk}/ckpt; nothing there was changed" in lines, lines
    assert lines[0] == "Traceback (most recent call last):" and len(lines) < 12, lines


# 6. hand edits of kvjax.json


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    kvjax.Model.random(TINY_CONFIGS["llama"]).save(str(path))
    return path


def edit_meta(path, **changes) -> None:
    meta = json.loads((path / "kvjax.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        elif key == "config":
            meta["config"].update(value)
        else:
            meta[key] = value
    (path / "kvjax.json").write_text(json.dumps(meta))


def test_a_hand_edited_config_is_refused(checkpoint):
    assert json.loads((checkpoint / "kvjax.json").read_text())["digest"].startswith("sha256:")
    edit_meta(checkpoint, config={"rope_theta": 1234.0})
    with pytest.raises(kvjax.CheckpointError) as e:
        kvjax.load(str(checkpoint))
    assert str(e.value) == (
        f"{checkpoint}/kvjax.json: its config or dtype was edited after saving (they no longer match the digest "
        'saved with them), so they may not describe these weights: undo the edit, or delete "digest" to load it as '
        "edited"
    )
    edit_meta(checkpoint, digest=None)  # as a checkpoint saved before digests: it loads, edit and all
    assert kvjax.load(str(checkpoint)).config.rope_theta == 1234.0


def test_a_newer_format_asks_for_a_newer_kvjax(checkpoint):
    edit_meta(checkpoint, format=saved.FORMAT + 1)
    with pytest.raises(kvjax.CheckpointError) as e:
        kvjax.load(str(checkpoint))
    assert str(e.value) == (
        f"{checkpoint}/kvjax.json has format {saved.FORMAT + 1}; this kvjax reads format <= {saved.FORMAT}: "
        "upgrade kvjax"
    )


@pytest.mark.parametrize(
    "serving, shown",
    [
        ({"kv_bits": 5}, f'"serving": "kv_bits" must be {SERVED}, or null (unquantized pages), got 5'),
        ({"kv_bits": "gear3"}, f'"serving": "kv_bits" must be {SERVED}, or null (unquantized pages), got "gear3"'),
        (
            {"kv_bits": "zipcache"},
            f'"serving": "kv_bits" must be {SERVED}, or null (unquantized pages), got "zipcache"',
        ),
        ({"kv_bits": True}, f'"serving": "kv_bits" must be {SERVED}, or null (unquantized pages), got true'),
        ({"kv_bits": 4.0}, f'"serving": "kv_bits" must be {SERVED}, or null (unquantized pages), got 4.0'),
        (4, '"serving" must be an object, got 4'),
    ],
)
def test_a_hand_edited_kv_bits_is_one_line_naming_the_file(checkpoint, serving, shown):
    edit_meta(checkpoint, serving=serving)  # not under the digest: a serving choice, not the weights
    with pytest.raises(kvjax.CheckpointError) as e:
        kvjax.load(str(checkpoint))
    assert str(e.value) == f"{checkpoint}/kvjax.json: {shown}"
    edit_meta(checkpoint, serving={"kv_bits": 2, "later": "ignored"})
    assert kvjax.load(str(checkpoint)).kv_bits == 2
    edit_meta(checkpoint, serving={"kv_bits": None})
    assert kvjax.load(str(checkpoint)).kv_bits is None


def test_a_hand_edited_kv_bits_on_a_palu_checkpoint_is_refused(tmp_path):
    path = tmp_path / "palu"
    kvjax.compress(kvjax.Model.random(TINY_CONFIGS["llama"]), removal_rate=0.2, method="palu", **RANDOM).save(str(path))
    edit_meta(path, serving={"kv_bits": 4})
    with pytest.raises(kvjax.CheckpointError) as e:
        kvjax.load(str(path))
    assert str(e.value) == (
        f'{path}/kvjax.json: "serving" asks for kv_bits 4, but quantized pages are not supported on Palu models yet: '
        "set it to null"
    )


# 7. and 8. the commands' own output


def test_importing_kvjax_silences_transformers_advisory_warning():
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    code = "import kvjax.cli.convert, transformers, os; print(os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0 and run.stdout == "1\n" and "PyTorch was not found" not in run.stderr, run.stderr


def test_convert_seed_has_help(capsys):
    with pytest.raises(SystemExit):
        convert.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seed of the random calibration token ids (--calibration random; default 0)" in help_text
