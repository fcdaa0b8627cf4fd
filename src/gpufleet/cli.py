# PYTHON_ARGCOMPLETE_OK  (argcomplete: this command completes its own arguments)
"""The ``gpufleet`` command: run scripts and workload files, list, follow, cancel and prune runs.

Exit status: 0 success; 1 the run failed (or no such run); 2 bad usage or input, before
anything starts; 124 the run timed out; 130 interrupted or cancelled; 143 preempted (SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import argcomplete

from gpufleet import __version__, _environ, flags, steps, telemetry
from gpufleet._log import log
from gpufleet.errors import ConfigError, GpufleetError, PayloadError, RunFailedError
from gpufleet.memory import command as estimate_command
from gpufleet.memory import records as shrink_records
from gpufleet.options import DEFAULT_STRAGGLER_THRESHOLD, RunOptions, Surface, speaking
from gpufleet.rank.script import run_command, run_module, run_script
from gpufleet.rundir import RunDir, runs_root
from gpufleet.runs import cluster, execution, handles, records
from gpufleet.watch import progress

EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED, EXIT_PREEMPTED = 1, 2, 124, 130, 143
EXIT_OF_STATUS = {
    records.SUCCEEDED: 0, records.FAILED: EXIT_FAILED, records.LOST: EXIT_FAILED,
    records.TIMEOUT: EXIT_TIMEOUT, records.CANCELLED: EXIT_INTERRUPTED, records.PREEMPTED: EXIT_PREEMPTED,
    records.DAMAGED: EXIT_FAILED,
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    if args.quiet:
        log.setLevel(logging.WARNING)
    try:
        args.runs_dir = getattr(args, "runs_dir", None) or args.global_runs_dir
        _check_folders(args)
    except ConfigError as exc:  # another user's folder, or none: bad input, whatever the command
        log.error(f"error: {exc}")
        return EXIT_USAGE
    try:
        with speaking(Surface.CLI, getattr(args, flags.SPELLED, {})):
            return args.command(args)
    except (ConfigError, PayloadError) as exc:
        log.error(f"error: {exc}")
        return EXIT_FAILED if getattr(args, "finds_run", False) else EXIT_USAGE
    except PermissionError as exc:  # what _check_folders could not foresee (ACLs, a file's mode)
        log.error(f"error: cannot use {exc.filename or 'a file of the runs folder'}: "
                  f"{exc.strerror}; use a folder of your own (--runs-dir DIR, or GPUFLEET_HOME)")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `gpufleet runs | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _check_folders(args) -> None:
    """The runs folder, and to start a run gpufleet's home (device locks, parameters), must be
    this user's to use: one line naming the folder, before anything starts."""
    records.check_folder(runs_root(args.runs_dir), "the runs folder",
                         write=getattr(args, "writes", False),
                         fix="give a folder of your own with --runs-dir DIR or GPUFLEET_HOME")
    if getattr(args, "starts", False):
        records.check_folder(_environ.gpufleet_home(), "gpufleet's home (GPUFLEET_HOME)",
                             write=True, fix="set GPUFLEET_HOME to a folder of your own")


def cmd_run(args) -> int:
    """Run a script on every rank here, in the foreground (or detached)."""
    words = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.module == []:
        raise ConfigError("-m needs a module name: gpufleet run [options] -m package.module [args ...]")
    fn: Callable[[str, list[str]], None]
    if args.module:  # -m takes the rest of the line: the module and its own arguments
        module, *rest = args.module
        fn, fn_args, name, what, kind = run_module, (module, rest), module, module, "module"
        argv = ["-m", module, *rest]
    else:
        if not words:
            raise ConfigError("give a script to run: gpufleet run [options] script.py [args ...] (or -m module)")
        script, *rest = words
        if not Path(script).is_file():
            raise ConfigError(f"script {script!r} not found (from {os.getcwd()})")
        fn, fn_args, name, what, kind = run_script, (script, rest), Path(script).stem, script, "script"
        argv = [script, *rest]
    options = _run_options(args)
    call = execution.Call.prepare(fn, fn_args, {}, options, name, what, kind=kind)
    if args.detach:
        return _started(handles.submit(call, argv=argv), args.json)
    address = cluster.jobs_address(call, submitting=False)
    if address is not None:  # supervised on the cluster, as a Ray job; followed from here
        return _follow_to_end(cluster.submit(call, address, argv=argv), cancel_on_interrupt=True)
    record = call.record(argv=argv, detached=False)
    record.supervised_here()
    return _foreground(call, record)


