"""Memory: will a training step fit, before anything starts; and a CUDA out-of-memory error that
shrinks the micro-batch on every rank instead of ending the run.

    from gpufleet import memory

    print(memory.estimate("config.json", "fsdp", world_size=8, micro_batch=4, seq_len=4096))

    batches = memory.MicroBatches(trainer, micro_batch=8)      # inside a rank
    for batch in loader:
        loss = batches.step(batch, lambda micro: loss_fn(trainer.model(micro["x"]), micro["y"]))

- ``estimate`` (``estimate.py``): weights, gradients, optimizer state per strategy
  (``_arith.py``), activations traced from the model (``_trace.py``, ``_model.py``; a stated
  formula where no trace is possible, ``_formula.py``), the largest micro-batch per common GPU
  (``_gpus.py``); the result's table, HTML and JSON (``_result.py``).
- the check before the first step (``check.py``): each rank against its GPU's free memory.
- ``MicroBatches`` (``batches.py``, with ``_drivers.py``): the step in micro-batches, the
  agreement after an OOM, the records of each shrink (``records.py``).

Importing this package imports neither torch nor Transformers; they come with the first call
that needs them.
"""

from __future__ import annotations

from gpufleet.memory._gpus import COMMON as GPUS
from gpufleet.memory._result import Estimate
from gpufleet.memory.batches import MicroBatches, MicroBatchFloorError
from gpufleet.memory.check import MemoryCheckError
from gpufleet.memory.estimate import estimate

__all__ = ["GPUS", "Estimate", "MemoryCheckError", "MicroBatchFloorError", "MicroBatches", "estimate"]
