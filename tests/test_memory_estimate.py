"""`gpufleet.memory.estimate` and `gpufleet estimate`: the peak memory of a training step per GPU,
before anything runs.

What a user relies on:

- weights, gradients, optimizer state and the optimizer step's temporaries follow each
  strategy's arithmetic (docs/memory.md, "What is counted"): checked here against numbers
  computed by hand, for ddp, fsdp (with and without CPU offload), zero1, zero2 and zero3,
  LoRA and each optimizer;
- activations are counted from the model's own forward and backward pass (never run: fake
  tensors), so a model whose pass is known by hand gives exactly its bytes, activation
  checkpointing shows, and a deep model shortened for the trace gives what the whole one does;
- a Hugging Face model whose pass cannot be traced falls back to the stated formula; any other
  such module says that its activations are not counted;
- the largest micro-batch per GPU is the largest whose total fits;
- bad input is a ConfigError naming the value and the fix;
- `gpufleet estimate` works on a config.json and on a module built on the meta device, for
  every strategy, as a table and as JSON.
"""

from __future__ import annotations

import json
import math
import subprocess
import textwrap

import pytest
import torch

from gpufleet import memory
from gpufleet.errors import ConfigError
from gpufleet.memory._arith import CUDA_CONTEXT, NCCL_BUFFERS
from support import PYTHON

pytestmark = pytest.mark.timeout(300)