def cmd_submit(args) -> int:
    """Start a workload file in the background; print its id (or follow it)."""
    from gpufleet.runs import workload

    work = workload.load(args.workload)
    options, surface, spelled = _submit_options(args, work)
    entries: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
        "script": (run_script, (work.target, work.args)),
        "module": (run_module, (work.target, work.args)),
        "command": (run_command, (work.target,)),
    }
    fn, fn_args = entries[work.entry]
    name = Path(work.target).stem if work.entry == "script" else work.path.stem
    with _naming(work.path), speaking(surface, spelled):  # e.g. more gpus than this machine has
        call = execution.Call.prepare(
            fn, fn_args, {}, options, name, str(work.path), kind=work.entry, params=work.parameters,
        )
    extra = {"MLFLOW_EXPERIMENT_NAME": work.experiment} if work.experiment else {}
    run = handles.submit(call, cwd=work.folder, env=extra, argv=[str(work.path)])
    if not args.follow:
        return _started(run, args.json)
    log.info(f"submitted {run.id}")
    return _follow_to_end(run)


def _run_options(args) -> RunOptions:
    """`gpufleet run`'s options: the flags typed (each wins, whatever its value), the config
    file's defaults for the others."""
    given, _ = flags.options_from(args)
    if args.runs_dir is not None:
        given["runs_dir"] = args.runs_dir
    options = RunOptions.create(**given)
    flags.check_torchrun_flags(args, options)
    return options


def _submit_options(args, work) -> tuple[RunOptions, Surface, dict[str, str]]:
    """A workload's options: its fields, the flags typed over them, the config file's
    defaults for the others; and the surface its errors speak, with the flags typed."""
    env = dict(work.options.pop("env", {}))
    if work.parameters_file is not None:
        env[_environ.PARAMETERS] = str(work.parameters_file)
    given, spelled = flags.options_from(args)  # flags override the file's fields
    env = {**env, **given.pop("env", {})}
    surface = Surface.FILE if not given else Surface.CLI  # the flags, where any was given
    with _naming(work.path), speaking(surface, spelled):
        if args.runs_dir:
            work.options["runs_dir"] = args.runs_dir
        options = RunOptions.create(**{**work.options, **given}, env=env, detach=True)
    return options, surface, spelled


