"""The entry of every rank: ``main(RUN_DIR)``, forked from the agent's template process.

It runs the pickled call once and leaves exactly one result file behind: ``("ok", value)``,
``("error", RankFailure)``, or ``("left", RankFailure)`` for a call that ended through
``sys.exit(0)`` (or a script's end): a success unless a peer failed on its absence
(``watch/outcome.py``). A warm rank (``gpufleet.pool``) does the same for each call handed
to it. See docs/design.md for why it ends with ``os._exit``.
"""

from __future__ import annotations

import atexit
import errno
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

from gpufleet import _environ, _process, _stacks, payload, runtime, steps, telemetry, timings, tracking
from gpufleet._log import log
from gpufleet.errors import RankFailure
from gpufleet.rank import warm
from gpufleet.rank.script import ScriptEnded
from gpufleet.rundir import RunDir, check_private_dir

EXIT_GRACE_SECONDS = 30
_keep_open: list = []  # the stacks file faulthandler writes to
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # gpufleet/
_RUNPY = runpy.__file__  # where Python does not freeze it (it does from 3.11: "<frozen runpy>")
_PEER_LOSS_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
    "nccl error",
    "socket timeout",
)


def main(run_dir: str) -> None:
    """A rank: forked by elastic's agent from its template process, which has imported
    torch and gpufleet already (``launchers/_elastic_agent.py``)."""
    timings.mark("ranks_started", timings.process_started())
    # Its own process group, as elastic gives ranks it starts from a command: gpufleet's
    # teardown kills each rank's group whole. The template dies with the agent, and the
    # rank with the template; an agent already gone means no run to join.
    os.setsid()
    _process.die_with_parent(signal.SIGKILL, None)
    if not _process.alive(_environ.parent_pid()):
        os._exit(1)
    _leave_the_template()
    sys.argv = [__file__, run_dir]
    run = RunDir(Path(run_dir))
    rank = _environ.rank()
    _environ.settle_node_rank()
    umask = _environ.caller_umask()
    if umask is not None:
        os.umask(umask)
    ok = _serve(run, rank) if _environ.pool_mode() else _call(run, rank)
    _exit(0 if ok else 1)


def _leave_the_template() -> None:
    """What a fork inherits from the template but a rank must not share with it: the
    forkserver's keep-alive pipe (held by a rank, it would keep the template alive after the
    agent died; user code that starts its own forkserver gets a fresh one), multiprocessing's
    start method (the template's is "forkserver"; a process of its own has the platform's
    default, which DataLoader workers rely on), torch's random generator state (the same
    in every rank; a process of its own seeds from the OS), and its thread count: OpenMP reads
    OMP_NUM_THREADS once, as torch is imported, which for a template forked from the kept one
    (``launchers/template.py``) was before the call's value was known. (Set here, in the rank:
    set before a fork, torch's thread pools break the children's backward passes.)"""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_start_method(None, force=True)
    server: Any = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        server._forkserver_pid = None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "").strip()
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _call(run: RunDir, rank: int, body=None, before_result=None) -> bool:
    """Run one call in ``run`` (its payload, or ``body``) and leave its result there;
    ``before_result`` runs just before the result is written."""
    _send_output_to(run.log(rank))
    payload.write_private(run.pid_file(rank), str(os.getpid()).encode())
    _answer_stack_requests(run.stacks(rank))
    runtime.heartbeat()
    # the node's first rank samples the host and the run's GPUs while the call runs (not
    # while a warm pool's ranks warm up: that is no call of anyone's)
    sampler = telemetry.Sampler.start(run) if body is None else None
    if body is None:
        steps.begin_call(run, rank)
    outcome = _run(run, rank, body or _payload_call)
    steps.finish_call()  # the last window, before the result: the caller may end with it
    if sampler is not None:
        sampler.stop()  # its last sample lands before the result: the caller may end with it
    try:
        data = payload.dump_result(outcome)
    except Exception as exc:  # the return value does not pickle: report that instead
        outcome = ("error", _result_failure(rank, outcome[1], exc))
        data = payload.dump_result(outcome)
    if outcome[0] == "ok" and (note := payload.large_result_note(outcome[1], len(data))):
        log.warning(note)  # weights sent back by accident, most likely
    timings.write_rank(run.timings(rank))
    tracking.flush_progress()  # the status line's last step is the function's last one
    if before_result is not None:
        before_result()
    try:
        payload.write_private(run.result(rank), data)
    except OSError as exc:  # a full disk, say: the result is lost, and the caller must hear why
        _report_unwritten_result(run, rank, len(data), exc)
        return False
    return outcome[0] in ("ok", "left")


