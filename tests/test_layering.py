"""Who may import what: gpufleet is grouped by the process a file runs in.

- The caller's side: ``gpufleet.api``, ``gpufleet.cli``, ``gpufleet.runs`` (a run, its record,
  its handle, the background supervisor), ``gpufleet.watch`` (the watcher) and the launchers
  that start ranks (the ``gpufleet.launchers`` registry, ``base``, ``local``, ``warm``, ``ray``,
  ``hardware``, ``devices``, ...).
- The rank's side: ``gpufleet.rank``, ``gpufleet.runtime``, ``gpufleet.data``,
  ``gpufleet.strategies``, ``gpufleet.checkpoint``, and the launcher parts that run in processes
  of their own (``launchers._elastic_agent`` and its ``_rendezvous``, ``_template``,
  ``_template_server`` and its ``_template_wire``, ``_ray_node``).
- Shared by both: ``errors``, ``options``, ``payload``, ``rundir``, ``timings``, ``tracking``,
  ``telemetry`` and the private helpers at the top (``gpufleet._environ``, ...).

The rules:

1. Rank-side code never imports caller-side code: what runs in a rank does not depend on how
   the rank was started or watched.
2. The watcher knows jobs, never a concrete launcher: ``gpufleet.watch`` imports from
   ``gpufleet.launchers`` only the interface, ``gpufleet.launchers.base``.
3. A private name (``_module`` or ``_function``) belongs to the package that holds it and is
   imported only from inside that package: ``gpufleet._environ`` anywhere in gpufleet,
   ``gpufleet.launchers._ray_job`` only from ``gpufleet.launchers``.

The source is read, not imported. Imports inside functions and under ``if TYPE_CHECKING:``
count; a module picked by a computed name (the launcher registry's ``importlib.import_module``)
is not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from support import REPO

SRC = REPO / "src"

RANK_SIDE = ("gpufleet.rank", "gpufleet.runtime", "gpufleet.data", "gpufleet.strategies",
             "gpufleet.checkpoint", "gpufleet.integrations.huggingface", "gpufleet.integrations.lightning")
# Launcher parts that run in processes of their own, beside the ranks rather than the caller.
PROCESS_SIDE_LAUNCHER_PARTS = ("gpufleet.launchers._elastic_agent", "gpufleet.launchers._template",
                               "gpufleet.launchers._ray_node", "gpufleet.launchers._template_server",
                               "gpufleet.launchers._template_wire", "gpufleet.launchers._rendezvous")
# Every other module under gpufleet.launchers (the registry included) is caller side.
CALLER_SIDE = ("gpufleet.api", "gpufleet.cli", "gpufleet.flags", "gpufleet.__main__", "gpufleet.runs",
               "gpufleet.watch", "gpufleet.launchers", "gpufleet.integrations.optuna")
SHARED = ("gpufleet", "gpufleet.errors", "gpufleet.options", "gpufleet.payload", "gpufleet.rundir",
          "gpufleet.timings", "gpufleet.tracking", "gpufleet.telemetry", "gpufleet.steps", "gpufleet._environ",
          "gpufleet._process", "gpufleet._stacks", "gpufleet._version", "gpufleet._log", "gpufleet.integrations",
          "gpufleet.flops", "gpufleet.peaks")
# Packages shared whole: the memory estimate (the command line's and the ranks') and its helper.
SHARED_PACKAGES = ("gpufleet.memory",)
LAUNCHER_INTERFACE = "gpufleet.launchers.base"


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module: "gpufleet.runs.handles"
    name: str  # what it imports, resolved: a module, or "module.name" for a name in a module

    def __str__(self) -> str:
        return f"{self.importer}: {self.name}"


# ---------------------------------------------------------------------------- the source tree


def module_path(module: str) -> Path | None:
    """The file of a gpufleet module or package, or None when `module` is not one."""
    base = SRC.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_module(name: str) -> bool:
    return module_path(name) is not None


def is_package(name: str) -> bool:
    path = module_path(name)
    return path is not None and path.name == "__init__.py"


def source_files() -> dict[str, Path]:
    """Every module of gpufleet by name: {"gpufleet.runs.handles": .../runs/handles.py}."""
    files = {}
    for path in sorted((SRC / "gpufleet").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def module_of(name: str) -> str:
    """The module an imported name lives in: itself when it is a module."""
    return name if is_module(name) else name.rpartition(".")[0]


# ---------------------------------------------------------------------------- the walker


def imports_in(importer: str, source: str) -> list[Import]:
    """Every import of a gpufleet module or name in `source`, anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(importer, node)
            # ``from a.b import c``: c is the submodule a.b.c or a name in a.b; the dotted name
            # is the same and is_module() tells them apart
            found += [base if alias.name == "*" else f"{base}.{alias.name}"
                      for alias in node.names]
    return [Import(importer, name) for name in found if within(name, "gpufleet")]


