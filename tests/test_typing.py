"""The typed public surface: an editor completes every option of ``@distributed`` and
``.options()``, and a type checker catches a misspelled one before anything runs.

mypy runs in subprocesses, as a user or CI would run it: on gpufleet's own source with the
repository's ``[tool.mypy]`` settings, and on a small user file that imports the installed
gpufleet (which needs the ``py.typed`` marker).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpufleet import DistributedFunction, distributed
from gpufleet.options import RunOptions, option_names
from support import REPO, line_of

needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (pip install -e '.[test]')")


def keyword_only(fn) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]


def option_defaults() -> dict[str, object]:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(RunOptions)}


def mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}  # gpufleet as installed
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_package_says_it_is_typed():
    assert importlib.resources.files("gpufleet").joinpath("py.typed").is_file(), (
        "gpufleet ships without py.typed, so type checkers ignore its annotations"
    )


@pytest.mark.parametrize("fn", [distributed, DistributedFunction.options],
                         ids=["distributed", "options"])
def test_every_option_is_a_typed_keyword(fn):
    params = keyword_only(fn)
    assert [p.name for p in params] == option_names(), f"{fn.__qualname__}'s keyword-only names"
    assert not [p.name for p in params if p.annotation is p.empty], "options without a type"


def test_decorator_defaults_are_the_run_defaults():
    shown = {p.name: p.default for p in keyword_only(distributed)}
    expected = option_defaults()
    wrong = [f"{name}: {repr(shown[name]) if name in shown else 'no such parameter'} "
             f"(RunOptions: {default!r})"
             for name, default in expected.items() if name not in shown or shown[name] != default]
    assert not wrong, "distributed() shows defaults that are not the run's: " + ", ".join(wrong)


@needs_mypy
# The first run without a .mypy_cache reads torch, ray, mlflow, ...: 2 minutes on a busy machine.
@pytest.mark.timeout(600)
def test_mypy_passes_on_the_source():
    result = mypy("src/gpufleet", cwd=REPO)
    if result.returncode:
        pytest.fail(f"mypy src/gpufleet exited {result.returncode}:\n"
                    f"{result.stdout}{result.stderr}")


USER_CODE_OK = """\
from gpufleet import distributed


@distributed(gpus=2)
def train(x: int) -> float:
    return x / 2


results: list[float] = train.distributed(3)
fewer: list[float] = train.options(gpus=1).distributed(3)
"""

USER_CODE_WRONG = """\
from gpufleet import distributed


@distributed(gpu=2)  # misspelled-decorator
def train(x: int) -> float:
    return x / 2


@distributed(gpus=2)
def evaluate(x: int) -> float:
    return x / 2


fewer = evaluate.options(gpu=1)  # misspelled-options
names: list[str] = evaluate.distributed(3)  # wrong-result-type
"""

# Only gpufleet's own signatures matter here: the libraries it imports (torch, ray, ...) are
# not read, which keeps a cold run to seconds rather than a minute.
USER_CONFIG = """\
[mypy]
follow_imports = skip
[mypy-gpufleet.*]
follow_imports = silent
"""


@needs_mypy
def test_type_checker_catches_a_misspelled_option(tmp_path):
    for name, text in [("ok.py", USER_CODE_OK), ("wrong.py", USER_CODE_WRONG),
                       ("mypy.ini", USER_CONFIG)]:
        (tmp_path / name).write_text(text)
    result = mypy("--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache"),
                  "--show-error-codes", "ok.py", "wrong.py", cwd=tmp_path)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if ": error:" in line]

    assert not [e for e in errors if e.startswith("ok.py:")], f"correct code rejected:\n{output}"
    missed = []
    for marker, words in [("misspelled-decorator", '"gpu"'), ("misspelled-options", '"gpu"'),
                          ("wrong-result-type", "list[str]")]:
        line = line_of(tmp_path / "wrong.py", marker)
        if not [e for e in errors if e.startswith(f"wrong.py:{line}:") and words in e]:
            missed.append(f"line {line} ({marker})")
    assert not missed, (f"mypy accepted wrong.py at {', '.join(missed)}:\n"
                        f"{textwrap.indent(USER_CODE_WRONG, '    ')}\nmypy said:\n{output}")