def cmd_runs(args) -> int:
    found = handles.runs(args.runs_dir, args.ray_address)[: args.limit]
    rows = [row for r in found if (row := _row(r)) is not None]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    header = ("ID", "NAME", "STATUS", "GPUS", "DEVICES", "STARTED", "DURATION")
    table = [header] + [
        (r["id"], r["name"] or "-", r["status"], str(r["gpus"] or "-"),
         ",".join(r["devices"]) or "-", _when(r["started"] or r["created"]), _duration(r)) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in rows:  # what is wrong with a damaged record, beside the table (not in it)
        if r["status"] == records.DAMAGED:
            log.warning("%s", r["error"])
    return 0


def _row(run: handles.Run) -> dict | None:
    """A run as ``gpufleet runs`` lists it; a damaged record as its id, "damaged" and what is
    wrong with it; None for a run deleted meanwhile."""
    try:
        return _summary(run)
    except records.DamagedRecordError as exc:
        return {"id": run.id, "name": None, "status": records.DAMAGED, "gpus": None, "devices": [],
                "created": None, "started": None, "ended": None, "duration": "-",
                "error": str(exc), "path": str(run.path)}
    except FileNotFoundError:  # pruned while listed
        return None


def cmd_logs(args) -> int:
    run = handles.attach(args.run, args.runs_dir, args.ray_address)
    if args.follow:  # Ctrl-C: 130, and the run goes on
        run.logs(args.rank, follow=True, logs=flags.logs_flag(args.logs))
        return 0
    run.logs(args.rank, out=sys.stdout)
    return 0


def cmd_status(args) -> int:
    run = handles.attach(args.run, args.runs_dir, args.ray_address)
    summary = _summary(run)
    sampled = _last_samples(run.path, summary)
    gpu_use = telemetry.describe_gpus(sampled)  # "" on CPU
    stepped = _last_steps(run.path, summary)
    shrinks = shrink_records.of_run(run.path)  # the micro-batch's shrinks after a CUDA OOM
    if args.json:
        gpus = [{"node": node, "host": s.get("host"), "time": s.get("time"), **gpu}
                for node, s in sorted(sampled.items()) for gpu in s.get("gpus") or ()]
        print(json.dumps({**summary, **({"gpu_telemetry": gpus} if gpus else {}),
                          **({"steps": stepped.as_dict()} if stepped else {}),
                          **({"memory_shrinks": shrinks} if shrinks else {})}, indent=1))
        return 0
    for key in ("id", "name", "status", "kind", "gpus", "devices", "device", "created", "started",
                "ended", "duration", "attempts", "error", "mlflow_run_id", "path"):
        value = summary.get(key)
        if key in ("created", "started", "ended"):
            value = _when(value) if value else "-"
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key + ':':<13} {value if value not in (None, '') else '-'}")
        if key == "gpus" and gpu_use:  # the run's GPUs as its nodes last sampled them
            age = time.time() - max(s.get("time", 0) for s in sampled.values())
            print(f"{'gpu use:':<13} {gpu_use} (sampled {progress.clock(age)} ago)")
        if key == "gpus" and stepped:  # the ranks' step telemetry: throughput, stragglers
            running = summary.get("status") not in records.FINAL
            print(f"{'steps:':<13} {' · '.join(progress.steps_parts(stepped, running))}")
        if key == "gpus":
            for i, shrink in enumerate(shrinks):
                print(f"{'memory:' if i == 0 else '':<13} {shrink_records.describe(shrink)}")
    if summary.get("timings"):
        print("timings of the last attempt:")
        print("\n".join(f"  {label}: {seconds:.3f} s" for label, seconds in summary["timings"]["phases"].items()))
    return 0


def _last_steps(folder: Path, summary: dict) -> steps.Comparison | None:
    """The ranks' recent steps in the run's last attempt, compared (``steps.py``)."""
    attempts = summary.get("attempts") or []
    if not attempts:
        return None
    threshold = summary.get("straggler_threshold") or DEFAULT_STRAGGLER_THRESHOLD
    return steps.compare(steps.recent_in(RunDir(folder / attempts[-1])), threshold)


def _last_samples(folder: Path, summary: dict) -> dict[int, dict]:
    """Each node's last telemetry sample in the run's last attempt (``telemetry.py``)."""
    attempts = summary.get("attempts") or []
    return telemetry.latest_in(RunDir(folder / attempts[-1]).telemetry) if attempts else {}


def cmd_cancel(args) -> int:
    run = handles.attach(args.run, args.runs_dir, args.ray_address)
    before = run.status()
    try:
        status = run.cancel()
    except TimeoutError:
        log.error(f"{run.id} did not stop in time; it is still {run.status()} "
                  f"(its supervisor: {run.record().get('supervisor')})")
        return EXIT_FAILED
    print(f"{run.id}: {status}" + ("" if before not in records.FINAL else " (had already ended)"))
    return 0


