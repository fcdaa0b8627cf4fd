"""Run example notebooks top to bottom and save them with their outputs.

    python examples/notebooks/run_all.py                        # the five notebooks below
    python examples/notebooks/run_all.py mlp_ddp.ipynb          # some of them

Each runs in its own folder, as Jupyter runs it, in the kernel named in the notebook (python3:
this interpreter, when ipykernel is installed here), at the size its first cell picks for this
machine: the scripts' small size without GPUs, their full size on GPUs. MLflow's download bars
and tqdm's warning that ipywidgets is missing are left out of the saved outputs, and the folder
of installed packages is shortened to `site-packages` in them (warnings name their files).
Needs nbclient.
"""

import os
import sys
import sysconfig
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("hello_world.ipynb", "mlp_ddp.ipynb", "retinanet_ddp.ipynb", "transformer_fsdp.ipynb",
             "lightning_two_tower.ipynb")
CELL_TIMEOUT_S = 3600  # the full sizes on GPUs take minutes
PACKAGES = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}


def run(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    started = time.monotonic()
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = shorten(output["text"])
    nbformat.write(nb, path)
    print(f"{path.name}: {time.monotonic() - started:.0f} s", flush=True)


def shorten(text: str) -> str:
    for folder in PACKAGES:
        text = text.replace(folder, "site-packages")
    return text


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # for the kernels
    os.environ.setdefault("PYTHONWARNINGS", "ignore:IProgress not found")
    for name in sys.argv[1:] or NOTEBOOKS:
        run(HERE / name)