def _from_base(importer: str, node: ast.ImportFrom) -> str:
    """The module of ``from BASE import ...``, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


@cache
def all_imports() -> tuple[Import, ...]:
    found = []
    for module, path in source_files().items():
        found += imports_in(module, path.read_text())
    return tuple(found)


def offending(pairs) -> str:
    return "\n".join(sorted({str(p) for p in pairs}))


# ---------------------------------------------------------------------------- the sides


def is_rank_side(module: str) -> bool:
    return (any(within(module, p) for p in RANK_SIDE)
            or module in PROCESS_SIDE_LAUNCHER_PARTS)


def is_caller_side(module: str) -> bool:
    return (any(within(module, p) for p in CALLER_SIDE)
            and module not in PROCESS_SIDE_LAUNCHER_PARTS)


def private_owners(name: str) -> list[str]:
    """The package that owns each private part of a dotted name: for a module ``a.b._m``,
    ``a.b``; for a name ``_x`` defined in module ``a.b.m``, ``a.b`` (in package ``a.b``'s
    ``__init__``, ``a.b``)."""
    parts = name.split(".")
    owners = []
    for i, part in enumerate(parts[1:], start=1):
        if not part.startswith("_") or (part.startswith("__") and part.endswith("__")):
            continue
        holder = ".".join(parts[:i])  # the module or package the private part sits in
        owners.append(holder if is_package(holder) else holder.rpartition(".")[0])
    return owners


# ---------------------------------------------------------------------------- the rules


def test_rank_side_never_imports_caller_side():
    bad = [imp for imp in all_imports()
           if is_rank_side(imp.importer) and is_caller_side(module_of(imp.name))]
    assert not bad, (
        "rank-side modules (and launcher parts that run in processes of their own) import "
        "caller-side modules:\n" + offending(bad)
    )


def test_watcher_knows_only_the_launcher_interface():
    bad = [imp for imp in all_imports()
           if within(imp.importer, "gpufleet.watch")
           and within(module_of(imp.name), "gpufleet.launchers")
           and module_of(imp.name) != LAUNCHER_INTERFACE]
    assert not bad, (
        f"gpufleet.watch imports concrete launchers (only {LAUNCHER_INTERFACE} is allowed):\n"
        + offending(bad)
    )


def test_private_names_stay_in_their_package():
    bad = [imp for imp in all_imports()
           if any(not within(imp.importer, owner) for owner in private_owners(imp.name))]
    assert not bad, "private names imported from outside their package:\n" + offending(bad)


# ---------------------------------------------------------------------------- the walker sees


def test_walker_sees_every_kind_of_import():
    source = (
        "import gpufleet.errors\n"
        "from gpufleet.launchers import _ray_node, for_run\n"
        "from . import _environ\n"
        "from .runs.handles import Run\n"
        "import os\n"
        "if TYPE_CHECKING:\n"
        "    from gpufleet.launchers.base import Job\n"
        "def f():\n"
        "    from gpufleet.watch.monitor import _hidden\n"
    )
    names = sorted(imp.name for imp in imports_in("gpufleet.api", source))
    assert names == ["gpufleet._environ", "gpufleet.errors", "gpufleet.launchers._ray_node",
                     "gpufleet.launchers.base.Job", "gpufleet.launchers.for_run",
                     "gpufleet.runs.handles.Run", "gpufleet.watch.monitor._hidden"]
    assert module_of("gpufleet.launchers._ray_node") == "gpufleet.launchers._ray_node"
    assert module_of("gpufleet.launchers.for_run") == "gpufleet.launchers"
    assert private_owners("gpufleet.launchers._ray_node") == ["gpufleet.launchers"]
    assert private_owners("gpufleet.watch.monitor._hidden") == ["gpufleet.watch"]
    assert private_owners("gpufleet._environ") == ["gpufleet"]
    assert private_owners("gpufleet.__version__") == []


def test_walker_finds_the_real_imports():
    api_imports = {module_of(imp.name) for imp in all_imports() if imp.importer == "gpufleet.api"}
    assert any(within(m, "gpufleet.runs") for m in api_imports), api_imports
    assert len(all_imports()) > 100, "the walker found too few imports to check anything"


def test_every_named_part_exists():
    named = (*RANK_SIDE, *PROCESS_SIDE_LAUNCHER_PARTS, *CALLER_SIDE, *SHARED, *SHARED_PACKAGES, LAUNCHER_INTERFACE)
    missing = [name for name in named if not is_module(name)]
    assert not missing, f"modules or packages named by the layering rules are missing: {missing}"
    for package in ("gpufleet.runs", "gpufleet.launchers", "gpufleet.watch", "gpufleet.rank",
                    "gpufleet.strategies", "gpufleet.checkpoint"):
        assert is_package(package), f"{package} should be a package (a folder with __init__.py)"


def test_every_module_has_a_side():
    """A new module is placed deliberately: on the rank's side, the caller's, or shared."""
    homeless = [m for m in source_files()
                if not (is_rank_side(m) or is_caller_side(m) or m in SHARED
                        or any(within(m, p) for p in SHARED_PACKAGES))]
    assert not homeless, (
        f"modules on no side (add them to a side in {Path(__file__).name}): {homeless}"
    )
