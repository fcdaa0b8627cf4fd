"""Where checkpoint steps live, and how one is published atomically.

Layout under a root (a local folder or an fsspec URL):

    step-00000100/              a committed step
        .metadata  __0_0.distcp ...   DCP files (model, optimizer, RNG, extras)
        deepspeed/                    the DeepSpeed engine's files (ZeRO strategies only)
        gpufleet.json                 the commit record, written last
    step-00000200.partial/      a save in progress, or one that was killed: never read
    step-00000300.damaged/      a step a retry found damaged and skipped: never read, never
                                deleted by gpufleet (look at it, then remove it yourself)

A step counts only once ``gpufleet.json`` is in it; the record also holds the size and digest
of every other file of the step (see ``_digest``). On a local root the step is written as
``step-N.partial``, the record is written (and fsynced) inside it, and the folder is renamed to
``step-N``: one atomic rename. On a remote root every file is first written to a local staging
folder, then uploaded, and the record is uploaded after everything else. Staging folders and
downloaded copies live under ``$GPUFLEET_HOME/cache/checkpoints/<digest of the URL>``, private
to the user (folders 0700, files 0600): they hold the weights.

A damaged step that a retry skips is moved aside (``set_aside``) rather than left in place: the
retry's saves would otherwise replace it (a save of the same step) or delete it (a save of an
earlier step drops the steps after it), and a damaged step may be mostly sound (a record cut
short over intact files) and worth recovering by hand. On a remote root the move is a copy and
a delete, since object stores cannot rename; it happens only on that rare path.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import posixpath
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from gpufleet import _environ
from gpufleet.errors import ConfigError
from gpufleet.rundir import ensure_private_dir

COMMIT_RECORD = "gpufleet.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class Store:
    """A checkpoint root: lists committed steps, stages, publishes and prunes them."""

    def __init__(self, root: str | os.PathLike):
        root = os.fspath(root)
        self.url = root
        self.remote = "://" in root and not root.startswith("file://")
        if self.remote:
            try:
                import fsspec
            except ImportError:
                raise ConfigError(
                    f"checkpoint root {root!r} is a URL, which needs fsspec: "
                    "pip install 'gpufleet[data]' (plus the filesystem's own package, "
                    "e.g. s3fs or gcsfs)"
                ) from None
            self.fs, self.path = fsspec.core.url_to_fs(root)
            digest = hashlib.sha256(root.encode()).hexdigest()[:24]
            self.local = _environ.gpufleet_home() / "cache" / "checkpoints" / digest
        else:
            self.local = Path(root.removeprefix("file://")).expanduser().absolute()

    def where(self, step: int) -> str:
        """The step's folder as the user named the root: a path, or a URL."""
        return self._where(step_name(step))

    def _where(self, name: str) -> str:
        if self.remote:
            return f"{self.url.rstrip('/')}/{name}"
        return str(self.local / name)

    # -- reading ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        if self.remote:
            try:
                names = [Path(p).name for p in self.fs.ls(self.path, detail=False)]
            except FileNotFoundError:
                return []
            found = [int(m[1]) for n in names if (m := _STEP_DIR.match(n))]
            return sorted(s for s in found if self.fs.exists(self._remote(s, COMMIT_RECORD)))
        if not self.local.is_dir():
            return []
        found = [int(m[1]) for p in self.local.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(s for s in found if (self.local / step_name(s) / COMMIT_RECORD).is_file())

    def record(self, step: int) -> bytes:
        """The step's commit record as stored (parsing it is the caller's: a record that does
        not parse is damage, a read that fails is not)."""
        if self.remote:
            return self.fs.cat_file(self._remote(step, COMMIT_RECORD))
        return (self.local / step_name(step) / COMMIT_RECORD).read_bytes()

    def fetch(self, step: int, *, again: bool = False) -> Path:
        """A local folder holding ``step`` (downloaded first from a remote root). A cached copy
        is used while its record matches the step's; ``again`` downloads it anyway, for a copy
        whose other files may be damaged (a disk error, a cleaner that cut files)."""
        target = self.local / step_name(step)
        if not self.remote:
            return target
        self._private_cache()
        cached = target / COMMIT_RECORD
        remote_record = self.fs.cat_file(self._remote(step, COMMIT_RECORD))
        # Not fresh: absent, re-saved since, or (again) suspected of damage in its other files.
        fresh = not again and cached.is_file() and cached.read_bytes() == remote_record
        if not (fresh and _is_private(target)):  # a copy by an earlier gpufleet may be 0755
            partial = self.local / f"{step_name(step)}.download"
            shutil.rmtree(partial, ignore_errors=True)
            self.fs.get(self._remote(step, ""), str(partial), recursive=True)
            _make_private(partial)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
        return target

    def _private_cache(self) -> None:
        """Create the cache folder of a remote root, each level 0700 from $GPUFLEET_HOME
        down; refuse one that another user owns or can enter: the copies are weights."""
        ensure_private_dir(self.local, closed=True)

    # -- writing ------------------------------------------------------------------------------

    def staging(self, step: int) -> Path:
        return self.local / f"{step_name(step)}.partial"

    def clear_staging(self, step: int) -> Path:
        """An empty staging folder for ``step`` (left-overs of a killed save removed)."""
        if self.remote:
            self._private_cache()
        path = self.staging(step)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        return path

    def retract(self, step: int) -> None:
        """Before ``step`` is saved again: its older save stops counting at once (remote);
        a local step folder is replaced by the rename that publishes the new one."""
        if self.remote and self.fs.exists(self._remote(step, COMMIT_RECORD)):
            self.fs.rm(self._remote(step, COMMIT_RECORD))

    def discard_staging(self, step: int) -> None:
        shutil.rmtree(self.staging(step), ignore_errors=True)

    def upload_files(self, step: int, names: list[str]) -> None:
        """Upload files of a staged step (remote roots; every node its own files)."""
        staged = self.staging(step)
        _make_private(staged)  # DCP and DeepSpeed write with the default modes
        for name in names:
            target = self._remote(step, name)
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)  # object stores: a no-op
            self.fs.put_file(str(staged / name), target)

    def publish(self, step: int, record: dict[str, Any]) -> None:
        """Write the commit record last; from then on the step counts."""
        staged = self.staging(step)
        mode = 0o600 if self.remote else 0o666  # on a local root: the umask decides, as for DCP
        _write_synced(staged / COMMIT_RECORD, json.dumps(record, indent=1), mode)
        if self.remote:
            self.fs.put_file(str(staged / COMMIT_RECORD), self._remote(step, COMMIT_RECORD))
            return
        final = self.local / step_name(step)
        shutil.rmtree(final, ignore_errors=True)  # an older save of the same step
        os.replace(staged, final)
        _fsync_dir(self.local)

    def set_aside(self, step: int) -> str:
        """Move a committed step that was found damaged out of the steps, to the first free
        name of ``step-N.damaged``, ``step-N.damaged-2``, ...; where it now is."""
        name = self._aside_name(step)
        if self.remote:
            self._copy_remote(step, name)
            self._delete(step)  # the record first: from then on the step no longer counts
        else:
            os.replace(self.local / step_name(step), self.local / name)
            _fsync_dir(self.local)
        return self._where(name)

    def _aside_name(self, step: int) -> str:
        """The first free name among ``step-N.damaged``, ``step-N.damaged-2``, ..."""
        names = (f"{step_name(step)}.damaged" + (f"-{n}" if n > 1 else "")
                 for n in itertools.count(1))
        return next(name for name in names if not self._exists(name))

    def _exists(self, name: str) -> bool:
        if self.remote:
            return self.fs.exists(f"{self.path.rstrip('/')}/{name}")
        return (self.local / name).exists()

    def _copy_remote(self, step: int, name: str) -> None:
        """Copy every file of a remote step into the folder ``name`` beside it (object stores
        copy on the server side; nothing is downloaded)."""
        source = self._remote(step, "")
        target = f"{self.path.rstrip('/')}/{name}"
        for path in self.fs.find(source):
            copy = f"{target}/{posixpath.relpath(path, source)}"
            self.fs.makedirs(posixpath.dirname(copy), exist_ok=True)  # object stores: a no-op
            self.fs.copy(path, copy)

    def drop_after(self, step: int) -> None:
        """Delete committed steps after ``step``: a run that restored an earlier step and saves
        again has abandoned them. Steps a retry skipped as damaged are not among them: they
        were moved aside (``set_aside``) before the run went on."""
        for later in [s for s in self.steps() if s > step]:
            self._delete(later)

    def prune(self, keep: int | None, protect: frozenset[int] = frozenset()) -> None:
        """Delete committed steps beyond the newest ``keep`` but those in ``protect`` (the
        best step), and abandoned partial saves."""
        for path in self.local.glob("step-*.partial") if self.local.is_dir() else ():
            shutil.rmtree(path, ignore_errors=True)
        if keep is None:
            return
        for step in self.steps()[:-keep]:
            if step not in protect:
                self._delete(step)

    def _delete(self, step: int) -> None:
        # The record goes first, so a half-deleted step no longer counts.
        if self.remote:
            self.fs.rm(self._remote(step, COMMIT_RECORD))
            self.fs.rm(self._remote(step, ""), recursive=True)
            shutil.rmtree(self.local / step_name(step), ignore_errors=True)  # a downloaded copy
        else:
            (self.local / step_name(step) / COMMIT_RECORD).unlink()
            shutil.rmtree(self.local / step_name(step), ignore_errors=True)

    def _remote(self, step: int, name: str) -> str:
        return "/".join(part for part in (self.path.rstrip("/"), step_name(step), name) if part)


def staged_files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != COMMIT_RECORD
    )


def _write_synced(path: Path, text: str, mode: int) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_private(top: Path) -> None:
    """Folders 0700 and files 0600 under ``top`` (a staging folder or a download)."""
    for folder, _, files in os.walk(top):  # os.walk does not follow links to folders
        os.chmod(folder, 0o700)
        for path in (os.path.join(folder, name) for name in files):
            if not os.path.islink(path):  # chmod would change the link's target
                os.chmod(path, 0o600)


def _is_private(folder: Path) -> bool:
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
