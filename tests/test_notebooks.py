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

from geonorm_jax.studies import claims, sweep
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


# Thirty steps, checkpoints at 10, 20 and 30, per-layer statistics every 5 steps, and spikes
# judged with a low threshold after 5 steps (as tests/test_replay.py): spikes to replay.
SPIKY = (f"{TINY},train.steps=30,train.eval_every=10,train.layer_stats_every=5,"
         "checkpoint.every=10,train.spike_zscore=0.5,train.spike_warmup=5")
# The kernel's devices and compiler flags are this process's (conftest), so a replay in the
# notebook runs the programs the run was trained with.
EIGHT_DEVICES = dict(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{os.environ['XLA_FLAGS']} "
                     "--xla_force_host_platform_device_count=8")


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("runs") / "spiky")
  train.train(config_lib.get_config(SPIKY), workdir)
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


# lr_sensitivity: made-up final losses over a grid, per (variant, width); seed 101's are 0.02
# higher wherever they lie below the loss at initialisation. pre_llama's grids hold a loss above
# L0 (capped at L0) and NaNs (runs without a finite loss, counted at L0).
NAN = float("nan")
SENSITIVITY_LRS = (1e-3, 4e-3, 1.6e-2, 6.4e-2, 0.256)
SENSITIVITY_GRIDS = {("pre_llama", 32): [1.80, 1.62, 2.40, 6.30, NAN],
                     ("simplenorm_llama", 32): [1.75, 1.60, 1.63, 1.70, 2.10],
                     ("pre_llama", 64): [1.70, 1.52, 2.90, NAN, NAN],
                     ("simplenorm_llama", 64): [1.66, 1.50, 1.52, 1.58, 1.90]}
SENSITIVITY_SEEDS = {100: 0.0, 101: 0.02}
INITIAL_LOSS = {32: 5.55, 64: 5.60}  # the runs' first train loss, the same at every LR


def _final_loss(variant, width, seed, index):
  loss = SENSITIVITY_GRIDS[variant, width][index]
  return loss + SENSITIVITY_SEEDS[seed] if loss < INITIAL_LOSS[width] else loss


def _lr_sensitivity_folder(out):
  """A results folder of experiments/lr_sensitivity.py as claims.run writes it: rows in
  claims.collect's columns, the run names of the experiment, sweep's writers, and
  claims.report's table, verdict and figures."""
  experiment = claims.load_experiment("lr_sensitivity")
  rows, curves = [], []
  for (variant, width) in SENSITIVITY_GRIDS:
    for seed in SENSITIVITY_SEEDS:
      for index, lr in enumerate(SENSITIVITY_LRS):
        name = f"{experiment.run_name(variant, width, 'judge')}/lr{lr:g}/seed{seed}"
        final = _final_loss(variant, width, seed, index)
        rows.append(dict(variant=variant, width=width, lr=lr,
                         stage="select" if seed == 100 else "sweep", name=name, seed=seed,
                         params=100000, steps=2000, tokens=2000 * 16 * 128,
                         final_eval_loss=final, final_train_loss=final, step_time_s=0.1,
                         loss_spikes=0, skipped_steps=0, collapse_step=None))
        curves += [dict(name=name, split="train", key="loss", step=1, value=INITIAL_LOSS[width]),
                   dict(name=name, split="train", key="loss", step=2000, value=final),
                   dict(name=name, split="eval", key="loss", step=2000, value=final)]
  os.makedirs(out)
  sweep.write_csv(os.path.join(out, "results.csv"), rows)
  sweep.write_csv(os.path.join(out, "curves.csv"), curves)
  lrs = ",".join(f"{lr:g}" for lr in SENSITIVITY_LRS)
  scale = experiment.SCALES["judge"]
  sweep.write_config(os.path.join(out, "config.json"), experiment=experiment.NAME,
                     claim=experiment.CLAIM, scale="judge", scale_note=scale.note,
                     command=f"python experiments/lr_sensitivity.py --widths=32,64 --lrs={lrs} "
                     "--seeds=100,101", config_file=scale.config_file,
                     args=dict(scale="judge", seeds="100,101", quick=False, extra="", lrs=lrs,
                               selection_seed=100, variants="pre_llama,simplenorm_llama",
                               widths="32,64"),
                     runs={row["name"]: "" for row in rows}, missing=[])
  claims.report(out)


