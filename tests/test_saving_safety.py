"""Saves and converts cannot lose data: what may be overwritten, and a fault or a kill at every step of a replace."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import FIXTURES, TINY_CONFIGS

import kvjax
from kvjax.cli import convert
from kvjax.io import atomic
from kvjax.io.saved import is_kvjax_checkpoint

PROMPT = [[5, 3, 9, 1]]
STEPS = ("written", "aside", "in", "done")


def tiny(seed):
    return kvjax.Model.random(TINY_CONFIGS["llama"], seed=seed)


def tree(path):
    """Every file below ``path`` with its bytes: what a test asserts is unchanged."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = fh.read()
    return out


def same_model(a, b):
    return np.array_equal(np.asarray(a.logits(PROMPT)), np.asarray(b.logits(PROMPT)))


@pytest.fixture
def user_files(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "notes.txt").write_text("a user's file")
    (d / "data").mkdir()
    (d / "data" / "x.bin").write_bytes(os.urandom(64))
    return d


def test_save_dot_with_overwrite_keeps_the_working_directory(user_files, monkeypatch):
    monkeypatch.chdir(user_files)
    before = tree(user_files)
    with pytest.raises(ValueError, match="current working directory"):
        tiny(0).save(".", overwrite=True)
    assert tree(user_files) == before


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(user_files):
    before = tree(user_files)
    with pytest.raises(ValueError, match=r"not a kvjax checkpoint \(it holds data, notes.txt\)"):
        tiny(0).save(str(user_files), overwrite=True)
    assert tree(user_files) == before


def test_overwrite_refuses_a_checkpoint_holding_other_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    tiny(0).save(str(ckpt))
    (ckpt / "my-notes.txt").write_text("keep me")
    before = tree(ckpt)
    with pytest.raises(ValueError, match="my-notes.txt"):
        tiny(1).save(str(ckpt), overwrite=True)
    assert tree(ckpt) == before


@pytest.mark.parametrize("kind", ["file", "link"])
def test_overwrite_refuses_a_file_or_a_link(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("a file")
    else:
        (tmp_path / "real").mkdir()
        target.symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="not a directory"):
        tiny(0).save(str(target), overwrite=True)
    assert target.exists() and (kind == "file" or target.is_symlink())


def test_overwrite_replaces_a_checkpoint_or_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    tiny(0).save(str(tmp_path / "empty"), overwrite=True)
    tiny(1).save(str(tmp_path / "empty"), overwrite=True)
    assert same_model(kvjax.load(str(tmp_path / "empty"), dtype="float32"), tiny(1))
    assert os.listdir(tmp_path) == ["empty"]  # no temporary or old directory left


