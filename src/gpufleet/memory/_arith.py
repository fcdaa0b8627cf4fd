"""The bytes each strategy keeps on one GPU besides activations: weights, gradients, optimizer
state, the optimizer step's temporaries, and the framework's own. Pure arithmetic on counts
of parameters, so that every rule is written once, stated in ``notes``, and checked by hand in
tests/test_memory_estimate.py.

Sizes follow what gpufleet's strategies build (docs/memory.md, "What is counted"):

- ``ddp``: every rank holds the whole model, its gradients (DDP's buckets are the gradients:
  ``gradient_as_bucket_view=True``) and the optimizer state. Under bf16 the weights stay in
  their dtype and autocast's bf16 copies are activations, found by the trace.
- ``fsdp`` (FSDP2): parameters, gradients and optimizer state sharded over the ranks; while a
  block computes its parameters are gathered in the compute dtype (the block and the next one,
  prefetched, plus the parts outside the blocks); a block's gradients are whole, then reduced
  in fp32, before they are sharded. With one rank nothing reshards: the whole model is gathered.
  CPU offload keeps the shards and the optimizer in host memory.
- ``zero1/2/3`` (DeepSpeed): under bf16 the module's weights are bf16 and the optimizer holds fp32
  master weights beside its state; stage 1 partitions the optimizer, 2 also the gradients, 3 also
  the weights; DeepSpeed's buckets (reduce and all-gather, 5e8 elements by default) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.errors import ConfigError

GIB = 2**30
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
PRECISIONS = ("bf16", "fp32")
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer state per trainable parameter, in units of the state's element size.
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "adam8bit": 0}
ADAM8BIT_BYTES = 2  # two 1-byte states (the block-wise scales are under 1% of that)

CUDA_CONTEXT = int(0.5 * GIB)  # the CUDA context, kernels and cuBLAS workspaces of a process
NCCL_BUFFERS = int(0.5 * GIB)  # NCCL's communicators and buffers, with more than one rank
FRAGMENTATION = 0.10  # of activations and gathered parameters: the caching allocator's slack
ZERO_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size and allgather_bucket_size (elements)


@dataclass(frozen=True)
class Counts:
    """A model's parameters, as the arithmetic needs them."""

    parameters: int
    trainable: int
    unit: int  # parameters of its largest repeated block (one FSDP unit); 0 when none
    unit_trainable: int
    blocks: int  # parameters inside the repeated blocks (the rest is gathered with the root)
    weight_bytes: int  # per parameter, as stored (fp32: 4)


@dataclass(frozen=True)
class Setup:
    strategy: str
    world_size: int
    precision: str  # "bf16": compute in bf16 (mixed precision); "fp32"
    optimizer: str
    offload: bool


@dataclass(frozen=True)
class Static:
    """Bytes on one GPU for everything but activations."""

    weights: int
    grads: int
    optimizer: int
    step: int  # the optimizer step's temporaries (activations are freed by then)
    gathered: int  # weights and gradients held whole for a while (part of weights and grads)
    overhead: int  # the CUDA context, NCCL
    notes: tuple[str, ...]


