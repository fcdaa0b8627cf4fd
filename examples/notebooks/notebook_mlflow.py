"""How the example notebooks end: rank 0 logs the trained model into the call's MLflow run, from
inside the distributed function, and the notebook loads it back by its run id.

Every rank of a tracked call gets MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID
(docs/tracking.md), so `mlflow.start_run()` on a rank resumes the call's own run rather than
starting one of its own.
"""

from __future__ import annotations

import inspect
import os
from importlib.metadata import version

import torch

from gpufleet import runtime


def log_model(model: torch.nn.Module | None, inputs: dict[str, torch.Tensor] | None = None, *,
              name: str = "model", requirements: tuple[str, ...] = ()) -> str | None:
    """Call it on every rank after training: rank 0 logs its ``model`` into the call's MLflow
    run, to be loaded as ``runs:/<run id>/<name>``. Every rank returns that run id, or None when
    the call is not tracked (MLflow is not installed, or tracking is off).

    With ``inputs`` (example inputs by argument name, each a batch of more than one) the model
    is saved as a graph traced by torch.export (MLflow's "pt2" format): loading it needs torch
    alone and unpickles no code. Without, as a pickle of the module, whose classes must import
    where it is loaded: ``requirements`` names the packages they come from.
    """
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id is None or not runtime.is_main_process():
        return run_id
    import mlflow
    import mlflow.pytorch

    model = model.to("cpu").eval()  # loads on any machine; no dropout in the traced graph
    # Named, so that MLflow does not infer them: that loads the model in a new Python process.
    pinned = [f"{package}=={version(package).split('+')[0]}" for package in requirements]
    options = {"pip_requirements": mlflow.pytorch.get_default_pip_requirements() + pinned}
    accepts = inspect.signature(mlflow.pytorch.log_model).parameters
    options["name" if "name" in accepts else "artifact_path"] = name  # MLflow 3, MLflow 2
    if "serialization_format" in accepts:  # older MLflow pickles, and has no other format
        options["serialization_format"] = "pt2" if inputs else "pickle"
        if inputs:
            options.update(graph_inputs(inputs))
    with mlflow.start_run():  # the call's run (MLFLOW_RUN_ID), resumed
        mlflow.pytorch.log_model(model, **options)
    return run_id


def graph_inputs(inputs: dict[str, torch.Tensor]) -> dict:
    """The example input and signature torch.export traces the model with; the first dimension
    of each input (the batch) may take any size."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    arrays = {key: tensor.detach().cpu().numpy() for key, tensor in inputs.items()}
    specs = [TensorSpec(a.dtype, (-1, *a.shape[1:]), key) for key, a in arrays.items()]
    return {"input_example": tuple(arrays.values()), "signature": ModelSignature(inputs=Schema(specs))}
