"""The package as a user gets it.

The sdist and the wheel are built from this checkout (``python -m build``) and pass
``twine check --strict``; the wheel holds every module, ``py.typed`` and the license, the sdist
the license, changelog and README. The wheel is then installed into a fresh virtual environment,
and from a folder outside the repository that environment runs the hello-world example and
``gpufleet --version``: a dependency missing from the metadata, a module left out of the wheel
or an example that only works from the checkout fails here.

Installing the wheel pulls torch and its CUDA libraries from the package index pip is configured
with (no other network): minutes and several GB, hence the generous timeout and a virtual
environment deleted as soon as the test ends. Run alone with
``pytest -q tests/test_package.py``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 1200  # about 150 s on an idle 2-core machine with a local index
RUN_TIMEOUT_S = 300


def package_version() -> str:
    """The version as written in its one source, read without importing anything."""
    tree = ast.parse((SRC / "gpufleet" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("src/gpufleet/_version.py assigns no __version__")


def package_files() -> set[str]:
    """What the wheel must hold of the package: every module and py.typed, as wheel paths."""
    files = {p.relative_to(SRC).as_posix() for p in (SRC / "gpufleet").rglob("*.py")}
    return files | {"gpufleet/py.typed"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would let a subprocess see the checkout or this venv's
    packages, or change how gpufleet runs."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "MLFLOW_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(dropped) and not k.startswith("GPUFLEET_")}
    return env | extra


def run(argv: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run argv, failing with its output (the last part, where the reason is) if it fails."""
    argv = [str(a) for a in argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          **kwargs)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{output}", pytrace=False)
    return proc


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) built from the checkout as ``python -m build`` builds a release: the
    sdist first, then the wheel from the unpacked sdist, each in an isolated environment."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, REPO], BUILD_TIMEOUT_S,
        env=clean_env())
    version = package_version()
    sdist, wheel = out / f"gpufleet-{version}.tar.gz", out / f"gpufleet-{version}-py3-none-any.whl"
    assert sorted(out.iterdir()) == sorted([sdist, wheel]), list(out.iterdir())
    return sdist, wheel


def test_extras_named_in_install_hints_exist():
    """Every ``pip install gpufleet[x]`` an error message, the README, the docs or an example
    tells a user to run names extras that exist."""
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    hint = re.compile(r"pip install[^\n`]*?(?:gpufleet|\.)\[([\w,-]+)\]")
    texts = [*SRC.rglob("*.py"), REPO / "README.md", *(REPO / "docs").glob("*.md"),
             *(REPO / "examples").rglob("*.py"), *(REPO / "examples").rglob("*.md"),
             *(REPO / "docker").glob("*")]
    named = {}
    for path in texts:
        for match in hint.finditer(path.read_text(errors="replace")):
            for extra in match.group(1).split(","):
                named.setdefault(extra, path.relative_to(REPO).as_posix())
    assert named, "no install hint found: the pattern no longer matches how hints are written"
    unknown = {extra: where for extra, where in named.items() if extra not in extras}
    assert not unknown, f"install hints name extras pyproject.toml lacks: {unknown}"


@pytest.mark.timeout(BUILD_TIMEOUT_S + 120)
def test_sdist_and_wheel_pass_twine_and_hold_the_package(dists):
    sdist, wheel = dists
    checked = run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel], 120,
                  env=clean_env())
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"gpufleet-{package_version()}.dist-info"
        license_text = zf.read(f"{info}/licenses/LICENSE").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    shipped = {n for n in names if not n.startswith(f"{info}/")}
    assert shipped == package_files(), (
        f"missing from the wheel: {sorted(package_files() - shipped)}; "
        f"not part of the package: {sorted(shipped - package_files())}")
    assert license_text == (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert f"\nVersion: {package_version()}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata

    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for name in ("LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml",
                 "examples/hello_world.py", *(f"src/{f}" for f in package_files())):
        assert name in members, f"{name} is missing from {sdist.name}"
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


@pytest.mark.timeout(BUILD_TIMEOUT_S + INSTALL_TIMEOUT_S + 3 * RUN_TIMEOUT_S)
def test_wheel_in_a_fresh_venv_runs_hello_world(dists):
    _, wheel = dists
    # A temporary folder outside the repository: nothing of the checkout can be imported by
    # accident; deleted at the end, because the environment holds torch and its CUDA libraries.
    with tempfile.TemporaryDirectory(prefix="gpufleet-wheel-") as tmp:
        tmp = Path(tmp)
        assert REPO not in tmp.parents, f"{tmp} is inside the repository"
        venv, work = tmp / "venv", tmp / "work"
        work.mkdir()
        python, env = venv / "bin" / "python", clean_env(GPUFLEET_HOME=str(tmp / "home"))
        run([sys.executable, "-m", "venv", venv], 120, env=env)
        run([python, "-m", "pip", "install", "--no-input", "--progress-bar", "off", wheel],
            INSTALL_TIMEOUT_S, env=env, cwd=work)

        imported = run([python, "-c", IMPORT_EVERY_MODULE], RUN_TIMEOUT_S, env=env, cwd=work)
        where = Path(imported.stdout.strip()).resolve()
        assert where.is_relative_to(venv.resolve()), f"gpufleet imported from {where}"

        hello = run([python, REPO / "examples" / "hello_world.py"], RUN_TIMEOUT_S, env=env,
                    cwd=work)
        check_hello_output(hello.stdout)

        version = run([venv / "bin" / "gpufleet", "--version"], 60, env=env, cwd=work)
        assert version.stdout.strip() == f"gpufleet {package_version()}"


# Imports every module of the installed package (a core dependency missing from the metadata
# fails here) and prints where the package was found. The integrations import their framework,
# an extra the fresh environment has not installed: each says which, as its ImportError.
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, gpufleet
for module in pkgutil.walk_packages(gpufleet.__path__, "gpufleet."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except ImportError as exc:
        if not module.name.startswith("gpufleet.integrations.") or "pip install" not in str(exc):
            raise
print(gpufleet.__file__)
"""


def check_hello_output(stdout: str) -> None:
    """What a user sees: each rank's greeting, every rank counted by the all-reduce, and the
    list of ranks in order (two CPU ranks without GPUs, one per GPU with them)."""
    greetings = re.findall(r"^\[rank (\d+)\] hello from rank (\d+) of (\d+) on \S+; "
                           r"all-reduce counted (\d+) ranks$", stdout, re.MULTILINE)
    assert greetings, stdout
    world = int(greetings[0][2])
    assert sorted(int(g[0]) for g in greetings) == list(range(world)), stdout
    assert all(g[0] == g[1] and int(g[2]) == int(g[3]) == world for g in greetings), stdout
    assert re.search(rf"^ranks: {re.escape(str(list(range(world))))}$", stdout, re.MULTILINE), \
        stdout
