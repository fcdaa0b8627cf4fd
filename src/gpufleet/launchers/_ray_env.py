"""What a remote run ships to the cluster, and the check that the nodes can run what it ships.

Ray's runtime_env carries the code and the packages: gpufleet itself, the caller's own
modules, the working directory, and (opt-in) the caller's pip packages. gpufleet decides what
goes in and uploads it once per call; the nodes' Python and torch must match the caller's,
since the function travels as bytecode and its tensors as torch's pickles.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import gpufleet
from gpufleet import _environ
from gpufleet.errors import ConfigError
from gpufleet.launchers._ray_node import version

# The cluster's own packages: pinning the caller's copies would replace the nodes' builds
# (a CPU torch onto GPU nodes, another Ray than the cluster runs).
# What the cluster's image owns: Ray and what its workers run on, and torch with the builds
# tied to its ABI and CUDA release; pinning the caller's copies would replace them.
_CLUSTER_OWN = {"ray", "torch", "torchvision", "torchaudio", "triton", "xformers", "flash-attn",
                "flash_attn", "deepspeed", "bitsandbytes", "grpcio", "protobuf", "pydantic",
                "pydantic-core", "aiohttp", "gpufleet", "pip", "setuptools", "wheel"}
_CLUSTER_OWN_PREFIXES = ("nvidia-",)
_GPUFLEET_DIR = str(Path(gpufleet.__file__).resolve().parent)
DEFAULT_EXCLUDES = ["__pycache__", "*.pyc", ".ipynb_checkpoints"]


def build(options, cwd: Path) -> tuple[dict, list[str]]:
    """The runtime_env of every rank's actor (local paths, uploaded by ``upload``), and
    notes for the user about what was left out."""
    user = dict(options.runtime_env or {})
    notes: list[str] = []
    if _environ.in_ray_job():  # the job shipped it all once (runs/cluster.py); actors inherit it
        return ({"env_vars": user["env_vars"]} if user.get("env_vars") else {}), notes
    if "working_dir" in user:
        working_dir = user.pop("working_dir")  # a path or URI, or None: ship none
        working_dir = None if working_dir is None else str(working_dir)
    elif cwd == Path.home() or cwd == Path(cwd.anchor):
        working_dir = None
        notes.append(
            f"the working directory {cwd} is not shipped to the cluster (a home folder or a "
            "disk's root); pass runtime_env={'working_dir': PATH} to ship one"
        )
    else:
        working_dir = str(cwd)
    skip = Path(working_dir).resolve() if working_dir and "://" not in working_dir else None
    env: dict[str, Any] = {
        "py_modules": [_GPUFLEET_DIR, *local_modules(skip), *_listed(user, "py_modules")],
        "excludes": DEFAULT_EXCLUDES + _listed(user, "excludes"),
    }
    if working_dir:
        env["working_dir"] = working_dir
    if options.pip:
        packages = pip_snapshot() if options.pip is True else list(options.pip)
        env["pip"] = {"packages": packages, "pip_check": False}
    env.update(user)
    return env, notes


def _listed(user: dict, key: str) -> list:
    """A list field of the user's runtime_env, added to gpufleet's own entries."""
    value = user.pop(key, [])
    if isinstance(value, (str, os.PathLike)) or not isinstance(value, (list, tuple)):
        example = {"py_modules": "['/path/to/package']", "excludes": "['data/', '*.ckpt']"}[key]
        raise ConfigError(f"runtime_env={{'{key}': {value!r}}} must be a list, e.g. {example}")
    return list(value)


def local_modules(skip_dir: Path | None) -> list[str]:
    """The caller's own top-level modules and packages (imported, outside the installed
    packages and the standard library), for py_modules: a function that uses them pickles
    them by reference, so the ranks must be able to import them. Those directly in
    ``skip_dir`` (the working directory, shipped whole) are left out."""
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.__file__),
                       _GPUFLEET_DIR})
    found: dict[str, str] = {}  # name: what to ship
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        # __main__ (and multiprocessing's alias of it) travels by value, with the function
        if "." in name or name in ("__main__", "__mp_main__") or not path:
            continue
        path = os.path.realpath(path)
        if path.startswith(installed) or "site-packages" in path or "dist-packages" in path:
            continue
        folders = list(getattr(module, "__path__", None) or [])
        if folders:
            if len(folders) != 1:  # a namespace package spread over folders: Ray ships one
                continue
            target = Path(os.path.realpath(folders[0]))
        elif path.endswith(".py"):
            target = Path(path)
        else:  # a compiled extension beside the script: no source to ship
            continue
        if skip_dir is None or target.parent != skip_dir:
            found[name] = str(target)
    if found:  # asked only then: reading every distribution's metadata takes a while
        packaged = _installed_names()
        found = {name: target for name, target in found.items() if name not in packaged}
    return sorted(found.values())


def _installed_names() -> set[str]:
    """Top-level modules that an installed distribution provides, wherever it was installed
    (``pip install --target DIR`` on PYTHONPATH too, which no site-packages path reveals),
    except editable installs: those are the caller's own project, and travel."""
    names = set()
    for name, dists in importlib.metadata.packages_distributions().items():
        if not all(_editable(dist) for dist in dists):
            names.add(name)
    return names


