"""The example notebooks (examples/notebooks/) run top to bottom in a real Jupyter kernel, in a
copy of the examples, at the scripts' small size (2 gloo CPU processes): every cell runs, the
training reaches what the script promises, and the end is that of a notebook on a managed GPU
service: rank 0 logged the model into the call's own MLflow run (the session's store), and the
notebook loaded it back from there and printed a prediction.

The kernel and its private HOME / Jupyter folders are tests/test_notebook.py's fixture.
"""

from __future__ import annotations

import importlib.util
import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient
from support import EXAMPLES
from test_notebook import KERNEL, kernel_env  # noqa: F401  (a fixture, used by name)

NOTEBOOKS = EXAMPLES / "notebooks"
# What a notebook imports: its example scripts, and the helper that logs the model.
SHARED = ("hello_world.py", "mlp_ddp.py", "retinanet_ddp.py", "transformer_fsdp.py", "lightning_two_tower.py",
          "notebooks/notebook_mlflow.py")
MLFLOW = importlib.util.find_spec("mlflow") is not None
CALL_RUN = re.compile(r"^gpufleet: MLflow run (\w+)", flags=re.M)  # printed as the call starts
LOGGED = re.compile(r"runs:/(\w+)/model")  # the prediction line names the model it loaded
NOT_TRACKED = "the call was not tracked (MLflow is not installed"


def execute(name: str, tmp_path, monkeypatch, timeout: int, **parameters) -> str:
    """Run the notebook in a copy of the examples, in its own folder as Jupyter runs it; every
    cell must run without an error (nbclient raises the cell's). Its outputs, as text.
    ``parameters`` are set in a cell after the one tagged "parameters", as papermill does."""
    monkeypatch.setenv("GPUFLEET_HOME", str(tmp_path / "gpufleet"))
    copy = tmp_path / "examples"
    (copy / "notebooks").mkdir(parents=True)
    for path in SHARED:
        shutil.copy(EXAMPLES / path, copy / path)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if parameters:
        [at] = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", ())]
        given = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(given, metadata={"tags": ["injected-parameters"]}))
    NotebookClient(nb, kernel_name=KERNEL, timeout=timeout, startup_timeout=60,
                   resources={"metadata": {"path": str(copy / "notebooks")}}).execute()
    return "\n".join(text(cell) for cell in nb.cells if cell.cell_type == "code")


def text(cell) -> str:
    """Streams as printed; a displayed value (the live status line, a cell's result) on lines
    of its own."""
    return "".join(o["text"] if o["output_type"] == "stream" else f"\n{o.get('data', {}).get('text/plain', '')}\n"
                   for o in cell.outputs)


def logged_to_the_call(output: str, function: str) -> str | None:
    """The call's MLflow run holds the model the notebook loaded back: the run gpufleet named
    when the call started is the one in the prediction line, created for the notebook's
    function, finished, with a model named "model". Its id (None without MLflow)."""
    if not MLFLOW:
        assert NOT_TRACKED in output, output
        return None
    import mlflow

    started, loaded = CALL_RUN.findall(output), LOGGED.findall(output)
    assert len(started) == 1 and loaded == started, output
    client = mlflow.MlflowClient()
    run = client.get_run(started[0])
    assert run.data.tags["gpufleet.function"] == function and run.info.status == "FINISHED", run
    if hasattr(client, "search_logged_models"):  # MLflow 3: a logged model of the run
        models = client.search_logged_models([run.info.experiment_id],
                                             filter_string=f"source_run_id = '{run.info.run_id}'")
        assert [m.name for m in models] == ["model"], models
    else:
        assert "model" in [a.path for a in client.list_artifacts(run.info.run_id)]
    return run.info.run_id


def numbers(pattern: str, output: str) -> list[tuple[float, ...]]:
    return [tuple(map(float, m)) if isinstance(m, tuple) else (float(m),)
            for m in re.findall(pattern, output, flags=re.M)]


@pytest.mark.timeout(240)
def test_hello_world_notebook(kernel_env, tmp_path, monkeypatch):  # noqa: F811
    output = execute("hello_world.ipynb", tmp_path, monkeypatch, timeout=180)

    assert "ranks: [0, 1]" in output, output
    assert "[rank 1] hello from rank 1 of 2 on cpu; all-reduce counted 2 ranks" in output, output
    if MLFLOW:  # hello world trains no model: the notebook shows the call's run, by its record
        started = CALL_RUN.search(output)
        assert started and f"MLflow run {started[1]}: FINISHED" in output, output
        assert "'world_size': '2'" in output, output
    else:
        assert NOT_TRACKED in output, output


