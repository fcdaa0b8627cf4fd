"""Checkpoint integrity on real gloo ranks: every file of a step has its digest in the commit
record and is checked on restore; a damaged step is an error on every rank (or, on a retry,
skipped for the newest intact one and moved aside, never deleted), while a failure that is not
damage is an error even on a retry; a damaged cached copy of a remote step is downloaded
again; metadata pickled by any CPython 3.10+ loads; copies of remote checkpoints are private
to their user.

Functions sent to ranks are defined here at module level or inside the tests; the helpers
below are imported by reference in the ranks (the caller's sys.path travels with the call).
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import pickle
import shutil
import stat
import warnings
from pathlib import Path, PosixPath

import pytest
import torch

from gpufleet import ConfigError, GpufleetError, RunFailedError, distributed, runtime
from gpufleet.checkpoint import Checkpointer
from support import run_folders
from test_checkpoint import _poison_item, _poison_metadata

pytestmark = pytest.mark.timeout(150)

STEP1, STEP2 = "step-00000001", "step-00000002"


# ---------------------------------------------------------------------------- in the ranks


def tiny_trainer(seed: int = 0, width: int = 4):
    from gpufleet import strategies

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, width)
    return strategies.prepare(model, lambda p: torch.optim.Adam(p, lr=0.1), "ddp")


def train_step(trainer, step: int) -> None:
    x = torch.full((2, 4), float(step + runtime.get_global_rank()))
    trainer.backward(trainer.model(x).pow(2).mean())
    trainer.step()


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.module().state_dict().items()}


def save_steps(root: str, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Train and save each of `steps`; the weights saved at each."""
    runtime.setup(timeout=60)
    trainer = tiny_trainer()
    saved = {}
    with Checkpointer(root, keep=None) as ckpt:
        for step in steps:
            train_step(trainer, step)
            ckpt.save(step, trainer)
            saved[step] = weights(trainer)
    return saved


def restore_outcomes(cases: dict[str, tuple[str, dict]]) -> dict[str, tuple]:
    """For each case (root, restore options): ("loaded", step, weights, warnings) or
    (exception type, is a GpufleetError, message)."""
    runtime.setup(timeout=60)
    outcomes = {}
    for case, (root, options) in cases.items():
        trainer = tiny_trainer(seed=99)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = Checkpointer(root).restore(trainer, **options)
            outcomes[case] = ("loaded", step, weights(trainer), [str(w.message) for w in caught])
        except Exception as exc:
            outcomes[case] = (type(exc).__name__, isinstance(exc, GpufleetError), str(exc))
    return outcomes


# ---------------------------------------------------------------------------- on disk


def _metadata(folder: Path):
    return pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here


def _flip_bit_in_tensor(folder: Path, values: torch.Tensor) -> str:
    """Flip the lowest bit of the first of `values` where the step stores them: the weights
    change by a hair and every file still parses. The data file's name."""
    raw = values.numpy().tobytes()
    for path in sorted(folder.glob("*.distcp")):
        data = bytearray(path.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at] ^= 1  # little-endian float32: its lowest byte
            path.write_bytes(bytes(data))
            return path.name
    raise AssertionError(f"no data file of {folder} holds {values}")


def _cut_record(folder: Path) -> None:
    """Cut a step's commit record short, as a disk that filled up or a copy cut short does."""
    record = folder / "gpufleet.json"
    record.write_text(record.read_text()[:25])


def _spoil_data_file(folder: Path) -> None:
    """Invert one byte in the middle of a step's largest data file (its size stays the same)."""
    path = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _record(folder: Path) -> dict:
    return json.loads((folder / "gpufleet.json").read_text())