def _editable(dist_name: str) -> bool:
    try:
        origin = importlib.metadata.distribution(dist_name).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    return origin is not None and bool(json.loads(origin).get("dir_info", {}).get("editable", False))


def pip_snapshot() -> list[str]:
    """This environment's distributions as requirements (``name==version``, or ``name @ URL``
    for those installed from a URL), like a notebook's environment snapshot. Left out: the
    cluster's own packages (Ray and what its workers run on, torch and builds tied to it), local
    versions (``+cu124``) and anything installed from a
    local folder or file, editable installs included, which no other machine can install
    (ship such code with runtime_env={'py_modules': [...]})."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        key = (name or "").lower().replace("_", "-")
        if not key or key in found or key in _CLUSTER_OWN or key.startswith(_CLUSTER_OWN_PREFIXES):
            continue
        requirement = _requirement(name, dist)
        if requirement:
            found[key] = requirement
    return sorted(found.values())


def _requirement(name: str, dist) -> str | None:
    origin = dist.read_text("direct_url.json")
    if not origin:
        # a local version (torchvision 0.21.0+cu124) names a build from some other index:
        # the nodes keep theirs
        return None if "+" in dist.version else f"{name}=={dist.version}"
    info = json.loads(origin)
    url = info.get("url", "")
    if url.startswith("file:"):
        return None
    vcs = info.get("vcs_info")
    if vcs:
        return f"{name} @ {vcs['vcs']}+{url}@{vcs.get('commit_id', '')}".rstrip("@")
    return f"{name} @ {url}"


def upload(runtime_env: dict) -> dict:
    """Upload the local paths of ``runtime_env`` to the cluster once, and return it with Ray's
    URIs in their place. Ray takes local paths only in ``ray.init``'s job-wide runtime_env; a
    call that joins a connection made earlier (a notebook's) must upload them itself, with the
    functions ``ray.init`` uses."""
    import ray
    from ray.exceptions import RuntimeEnvSetupError
    from ray.runtime_env import RuntimeEnv

    try:  # the helpers ray.init uses; private, so checked
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    except ImportError as exc:
        raise ConfigError(
            f"this Ray ({ray.__version__}) lacks the runtime_env upload gpufleet uses ({exc}); "
            "install the Ray release gpufleet supports: pip install 'gpufleet[ray]'"
        ) from exc
    try:
        with tempfile.TemporaryDirectory(prefix="gpufleet-upload-") as scratch:
            env = upload_py_modules_if_needed(
                dict(runtime_env), include_gitignore=True, scratch_dir=scratch
            )
            env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
        env.pop("excludes", None)  # applied while packing
        RuntimeEnv(**env)  # Ray's own validation, before anything starts
    except (ValueError, TypeError, OSError, RuntimeEnvSetupError) as exc:
        raise ConfigError(
            f"the runtime_env for the cluster cannot be built: {type(exc).__name__}: {exc}. "
            "Large folders: add them to .gitignore or runtime_env={'excludes': [...]}; "
            "runtime_env={'working_dir': None} ships no working directory"
        ) from exc
    return env


def check_versions(nodes: dict[str, dict]) -> None:
    """Raise ConfigError unless every node (``label -> description``) runs this process's
    Python (major.minor) and torch release, and has cloudpickle."""
    python = _minor(platform.python_version())
    torch = _release(version("torch"))
    wrong = []
    for label, node in nodes.items():
        found = []
        if _minor(node["python"]) != python:
            found.append(f"Python {node['python']}")
        if _release(node["torch"]) != torch:
            found.append(f"torch {node['torch']}" if node["torch"] else "no torch")
        if node["cloudpickle"] is None:
            found.append("no cloudpickle")
        if found:
            wrong.append(f"{label}: {', '.join(found)}")
    if wrong:
        raise ConfigError(
            f"the cluster's nodes must run what this process runs (Python {python}, torch "
            f"{torch}, cloudpickle): the function travels as Python bytecode and tensors as "
            f"torch's pickles. Found {'; '.join(wrong)}. Install the same versions on the nodes "
            "(their image or environment), or choose one with runtime_env= (e.g. a container "
            "image or conda environment)"
        )


def origin() -> dict[str, str]:
    """What pickled a call here, for ``check_submitter`` on the cluster."""
    return {"python": platform.python_version(), "torch": version("torch") or "none"}


def check_submitter(python: str, torch: str | None) -> None:
    """In a run's Ray job (``runs/cluster_job.py``): ConfigError unless this node runs the
    submitter's Python (major.minor) and torch release, which pickled the call."""
    here = origin()
    wrong = []
    if _minor(python) != _minor(here["python"]):
        wrong.append(f"Python {here['python']} (the submitter: {python})")
    if _release(torch) != _release(here["torch"]):
        wrong.append(f"torch {here['torch'] or 'missing'} (the submitter: {torch})")
    if wrong:
        raise ConfigError(
            f"the Ray cluster's head {platform.node()} runs {', '.join(wrong)}: the call travels "
            "as Python bytecode and tensors as torch's pickles, so submit from an environment "
            "with the cluster's Python (major.minor) and torch release"
        )


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _release(version: str | None) -> str | None:
    """``2.14.1+cu130`` → ``2.14.1``: builds for CPU and for GPUs of one release mix fine."""
    return version.split("+", 1)[0] if version else None
