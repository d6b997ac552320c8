"""Writing a directory so that no failure loses it: build beside, swap in by renames, recover a swap cut short.

A write builds the new directory as ``.NAME.kvjax-new-PID-XXXX`` beside ``NAME`` (its completeness marker written
last). Replacing an existing ``NAME`` renames it aside to ``.NAME.kvjax-old-PID-XXXX``, renames the new one in,
and only then deletes the old one. Whenever the writer dies, the old or the new directory is whole, under ``NAME``
or under a sibling whose name says which; ``recover`` puts it back and deletes what dead writers left behind.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable

NEW, OLD = "kvjax-new", "kvjax-old"


def _step(name: str) -> None:
    """A no-op between the steps of a replace; tests replace it to inject a crash at each step."""


def temp_dir(path: str) -> str:
    """Create and return a new empty sibling directory to build ``path``'s replacement in."""
    tmp = _sibling(path, NEW)
    os.mkdir(tmp)
    return tmp


def commit(tmp: str, path: str) -> None:
    """Move the complete directory ``tmp`` to ``path``; an existing ``path`` is renamed aside first, deleted last."""
    _step("written")
    if os.path.lexists(path):
        old = _sibling(path, OLD)
        os.rename(path, old)
        try:
            _step("aside")
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)  # the new one did not go in: the old one goes back
            raise
        _sync_dir(os.path.dirname(path))
        try:
            _step("in")
        finally:
            shutil.rmtree(old)
    else:
        os.rename(tmp, path)
        _sync_dir(os.path.dirname(path))
    _step("done")


def recover(path: str, is_complete: Callable[[str], bool]) -> list[str]:
    """Finish or undo a replace of ``path`` that a dead writer left half done, and delete its leftovers.

    Returns one line per action taken (for the caller to report). Directories of writers still running are left
    alone; ``is_complete`` tells a finished new directory from one whose writer died while writing it."""
    path = os.path.abspath(path)

    def dead(kind):
        return [d for d in _siblings(path, kind) if not _alive(d)]

    done: list[str] = []
    if not os.path.lexists(path):
        new = [d for d in dead(NEW) if is_complete(d)]
        old = dead(OLD)
        if not new and not old:
            return done
        found, verb, done_verb = (new[-1], "finish", "finished") if new else (old[-1], "undo", "undid")
        try:
            os.rename(found, path)
        except OSError as e:  # a directory we may not write: say what is there, change nothing
            done.append(f"could not {verb} an interrupted save of {path}: its checkpoint is at {found} ({e.strerror})")
            return done
        _sync_dir(os.path.dirname(path))
        done.append(f"{done_verb} an interrupted save: moved {os.path.basename(found)} to {path}")
    for d in dead(NEW) + dead(OLD):
        shutil.rmtree(d, ignore_errors=True)
        if not os.path.lexists(d):
            done.append(f"deleted {d}, left by an interrupted save")
    return done


def check_target(
    path: str,
    *,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    what: str,
    sources: tuple[str, ...] = (),
    hint: str = "overwrite=True",
) -> str:
    """The absolute ``path`` if writing there can lose nothing of the user's, else a clear error.

    A path that exists is replaced only with ``overwrite`` and only if it is an empty directory or ``replaceable``
    (a ``what``, e.g. a kvjax checkpoint). Refused always: a path equal to, inside or containing any of ``sources``
    (what is being read) or the working directory, and a parent that is not a writable directory."""
    path = os.path.abspath(path)
    real = os.path.realpath(path)
    for src in sources:
        src_real = os.path.realpath(src)
        if _within(real, src_real) or _within(src_real, real):
            relation = "is" if real == src_real else "is inside" if _within(real, src_real) else "contains"
            raise ValueError(f"refusing to write {path}: it {relation} the source {src}")
    if _within(os.path.realpath(os.getcwd()), real):
        raise ValueError(f"refusing to write {path}: it is or contains the current working directory")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {path}: {parent} is not a writable directory")
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} already exists (pass {hint} to replace it)")
        if os.path.islink(path) or not os.path.isdir(path):
            raise ValueError(f"refusing to overwrite {path}: it is not a directory")
        entries = os.listdir(path)
        if entries and not replaceable(path):
            shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
            raise ValueError(f"refusing to overwrite {path}: it is not a {what} (it holds {shown})")
    return path


def _within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies below it (both real, absolute paths)."""
    return os.path.commonpath([path, root]) == root


def _sibling(path: str, kind: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _siblings(path: str, kind: str) -> list[str]:
    """Existing sibling directories of ``kind`` for ``path``, oldest first."""
    head, name = os.path.split(path)
    prefix = f".{name}.{kind}-"
    try:
        found = [os.path.join(head, f) for f in os.listdir(head) if f.startswith(prefix)]
    except OSError:
        return []
    found = [d for d in found if os.path.isdir(d) and not os.path.islink(d)]
    return sorted(found, key=os.path.getmtime)


def _alive(sibling: str) -> bool:
    """Whether the process that made ``sibling`` (its PID is in the name) is still running (this one counts)."""
    try:
        pid = int(os.path.basename(sibling).rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return True  # not ours to judge: keep it
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
