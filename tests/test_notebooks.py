"""Every notebook executes headless on tiny settings and draws its figures; the committed
notebooks carry no outputs and share one install cell."""
import ast
import csv
import glob
import json
import os
import re

import nbformat
import numpy as np
import pytest

from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(REPO_ROOT, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
# One layer, width 32, 16-token windows: every notebook's compiles take seconds.
TINY = ("model.num_layers=1,model.d_model=32,model.num_heads=2,model.max_seq_len=16,"
        "data.seq_len=16,data.batch_size=8,train.eval_batches=2,train.warmup_steps=1,"
        "train.log_every=1,train.progress_bar=false")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """Four steps of a one-layer model, with per-layer statistics and a final checkpoint, so
  every notebook that reads a run has data."""
  workdir = str(tmp_path_factory.mktemp("runs") / "tiny")
  config = config_lib.get_config(
      f"{TINY},train.steps=4,train.eval_every=2,train.layer_stats_every=2")
  train.train(config, workdir)
  return workdir


def _execute(name, monkeypatch, **env):
  """Runs notebooks/<name> top to bottom in a fresh kernel with `env` set; returns it run."""
  import nbclient  # test extras: `pip install -e ".[test]"`  pylint: disable=g-import-not-at-top
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  notebook = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": NOTEBOOK_DIR}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if output.get("output_type") == "error"]
  assert not errors
  return notebook


def _image_count(notebook):
  return sum("image/png" in output.get("data", {})
             for cell in notebook.cells for output in cell.get("outputs", []))


def _printed(notebook):
  """Everything the cells printed (streams) and returned (text results), in order."""
  parts = []
  for cell in notebook.cells:
    for output in cell.get("outputs", []):
      parts.append(output.get("text", "") or output.get("data", {}).get("text/plain", ""))
  return "".join(parts)


def _assert_installed_from_checkout(notebook):
  # The install cell found this checkout by walking up from notebooks/ and imported it,
  # not another installed copy.
  assert f"geonorm_jax from {os.path.join(REPO_ROOT, 'geonorm_jax')}\n" in _printed(notebook)


@pytest.mark.slow  # starts a Jupyter kernel
def test_explore_runs_executes_and_plots(tiny_run, monkeypatch):
  notebook = _execute("explore_runs.ipynb", monkeypatch, GEONORM_RUN_DIRS=tiny_run)
  _assert_installed_from_checkout(notebook)
  # Loss curves, throughput, and at least one per-layer figure.
  assert _image_count(notebook) >= 3
  printed = _printed(notebook)
  assert "tiny: " in printed and "No per-layer statistics" not in printed


@pytest.mark.slow
def test_quickstart_trains_plots_and_samples(tmp_path, monkeypatch):
  workdir = str(tmp_path / "quickstart")
  notebook = _execute("quickstart.ipynb", monkeypatch, GEONORM_QUICKSTART_WORKDIR=workdir,
                      GEONORM_QUICKSTART_CONFIG=f"{TINY},placement=geonorm,train.steps=3,"
                      "train.eval_every=3,train.layer_stats_every=0",
                      GEONORM_QUICKSTART_TOKENS="12")
  _assert_installed_from_checkout(notebook)
  assert _image_count(notebook) >= 1
  printed = _printed(notebook)
  assert "placement geonorm, 1 blocks x d_model 32, 3 steps" in printed
  assert metrics.read_summary(workdir)["final_step"] == 3  # it trained where it was told
  steps, _ = metrics.read_scalar_series(workdir, "loss", split="eval")
  assert list(steps) == [3]
  # The sample: the prompt and twelve generated characters, printed last.
  sample_text = notebook.cells[-2].outputs[-1]["text"]
  assert sample_text.startswith("The ") and len(sample_text.rstrip("\n")) >= len("The ") + 6


def test_committed_notebooks_carry_no_outputs():
  assert len(NOTEBOOKS) >= 4
  for path in NOTEBOOKS:
    with open(path, encoding="utf-8") as f:
      notebook = json.load(f)  # the file as committed, not as nbformat would upgrade it
    for index, cell in enumerate(notebook["cells"]):
      if cell["cell_type"] == "code":
        assert cell["outputs"] == [], f"{path} cell {index} has outputs"
        assert cell["execution_count"] is None, f"{path} cell {index} has an execution count"


def test_every_notebook_opens_with_the_same_install_cell():
  """The install cell is copied into each notebook (nothing is importable before it runs), so
  the copies must not drift; its repository URL is the one the README names."""
  first_code_cells = []
  for path in NOTEBOOKS:
    notebook = nbformat.read(path, as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    first_code_cells.append(code[0])
  assert len(set(first_code_cells)) == 1, "the notebooks' install cells differ"
  url = re.search(r'"(https://[^"]+)"', first_code_cells[0]).group(1)
  with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
    assert url in f.read()


@pytest.mark.slow
def test_norm_zoo_compares_results_and_a_run(tiny_run, monkeypatch):
  notebook = _execute("norm_zoo.ipynb", monkeypatch, GEONORM_RUN_DIRS=tiny_run)
  _assert_installed_from_checkout(notebook)
  # Loss by placement, tied vs untied, per-layer profiles, collapse, and the run's statistics.
  assert _image_count(notebook) >= 5
  printed = _printed(notebook)
  assert "not found" not in printed and "no per-layer statistics" not in printed
  # Pre-LN's row of the committed table: seeds, mean and sample std, computed here with csv.
  with open(os.path.join(REPO_ROOT, "results", "shakespeare", "results.csv")) as f:
    rows = list(csv.DictReader(f))
  pre = np.array([float(r["final_eval_loss"]) for r in rows if r["variant"] == "pre"])
  assert f"\n{'pre':22s} {len(pre):5d} {pre.mean():7.3f} {pre.std(ddof=1):7.3f} " in printed
  # Every run whose collapse warning fired is named with its step; the checkpoint re-measured.
  for r in rows:
    if r["collapse_step"]:
      assert f"{r['name']} warned of collapse from step {r['collapse_step']} " in printed
  assert re.search(r"tiny \(pre, step 4\): token cosine 0\.\d{3}, logit spread", printed)


@pytest.mark.slow
def test_hessian_analyses_a_checkpoint_and_plots_the_weight_scale_result(tiny_run, monkeypatch):
  # One probe: the density comes from the top run alone, so one Lanczos program compiles.
  notebook = _execute("hessian.ipynb", monkeypatch, GEONORM_HESSIAN_RUN=tiny_run,
                      GEONORM_HESSIAN_SETTINGS="num_steps=4,num_probes=1,num_batches=1,top_k=3")
  _assert_installed_from_checkout(notebook)
  # Density and top eigenvalues, the command's own density figure, the weight-scale grid.
  assert _image_count(notebook) >= 3
  with open(os.path.join(tiny_run, "hessian", "step_4.json")) as f:
    stored = json.load(f)
  assert stored["settings"]["num_steps"] == 4 and stored["settings"]["top_k"] == 3
  printed = _printed(notebook)
  assert f"lambda_1 = {stored['lanczos']['top_eigenvalues'][0]:.5g} " in printed
  # SimpleNorm's MLP input Hessian against the weight scale: the slope, fitted here, in the
  # section of each backbone whose results are committed (gpt2's at least).
  results = os.path.join(REPO_ROOT, "results", "hessian_vs_weight_scale")
  backbones = [backbone for backbone in ("llama", "gpt2")
               if os.path.exists(os.path.join(results, backbone, "results.csv"))]
  assert "gpt2" in backbones
  # "<backbone>: the claim's quantity, ..." opens each backbone's lines, in that order.
  sections = printed.split(": the claim's quantity, Hessian w.r.t. the input")
  assert len(sections) == len(backbones) + 1
  for index, backbone in enumerate(backbones):
    assert sections[index].endswith(backbone)
    section = sections[index + 1]
    with open(os.path.join(results, backbone, "results.csv")) as f:
      by_c = {}
      for r in csv.DictReader(f):
        if (r["placement"], r["scope"], r["quantity"]) == ("simplenorm", "up", "act_in"):
          by_c.setdefault(float(r["c"]), []).append(np.log(float(r["lambda_max"])))
    c = sorted(by_c)  # the geometric mean over seeds at each c
    slope = np.polyfit(np.log(c), [np.mean(by_c[value]) for value in c], 1)[0]
    assert f"simplenorm           up : slope {slope:+.2f}\n" in section


def _find_checkout_function():
  """The install cell's find_checkout, compiled alone (the cell itself would clone or pip)."""
  notebook = nbformat.read(NOTEBOOKS[0], as_version=4)
  source = next(cell.source for cell in notebook.cells if cell.cell_type == "code")
  tree = ast.parse(source)
  function = next(node for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name == "find_checkout")
  namespace = {"os": os}
  exec(compile(ast.Module([function], []), "install cell", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["find_checkout"]


def test_install_cell_finds_the_checkout_or_its_clone(tmp_path):
  find_checkout = _find_checkout_function()
  assert find_checkout(NOTEBOOK_DIR) == REPO_ROOT  # walks up from notebooks/
  assert find_checkout(os.path.join(REPO_ROOT, "geonorm_jax")) == REPO_ROOT
  # A fresh runtime (Colab's /content): nothing yet, so the cell clones into ./geonorm_jax;
  # run again, it finds that clone instead of cloning twice.
  content = tmp_path / "content"
  content.mkdir()
  assert find_checkout(str(content)) is None
  (content / "geonorm_jax").mkdir()
  (content / "geonorm_jax" / "setup.py").write_text('setup(\n    name="geonorm_jax",\n)\n')
  assert find_checkout(str(content)) == str(content / "geonorm_jax")
  # Another project's setup.py on the way up is not ours.
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "setup.py").write_text('setup(name="something_else")\n')
  assert find_checkout(str(tmp_path / "other")) is None