@pytest.mark.timeout(300)
def test_mlp_ddp_notebook(kernel_env, tmp_path, monkeypatch):  # noqa: F811
    output = execute("mlp_ddp.ipynb", tmp_path, monkeypatch, timeout=240)

    losses = numbers(r"^rank \d: loss ([\d.]+) -> ([\d.]+)$", output)
    assert len(losses) == 2 and all(last < first for first, last in losses), output
    epochs = [line for line in output.splitlines() if re.match(r"\[rank \d\] epoch \d/5 ", line)]
    assert len(epochs) == 5 and all(line.startswith("[rank 0]") for line in epochs), "rank 0 logs each epoch"
    if logged_to_the_call(output, "train"):
        [(predicted, target)] = numbers(r"for the first sample: (-?[\d.]+) \(target (-?[\d.]+)\)$", output)
        assert abs(predicted - target) < 1.0, "the model learned the target: its loss is near 0.1"


@pytest.mark.timeout(600)
def test_retinanet_ddp_notebook(kernel_env, tmp_path, monkeypatch):  # noqa: F811
    """Two epochs of the small size, as tests/test_example_retinanet.py runs the script: the
    training is the script's; what the notebook adds is its cells, MLflow and the reload."""
    output = execute("retinanet_ddp.ipynb", tmp_path, monkeypatch, timeout=540, EPOCHS=2)

    [losses] = [line.split(":")[1].split() for line in output.splitlines()
                if line.startswith("training loss by epoch:")]
    [maps] = [line.split(":")[1].split() for line in output.splitlines() if line.startswith("mAP by epoch:")]
    [first] = [line.split(":")[1] for line in output.splitlines() if line.startswith("training loss at the first step:")]
    assert len(losses) == len(maps) == 2 and float(losses[-1]) < float(first), output
    assert all(0 <= float(m) <= 1 for m in maps), output
    assert not re.search(r"^\[rank 1\] .*mAP", output, re.M), "only rank 0 logs"
    out = tmp_path / "examples" / "notebooks" / "retinanet-out"  # OUT, beside the notebook
    assert list(out.glob("shapes-*/annotations/instances_val2017.json")), "a COCO-style folder"
    assert (out / "retinanet.pt").stat().st_size > 0, "rank 0 saves the trained weights"
    if logged_to_the_call(output, "train"):
        assert re.search(r"^the image holds: (red square|green circle|blue triangle) at \(", output, re.M), output
        found = re.search(r"^runs:/\w+/model found \(best 3\): (.+)$", output, re.M)
        assert found and len(found[1].split("; ")) == 3 and "score" in found[1], output


@pytest.mark.timeout(300)
def test_transformer_fsdp_notebook(kernel_env, tmp_path, monkeypatch):  # noqa: F811
    output = execute("transformer_fsdp.ipynb", tmp_path, monkeypatch, timeout=240)

    ranks = numbers(r"^rank \d: steps 0 -> 100, loss ([\d.]+) -> ([\d.]+), val loss ([\d.]+) ", output)
    [(unigram,)] = numbers(r"^unigram baseline ([\d.]+) nats/byte", output)
    assert len(ranks) == 2, output
    (initial, final, val) = ranks[0]
    assert final < initial - 2 and val < unigram - 0.3, "the script's small size: 5.6 -> 2.4, val 2.5 vs 3.3"
    if logged_to_the_call(output, "train"):
        continued = output.split("\ncontinued by runs:/")[1].split("\n", 1)[1]
        assert continued.strip(), output


@pytest.mark.timeout(300)
def test_lightning_two_tower_notebook(kernel_env, tmp_path, monkeypatch):  # noqa: F811
    output = execute("lightning_two_tower.ipynb", tmp_path, monkeypatch, timeout=240)

    assert "2 ranks (TorchElasticEnvironment)" in output, "Lightning joined gpufleet's ranks"
    [(best, _)] = numbers(r"^best val AUROC ([\d.]+) \(last epoch ([\d.]+)\)$", output)
    assert best >= 0.75, output
    epochs = [line for line in output.splitlines() if re.match(r"\[rank \d\] epoch \d/6 ", line)]
    assert len(epochs) == 6 and all(line.startswith("[rank 0]") for line in epochs), output
    run_id = logged_to_the_call(output, "train")
    if run_id:
        import mlflow

        aurocs = mlflow.MlflowClient().get_metric_history(run_id, "val_auroc")
        assert len(aurocs) == 6, "Lightning's MLFlowLogger logged each epoch into the call's run"
        scored = numbers(r"^  user +\d+ likes item +\d+ with probability ([\d.]+)  \(planted label [01]\)$", output)
        assert len(scored) == 5 and all(0 <= p <= 1 for (p,) in scored), output