def test_save_without_overwrite_refuses_an_existing_path(tmp_path):
    tiny(0).save(str(tmp_path / "ckpt"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        tiny(1).save(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_a_model_is_never_saved_over_into_or_around_its_source(tmp_path, where):
    src = tmp_path / "outer" / "src"
    src.parent.mkdir()
    tiny(0).save(str(src))
    model = kvjax.load(str(src), dtype="float32")
    before = tree(tmp_path)
    dest = {"same": src, "inside": src / "sub", "contains": src.parent}[where]
    with pytest.raises(
        ValueError,
        match={"same": "is the source", "inside": "is inside the source", "contains": "contains the source"}[where],
    ):
        model.save(str(dest), overwrite=True)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("where", ["same", "inside"])
def test_convert_refuses_to_write_over_or_into_its_source(tmp_path, capsys, where):
    src = tmp_path / "src"
    tiny(0).save(str(src))
    before = tree(tmp_path)
    out = src if where == "same" else src / "compressed"
    with pytest.raises(SystemExit) as e:
        convert.main([str(src), str(out), "--removal-rate", "0.2", "--overwrite", "--num-tokens", "64"])
    assert e.value.code == 2 and "source" in capsys.readouterr().err
    assert tree(tmp_path) == before


def test_convert_overwrite_refuses_a_user_directory_before_calibrating(user_files, capsys):
    before = tree(user_files)
    with pytest.raises(SystemExit):
        convert.main([os.path.join(FIXTURES, "llama"), str(user_files), "--removal-rate", "0.2", "--overwrite"])
    assert "not a kvjax checkpoint" in capsys.readouterr().err and tree(user_files) == before


@pytest.mark.parametrize("step", STEPS)
def test_an_exception_at_any_step_leaves_one_whole_checkpoint_and_no_debris(tmp_path, monkeypatch, step):
    ckpt = tmp_path / "ckpt"
    tiny(0).save(str(ckpt))

    def fail(name):
        if name == step:
            raise OSError(f"injected fault at {name}")

    monkeypatch.setattr(atomic, "_step", fail)
    with pytest.raises(OSError, match="injected"):
        tiny(1).save(str(ckpt), overwrite=True)
    expected = tiny(0) if step in ("written", "aside") else tiny(1)  # before or after the new one went in
    assert same_model(kvjax.load(str(ckpt), dtype="float32"), expected)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_failing_writer_leaves_the_old_checkpoint_and_no_debris(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "ckpt"
    tiny(0).save(str(ckpt))
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        tiny(1).save(str(ckpt), overwrite=True)
    assert same_model(kvjax.load(str(ckpt), dtype="float32"), tiny(0)) and os.listdir(tmp_path) == ["ckpt"]


KILLED_SAVE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import kvjax
    from conftest import TINY_CONFIGS
    from kvjax.io import atomic
    step = sys.argv[1]
    if step == "writing":  # killed while orbax writes: the checkpointer never returns
        import orbax.checkpoint as ocp
        def killed(self, path, *a, **k):
            os.makedirs(path)
            open(os.path.join(path, "partial"), "w").write("half")
            os._exit(9)
        ocp.StandardCheckpointer.save = killed
    else:
        atomic._step = lambda name: os._exit(9) if name == step else None
    kvjax.Model.random(TINY_CONFIGS["llama"], seed=1).save(sys.argv[2], overwrite=True)
""")


@pytest.mark.parametrize("step", ("writing",) + STEPS[:-1])
def test_a_kill_at_any_step_is_recovered_on_the_next_load(tmp_path, step):
    ckpt = tmp_path / "ckpt"
    tiny(0).save(str(ckpt))
    script = KILLED_SAVE.format(tests=os.path.dirname(__file__))
    run = subprocess.run([sys.executable, "-c", script, step, str(ckpt)], capture_output=True, text=True)
    assert run.returncode == 9, run.stderr
    leftovers = [f for f in os.listdir(tmp_path) if f != "ckpt"]
    assert leftovers and all(atomic.NEW in f or atomic.OLD in f for f in leftovers)
    with pytest.warns(UserWarning, match="interrupted save"):
        back = kvjax.load(str(ckpt), dtype="float32")
    # killed before the new checkpoint was in place: the old one; once the old one was aside, the new one
    assert same_model(back, tiny(1) if step in ("aside", "in") else tiny(0))
    assert os.listdir(tmp_path) == ["ckpt"] and is_kvjax_checkpoint(str(ckpt))


def test_recover_leaves_the_directories_of_a_running_writer_alone(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    live = tmp_path / f".ckpt.{atomic.NEW}-{os.getpid()}-abcd1234"
    live.mkdir()
    assert atomic.recover(str(ckpt), is_kvjax_checkpoint) == [] and live.exists()


def test_recover_in_a_read_only_directory_reports_and_changes_nothing(tmp_path, monkeypatch):
    old = tmp_path / f".ckpt.{atomic.OLD}-999999999-abcd1234"  # a writer that cannot be running
    old.mkdir()
    (old / "kvjax.json").write_text("{}")

    def refuse(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.os, "rename", refuse)
    (line,) = atomic.recover(str(tmp_path / "ckpt"), is_kvjax_checkpoint)
    assert "could not undo an interrupted save" in line and str(old) in line and old.exists()
