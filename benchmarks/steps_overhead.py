"""What step telemetry costs: step time with it on and off, side by side in one run.

    python benchmarks/steps_overhead.py --gpus 1 --time-limit 420 \\
        --out benchmarks/results/steps_overhead-1xH200-DATE.md
    python benchmarks/steps_overhead.py --gpus 1,2                 # 1 and 2 GPUs
    python benchmarks/steps_overhead.py --models 124m --repeats 5  # one model, more repeats
    GPUFLEET_TRACKING=0 python benchmarks/steps_overhead.py --config tiny --no-compile \\
        --repeats 1 --steps 5 --warmup 2 --out /tmp/so.md          # smoke test on CPU (gloo)

The target: telemetry on is within 1% of telemetry off. Two models, as in fsdp_throughput.py
(``models.py``): the Llama-style 1.2B under gpufleet's ``"fsdp"`` and the 124M under ``"ddp"``
(``--config tiny`` keeps both strategies on the tiny model), each built in the rank and made
ready by ``gpufleet.strategies.prepare(..., compile=True)`` unless ``--no-compile``. With one
GPU the strategies still wrap the model (DDP, FSDP2) in a world of one.

Each (model, telemetry on/off, repeat) is a gpufleet call of its own, since the option
``step_telemetry`` is per call (``fn.options(step_telemetry=False)``). The calls go in rounds,
each round every model off then on (on then off in odd rounds), so that drift (clocks,
temperature, a neighbour) hits both alike and a run cut short stays balanced. In
each call: the trainer's loop with no telemetry code in it, ``prepared.backward(loss)`` and
``prepared.step()``, so what is measured is the no-code-change path: the trainer ending each
step, the wrapped ``torch.autograd.backward`` marking the arrival, two CUDA events a step read
once done, and one JSON line a second. Batches are random tokens made on the device up front
(no loader: the input is free, and the loader's timing wrapper is not exercised); with
``--timed-input`` the batches pass through ``gpufleet.data``'s wrapper (``_timed``, what a
gpufleet loader runs each batch through) in both the on and the off calls. ``--warmup`` steps
(compilation included), then ``--steps`` steps timed with ``torch.cuda.synchronize()`` before
and after the timed block only (124m: 5 × ``--steps``, its steps being ~6× shorter). Rank 0's
ms/step is the call's value; the table gives, per model, the median over repeats of each, the
overhead and every repeat's value. Each "on" call's attempt folder (``fn.last_run``) must hold
``steps.json`` with every step counted and ``median_arrive_s`` set (on a GPU, the CUDA events'
arrival); each "off" call's none. The markdown table is rewritten to ``--out`` after every call,
so a run cut short keeps what it measured.

Sizing for one H200 (defaults: 3 rounds; 1.2b 10 + 20 steps, 124m 10 + 100): 12 cold calls,
each ~30 s (1.2b) to ~45 s (124m) of which the timed steps are ~5 s: process start, CUDA,
building the model and torch.compile (the first call of each model compiles cold, later ones
hit inductor's on-disk cache) are per call and cannot be shared between calls. About 7 minutes
in all; ``--time-limit 420`` starts no round that the last round's length says would end past
420 s, so a slow machine gives 2 rounds rather than running over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CONFIGS, build  # noqa: E402

from gpufleet import distributed, runtime  # noqa: E402

MODELS = {"1.2b": "fsdp", "124m": "ddp"}  # the model each strategy is measured on
LONGER = {"124m": 5}  # its steps are ~6× shorter: this many times --steps are timed
TARGET = 0.01


@distributed(timeout=1800, logs="rank0")
def measure(strategy: str, config_name: str, steps: int, warmup: int, compile: bool,
            timed_input: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from gpufleet import strategies

    config = CONFIGS[config_name]
    device = runtime.setup()
    model, params = build(config_name, device)

    def adamw(parameters):
        return torch.optim.AdamW(parameters, lr=1e-4, fused=device.type == "cuda")

    prepared = strategies.prepare(model, adamw, strategy, compile=compile)
    generator = torch.Generator(device).manual_seed(runtime.get_global_rank())
    batches = [torch.randint(0, config.vocab, (config.batch, config.seq + 1), device=device,
                             generator=generator) for _ in range(4)]

    def feed(n: int):
        stream = (batches[i % len(batches)] for i in range(n))
        if timed_input:
            from gpufleet.data import _timed  # what a gpufleet loader runs its batches through

            return _timed(stream)
        return stream

    def train(n: int) -> torch.Tensor:
        loss = torch.zeros(())
        for tokens in feed(n):
            logits = prepared.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            prepared.backward(loss)
            prepared.step()
        return loss.detach()

    cuda = device.type == "cuda"
    train(warmup)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = train(steps)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "step_ms": 1000 * elapsed / steps,
        "tokens_per_s_per_gpu": config.batch * config.seq * steps / elapsed,
        "loss": float(loss),
        "params": params,
        "gpus": runtime.get_world_size(),
        "device": torch.cuda.get_device_name(device) if cuda else "CPU (gloo)",
        "torch": torch.__version__,
    }


def recorded(folder: Path | None) -> dict:
    """What the attempt's step telemetry left: rank 0's counted steps, its median arrival."""
    summary = folder / "steps.json" if folder else None
    if summary is None or not summary.exists():
        lines = list((folder / "steps").glob("rank-*.jsonl")) if folder else []
        return {"summary": False, "rank_files": len(lines)}
    ranks = json.loads(summary.read_text())["ranks"]
    first = next((r for r in ranks if r["rank"] == 0), ranks[0])
    return {"summary": True, "ranks": len(ranks), "steps": first["steps"],
            "median_step_s": first["median_step_s"], "median_arrive_s": first["median_arrive_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: 1.2b (fsdp), 124m (ddp)")
    parser.add_argument("--config", help="one model size for every strategy (tiny: the CPU smoke test)")
    parser.add_argument("--gpus", default="", help="comma-separated world sizes (default: every visible GPU, "
                                                   "2 processes on CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="calls with telemetry on, and as many off")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (124m: 5×)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--timed-input", action="store_true",
                        help="pass the batches through gpufleet.data's timing wrapper")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds: start no round (every model off and on) that would end past it, judged "
                             "by the last round's length (0: no limit)")
    parser.add_argument("--out", type=Path, default=None, help="markdown table written here")
    args = parser.parse_args()
    worlds = [int(g) for g in args.gpus.split(",")] if args.gpus else [None]
    cases = [(name, MODELS[name], gpus) for name in args.models.split(",") for gpus in worlds]
    command = shlex.join(["python", *sys.argv])
    calls: list[dict] = []
    began = time.perf_counter()
    stopped = None
    for repeat in range(args.repeats):  # a round: every model off and on, so a cut-off run is balanced
        round_began = time.perf_counter()
        for name, strategy, gpus in cases:
            config = args.config or name
            steps = args.steps * LONGER.get(config, 1)
            for on in ((False, True) if repeat % 2 == 0 else (True, False)):
                fn = measure.options(step_telemetry=on, **({"gpus": gpus} if gpus else {}))
                started = time.perf_counter()
                row = {"case": (name, strategy, gpus), "config": config, "strategy": strategy,
                       "telemetry": on, "repeat": repeat}
                try:
                    row.update(fn.distributed(strategy, config, steps, args.warmup, args.compile,
                                              args.timed_input)[0])
                except Exception as exc:  # one failing call must not hide the others' numbers
                    row["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                row["call_s"] = time.perf_counter() - started
                row["telemetry_seen"] = recorded(fn.last_run)
                row["expected_steps"] = args.warmup + steps
                calls.append(row)
                print(f"[{time.perf_counter() - began:4.0f} s] {_line(row)}", flush=True)
                if args.out:
                    args.out.write_text(report(calls, args, command))
        now = time.perf_counter()
        if args.time_limit and repeat + 1 < args.repeats and now - began + (now - round_began) > args.time_limit:
            stopped = (f"stopped after {repeat + 1} of {args.repeats} rounds: another "
                       f"({now - round_began:.0f} s) would pass --time-limit {args.time_limit:.0f} s")
            print(stopped, flush=True)
            break
    text = report(calls, args, command) + (f"\n{stopped}\n" if stopped else "")
    print("\n" + text, end="")
    print(f"\n{len(calls)} calls in {time.perf_counter() - began:.0f} s")
    if args.out:
        args.out.write_text(text)
        print(f"written to {args.out}")
    if any("error" in row for row in calls):
        sys.exit(1)


def _line(row: dict) -> str:
    what = f"{row['config']} {row['strategy']} telemetry {'on ' if row['telemetry'] else 'off'} #{row['repeat'] + 1}"
    if "error" in row:
        return f"{what}: FAILED: {row['error']}"
    seen = row["telemetry_seen"]
    told = (f"steps.json: {seen['steps']} steps, arrive {seen['median_arrive_s']}" if seen["summary"]
            else f"no steps.json ({seen['rank_files']} rank files)")
    return (f"{what}: {row['step_ms']:.2f} ms/step, {row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"loss {row['loss']:.3f}; {told}; call {row['call_s']:.1f} s")


def report(calls: list[dict], args: argparse.Namespace, command: str) -> str:
    done = [row for row in calls if "error" not in row]
    device = done[0]["device"] if done else "?"
    worlds = sorted({row["gpus"] for row in done}) or ["?"]
    rounds = len({row["repeat"] for row in calls})
    longer = "".join(f" ({c}: {args.steps * n})" for c, n in LONGER.items() if any(r["config"] == c for r in calls))
    lines = [
        "# Step telemetry's overhead: step time with it on and off",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        f"- hardware: {' and '.join(str(w) for w in worlds)} × {device}; {os.cpu_count()} CPU cores; "
        f"{platform.platform()}; Python {platform.python_version()}; torch {done[0]['torch'] if done else '?'}",
        f"- command: {command}",
        f"- per call: {args.warmup} warm-up steps, then {args.steps} timed steps{longer}; "
        f"torch.compile {'on' if args.compile else 'off'}; "
        f"input: {'through gpufleet.data._timed' if args.timed_input else 'random tokens on the device'}; "
        f"{rounds} round(s) of {args.repeats} (each model off then on, on then off in odd rounds)",
        f"- target: on within {TARGET:.0%} of off; overhead = median(on) / median(off) - 1; "
        "spread = (max - min) / median of the off calls, the run's own noise",
        "",
        "| model | strategy | GPUs | off ms/step | on ms/step | overhead | off spread | within 1% "
        "| off, each call | on, each call | tokens/s/GPU off / on |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = list(dict.fromkeys(row["case"] for row in calls))
    for case in cases:
        rows = [row for row in done if row["case"] == case]
        off = [row["step_ms"] for row in rows if not row["telemetry"]]
        on = [row["step_ms"] for row in rows if row["telemetry"]]
        if not rows:
            config = next(row["config"] for row in calls if row["case"] == case)
            lines.append(f"| {config} | {case[1]} | {case[2] or '-'} | failed |  |  |  |  |  |  |  |")
            continue
        config, gpus = rows[0]["config"], rows[0]["gpus"]
        if off and on:
            overhead = statistics.median(on) / statistics.median(off) - 1
            spread = (max(off) - min(off)) / statistics.median(off)
            cells = [f"{statistics.median(off):.2f}", f"{statistics.median(on):.2f}", f"{overhead:+.2%}",
                     f"{spread:.2%}", "yes" if overhead <= TARGET else "**no**"]
        else:
            cells = [f"{statistics.median(off):.2f}" if off else "-",
                     f"{statistics.median(on):.2f}" if on else "-", "-", "-", "-"]
        tokens = [statistics.median(row["tokens_per_s_per_gpu"] for row in rows if row["telemetry"] is t)
                  if any(row["telemetry"] is t for row in rows) else 0.0 for t in (False, True)]
        lines.append(f"| {config} | {case[1]} | {gpus} | " + " | ".join(cells) + " | "
                     + ", ".join(f"{v:.2f}" for v in off) + " | " + ", ".join(f"{v:.2f}" for v in on)
                     + f" | {tokens[0]:,.0f} / {tokens[1]:,.0f} |")
    lines += [
        "",
        "What each call's attempt folder held (`steps.json` is written by the caller when an "
        "\"on\" call ends; rank 0's row):",
        "",
        "| model | strategy | GPUs | telemetry | call | ms/step | steps.json | steps counted / run "
        "| telemetry's median step ms | median_arrive_s | call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in calls:
        seen = row["telemetry_seen"]
        head = (f"| {row['config']} | {row['strategy']} | {row.get('gpus', row['case'][2] or '-')} "
                f"| {'on' if row['telemetry'] else 'off'} | {row['repeat'] + 1} ")
        if "error" in row:
            lines.append(head + f"| failed: {row['error'][:120]} |  |  |  |  | {row['call_s']:.1f} |")
            continue
        if seen["summary"]:
            arrive = seen["median_arrive_s"]
            step = seen["median_step_s"]
            counted = f"{seen['steps']} / {row['expected_steps']}"
            cells = ["yes", counted, f"{step * 1000:.2f}" if step is not None else "-",
                     f"{arrive:.6f}" if arrive is not None else "**missing**"]
        else:
            cells = [f"no ({seen['rank_files']} rank files)", "-", "-", "-"]
        lines.append(head + f"| {row['step_ms']:.2f} | " + " | ".join(cells) + f" | {row['call_s']:.1f} |")
    bad = [row for row in done if row["telemetry"] and not (
        row["telemetry_seen"]["summary"] and row["telemetry_seen"]["steps"] == row["expected_steps"]
        and row["telemetry_seen"]["median_arrive_s"] is not None)]
    bad += [row for row in done if not row["telemetry"] and row["telemetry_seen"]["summary"]]
    if not done:
        verdict = "no call succeeded"
    elif bad:
        verdict = f"**{len(bad)} call(s) not as expected** (see the table above)"
    else:
        verdict = ("every \"on\" call counted every step and has median_arrive_s; "
                   "no \"off\" call left steps.json")
    lines += ["", f"Telemetry check: {verdict}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