def _digest(data: bytes, piece_bytes: int) -> str:
    """A file's digest as docs/security.md defines it: the SHA-256 of its pieces' SHA-256s."""
    pieces = [data[i:i + piece_bytes] for i in range(0, max(len(data), 1), piece_bytes)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace a file of a committed step and its digest in the commit record: a step written
    that way by the saver (another Python, say), not damaged after the commit."""
    (folder / name).write_bytes(data)
    record = _record(folder)
    if "files" in record:  # a step committed with digests
        digest = _digest(data, record["digest_method"]["piece_bytes"])
        record["files"][name] = {"bytes": len(data), "digest": digest}
        (folder / "gpufleet.json").write_text(json.dumps(record))


def _modes(top: Path) -> dict[str, str]:
    """Every folder and file under `top` (and `top`), with its permission bits."""
    paths = [top, *top.rglob("*")]
    return {str(p.relative_to(top.parent)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in paths}


# ---------------------------------------------------------------------------- digests


def test_a_flipped_bit_is_refused_on_every_rank_unless_verification_is_skipped(runs_dir, tmp_path):
    call = distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    good = tmp_path / "good"
    saved = call(save_steps).distributed(str(good), [1])[0][1]
    folder = good / STEP1
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name != "gpufleet.json")
    assert sorted(_record(folder)["files"]) == on_disk, "the commit record lists every file"

    roots = {case: tmp_path / case.replace(" ", "-")
             for case in ("flipped", "metadata", "added", "older", "cut", "code in metadata",
                          "code in an item")}
    for root in roots.values():
        shutil.copytree(good, root)
    flipped_file = _flip_bit_in_tensor(roots["flipped"] / STEP1, saved["weight"])
    metadata = roots["metadata"] / STEP1 / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b"\0")
    (roots["added"] / STEP1 / "__7_0.distcp").write_bytes(b"planted")
    older = _record(roots["older"] / STEP1)  # a step committed before records held digests
    del older["files"]
    (roots["older"] / STEP1 / "gpufleet.json").write_text(json.dumps(older))
    cut = roots["cut"] / STEP1 / flipped_file
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    markers = {case: tmp_path / f"{roots[case].name}.marker"
               for case in ("code in metadata", "code in an item")}
    _poison_metadata(roots["code in metadata"] / STEP1, markers["code in metadata"])
    _poison_item(roots["code in an item"] / STEP1, "rng_rank0.python_version",
                 markers["code in an item"])

    flipped = str(roots["flipped"])
    results = call(restore_outcomes).distributed({
        "intact": (str(good), {}),
        "flipped": (flipped, {}),
        "metadata": (str(roots["metadata"]), {}),
        "added": (str(roots["added"]), {}),
        "older": (str(roots["older"]), {}),
        "flipped, restore(verify=False)": (flipped, {"verify": False}),
        "cut, restore(verify=False)": (str(roots["cut"]), {"verify": False}),
        # Without the digests, the loading rules alone still keep planted code from running.
        **{f"{case}, restore(verify=False)": (str(roots[case]), {"verify": False})
           for case in markers},
    })

    for rank, outcome in enumerate(results):
        assert outcome["intact"][:2] == ("loaded", 1), outcome["intact"]
        loaded = outcome["intact"][2]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        for case, names in [("flipped", flipped_file), ("metadata", ".metadata"),
                            ("added", "__7_0.distcp")]:
            name, is_ours, message = outcome[case]
            assert is_ours, f"rank {rank}, {case}: {name} instead of a GpufleetError: {message}"
            assert str(roots[case] / STEP1) in message and names in message, (
                f"rank {rank}, {case}: the error must name the step folder and the file: {message}"
            )
        # Unchecked, a file cut short is still refused, by DCP's reader, in one clean paragraph.
        name, is_ours, message = outcome["cut, restore(verify=False)"]
        assert is_ours and str(roots["cut"] / STEP1) in message, (name, message)
        assert "FrameSummary" not in message and "\n" not in message, message
        for case in markers:
            name, is_ours, message = outcome[f"{case}, restore(verify=False)"]
            assert is_ours and str(roots[case] / STEP1) in message, (case, name, message)
        assert outcome["older"][:2] == ("loaded", 1), outcome["older"]
        caught = outcome["older"][3]
        assert any("without file digests" in w for w in caught), caught
        case = "flipped, restore(verify=False)"
        assert outcome[case][:2] == ("loaded", 1), f"rank {rank}, {case}: {outcome[case]}"
        # What skipping costs: the altered weight is loaded as if it were the saved one.
        assert not torch.equal(outcome[case][2]["weight"], saved["weight"])
    ran_code = [case for case, marker in markers.items() if marker.exists()]
    assert not ran_code, f"loading these checkpoints ran the code in them: {ran_code}"


# ---------------------------------------------------------------------------- metadata


class _Later:
    """The callable of a planted call, pickled as getattr(target, name)."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __call__(self, *args):
        raise AssertionError("never called here; only unpickling would call it")


class _Planted:
    """Pickled as getattr(target, name)(marker): what a tampered metadata file could do with
    an unrestricted getattr (getattr(PosixPath, 'touch')(marker) creates a file)."""

    def __init__(self, target, name, marker: Path):
        self.call, self.marker = _Later(target, name), marker


class _Python3112Pickler(pickle.Pickler):
    """Pickles enum members as CPython 3.11.0-3.11.3 did: getattr(EnumClass, "MEMBER")."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, _Later):
            return getattr, (obj.target, obj.name)
        if isinstance(obj, _Planted):
            return obj.call, (obj.marker,)
        return NotImplemented


def _repickled(metadata) -> bytes:
    buffer = io.BytesIO()
    _Python3112Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    return buffer.getvalue()


def _one_rank_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A step saved in this process (no gpufleet call: one rank, no process group)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, async_save=False) as ckpt:
        ckpt.save(1, model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_verify_is_true_or_false(tmp_path):
    root = tmp_path / "ckpt"
    _one_rank_checkpoint(root)
    for bad in ("no", 0, None):
        with pytest.raises(ConfigError, match="verify"):
            Checkpointer(root).restore(torch.nn.Linear(4, 4), verify=bad)


def test_metadata_pickled_by_python_3_11_2_restores(tmp_path):
    root = tmp_path / "ckpt"
    saved = _one_rank_checkpoint(root)
    folder = root / STEP1
    data = _repickled(_metadata(folder))
    assert b"getattr" in data and b"_MEM_FORMAT_ENCODING" in data  # the 3.11.2 shape
    _rewrite(folder, ".metadata", data)

    model = torch.nn.Linear(4, 4)
    assert Checkpointer(root).restore(model) == 1
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


def test_getattr_in_metadata_reaches_nothing_but_enum_members(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    root = tmp_path / "ckpt"
    _one_rank_checkpoint(root)
    folder = root / STEP1
    marker = tmp_path / "code-ran"
    original, planted = (folder / ".metadata").read_bytes(), {}
    for target, name in [(PosixPath, "touch"), (_MEM_FORMAT_ENCODING, "__class__"),
                         (_MEM_FORMAT_ENCODING, "NO_SUCH_MEMBER")]:
        metadata = pickle.loads(original)  # our own file: trusted here
        metadata.planner_data = {"note": _Planted(target, name, marker)}
        planted[name] = _repickled(metadata)
        _rewrite(folder, ".metadata", planted[name])

        with pytest.raises(GpufleetError) as info:
            Checkpointer(root).restore(torch.nn.Linear(4, 4))
        message = str(info.value)
        named = f"getattr({target.__module__}.{target.__qualname__}, {name!r})"
        assert named in message and str(folder) in message, message
        assert not marker.exists(), f"restoring ran {named}"
    pickle.loads(planted["touch"])  # the planted call is real: plain unpickling runs it
    assert marker.exists()


# ---------------------------------------------------------------------------- damaged latest step


def restore_latest(root: str) -> int:
    runtime.setup(timeout=60)
    return Checkpointer(root).restore(tiny_trainer(seed=99))


def test_a_damaged_latest_step_is_an_error_on_every_rank_that_says_what_to_do(runs_dir, tmp_path):
    root = tmp_path / "ckpt"
    call = distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    call(save_steps).distributed(str(root), [1, 2])
    record = root / STEP2 / "gpufleet.json"
    record.write_text(record.read_text()[:25])  # a disk that filled up, a copy cut short

    with pytest.raises(RunFailedError) as info:
        call(restore_latest).distributed(str(root))

    error = info.value
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    for failure in error.failures:
        assert not failure.collateral, f"rank {failure.rank} saw a lost peer: {failure.summary}"
        assert "GpufleetError" in failure.summary and str(root / STEP2) in failure.summary, (
            f"rank {failure.rank}: the error must name the damaged step folder: {failure.summary}"
        )
        assert "step=1" in failure.summary, f"the error must say how to proceed: {failure.summary}"
    assert "FrameSummary" not in str(error), str(error)
    assert "root cause: ranks 0, 1:" in str(error), str(error)


def _checkpoint_root(where: str, tmp_path: Path, monkeypatch) -> tuple[Path, str]:
    """(the folder that holds the steps, the root to pass to Checkpointer): a local folder,
    or the same folder through fsspec's remote code path (`local://`)."""
    bucket = tmp_path / "ckpt"
    if where == "local":
        return bucket, str(bucket)
    pytest.importorskip("fsspec")
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "home"))
    return bucket, f"local://{bucket}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where, damage", [("local", "cut record"), ("remote", "spoilt data file")])