WIDTH = 1000
BLOCK = 2 * WIDTH * WIDTH  # two bias-free linear layers per block
HEAD = WIDTH * 10
P4 = 4 * BLOCK + HEAD  # parameters of Stack(4): 8,010,000


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    """Repeated blocks in a ModuleList (what FSDP shards one by one) and a head."""

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(WIDTH, 10, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Unstacked(torch.nn.Module):
    """The same computation as Stack, its blocks as plain attributes: no stack to shorten."""

    def __init__(self, blocks: int):
        super().__init__()
        self.count = blocks
        for i in range(blocks):
            setattr(self, f"b{i}", Block())
        self.head = torch.nn.Linear(WIDTH, 10, bias=False)

    def forward(self, x):
        for i in range(self.count):
            x = getattr(self, f"b{i}")(x)
        return self.head(x)


def on_meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def vectors(batch: int):
    return torch.randn(batch, WIDTH)


def stack_estimate(strategy="ddp", **options):
    options.setdefault("inputs", vectors)
    return memory.estimate(on_meta(Stack), strategy, **options)


def parts(e):
    return e.weights, e.grads, e.optimizer_state, e.step


def shard(n, world):
    return math.ceil(n / world)


# ---------------------------------------------------------------------------- the arithmetic


def test_ddp_holds_everything_on_every_rank():
    p = P4
    e = stack_estimate("ddp", precision="fp32")
    assert e.parameters == e.trainable == p
    assert parts(e) == (4 * p, 4 * p, 8 * p, 4 * p)  # fp32 weights, grads, Adam's 2 states, one copy
    assert e.overhead == CUDA_CONTEXT
    on_two = stack_estimate("ddp", world_size=2)
    assert parts(on_two) == parts(e), "DDP does not shard: the same on every rank"
    assert on_two.overhead == CUDA_CONTEXT + NCCL_BUFFERS


def test_fsdp_shards_and_gathers_two_blocks_in_bf16():
    p, n = P4, 4
    e = stack_estimate("fsdp", world_size=n)
    gathered = 2 * (HEAD + 2 * BLOCK)  # bf16: the parts outside blocks, a block and the next
    whole_grads = (2 + 4) * BLOCK  # one block's gradients in bf16, then fp32 for the reduce
    assert parts(e) == (shard(4 * p, n) + gathered, shard(4 * p, n) + whole_grads,
                        shard(8 * p, n), shard(4 * p, n))
    assert e.gathered == gathered + whole_grads


def test_fsdp_on_one_rank_gathers_the_whole_model():
    p = P4
    e = stack_estimate("fsdp")
    assert e.weights == 4 * p + 2 * p
    assert e.grads == 4 * p + 6 * BLOCK


def test_fsdp_cpu_offload_keeps_only_what_is_gathered():
    e = stack_estimate("fsdp", world_size=4, offload=True)
    assert parts(e) == (2 * (HEAD + 2 * BLOCK), 6 * BLOCK, 0, 0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_partition_optimizer_then_gradients_then_weights(stage):
    p, n = P4, 4
    e = stack_estimate(f"zero{stage}", world_size=n)
    weights = shard(2 * p, n) + 2 * (HEAD + 2 * BLOCK) if stage == 3 else 2 * p  # a bf16 module
    grads = (shard(2 * p, n) if stage >= 2 else 2 * p) + shard(4 * p, n)  # bf16, the fp32 partition
    buckets = 2 * (p + (p if stage < 3 else 0))  # reduce (and all-gather) buckets: all of a small model
    assert parts(e) == (weights, grads + buckets, shard((4 + 8) * p, n), 0)  # fp32 master + Adam


def test_zero3_offload_and_fp32():
    p, n = P4, 4
    offloaded = stack_estimate("zero3", world_size=n, offload=True)
    assert (offloaded.weights, offloaded.optimizer_state) == (2 * (HEAD + 2 * BLOCK), 0)
    fp32 = stack_estimate("zero1", world_size=n, precision="fp32")
    assert parts(fp32) == (4 * p, 4 * p + 4 * (p + p), shard(8 * p, n), 0)  # no master copy


@pytest.mark.parametrize("optimizer, state, step", [("sgd", 0, 0), ("sgd-momentum", 4, 0),
                                                    ("adam", 8, 4), ("adam8bit", 2, 0)])
def test_each_optimizer_keeps_its_state(optimizer, state, step):
    e = stack_estimate("ddp", optimizer=optimizer)
    assert (e.optimizer_state, e.step) == (state * P4, step * P4)


def test_lora_trains_only_its_adapters():
    rank = 8
    e = stack_estimate("ddp", lora_rank=rank, lora_targets=["up"], precision="fp32")
    adapters = 4 * rank * (WIDTH + WIDTH)  # A: rank × in, B: out × rank, on each block's "up"
    assert (e.parameters, e.trainable) == (P4 + adapters, adapters)
    assert parts(e) == (4 * (P4 + adapters), 4 * adapters, 8 * adapters, 4 * adapters)


def test_bf16_weights_halve_weights_gradients_and_state():
    e = stack_estimate("ddp", dtype="bf16")
    assert parts(e) == (2 * P4, 2 * P4, 4 * P4, 2 * P4)


# ---------------------------------------------------------------------------- activations


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.w


def test_a_pass_known_by_hand_gives_its_bytes():
    # Per sample: the input x and the product x·w, 4 bytes × 1000 each; the product is freed
    # once summed, and backward's x·grad takes its place. The fixed part is the loss and its
    # gradient, 4 bytes each.
    e = memory.estimate(on_meta(Scale), precision="fp32", micro_batch=3, inputs=vectors)
    assert e.traced
    assert e.activations_per_sample == 2 * 4 * WIDTH
    assert e.activations_fixed == 8
    assert e.activations == 8 + 3 * 8000


def test_activation_checkpointing_keeps_only_each_blocks_input():
    plain = stack_estimate("ddp", precision="fp32")
    recomputed = stack_estimate("ddp", precision="fp32", activation_checkpointing=True)
    # Without: each block keeps the inputs of its two linear layers and of its GELU (3 × 4000
    # bytes a sample); with: its input only, and one block whole again while it is recomputed.
    assert recomputed.activations_per_sample < plain.activations_per_sample * 0.6
    assert plain.activations_per_sample >= 4 * 3 * 4 * WIDTH


def test_a_deep_stack_shortened_for_the_trace_gives_what_the_whole_one_does():
    deep = memory.estimate(on_meta(Stack, 8), precision="fp32", inputs=vectors)
    whole = memory.estimate(on_meta(Unstacked, 8), precision="fp32", inputs=vectors)
    assert (deep.activations_fixed, deep.activations_per_sample) == (
        whole.activations_fixed, whole.activations_per_sample)


def test_a_module_on_a_device_is_never_run():
    model = Stack(2)  # real weights on CPU
    before = [p.detach().clone() for p in model.parameters()]
    e = memory.estimate(model, precision="fp32", inputs=vectors)
    assert e.parameters == 2 * BLOCK + HEAD and e.traced
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


class Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        if x.sum().item() > 0:  # data-dependent: no trace can go on
            x = x * 2
        return x * self.w


def test_a_module_that_cannot_be_traced_says_its_activations_are_not_counted():
    e = memory.estimate(on_meta(Untraceable), inputs=vectors)
    assert not e.traced and e.activations == 0
    assert any("NOT counted" in note for note in e.notes), e.notes


# ---------------------------------------------------------------------------- Hugging Face


@pytest.fixture
def llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512)


def test_a_hugging_face_config_object_file_and_folder_agree(llama_config, tmp_path):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(llama_config)
    llama_config.save_pretrained(tmp_path)
    found = [memory.estimate(source, "fsdp", world_size=2, micro_batch=2, seq_len=128)
             for source in (llama_config, tmp_path / "config.json", tmp_path, llama_config.to_dict())]
    assert {e.parameters for e in found} == {sum(p.numel() for p in real.parameters())}
    assert len({(e.total, e.activations_per_sample) for e in found}) == 1
    assert found[0].traced and found[0].seq_len == 128 and found[0].activations_per_sample > 0


def test_tied_weights_count_once(llama_config):
    from transformers import AutoModelForCausalLM

    llama_config.tie_word_embeddings = True
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(llama_config)
    assert real.lm_head.weight is real.model.embed_tokens.weight
    for dtype in ("bf16", "fp32"):  # the copy stored in another dtype than it was built in
        e = memory.estimate(llama_config, "fsdp", dtype=dtype, seq_len=64)
        assert e.parameters == sum(p.numel() for p in real.parameters())
        assert e.weights == (2 if dtype == "bf16" else 4) * e.parameters + 2 * e.parameters


def test_hugging_face_lora_and_checkpointing(llama_config):
    h, kv = 64, 2 * (64 // 4)
    lora = memory.estimate(llama_config, lora_rank=4, lora_targets=["q_proj", "v_proj"], seq_len=256)
    assert lora.trainable == 2 * (4 * (h + h) + 4 * (h + kv))  # per layer: q (h → h), v (h → kv heads)
    plain = memory.estimate(llama_config, seq_len=256)
    recomputed = memory.estimate(llama_config, seq_len=256, activation_checkpointing=True)
    assert recomputed.traced and recomputed.activations_per_sample < plain.activations_per_sample


def test_the_default_sequence_is_capped_by_the_models_positions(llama_config):
    assert memory.estimate(llama_config).seq_len == 512


def test_a_hugging_face_model_that_cannot_be_traced_gets_the_stated_formula(llama_config):
    from transformers import LlamaForCausalLM

    class Stubborn(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            if input_ids.max().item() > 10**9:  # data-dependent: no trace can go on
                input_ids = input_ids * 0
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    with torch.device("meta"):
        model = Stubborn(llama_config)
    e = memory.estimate(model, seq_len=128)
    assert not e.traced and any("formula" in note for note in e.notes), e.notes
    s, h, a, i, layers, vocab = 128, 64, 4, 176, 2, 1000
    layer = s * h * (15 + 19 * i / (4 * h)) + 5 * a * s * s  # bytes at 16 bits (docs/memory.md)
    assert e.activations_per_sample == int(layers * layer + s * vocab * (2 + 8))


# ---------------------------------------------------------------------------- the result


def test_the_largest_micro_batch_is_the_largest_that_fits():
    tokens = 4096  # a "sample" of 4096 vectors: activations that fill GPUs in hundreds, not millions
    e = stack_estimate("ddp", precision="fp32", inputs=lambda b: torch.randn(b * tokens, WIDTH))
    capacity = e.at(37).total + 1
    assert e.largest_micro_batch(capacity) == 37
    assert e.at(38).total > capacity
    assert e.largest_micro_batch(e.at(1).total - 1) == 0
    assert set(e.fits) == set(memory.GPUS)
    assert all(e.at(b).total <= memory.GPUS[name] < e.at(b + 1).total for name, b in e.fits.items())


def test_the_result_shows_itself_as_text_html_and_json():
    e = stack_estimate("fsdp", world_size=2, micro_batch=4)
    text = str(e)
    assert "total per GPU" in text and "H100 80GB" in text and "micro-batch 4" in text
    assert "<table>" in e._repr_html_()
    data = json.loads(json.dumps(e.as_dict()))
    assert data["total"] == e.total and data["fits"]["H200 141GB"] == e.fits["H200 141GB"]
    assert data["total"] == sum(size for _, size, _ in e.parts())


@pytest.mark.parametrize("options, named", [
    (dict(strategy="zero4"), "zero4"), (dict(micro_batch=0), "micro_batch=0"),
    (dict(precision="fp8"), "fp8"), (dict(optimizer="lion"), "lion"), (dict(world_size=0), "world_size=0"),
    (dict(gpus=["V100"]), "V100"), (dict(lora_rank=4, lora_targets=["nothing"]), "nothing"),
    (dict(dtype="int8"), "int8"), (dict(strategy="ddp", offload=True), "offload"),
])
def test_bad_input_names_the_value(options, named):
    strategy = options.pop("strategy", "ddp")
    with pytest.raises(ConfigError, match=named):
        stack_estimate(strategy, **options)


def test_a_module_without_inputs_says_what_to_pass():
    with pytest.raises(ConfigError, match="inputs="):
        memory.estimate(on_meta(Stack))


# ---------------------------------------------------------------------------- the command


def gpufleet(*args, cwd):
    return subprocess.run([PYTHON, "-m", "gpufleet", "estimate", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_the_command_on_a_config_for_every_strategy(llama_config, tmp_path):
    llama_config.save_pretrained(tmp_path)
    done = gpufleet(tmp_path / "config.json", "--strategy", "all", "--world-size", "2",
                    "--micro-batch", "2", "--seq-len", "64", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert [e["strategy"] for e in found] == ["ddp", "fsdp", "zero1", "zero2", "zero3"]
    assert all(e["traced"] and e["total"] > 0 and e["fits"]["H100 80GB"] > 0 for e in found)
    python = memory.estimate(llama_config, "zero3", world_size=2, micro_batch=2, seq_len=64)
    assert found[-1]["total"] == python.total
    table = gpufleet(tmp_path, "--strategy", "fsdp", "--seq-len", "64", cwd=tmp_path)
    assert table.returncode == 0 and "total per GPU" in table.stdout, table.stderr


def test_the_command_on_a_module_built_on_meta(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(f"""
        import torch

        def build():
            assert torch.empty(1).device.type == "meta"  # built where nothing is allocated
            return torch.nn.Sequential(torch.nn.Linear({WIDTH}, {WIDTH}), torch.nn.ReLU(),
                                       torch.nn.Linear({WIDTH}, 10))

        def example(batch):
            return torch.randn(batch, {WIDTH})
    """))
    done = gpufleet("model.py:build", "--inputs", "model.py:example", "--strategy", "ddp,zero2",
                    "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ddp, zero2 = json.loads(done.stdout)
    assert ddp["parameters"] == WIDTH * WIDTH + WIDTH + WIDTH * 10 + 10
    assert ddp["traced"] and ddp["activations_per_sample"] > 0 and zero2["strategy"] == "zero2"


def test_the_command_refuses_bad_input_before_anything(tmp_path):
    done = gpufleet("nowhere/config.json", "--strategy", "zero9", cwd=tmp_path)
    assert done.returncode == 2 and "zero9" in done.stderr, done.stderr
    done = gpufleet(tmp_path / "missing.json", cwd=tmp_path)
    assert done.returncode == 2 and "config.json" in done.stderr, done.stderr
