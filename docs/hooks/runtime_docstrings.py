"""A griffe extension for the API page: docstrings that exist only at run time.

mkdocstrings reads the source without importing it, and a docstring assigned after the
definition (``distributed.__doc__ = f"..."``, which lists every option from ``OPTIONS``) is not
in the source. For each object named in ``objects`` that has no docstring in the source, this
imports its module and takes the docstring the object has at run time.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe


class RuntimeDocstrings(griffe.Extension):
    def __init__(self, objects: list[str]) -> None:
        super().__init__()
        self.objects = set(objects)

    def on_function(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.path not in self.objects or func.docstring is not None:
            return
        module, _, name = func.path.rpartition(".")
        doc = inspect.getdoc(getattr(importlib.import_module(module), name))
        if doc:
            func.docstring = griffe.Docstring(doc, parent=func)