def cmd_prune(args) -> int:
    if args.older_than is None and args.keep is None:
        raise ConfigError("say which ended runs to delete: --older-than AGE (e.g. 7d), --keep N, or both")
    if args.keep is not None and args.keep < 0:
        raise ConfigError(f"--keep {args.keep}: give a number of runs, 0 or more")
    chosen = records.prunable(args.runs_dir, args.older_than, args.keep)
    size, failed = 0, 0
    for path in chosen:
        size += _size(path)
        if not args.dry_run:
            try:
                _delete(path)
            except OSError as exc:
                log.error(f"could not delete {path}: {exc}")
                failed += 1
                continue
        print(path.name.removeprefix(records.PRUNING))
    done = len(chosen) - failed
    what = f"{done} folder{'' if done == 1 else 's'}, {size / 2**20:.1f} MiB"
    log.info(f"{'would delete' if args.dry_run else 'deleted'} {what}")
    return EXIT_FAILED if failed else 0


def cmd_ui(args) -> int:
    """Serve the MLflow UI on gpufleet's store, on loopback unless told otherwise."""
    from gpufleet import tracking

    return tracking.serve_ui(args.host, args.port)


def _memory(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**30:.2f} GiB"


def cmd_template(args) -> int:
    """Show or stop the kept templates runs are forked from (launchers/template.py)."""
    from gpufleet.launchers import template

    if args.action == "stop":
        stopped = template.stop()
        log.info(f"stopped {len(stopped)} template{'' if len(stopped) == 1 else 's'}"
                 + (f" (pid {', '.join(map(str, stopped))})" if stopped else ""))
        return 0
    found = template.running()
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    if not found:
        print("no template is running (the next run starts one)")
    for entry in found:
        age = time.time() - entry["started"]
        print(f"pid {entry['pid']}: up {age:.0f} s, {entry['runs']} run(s) and {entry['trackers']} MLflow "
              f"tracker(s) started, {entry['running']} running, "
              f"torch imported in {entry['import_seconds']:.1f} s, ends after {entry['idle_seconds']:.0f} s idle, "
              f"{_memory(entry.get('uss_bytes'))} of memory its own (USS); {entry['python']}")
    return 0


def cmd_schema(args) -> int:
    from gpufleet.runs import workload

    print(json.dumps(workload.schema(), indent=2))
    return 0


def cmd_completion(args) -> int:
    print(argcomplete.shellcode(["gpufleet"], shell=args.shell))
    return 0


