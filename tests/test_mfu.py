"""MFU in the step telemetry, as a user sees it: the model's FLOPs are counted on one step with
torch's FLOP counter (or given with `runtime.flops`), measured against a peak (the GPU's, from
the table, or `GPUFLEET_PEAK_FLOPS`, which CPU runs need), and shown with tokens/s per GPU in
the live status line, the printed summary and `steps.json`, `gpufleet status` and MLflow; the
Hugging Face and Lightning callbacks put them into what their trainers log.

The counted figure is checked against hand counts: a stack of Linear layers (the FLOPs of
every matmul of forward and backward), and a small Llama (6·N per token plus attention).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import subprocess
import sys

import pytest

from gpufleet import ConfigError, distributed, peaks, runtime, steps
from gpufleet.watch import progress
from support import run_folders, terminal_stdout

pytestmark = pytest.mark.timeout(180)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PEAK = 1e9  # FLOP/s a CPU rank is measured against in these tests (it has no peak of its own)
ENV = {"GPUFLEET_PEAK_FLOPS": str(PEAK), "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
       "HF_HUB_OFFLINE": "1"}


def summary_of(attempt) -> dict:
    return json.loads((attempt / "steps.json").read_text())


def windows_of(attempt, rank: int) -> list[dict]:
    return [json.loads(line) for line in (attempt / "steps" / f"rank-{rank}.jsonl").read_text().splitlines()]


def gpufleet_status(runs_dir, run_id: str, *flags: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpufleet", "status", *flags, "--runs-dir", str(runs_dir), run_id],
                          capture_output=True, text=True, timeout=60, check=True).stdout


# ---------------------------------------------------------------------------- the arithmetic


def window(rank: int, i: int, tokens: int, wall_s: float, flops: float | None, peak: float | None) -> dict:
    return {"rank": rank, "host": "h", "gpu": str(rank), "time": 1000.0 + i, "first": 10 * i + 1,
            "last": 10 * (i + 1), "steps": 10, "wall_s": wall_s, "step_s": wall_s / 10, "arrive_s": 0.01,
            "input_s": 0.0, "samples": 80, "tokens": tokens, "flops": flops, "peak_flops": peak,
            "model_flops": {"per": "token", "value": 1e6, "counted": True, "dtype": "bf16"}}


def test_mfu_is_the_model_flops_per_second_over_the_peak_per_gpu():
    # rank 0: 4,000 tokens a second at 1e6 FLOPs a token on a 1e10 peak: 40%; rank 1: 30%
    recent = {0: [window(0, i, 4000, 1.0, 4000 * 1e6, 1e10) for i in range(3)],
              1: [window(1, i, 3000, 1.0, 3000 * 1e6, 1e10) for i in range(3)]}
    found = steps.compare(recent, threshold=0.2)
    assert [v.mfu for v in found.ranks] == [pytest.approx(0.4), pytest.approx(0.3)]
    assert [v.tokens_per_s for v in found.ranks] == [pytest.approx(4000), pytest.approx(3000)]
    assert found.mfu == pytest.approx(0.35), "the ranks' mean"
    parts = progress.steps_parts(found)
    assert "7k tokens/s (3.5k/GPU)" in parts and "MFU 35% (30%–40%)" in parts, parts

    shown = found.as_dict()
    assert shown["mfu"] == 0.35 and [r["mfu"] for r in shown["ranks"]] == [0.4, 0.3]
    metrics, _ = steps.mlflow_metrics(recent[0] + recent[1], found)
    named = {name: value for name, value, _, _ in metrics}
    assert named["steps/rank0/mfu"] == pytest.approx(0.4) and named["steps/rank1/tokens_per_s"] == 3000
    assert named["steps/mfu"] == pytest.approx(0.35)


def test_a_window_whose_flops_are_unknown_counts_for_tokens_but_not_mfu():
    recent = {0: [window(0, 0, 4000, 1.0, None, None), window(0, 1, 2000, 1.0, 2000 * 1e6, 1e10)]}
    found = steps.compare(recent, threshold=0.2)
    assert found.ranks[0].mfu == pytest.approx(0.2), "only the window whose FLOPs are known"
    assert found.ranks[0].tokens_per_s == pytest.approx(3000)
    no_peak = steps.compare({0: [window(0, 0, 4000, 1.0, 4e9, None)]}, threshold=0.2)
    assert no_peak.mfu is None and "MFU" not in " ".join(progress.steps_parts(no_peak))


def test_the_peak_table_knows_each_gpu_by_its_cuda_name():
    bf16 = {name: peaks.peak(name, "bf16") for name in (
        "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
        "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA L4", "NVIDIA L40S", "NVIDIA B200")}
    assert bf16 == {"NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
                    "NVIDIA H100 80GB HBM3": 989.5e12, "NVIDIA H100 PCIe": 756.5e12,
                    "NVIDIA H100 NVL": 835.5e12, "NVIDIA H200": 989.5e12, "NVIDIA H200 NVL": 835.5e12,
                    "NVIDIA L4": 121e12, "NVIDIA L40S": 362.05e12, "NVIDIA B200": 2250e12}
    assert peaks.peak("NVIDIA H100 80GB HBM3", "tf32") == 494.5e12
    assert peaks.peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peaks.find("NVIDIA L40") is None and peaks.find("Tesla T4") is None, "unknown: no MFU"


def test_bad_flops_and_peaks_are_clear_errors(monkeypatch):
    for bad in (dict(per_token=-1), dict(per_token=1, per_step=2), dict(per_sample="6e9")):
        with pytest.raises(ConfigError, match=r"runtime\.flops"):
            runtime.flops(**bad)
    with pytest.raises(ConfigError, match=r"count='yes'"):
        runtime.flops(count="yes")
    runtime.flops(per_token=6e9)  # outside a run: checked, then nothing
    monkeypatch.setenv("GPUFLEET_PEAK_FLOPS", "fast")

    @distributed(gpus=2, tracking=False)
    def never():
        raise AssertionError("no rank starts")

    with pytest.raises(ConfigError, match=r"GPUFLEET_PEAK_FLOPS='fast' must be a number of FLOP/s"):
        never.distributed()


# ---------------------------------------------------------------------------- counted in real runs


def test_a_linear_stack_is_counted_and_its_mfu_shown_everywhere(runs_dir, monkeypatch, capfd):
    @distributed(gpus=2, runs_dir=runs_dir, env=ENV)
    def train():
        import time

        import torch

        runtime.setup()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(), torch.nn.Linear(128, 64, bias=False)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(60):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.05)
            runtime.step(tokens=32)  # a row is a token here
        return True

    screen = terminal_stdout(monkeypatch)
    assert train.distributed() == [True, True]

    # Forward 2·N·T, weight gradients 2·N·T, input gradients 2·N·T for every layer but the
    # first (its input needs none): N = 64·128 + 128·64.
    per_token = 6 * (64 * 128 + 128 * 64) - 2 * 64 * 128
    attempt = run_folders(runs_dir)[-1]
    for row in summary_of(attempt)["ranks"]:
        assert row["model_flops"] == {"per": "token", "value": per_token, "counted": True, "dtype": "fp32"}
        assert row["peak_flops"] == PEAK and row["tokens"] == 60 * 32
        lines = [w for w in windows_of(attempt, row["rank"]) if w["flops"] is not None]
        assert lines and all(w["flops"] == per_token * w["tokens"] for w in lines)
        assert row["mfu"] == pytest.approx(statistics.median(w["flops"] / w["wall_s"] / PEAK for w in lines), rel=1e-4)
        assert 0 < row["mfu"] < 1

    statuses = ANSI.sub("", screen.getvalue()).replace("\r", "\n").splitlines()
    assert any(re.search(r"[\d.]+k? tokens/s \([\d.]+k?/rank\) · MFU \d+%", line) for line in statuses), statuses
    assert re.search(r"tokens/s\s+MFU\s+slowest steps", capfd.readouterr().err), "the printed summary"

    run_id = attempt.parent.name
    assert re.search(r"^steps: .* MFU \d+%", gpufleet_status(runs_dir, run_id), re.M)
    shown = json.loads(gpufleet_status(runs_dir, run_id, "--json"))["steps"]
    assert shown["mfu"] > 0 and all(r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in shown["ranks"])

    from mlflow import MlflowClient

    record = json.loads((attempt.parent / "record.json").read_text())
    logged = set(MlflowClient().get_run(record["mlflow_run_id"]).data.metrics)
    assert {"steps/rank0/mfu", "steps/rank1/mfu", "steps/rank0/tokens_per_s", "steps/mfu"} <= logged, logged


def test_a_small_llamas_count_is_6n_per_token_plus_attention(runs_dir):
    pytest.importorskip("transformers")
    layers, hidden, heads, kv_heads, inner, vocab, seq, batch = 2, 64, 4, 2, 128, 256, 32, 2

    @distributed(gpus=1, runs_dir=runs_dir, tracking=False, env={"HF_HUB_OFFLINE": "1"})
    def train():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        runtime.flops()  # count them, though this CPU has no peak to show an MFU against
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, max_position_embeddings=seq,
                             tie_word_embeddings=True)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(4):
            ids = torch.randint(vocab, (batch, seq))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            runtime.step(tokens=ids.numel())
        return sum(p.numel() for p in model.parameters())

    train.distributed()
    head_dim = hidden // heads
    # N: every weight a matmul uses, the tied embedding once (as the output layer)
    n = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inner) + vocab * hidden
    attention = 12 * layers * hidden * seq  # QKᵀ and AV: 4·T·d a token forward, twice that backward
    row = summary_of(run_folders(runs_dir)[-1])["ranks"][0]
    assert row["model_flops"]["counted"] and row["model_flops"]["per"] == "token"
    assert row["mfu"] is None and row["peak_flops"] is None, "no peak: FLOPs, but no MFU"
    # what else runs as a matmul (the rotary embedding's angles) is under 0.1%
    assert row["model_flops"]["value"] == pytest.approx(6 * n + attention, rel=1e-3)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["heads alike", "grouped-query"])
def test_fused_attention_counts_its_two_products_forward_and_four_backward(kv_heads):
    import torch
    import torch.nn.functional as F

    from gpufleet.flops import Counter

    batch, heads, seq, width = 2, 4, 16, 8
    query = torch.randn(batch, heads, seq, width, requires_grad=True)
    key, value = (torch.randn(batch, kv_heads, seq, width, requires_grad=True) for _ in range(2))
    counter = Counter()
    counter.start()
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    out.sum().backward()
    counter.ended_step(samples=batch, tokens=batch * seq)
    figure = counter.stop()
    forward = 2 * (2 * batch * heads * seq * seq * width)  # QKᵀ and AV, causal or not
    assert figure is not None and figure.value * batch * seq == pytest.approx(3 * forward)


def test_given_flops_replace_the_count_and_count_false_counts_nothing(runs_dir):
    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, env=ENV)
    def train():
        import torch

        if runtime.get_global_rank() == 0:
            runtime.flops(per_sample=1e6)
        else:
            runtime.flops(count=False)
        model = torch.nn.Linear(16, 16)
        for _ in range(5):
            model(torch.randn(8, 16)).sum().backward()
            runtime.step(samples=8)
        return True

    train.distributed()
    rows = summary_of(run_folders(runs_dir)[-1])["ranks"]
    assert rows[0]["model_flops"] == {"per": "sample", "value": 1e6, "counted": False, "dtype": None}
    assert rows[1]["model_flops"] is None and rows[1]["mfu"] is None


# ---------------------------------------------------------------------------- the callbacks


def test_the_hugging_face_trainer_logs_this_gpus_tokens_per_second_and_mfu(runs_dir, tmp_path):
    pytest.importorskip("transformers")

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, env=ENV)
    def train(out):
        import time

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

        from gpufleet.integrations.huggingface import GpufleetCallback

        class Slow(TrainerCallback):  # steps of 0.1 s: several windows of step telemetry
            def on_step_end(self, args, state, control, **kwargs):
                time.sleep(0.1)

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(32, (128, 8))]
        args = TrainingArguments(out, max_steps=30, per_device_train_batch_size=2, logging_steps=5,
                                 save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
        trainer = Trainer(LlamaForCausalLM(config), args, train_dataset=data,
                          callbacks=[Slow(), GpufleetCallback()])
        trainer.train()
        return trainer.state.log_history

    history = train.distributed(str(tmp_path / "out"))[0]
    logged = [entry for entry in history if "loss" in entry]
    measured = [entry for entry in logged if "device/mfu" in entry]
    assert len(measured) >= len(logged) - 2, f"every training log once a window is done: {history}"
    assert all(0 < e["device/mfu"] < 1 and e["device/tokens_per_s"] > 0 for e in measured)
    rows = summary_of(run_folders(runs_dir)[-1])["ranks"]
    assert [row["tokens"] for row in rows] == [30 * 2 * 8] * 2, "the input_ids of each step's batch"
    assert all(row["model_flops"]["per"] == "token" and row["model_flops"]["counted"] for row in rows)


def test_lightning_logs_tokens_per_second_and_mfu_from_flops_per_batch(runs_dir, tmp_path):
    pytest.importorskip("lightning")

    @distributed(gpus=2, runs_dir=runs_dir, tracking=False, env=ENV)
    def train(out):
        import time

        import lightning as L
        import torch
        from lightning.pytorch.loggers import CSVLogger
        from torch.utils.data import DataLoader, TensorDataset

        from gpufleet.integrations.lightning import GpufleetCallback

        class Tiny(L.LightningModule):
            flops_per_batch = 6 * 4 * 4 * 8  # Lightning's attribute: a batch of 8 rows, forward and backward

            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 4)

            def training_step(self, batch, batch_idx):
                time.sleep(0.1)
                return self.layer(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = DataLoader(TensorDataset(torch.randn(512, 4)), batch_size=8)
        trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=30,
                            accumulate_grad_batches=2, log_every_n_steps=5,
                            logger=CSVLogger(out, name="csv", version=0),
                            callbacks=[GpufleetCallback(tokens=lambda batch: batch[0].shape[0])],
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), data)
        return True

    train.distributed(str(tmp_path))
    rows = summary_of(run_folders(runs_dir)[-1])["ranks"]
    for row in rows:
        assert row["model_flops"] == {"per": "step", "value": 2 * 6 * 4 * 4 * 8, "counted": False, "dtype": None}
        assert row["tokens"] == 30 * 2 * 8, "two batches of 8 rows a step"
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("device/mfu")]
    assert logged and all(0 < float(row["device/mfu"]) < 1 and float(row["device/tokens_per_s"]) > 0
                          for row in logged)