def _sensitivity_by_hand(variant, width):
  """S per the experiment's docstring, mean over the seeds: the grid's losses capped at L0 (a
  NaN counts at L0), their mean minus their min."""
  values = []
  for seed in SENSITIVITY_SEEDS:
    capped = []
    for index in range(len(SENSITIVITY_LRS)):
      loss = _final_loss(variant, width, seed, index)
      capped.append(INITIAL_LOSS[width] if loss != loss else min(loss, INITIAL_LOSS[width]))
    values.append(sum(capped) / len(capped) - min(capped))
  return values


@pytest.mark.slow
def test_stability_plots_lr_sensitivity_mechanisms_and_a_replayed_spike(spiky_run, tmp_path,
                                                                       monkeypatch):
  results = str(tmp_path / "lr_sensitivity")
  _lr_sensitivity_folder(results)
  notebook = _execute("stability.ipynb", monkeypatch, GEONORM_LR_SENSITIVITY_DIR=results,
                      GEONORM_STABILITY_RUN=spiky_run, GEONORM_REPLAY_AFTER="3", **EIGHT_DEVICES)
  _assert_installed_from_checkout(notebook)
  # Loss against LR and S against width; the mechanisms figure; the replay's losses and its
  # per-layer statistics.
  assert _image_count(notebook) == 5
  printed = _printed(notebook)
  # S of each cell, computed here from the constructed losses; simplenorm_llama's d = 32 row
  # whole: best loss 1.60 and 1.62 (seed 101's +0.02), optimum 4e-3, within 0.05 of its 1.60
  # up to 1.6e-2 (1.63), not 6.4e-2 (1.70).
  for variant, width in SENSITIVITY_GRIDS:
    s = _sensitivity_by_hand(variant, width)
    assert f"\n{variant:18s} {width:5d} {2:5d} {np.mean(s):7.3f} " in printed, (variant, width)
  s = _sensitivity_by_hand("simplenorm_llama", 32)
  assert (f"\n{'simplenorm_llama':18s} {32:5d} {2:5d} {np.mean(s):7.3f} "
          f"{f'{min(s):.3f}-{max(s):.3f}':>13s} {1.61:9.3f} {'0.004':>14s} {'0.016':>10s} "
          f"{'4x':>6s}\n" in printed)
  with open(os.path.join(results, "verdict.json")) as f:
    verdict = json.load(f)
  assert f"verdict.json: {verdict['verdict']}: {verdict['result']}\n" in printed
  # The first spike of the run's metrics, its z-scores, and a replay that reproduced the run.
  spikes = {r["step"]: r for r in metrics.read_metrics(spiky_run) if r["split"] == "spikes"}
  first = spikes[min(spikes)]
  assert (f"\nfirst spike: step {first['step']}: loss {first['loss']:.4f} "
          f"(z {first['loss_z']:+.3f} against ") in printed
  assert f"gradient norm {first['grad_norm']:.4f} (z {first['grad_norm_z']:+.3f} " in printed
  to_step = first["step"] + 3
  replay_dir = os.path.join(spiky_run, "replays", f"from{first['step'] - 1}_to{to_step}")
  replayed = {r["step"]: r["loss"] for r in metrics.read_metrics(replay_dir)
              if r["split"] == "train"}
  run_losses = {r["step"]: r["loss"] for r in metrics.read_metrics(spiky_run)
                if r["split"] == "train"}
  assert replayed and replayed == {step: run_losses[step] for step in replayed}
  assert max(replayed) == to_step
  assert (f"losses: equal to the run's bit for bit at all {len(replayed)} steps compared "
          f"({min(replayed)}-{to_step})\n") in printed
  assert "gradient norms: equal to the run's bit for bit" in printed and "(the same)" in printed
  assert "per-layer statistics: equal to the run's bit for bit at the " in printed


@pytest.mark.slow
def test_stability_without_results_or_spikes_says_so(tiny_run, tmp_path, monkeypatch):
  missing = str(tmp_path / "no_results")
  notebook = _execute("stability.ipynb", monkeypatch, GEONORM_LR_SENSITIVITY_DIR=missing,
                      GEONORM_STABILITY_RUN=tiny_run)
  assert _image_count(notebook) == 1  # the mechanisms only
  printed = _printed(notebook)
  assert (f"{missing} has no results.csv yet: `python experiments/lr_sensitivity.py` writes it"
          in printed)
  assert "tiny has no spike: no step's loss or gradient norm lay more than " in printed
  assert "nothing to replay" in printed and not os.path.exists(os.path.join(tiny_run, "replays"))