def _run_ids(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Completion of a run id: the runs of the runs folder the line names."""
    runs_dir = getattr(parsed_args, "runs_dir", None) or getattr(parsed_args, "global_runs_dir", None)
    try:
        return [r.id for r in handles.runs(runs_dir) if r.id.startswith(prefix)]
    except (OSError, GpufleetError):
        return []


def _delete(path: Path) -> None:
    """Hidden first (no listing shows a half-deleted run), then removed; a folder left half
    deleted is picked up by the next prune."""
    try:
        if not path.name.startswith(records.PRUNING):
            doomed = path.with_name(records.PRUNING + path.name)
            path.rename(doomed)
            path = doomed
        shutil.rmtree(path)
    except FileNotFoundError:  # another prune is deleting it
        pass


def _size(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.lstat().st_size if f.is_file() else 0
        except OSError:  # removed meanwhile
            pass
    return total


def _foreground(call: execution.Call, record: records.Record) -> int:
    try:
        execution.execute(call, record, exits_after=True)
    except RunFailedError as exc:
        log.error("%s", exc)
        return EXIT_OF_STATUS[records.status_of(exc)]
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0


def _started(run: handles.Run, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"id": run.id, "path": str(run.path), "status": run.status()}))
    else:
        print(run.id)
    return 0


def _follow_to_end(run: handles.Run, cancel_on_interrupt: bool = False) -> int:
    try:
        run.logs(follow=True)
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            raise
        log.warning(f"cancelling run {run.id}")
        run.cancel()
        return EXIT_INTERRUPTED
    status = run.wait()
    if status != records.SUCCEEDED:
        try:
            run.result()
        except GpufleetError as exc:
            log.error("%s", exc)
    return EXIT_OF_STATUS[records.RunStatus(status)]


def _summary(run: handles.Run) -> dict:
    data = run.record()
    data["status"] = run.status()
    data["duration"] = _duration(data)
    data["path"] = str(run.path)
    data.pop("supervisor", None)
    attempt = run.path / data["attempts"][-1] if data["attempts"] else None
    if attempt is not None and (attempt / "timings.json").is_file():
        from gpufleet.timings import Timings

        data["timings"] = {k: v for k, v in Timings.read(attempt).as_json().items() if k in ("phases", "total")}
    return data


def _duration(data: dict) -> str:
    if not data.get("started"):
        return "-"
    return progress.clock((data.get("ended") or time.time()) - data["started"])


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


@contextlib.contextmanager
def _naming(path: Path):
    """A ConfigError about a workload's values names its file."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    runs_dir_help = "the runs folder (default: $GPUFLEET_HOME/runs, ~/.gpufleet/runs)"
    common = flags.Parser(add_help=False)
    common.add_argument("--runs-dir", type=Path, metavar="DIR", help=runs_dir_help)
    on_cluster = flags.Parser(add_help=False, parents=[common])
    on_cluster.add_argument("--ray-address", metavar="ADDRESS",
                         help="the Ray cluster (default: RAY_ADDRESS); its Jobs address, "
                         "http://HEAD:8265, reaches runs supervised there from any machine")
    parser = flags.Parser(
        prog="gpufleet",
        description="Run scripts and workload files on this machine's GPUs (or a Ray cluster); "
        "list, follow, cancel and prune runs.",
        epilog="exit status: 0 success, 1 run failed or not found, 2 bad usage, 124 timeout, "
        "130 interrupted or cancelled, 143 preempted",
    )
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="only warnings and errors from gpufleet itself (the ranks' output stays)")
    # before the command too; its own dest, as a subcommand's default would overwrite it
    parser.add_argument("--runs-dir", type=Path, dest="global_runs_dir", metavar="DIR", help=runs_dir_help)
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND", parser_class=flags.Parser)
    _run_command(sub, common)
    _other_commands(sub, common, on_cluster)
    return parser


def _run_command(sub: Any, common: argparse.ArgumentParser) -> None:
    run = sub.add_parser("run", parents=[common], help="run a script on N GPUs, as torchrun would",
                         description="Run a Python script (or -m module) on every rank, with "
                         "torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), "
                         "live [rank N] logs, precise errors and a run record. Durations read 90, "
                         "90s, 30m, 2h, 7d.")
    flags.add_option_flags(run)
    run.add_argument("--json", action="store_true", help="with --detach: print the run as JSON")
    run.add_argument("-m", "--module", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [args ...]",
                     help="run a module, as python -m does (the rest of the line is its own)")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="script.py [args ...]")
    # writes: in the runs folder; starts: a run, in gpufleet's home too (device locks,
    # parameters). Both folders are checked before the command starts.
    run.set_defaults(command=cmd_run, writes=True, starts=True)


