"""Every notebook executes headless on a tiny run made here, and draws its figures."""
import os

import nbclient  # test extras: `pip install -e ".[test]"`
import nbformat
import pytest

from geonorm_jax import config as config_lib
from geonorm_jax import train

pytestmark = pytest.mark.slow  # starts a Jupyter kernel

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(REPO_ROOT, "notebooks")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """Four steps of a one-layer model, with per-layer statistics so every cell has data."""
  workdir = str(tmp_path_factory.mktemp("runs") / "tiny")
  config = config_lib.get_config(
      "model.num_layers=1,model.d_model=32,model.num_heads=2,model.max_seq_len=16,"
      "data.seq_len=16,data.batch_size=8,train.steps=4,train.eval_every=2,"
      "train.eval_batches=2,train.warmup_steps=1,train.log_every=1,"
      "train.layer_stats_every=2,train.progress_bar=false")
  train.train(config, workdir)
  return workdir


def _image_outputs(notebook):
  return [output for cell in notebook.cells for output in cell.get("outputs", [])
          if "image/png" in output.get("data", {})]


def test_explore_runs_executes_and_plots(tiny_run, monkeypatch):
  monkeypatch.setenv("GEONORM_RUN_DIRS", tiny_run)
  notebook = nbformat.read(os.path.join(NOTEBOOK_DIR, "explore_runs.ipynb"), as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": NOTEBOOK_DIR}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if output.get("output_type") == "error"]
  assert not errors
  # Loss curves, throughput, and at least one per-layer figure.
  assert len(_image_outputs(notebook)) >= 3
  printed = "".join(output.get("text", "") for cell in notebook.cells
                    for output in cell.get("outputs", []))
  assert "tiny: " in printed and "No per-layer statistics" not in printed