def test_a_retry_falls_back_past_a_damaged_step_and_keeps_it_aside(
        where, damage, runs_dir, tmp_path, monkeypatch):
    bucket, root = _checkpoint_root(where, tmp_path, monkeypatch)
    reference = tmp_path / "step1.pt"
    spoil = _cut_record if damage == "cut record" else _spoil_data_file

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120, max_retries=1)
    def train(root: str, bucket: str, reference: str):
        import torch.distributed as dist

        runtime.setup(timeout=60)
        rank = runtime.get_global_rank()
        trainer = tiny_trainer()
        ckpt = Checkpointer(root, keep=None)
        start = ckpt.restore(trainer)
        restored = weights(trainer)
        if runtime.get_attempt() == 0:
            for step in (1, 2):
                train_step(trainer, step)
                ckpt.save(step, trainer)
                ckpt.wait()
                if step == 1 and rank == 0:
                    torch.save(weights(trainer), reference)
            dist.barrier()
            if rank == 0:  # step 2 is damaged where it is stored, then the run crashes
                spoil(Path(bucket) / STEP2)
                raise RuntimeError("simulated crash after step 2 was damaged")
            dist.barrier()  # rank 1 waits here until gpufleet stops it
        for step in range(start + 1, 4):
            train_step(trainer, step)
            ckpt.save(step, trainer)
        ckpt.wait()
        return {"attempt": runtime.get_attempt(), "start": start, "restored": restored,
                "steps": ckpt.steps()}

    results = train.distributed(root, str(bucket), str(reference))

    step1 = torch.load(reference, weights_only=True)
    for rank, r in enumerate(results):
        assert (r["attempt"], r["start"]) == (1, 1), f"rank {rank}: {r['attempt']=}, {r['start']=}"
        assert all(torch.equal(r["restored"][k], step1[k]) for k in step1), "step 1's weights"
        assert r["steps"] == [1, 2, 3], r["steps"]
    # Saving steps 2 and 3 again replaced nothing that was damaged: it is kept, moved aside.
    aside = bucket / f"{STEP2}.damaged"
    kept = sorted(p.name for p in aside.iterdir()) if aside.is_dir() else []
    assert "gpufleet.json" in kept and ".metadata" in kept, f"damaged step not kept: {kept}"
    damaged = f"{root}/{STEP2}" if where == "remote" else str(bucket / STEP2)
    retry = run_folders(runs_dir)[-1]
    for rank in (0, 1):
        log = (retry / "logs" / f"rank-{rank}.log").read_text()
        said = [line for line in log.splitlines() if damaged in line]
        assert said and "step 1" in said[0], f"rank {rank}'s log says no fallback:\n{log}"
        assert f"{damaged}.damaged" in said[0], f"rank {rank}'s log hides the damaged step:\n{log}"