def _other_commands(sub: Any, common: argparse.ArgumentParser, on_cluster: argparse.ArgumentParser) -> None:
    submit = sub.add_parser("submit", parents=[common], help="start a workload file in the background",
                            description="Start the run a workload file (YAML or JSON) describes; print its id.")
    submit.add_argument("workload", help="the workload file")
    flags.add_option_flags(submit, workload=True)
    submit.add_argument("--follow", action="store_true", help="stream its logs and exit with its status")
    submit.add_argument("--json", action="store_true", help="print the run as JSON")
    submit.set_defaults(command=cmd_submit, writes=True, starts=True)

    listing = sub.add_parser("runs", parents=[on_cluster], help="list runs, newest first")
    listing.add_argument("--json", action="store_true", help="print the records as JSON")
    listing.add_argument("--limit", type=int, default=50, help="how many runs (default 50)")
    listing.set_defaults(command=cmd_runs)

    prune = sub.add_parser(
        "prune", parents=[common], help="delete the folders of ended runs",
        description="Delete the folders of runs that have ended (never a queued or running one) "
        "and, with --older-than, of warm pools that are gone; print what was deleted. With both "
        "limits, a run goes when it ended more than AGE ago and is not among the N most recently "
        "ended.")
    prune.add_argument("--older-than", type=flags.duration, metavar="AGE",
                       help="runs that ended more than AGE ago: 90s, 30m, 12h, 7d")
    prune.add_argument("--keep", type=int, metavar="N", help="keep the N most recently ended runs")
    prune.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    prune.set_defaults(command=cmd_prune, writes=True)

    for name, fn, what in (("logs", cmd_logs, "print a run's logs"), ("status", cmd_status, "show a run's record"),
                           ("cancel", cmd_cancel, "stop a run (every rank)")):
        one = sub.add_parser(name, parents=[on_cluster], help=what, description=what[0].upper() + what[1:] + ".")
        one.add_argument("run", help="run id, or a unique start or 6-digit end of it").completer = _run_ids  # type: ignore[attr-defined]
        one.set_defaults(command=fn, finds_run=True, writes=name == "cancel")
        if name == "logs":
            one.add_argument("--rank", type=int, help="only this rank's log, without prefixes")
            one.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
            one.add_argument("--logs", metavar="RANKS", help="with --follow: which ranks' lines to show, "
                             "all, rank0, none or ranks such as 0,3 (default: the run's logs option)")
        if name == "status":
            one.add_argument("--json", action="store_true", help="print the record as JSON")

    ui = sub.add_parser("ui", help="serve the MLflow UI of gpufleet's runs",
                        description="Serve the MLflow UI on the store gpufleet tracks into "
                        "(MLFLOW_TRACKING_URI, else $GPUFLEET_HOME/mlflow.db), until Ctrl-C.")
    ui.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    ui.add_argument("--port", type=int, default=5000, help="the port (default 5000)")
    ui.set_defaults(command=cmd_ui)

    kept = sub.add_parser(
        "template", help="show or stop the kept template runs are forked from",
        description="Show or stop the kept templates: per-user processes with torch imported, from which "
                    "runs fork their processes (GPUFLEET_TEMPLATE=0 turns them off; GPUFLEET_TEMPLATE_IDLE "
                    "sets how many seconds one waits for a run before it ends).",
    )
    kept.add_argument("action", choices=("status", "stop"), nargs="?", default="status",
                      help="status (default): the running templates; stop: end them (runs they started go on)")
    kept.add_argument("--json", action="store_true", help="status as JSON")
    kept.set_defaults(command=cmd_template)

    schema = sub.add_parser("schema", help="print the JSON Schema of workload files",
                            description="Print the JSON Schema of workload files, for editors "
                            "(e.g. `# yaml-language-server: $schema=...` in a workload file).")
    schema.set_defaults(command=cmd_schema)

    completion = sub.add_parser("completion", help="print the shell completion script",
                                description="Print the completion script of the gpufleet command; "
                                'e.g. in ~/.bashrc: eval "$(gpufleet completion bash)"')
    completion.add_argument("shell", choices=("bash", "zsh", "fish", "tcsh", "powershell"), nargs="?",
                            default="bash", help="the shell (default bash)")
    completion.set_defaults(command=cmd_completion)
    estimate_command.add_parser(sub)  # the flags are many: in its own module