def _report_unwritten_result(run: RunDir, rank: int, size: int, exc: OSError) -> None:
    """Leave a small failure in place of a result that could not be written; if even that
    does not fit, the caller names the full file system from the exit alone."""
    failure = RankFailure(
        rank=rank, kind="result", host=socket.gethostname(), pid=os.getpid(), exitcode=1,
        time=time.time(),
        summary=f"its result ({size / 2**20:.1f} MiB) could not be written to {run.result(rank)}: "
        f"{exc.strerror or exc}{payload.free_space_note(run.path, exc.errno == errno.ENOSPC)}",
    )
    log.error(failure.summary)
    try:
        payload.write_private(run.result(rank), payload.dump_result(("error", failure)))
    except OSError:
        pass  # nothing fits: the rank's exit code and the caller's look at the disk tell it


def _serve(pool: RunDir, rank: int) -> bool:
    """A warm rank of ``gpufleet.pool``: set up CUDA and the process group once, then run
    each call handed over through the pool's pipe, in the call's own run folder, until the
    pipe closes. A failed call ends the rank, and the pool starts again for the next call:
    no call inherits a broken process group or a collective left half done. After each call
    the rank puts its state back and says it is ready; the caller hands over the next call
    only then."""
    if not _call(pool, rank, _warm_up):
        return False
    baseline = warm.Baseline()
    group = warm.WarmGroup()
    group.install()
    modules = warm.ModuleFiles()
    release_memory = _environ.pool_mode() != _environ.POOL_KEEP_MEMORY
    calls = 0
    payload.write_private(pool.ready(rank), b"0")
    with open(pool.orders(rank), "rb") as orders:
        for line in orders:
            order = json.loads(line)
            timings.reset()
            timings.mark("call_received")
            baseline.enter(order["env"], order["cwd"])
            group.begin_call()
            # before the result: the caller may edit a module as soon as the call returns
            record = (lambda: payload.write_private(pool.modules, modules.seen())) if rank == 0 else None
            if not _call(RunDir(Path(order["run"])), rank, before_result=record):
                return False
            _send_output_to(pool.log(rank))
            _answer_stack_requests(pool.stacks(rank))
            try:
                group.end_call(keep=runtime._own_groups())
                baseline.restore(release_memory)
            except Exception:  # the rank cannot promise a clean state: the pool starts again
                traceback.print_exc()
                return False
            calls += 1
            payload.write_private(pool.ready(rank), str(calls).encode())
    return True


def _warm_up(run: RunDir) -> None:
    runtime.setup()
    if _environ.local_rank() == 0:
        telemetry.prepare()  # the node's sampler runs here, one call after the other


def _send_output_to(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)


def _answer_stack_requests(path: Path) -> None:
    """On SIGUSR1, faulthandler writes every thread's Python stack to the rank's stacks file
    from C, so the rank answers even while blocked in a collective. The first line names the
    main thread, which the caller's diagnosis reads first."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    stacks = os.fdopen(fd, "a", encoding="utf-8")  # open for the process's life
    stacks.write(f"{_stacks.MAIN_THREAD_HEADER}{threading.main_thread().ident:#x}\n")
    stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    while _keep_open:  # a warm rank's previous call's file
        _keep_open.pop().close()
    _keep_open.append(stacks)


def _run(run: RunDir, rank: int, body) -> tuple:
    try:
        check_private_dir(run.path)  # refuse a run folder that someone else could have planted
        value = body(run)
        runtime._finish_saves()
        return ("ok", value)
    except SystemExit as exc:
        return _left(rank, exc)
    except BaseException as exc:
        failure = _failure(rank, exc)
        print(failure.traceback, file=sys.stderr, end="", flush=True)  # the rank's log too
        return ("error", failure)


def _left(rank: int, exc: SystemExit) -> tuple:
    """The call ended through ``sys.exit`` (or a script ended): no value. A status other than 0
    fails the rank. Status 0 is a success, unless another rank then fails with a communication
    error: the caller names this rank as the cause (it left the collectives the others were in,
    and their errors only say that a peer closed the connection), so the time it left is kept."""
    if isinstance(exc, ScriptEnded):
        summary, code = exc.summary, 0
    else:
        summary = f"sys.exit({exc.code!r}) inside the function"
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    failure = _failure(rank, exc, kind="left", summary=summary)
    failure.exitcode = code
    if isinstance(exc, ScriptEnded):
        failure.traceback = ""  # the script reached its end: no frame of it to show
    return ("left" if code == 0 else "error", failure)


def _payload_call(run: RunDir):
    fn, args, kwargs = payload.load_call(run.payload)
    timings.mark("payload_loaded")
    runtime.heartbeat()  # loading may import for a long time; that was progress too
    if _environ.tracked():
        tracking.join_in_rank(run.tracking)
        timings.mark("tracking_joined")
    try:
        return fn(*args, **kwargs)
    finally:
        timings.mark("function_ended")


def _failure(rank: int, exc: BaseException, kind: str = "", summary: str = "") -> RankFailure:
    if not kind:
        kind, summary = _classify(exc)
    try:
        pickled = payload.dump_result(exc)
    except Exception:  # an exception that does not pickle still travels as text
        pickled = None
    sys.stderr.flush()
    return RankFailure(
        rank=rank,
        kind=kind,
        log_bytes=os.fstat(2).st_size,
        summary=summary or "".join(traceback.format_exception_only(type(exc), exc)).strip(),
        traceback=_user_traceback(exc),
        host=socket.gethostname(),
        pid=os.getpid(),
        exitcode=1,
        time=time.time(),
        collateral=_is_peer_loss(exc),
        exception=pickled,
    )


def _classify(exc: BaseException) -> tuple[str, str]:
    """The failure's kind and one-line summary; out-of-memory errors carry the numbers."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    torch = sys.modules.get("torch")
    cuda_oom = getattr(torch, "OutOfMemoryError", ()) if torch is not None else ()
    for cause in _chain(exc):
        message = str(cause)
        if isinstance(cause, MemoryError) or ("DefaultCPUAllocator" in message and "memory" in message):
            first = message.splitlines()[0] if message else ""
            return "host-oom", f"{type(cause).__name__}: {first}".rstrip(": ") + _host_memory()
        if cuda_oom and isinstance(cause, cuda_oom):
            return "cuda-oom", _cuda_oom_summary(torch, cause)
    return "exception", text


