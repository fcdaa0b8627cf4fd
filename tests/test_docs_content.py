"""Docs pages that quote the code, checked against it so that they cannot drift.

- docs/troubleshooting.md is keyed by messages: every heading made only of code spans
  (`` ### `message` `` or `` ### `start` … `end` ``) must be a message that a string of
  src/gpufleet still writes. ``<placeholder>`` stands for a value the code fills in (an
  f-string's ``{...}``); the literal text around the placeholders must appear, in order, in
  one string of the source (an f-string's literal parts, or ``"a" + f"b"`` concatenations).
- docs/run-folder.md documents the fields of `gpufleet status --json`, `gpufleet runs --json`,
  `gpufleet run --detach --json` and `gpufleet template --json`: the fields a real finished
  2-process CPU run prints must be documented, and every field documented as "always" must be
  printed.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
import time
from functools import lru_cache
from pathlib import Path

import psutil
import pytest
from support import PYTHON, REPO, script_env

pytestmark = pytest.mark.timeout(120)

DOCS = REPO / "docs"
SOURCE = REPO / "src" / "gpufleet"
HOLE = "\x00"  # where an f-string fills in a value
MAX_RENDERINGS = 64  # per string: the product of its ``'s' if n > 1 else ''`` alternatives
MIN_LITERAL_CHARS = 12  # of each heading: a heading of placeholders alone would match anything
MIN_MESSAGES = 25
RUN_BOUND_S = 90.0

# ------------------------------------------------------------------ troubleshooting.md


def _render(node: ast.AST) -> list[str] | None:
    """The texts a string expression can produce, each value it fills in as HOLE; None for an
    expression that is not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return _joined([_render(v) if isinstance(v, ast.Constant) else _hole(v.value) for v in node.values])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        if left is None and right is None:
            return None
        return _joined([left or [HOLE], right or [HOLE]])
    if isinstance(node, ast.IfExp):
        body, orelse = _render(node.body), _render(node.orelse)
        return body + orelse if body is not None and orelse is not None else None
    return None


def _hole(node: ast.AST) -> list[str]:
    """An f-string's ``{...}``: its alternatives when it is ``'s' if n > 1 else ''``, else HOLE."""
    if isinstance(node, ast.IfExp):
        return _render(node) or [HOLE]
    return [HOLE]


def _joined(parts: list[list[str] | None]) -> list[str]:
    combos = itertools.islice(itertools.product(*[p or [HOLE] for p in parts]), MAX_RENDERINGS)
    return ["".join(c) for c in combos]


@lru_cache(maxsize=1)
def source_strings() -> tuple[str, ...]:
    """Every string src/gpufleet can write, as rendered by ``_render``."""
    found: set[str] = set()
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            rendered = _render(node)
            if rendered:
                found.update(r for r in rendered if r.strip(HOLE))
    return tuple(found)


CODE_SPAN = re.compile(r"(`+)\s?(.+?)\s?\1")
PLACEHOLDER = re.compile(r"<[^<>]*>")


def message_headings(text: str) -> list[tuple[str, list[str]]]:
    """The headings of a page that are messages: made of code spans only (joined by " … "),
    each heading with its spans."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = re.match(r"#{2,4} (.+)$", line)
        if fenced or not match:
            continue
        heading = match.group(1).strip()
        spans = [m.group(2) for m in CODE_SPAN.finditer(heading)]
        if spans and not CODE_SPAN.sub("", heading).replace("…", "").strip():
            found.append((heading, spans))
    return found


def literal_parts(span: str) -> list[str]:
    return [part for part in PLACEHOLDER.split(span) if part]


def in_source(span: str) -> bool:
    """Whether one string of the source writes ``span``: its literal parts in this order, the
    placeholders standing for anything (the values filled in, or more text)."""
    parts = literal_parts(span)
    pattern = re.compile(".*?".join(re.escape(p) for p in parts), re.DOTALL)
    longest = max(parts, key=len)
    return any(longest in s and pattern.search(s) for s in source_strings())


def test_the_matcher_tells_real_messages_from_made_up_ones():
    """What the page test relies on, on messages whose source is known."""
    # an f-string, its placeholders, and an 's' that depends on a count
    assert in_source("<gpus> but only <n> GPUs are visible here")
    assert in_source("<gpus> but only <n> GPU is visible here")
    # "a" + f"b": a headline built from pieces (watch/diagnosis.py)
    assert in_source("<rank> is not in a collective while rank <r> waits in <collective>")
    # words the code never wrote, or wrote apart, or in another order
    assert not in_source("<gpus> but only <n> GPUs are available here")
    assert not in_source("GPUs are visible here <x> but only")
    assert not in_source("no GPU visible: running <n> CPU processes with nccl")


def test_every_troubleshooting_heading_is_a_message_the_code_writes():
    page = (DOCS / "troubleshooting.md").read_text()
    headings = message_headings(page)
    assert len(headings) >= MIN_MESSAGES, f"only {len(headings)} message headings found"
    short = [h for h, spans in headings
             if sum(len(p) for s in spans for p in literal_parts(s)) < MIN_LITERAL_CHARS]
    assert not short, "headings with too little literal text to check:\n" + "\n".join(short)
    missing = [h for h, spans in headings if not all(in_source(s) for s in spans)]
    assert not missing, ("troubleshooting.md quotes messages that src/gpufleet no longer "
                         "writes (fix the heading, or the page):\n" + "\n".join(missing))
    duplicated = {h for h, _ in headings if [x for x, _ in headings].count(h) > 1}
    assert not duplicated, f"headings twice: {duplicated}"


# ------------------------------------------------------------------ run-folder.md

PROBE = """
import torch
import torch.distributed as dist