class Loader:
    """A data loader's position in a data set of `size` samples, refusing one past its end."""

    def __init__(self, size: int):
        self.size, self.position = size, 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["position"] > self.size:
            raise ValueError(f"position {state['position']} is past the end of the data set "
                             f"({self.size} samples)")
        self.position = state["position"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change, error", [("wider layer", "Size mismatch"),
                                           ("shorter data set", "past the end of the data set")])
def test_a_retry_that_cannot_load_the_newest_step_for_another_reason_fails_and_keeps_it(
        change, error, runs_dir, tmp_path):
    """Only damage is skipped on a retry. Here something read at start-up changed between the
    attempts: the retry builds its layer wider than the one saved (no step fits), or its data
    set is shorter than the position saved at step 2 (step 1 would fit). Either is the error,
    on every rank, and no step is skipped, moved, replaced or deleted."""
    root, record = tmp_path / "ckpt", tmp_path / "step2.json"

    @distributed(gpus=2, runs_dir=runs_dir, timeout=120, max_retries=1)
    def train(root: str, change: str, record: str):
        runtime.setup(timeout=60)
        first = runtime.get_attempt() == 0
        trainer = tiny_trainer(width=8 if change == "wider layer" and not first else 4)
        loader = Loader(size=3 if change == "shorter data set" and not first else 10)
        ckpt = Checkpointer(root, keep=None)
        start = ckpt.restore(trainer, extra={"loader": loader})
        for step in range(start + 1, 3):
            train_step(trainer, step)
            loader.position += 2
            ckpt.save(step, trainer, extra={"loader": loader})
        ckpt.wait()
        if first:
            if runtime.get_global_rank() == 0:
                shutil.copy(Path(root) / STEP2 / "gpufleet.json", record)
            raise RuntimeError("simulated crash after step 2")
        return start

    with pytest.raises(RunFailedError) as info:
        train.distributed(str(root), change, str(record))

    failures = info.value.failures
    assert sorted(f.rank for f in failures) == [0, 1], str(info.value)
    for failure in failures:
        summary = failure.summary
        assert not failure.collateral, f"rank {failure.rank} saw a lost peer: {summary}"
        assert error in summary and str(root / STEP2) in summary, summary
        assert "is damaged" not in summary and "intact step" not in summary, summary
    assert sorted(p.name for p in root.iterdir()) == [STEP1, STEP2]
    assert (root / STEP2 / "gpufleet.json").read_bytes() == record.read_bytes(), (
        "step 2 was saved again over the one the crashed attempt committed")