def _chain(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 10:
        yield exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def _cuda_oom_summary(torch, exc: BaseException) -> str:
    """torch's message leads; then this rank's GPU memory as torch counts it."""
    message = str(exc).split(". Including non-PyTorch memory")[0].split("If reserved")[0].strip()
    try:
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        gib = 2**30
        numbers = (
            f" [cuda:{device} {torch.cuda.get_device_name(device)}: {total / gib:.1f} GiB in all, "
            f"{free / gib:.2f} GiB free; PyTorch had {torch.cuda.memory_allocated(device) / gib:.2f} GiB "
            f"allocated (peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB), "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved]"
        )
    except Exception:  # the numbers are a help; the error must be reported without them
        numbers = ""
    return (
        f"{type(exc).__name__}: {message}{numbers} — lower the batch size, or use "
        "activation_checkpointing=True, or shard the model ('fsdp', 'zero3')"
    )


def _host_memory() -> str:
    try:
        rss = psutil.Process().memory_info().rss / 2**30
        available = psutil.virtual_memory().available / 2**30
    except psutil.Error:  # the numbers are a help; the error must be reported without them
        return ""
    return f" [this rank used {rss:.2f} GiB; {available:.2f} GiB left on the host]"


def _result_failure(rank: int, value, exc: Exception) -> RankFailure:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return RankFailure(
        rank=rank,
        kind="result",
        summary=f"the return value (a {kind}) cannot be pickled: {exc}",
        log_bytes=os.fstat(2).st_size,
        host=socket.gethostname(),
        pid=os.getpid(),
        exitcode=1,
        time=time.time(),
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback without the frames at its top that are gpufleet's own, or runpy's (which
    runs a script or module as ``__main__`` for ``gpufleet run``)."""
    tb = exc.__traceback__
    while tb is not None and _is_launch_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_launch_frame(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename in (_RUNPY, "<frozen runpy>")


def _is_peer_loss(exc: BaseException | None) -> bool:
    """A communication error: usually the echo of another rank's death, not the cause."""
    dist = sys.modules.get("torch.distributed")
    for cause in _chain(exc):
        if dist is not None and isinstance(cause, getattr(dist, "DistError", ())):
            return True
        if any(m in str(cause).lower() for m in _PEER_LOSS_MESSAGES):
            return True
    return False


def _exit(code: int) -> None:
    """End the rank without C++ static destructors (gloo aborts in them), atexit hooks kept.

    A failed rank leaves at once (``os._exit``). A successful one returns to elastic's
    wrapper, which hands its (empty) return value to the agent and then leaves through
    ``os._exit`` too; a user's leftover thread cannot hold it longer than EXIT_GRACE_SECONDS.
    """
    timer = threading.Timer(EXIT_GRACE_SECONDS, os._exit, (code,))
    timer.daemon = True
    timer.start()
    if code == 0:
        _release_process_group()
    atexit._run_exitfuncs()  # user hooks (loggers, trackers) still flush
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        os._exit(code)


def _release_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # the result is already written; a failed cleanup must not fail the rank
        traceback.print_exc()