from gpufleet import runtime

dist.init_process_group("gloo")
for step in range(5):
    with runtime.step():
        total = torch.ones(1)
        dist.all_reduce(total)
print("world", int(total.item()), flush=True)
dist.destroy_process_group()
"""

STATUS_FIELDS = "`gpufleet status RUN --json`"
RECORD_FIELDS = "`record.json`"
STEPS_FIELDS = "`steps`"
STEPS_RANK_FIELDS = "`steps.ranks[]`"
STARTED_FIELDS = "`gpufleet run --detach --json`, `gpufleet submit --json`"
TEMPLATE_FIELDS = "`gpufleet template --json`"


def documented(title: str) -> dict[str, str]:
    """The first table under the heading ``title`` of run-folder.md: each row's field (the
    first cell's code span) and when it is there (the second cell)."""
    lines = (DOCS / "run-folder.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"#+ " + re.escape(title), line)]
    assert len(starts) == 1, f"run-folder.md has no single heading {title!r}"
    fields: dict[str, str] = {}
    for line in lines[starts[0] + 1:]:
        if line.startswith("#"):
            break
        if fields and not line.startswith("|"):
            break  # the end of the first table
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = CODE_SPAN.match(cells[0]) if line.startswith("| `") else None
        if name:
            fields[name.group(2)] = cells[1]
    assert fields, f"no table of fields under {title!r}"
    return fields


def always(fields: dict[str, str]) -> set[str]:
    return {name for name, when in fields.items() if when.startswith("always")}


def gpufleet(*args, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([PYTHON, "-m", "gpufleet", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_BOUND_S)
    assert proc.returncode == 0, f"$ gpufleet {' '.join(map(str, args))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A detached 2-process CPU run of PROBE, untracked, waited for until it ended and its
    supervisor exited: (what `run --detach --json` printed, the CLI's folder and env)."""
    folder = tmp_path_factory.mktemp("docs-run")
    (folder / "probe.py").write_text(PROBE)
    env = script_env(folder, GPUFLEET_HOME=str(folder / "gpufleet-home"))
    env.pop("GPUFLEET_VIRTUAL_GPUS", None)
    started = json.loads(gpufleet("run", "--detach", "--json", "--gpus", "2", "--no-tracking",
                                  "probe.py", cwd=folder, env=env).stdout)
    record = Path(started["path"]) / "record.json"
    deadline = time.monotonic() + RUN_BOUND_S
    while json.loads(record.read_text())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"the run did not end in {RUN_BOUND_S:.0f} s"
        time.sleep(0.2)
    supervisor = json.loads(record.read_text())["supervisor"]
    psutil.wait_procs([p for p in psutil.process_iter() if p.pid == supervisor["pid"]], timeout=30)
    return started, folder, env


def test_the_started_run_json_is_documented(finished):
    started, _, _ = finished
    assert set(started) == set(documented(STARTED_FIELDS)), started


def test_status_json_of_a_finished_run_prints_the_documented_fields(finished):
    started, folder, env = finished
    status = json.loads(gpufleet("status", started["id"], "--json", cwd=folder, env=env).stdout)
    assert status["status"] == "succeeded", status
    fields = {**documented(RECORD_FIELDS), **documented(STATUS_FIELDS)}
    fields.pop("supervisor")  # in record.json, never printed
    assert set(status) <= set(fields), f"undocumented: {set(status) - set(fields)}"
    assert always(fields) <= set(status), f"documented as always, not printed: {always(fields) - set(status)}"
    assert "steps" in status, "the probe steps with runtime.step(): status has its steps"
    assert set(status["steps"]) == set(documented(STEPS_FIELDS))
    assert {k for rank in status["steps"]["ranks"] for k in rank} == set(documented(STEPS_RANK_FIELDS))
    on_disk = json.loads((Path(started["path"]) / "record.json").read_text())
    records = documented(RECORD_FIELDS)
    assert set(on_disk) <= set(records), f"undocumented in record.json: {set(on_disk) - set(records)}"
    assert always(records) <= set(on_disk), f"missing from record.json: {always(records) - set(on_disk)}"


def test_runs_json_prints_the_status_fields_but_steps(finished):
    started, folder, env = finished
    (listed,) = json.loads(gpufleet("runs", "--json", cwd=folder, env=env).stdout)
    fields = {**documented(RECORD_FIELDS), **documented(STATUS_FIELDS)}
    assert listed["id"] == started["id"]
    assert set(listed) <= set(fields) - {"supervisor", "steps", "gpu_telemetry"}, listed
    assert always(fields) - {"supervisor"} <= set(listed)


def test_template_json_is_documented(finished):
    _, folder, env = finished
    templates = json.loads(gpufleet("template", "--json", cwd=folder, env=env).stdout)
    assert templates, "the run was forked from a kept template, which is still running"
    assert {k for t in templates for k in t} == set(documented(TEMPLATE_FIELDS))