def check_setup(setup: Setup) -> None:
    if setup.strategy not in STRATEGIES:
        raise ConfigError(f"strategy={setup.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if isinstance(setup.world_size, bool) or not isinstance(setup.world_size, int) or setup.world_size < 1:
        raise ConfigError(f"world_size={setup.world_size!r} must be a whole number ≥ 1")
    if setup.precision not in PRECISIONS:
        raise ConfigError(f"precision={setup.precision!r} must be 'bf16' (mixed precision: weights in "
                          "their dtype, compute in bf16) or 'fp32'")
    if setup.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={setup.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if setup.offload and setup.strategy == "ddp":
        raise ConfigError("offload=True needs a sharded strategy: 'fsdp' (CPU offload) or 'zero1/2/3' "
                          "(optimizer offload; 'zero3' also offloads parameters)")


def static(counts: Counts, setup: Setup) -> Static:
    """Everything but activations, per GPU."""
    check_setup(setup)
    overhead = CUDA_CONTEXT + (NCCL_BUFFERS if setup.world_size > 1 else 0)
    if setup.strategy == "ddp":
        parts = _ddp(counts, setup)
    elif setup.strategy == "fsdp":
        parts = _fsdp(counts, setup)
    else:
        parts = _zero(counts, setup, int(setup.strategy[-1]))
    notes = (*parts.notes, f"CUDA context {CUDA_CONTEXT / GIB:.1f} GiB"
             + (f", NCCL {NCCL_BUFFERS / GIB:.1f} GiB" if setup.world_size > 1 else ""),
             f"allocator slack {FRAGMENTATION:.0%} of activations and gathered parameters")
    return Static(parts.weights, parts.grads, parts.optimizer, parts.step, parts.gathered, overhead, notes)


def state_bytes(counts: Counts, setup: Setup) -> tuple[int, int]:
    """The optimizer's bytes per trainable parameter: its state, and its step's temporaries
    (torch's foreach Adam makes one state-sized copy)."""
    element = counts.weight_bytes  # torch keeps a state in its parameter's dtype
    slots = OPTIMIZERS[setup.optimizer]
    if setup.optimizer == "adam8bit":
        return ADAM8BIT_BYTES, 0
    return slots * element, (element if slots == 2 else 0)


def _ddp(counts: Counts, setup: Setup) -> Static:
    state, temp = state_bytes(counts, setup)
    w = counts.weight_bytes
    return Static(
        weights=w * counts.parameters, grads=w * counts.trainable,
        optimizer=state * counts.trainable, step=temp * counts.trainable, gathered=0, overhead=0,
        notes=(f"weights {w} B/parameter, gradients {w} B/trainable parameter (DDP's buckets), "
               f"optimizer {state} B/trainable parameter",),
    )


def _fsdp(counts: Counts, setup: Setup) -> Static:
    n, w = setup.world_size, counts.weight_bytes
    compute = 2 if setup.precision == "bf16" else w
    state, temp = state_bytes(counts, setup)
    if n == 1:  # nothing reshards with one rank: every unit stays gathered
        gathered = compute * counts.parameters
    else:
        gathered = compute * (counts.parameters - counts.blocks + 2 * counts.unit)
    whole_grads = (compute + (4 if compute != 4 else 0)) * counts.unit_trainable  # one unit's, reduced in fp32
    if setup.offload:
        note = "sharded weights, gradients and optimizer state in host memory (CPU offload)"
        return Static(weights=gathered, grads=whole_grads, optimizer=0, step=0,
                      gathered=gathered + whole_grads, overhead=0, notes=(note,))
    return Static(
        weights=_shard(w * counts.parameters, n) + gathered,
        grads=_shard(w * counts.trainable, n) + whole_grads,
        optimizer=_shard(state * counts.trainable, n), step=_shard(temp * counts.trainable, n),
        gathered=gathered + whole_grads, overhead=0,
        notes=(f"weights, gradients and optimizer state sharded over {n} rank{'s' if n > 1 else ''}; "
               f"gathered in {'bf16' if compute == 2 else 'fp32'}: "
               + ("the whole model (one rank)" if n == 1 else "2 blocks and the parts outside blocks"),),
    )


def _zero(counts: Counts, setup: Setup, stage: int) -> Static:
    n, p, t = setup.world_size, counts.parameters, counts.trainable
    mixed = setup.precision == "bf16"
    module = 2 if mixed else counts.weight_bytes  # DeepSpeed's bf16 casts the module to bf16
    state, _ = state_bytes(Counts(p, t, 0, 0, 0, 4), setup)  # fp32 state, as DeepSpeed keeps it
    master = 4 if mixed else 0  # fp32 master weights beside a bf16 module
    weights = _shard(module * p, n) if stage == 3 else module * p
    grads = _shard(module * t, n) if stage >= 2 else module * t
    grads += _shard(4 * t, n) if mixed else 0  # the fp32 gradient of each rank's partition
    optimizer = 0 if setup.offload else _shard((master + state) * t, n)
    gathered = module * (p - counts.blocks + 2 * counts.unit) if stage == 3 else 0
    buckets = module * (min(ZERO_BUCKET, t) + (min(ZERO_BUCKET, p) if stage < 3 else 0))
    if setup.offload and stage == 3:
        weights = 0
    return Static(
        weights=weights + gathered, grads=grads + buckets, optimizer=optimizer, step=0,
        gathered=gathered, overhead=0,
        notes=(f"ZeRO-{stage} over {n} rank{'s' if n > 1 else ''}: module in {'bf16' if module == 2 else 'fp32'}"
               + (", fp32 master weights in the optimizer" if mixed else "")
               + (", optimizer state in host memory" if setup.offload else "")
               + (", parameters in host memory" if setup.offload and stage == 3 else "")
               + f"; DeepSpeed's buckets {buckets / GIB:.2f} GiB",),
    )


def _shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)  # the first ranks hold the larger shards
