"""What an estimate says, and how it shows itself: a table in a terminal (rich) or plain text,
an HTML table in a notebook, a dict for JSON."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpufleet.memory._arith import FRAGMENTATION, GIB

MAX_MICRO_BATCH = 1 << 20  # the search for the largest micro-batch stops here


@dataclass(frozen=True)
class Estimate:
    """Peak memory of one GPU for one training step, in bytes, by part.

    ``weights``, ``grads``, ``optimizer`` (its state) and ``step`` (the optimizer step's
    temporaries, which come after the activations are freed) do not depend on the
    micro-batch; ``activations`` is ``activations_fixed + activations_per_sample ×
    micro_batch``: the working memory of the forward and backward pass. ``allocated`` is what
    ``torch.cuda.max_memory_allocated`` would show, ``reserved`` adds the caching allocator's
    slack, ``total`` the CUDA context and NCCL (what nvidia-smi shows). ``fits`` gives, for
    each GPU, the largest micro-batch whose total fits it (0: not even one sample).
    """

    model: str
    parameters: int
    trainable: int
    strategy: str
    world_size: int
    micro_batch: int
    seq_len: int | None
    precision: str
    dtype: str
    optimizer: str
    lora_rank: int | None
    activation_checkpointing: bool
    offload: bool
    weights: int
    grads: int
    optimizer_state: int
    step: int
    gathered: int
    overhead: int
    activations_fixed: int
    activations_per_sample: int
    traced: bool
    notes: tuple[str, ...]
    gpus: dict[str, int] = field(default_factory=dict)

    # -- the numbers ------------------------------------------------------------------------

    @property
    def activations(self) -> int:
        return self.activations_fixed + self.activations_per_sample * self.micro_batch

    @property
    def allocated(self) -> int:
        return self.weights + self.grads + self.optimizer_state + max(self.activations, self.step)

    @property
    def slack(self) -> int:
        return int(FRAGMENTATION * (self.activations + self.gathered))

    @property
    def reserved(self) -> int:
        return self.allocated + self.slack

    @property
    def total(self) -> int:
        return self.reserved + self.overhead

    @property
    def fits(self) -> dict[str, int]:
        return {name: self.largest_micro_batch(size) for name, size in self.gpus.items()}

    def at(self, micro_batch: int) -> Estimate:
        """The same estimate at another micro-batch."""
        return dataclasses.replace(self, micro_batch=micro_batch)

    def largest_micro_batch(self, capacity: int) -> int:
        """The largest micro-batch whose total fits in ``capacity`` bytes (0: none does)."""
        if self.at(1).total > capacity:
            return 0
        if self.activations_per_sample <= 0:
            return MAX_MICRO_BATCH
        low, high = 1, 2
        while high < MAX_MICRO_BATCH and self.at(high).total <= capacity:
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.at(middle).total <= capacity else (low, middle)
        return low

    # -- how it shows itself ------------------------------------------------------------------

    def parts(self) -> list[tuple[str, int, str]]:
        """(part, bytes, how it was counted), in the order of the table."""
        acts = (f"{_gib(self.activations_fixed)} + {_gib(self.activations_per_sample)} per sample"
                + ("" if self.traced else " (not traced: see notes)"))
        rows = [("weights", self.weights, ""), ("gradients", self.grads, ""),
                ("optimizer state", self.optimizer_state, self.optimizer),
                (f"activations (micro-batch {self.micro_batch})", self.activations, acts)]
        if self.step > self.activations:
            rows.append(("optimizer step (after the activations)", self.step - self.activations,
                         "its temporaries exceed the activations"))
        rows += [("allocator slack", self.slack, f"{FRAGMENTATION:.0%} of activations and gathered weights"),
                 ("CUDA context, NCCL", self.overhead, "")]
        return rows

    def headline(self) -> str:
        lora = f", LoRA rank {self.lora_rank}" if self.lora_rank else ""
        ac = ", activation checkpointing" if self.activation_checkpointing else ""
        seq = f" × {self.seq_len} tokens" if self.seq_len else ""
        return (f"{self.model}: {self.strategy} on {self.world_size} GPU{'s' if self.world_size > 1 else ''}, "
                f"micro-batch {self.micro_batch}{seq}, {self.precision}, weights {self.dtype}, "
                f"{self.optimizer}{lora}{ac}{', offload' if self.offload else ''}")

    def __str__(self) -> str:
        rows = [(name, _gib(size), how) for name, size, how in self.parts()]
        rows += [("total per GPU", _gib(self.total), f"PyTorch allocates {_gib(self.allocated)}, "
                  f"reserves {_gib(self.reserved)}")]
        lines = [self.headline(), *_aligned(rows)]
        if self.gpus:
            lines += ["largest micro-batch per GPU:"]
            lines += _aligned([(name, _gib(size), str(b) if b else "none fits")
                               for (name, size), b in zip(self.gpus.items(), self.fits.values())])
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        parts = Table(title=self.headline(), title_justify="left", show_edge=False)
        for column in ("part", "GiB", "how"):
            parts.add_column(column, justify="right" if column == "GiB" else "left")
        for name, size, how in self.parts():
            parts.add_row(name, f"{size / GIB:.2f}", how)
        parts.add_row("[bold]total per GPU", f"[bold]{self.total / GIB:.2f}",
                      f"PyTorch allocates {_gib(self.allocated)}, reserves {_gib(self.reserved)}")
        fits = Table(title="largest micro-batch per GPU", title_justify="left", show_edge=False)
        for column in ("GPU", "GiB", "micro-batch"):
            fits.add_column(column, justify="left" if column == "GPU" else "right")
        for (name, size), b in zip(self.gpus.items(), self.fits.values()):
            fits.add_row(name, f"{size / GIB:.1f}", str(b) if b else "[red]none fits")
        return Group(parts, fits, *(f"note: {n}" for n in self.notes))

    def _repr_html_(self) -> str:
        def table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
            cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
            return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"

        rows = [(name, f"{size / GIB:.2f}", how) for name, size, how in self.parts()]
        rows.append(("total per GPU", f"{self.total / GIB:.2f}", f"PyTorch allocates {_gib(self.allocated)}"))
        fits = [(name, f"{size / GIB:.1f}", str(b) if b else "none fits")
                for (name, size), b in zip(self.gpus.items(), self.fits.values())]
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (f"<p><b>{html.escape(self.headline())}</b></p>" + table(("part", "GiB", "how"), rows)
                + table(("GPU", "GiB", "largest micro-batch"), fits) + f"<ul>{notes}</ul>")

    def as_dict(self) -> dict[str, Any]:
        """Every field, the derived totals, and ``fits``: for ``--json``."""
        data = dataclasses.asdict(self)
        data.update(activations=self.activations, allocated=self.allocated, slack=self.slack,
                    reserved=self.reserved, total=self.total, fits=self.fits, notes=list(self.notes))
        return data


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def _aligned(rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return [f"  {a.ljust(widths[0])}  {b.rjust(widths[1])}  {c}".rstrip() for a, b, c in rows]