# ---------------------------------------------------------------------------- private caches


def save_and_restore(url: str) -> int:
    runtime.setup(timeout=60)
    trainer = tiny_trainer()
    with Checkpointer(url) as ckpt:
        for step in (1, 2):
            train_step(trainer, step)
            ckpt.save(step, trainer)
    return Checkpointer(url).restore(tiny_trainer(seed=99))


def test_cached_copies_of_remote_checkpoints_are_private(runs_dir, tmp_path, monkeypatch):
    pytest.importorskip("fsspec")
    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    url = f"local://{tmp_path / 'bucket'}"
    call = distributed(gpus=2, runs_dir=runs_dir, timeout=120)

    assert call(save_and_restore).distributed(url) == [2, 2]

    modes = _modes(home / "cache")
    assert any(name.endswith(".metadata") for name in modes), "restore left no cached copy"
    folders = {n: m for n, m in modes.items() if (home / n).is_dir()}
    files = {n: m for n, m in modes.items() if n not in folders}
    assert set(folders.values()) == {"0o700"}, f"folders open to others: {folders}"
    assert set(files.values()) == {"0o600"}, f"files open to others: {files}"
    assert oct(stat.S_IMODE(home.stat().st_mode)) == "0o700"


def test_a_cache_folder_open_to_others_is_refused(runs_dir, tmp_path, monkeypatch):
    pytest.importorskip("fsspec")
    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    planted = home / "cache" / "checkpoints"
    for folder in (home, home / "cache"):
        folder.mkdir(mode=0o700)
    planted.mkdir()
    planted.chmod(0o777)  # as anyone could have made it, for anyone to fill

    with pytest.raises(RunFailedError) as info:
        distributed(gpus=2, runs_dir=runs_dir, timeout=120)(save_and_restore).distributed(
            f"local://{tmp_path / 'bucket'}")

    error = info.value
    assert sorted(f.rank for f in error.failures) == [0, 1], str(error)
    for failure in error.failures:
        assert str(planted) in failure.summary and "chmod 700" in failure.summary, failure.summary
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").iterdir())


def test_a_damaged_cached_copy_of_a_remote_step_is_downloaded_again(runs_dir, tmp_path,
                                                                     monkeypatch):
    pytest.importorskip("fsspec")
    home = tmp_path / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    url = f"local://{tmp_path / 'bucket'}"
    call = distributed(gpus=2, runs_dir=runs_dir, timeout=120)
    saved = call(save_steps).distributed(url, [1, 2])[0][2]
    first = call(restore_outcomes).distributed({"first": (url, {})})
    assert [r["first"][:2] for r in first] == [("loaded", 2)] * 2, first
    [cached] = home.glob(f"cache/checkpoints/*/{STEP2}")
    _flip_bit_in_tensor(cached, saved["weight"])  # a disk error, a cleaner that cut a file

    results = call(restore_outcomes).distributed({"again": (url, {})})

    for rank, outcome in enumerate(results):
        assert outcome["again"][:2] == ("loaded", 2), f"rank {rank}: {outcome['again']}"
        loaded, caught = outcome["again"][2], outcome["again"][3]
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), "step 2's weights"
        assert any(str(cached) in w and "downloaded again" in w for w in caught), caught
