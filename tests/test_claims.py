"""The claim experiments: the statistics and definitions they share against hand-computed
cases, every experiment run at its smallest settings (the files and columns it writes), the
report command rebuilding them from the files alone, and the paper-scale configs lowering on
the 8 fake devices without allocating a parameter."""
import json
import math
import os
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fast_compile  # tests/ is on sys.path (no __init__.py)

from geonorm_jax.studies import claims, sweep
from geonorm_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = ("norm_zoo", "geonorm_decay", "seq_length", "update_balance", "lr_tolerance",
               "depth_growth", "residual_step", "divergence_trials", "lr_sensitivity")
# One layer of width 32, three steps: each run is a few seconds of compilation. No layer
# statistics (they add a program and grow the train step) except where an experiment reads
# them (LAYER_STATS).
TINY = ("steps=3,warmup_steps=1,eval_batches=1,eval_every=3,checkpoint.every=3,"
        "layer_stats_every=0,log_every=1,model.d_model=32,model.num_heads=2,async_save=false")
LAYER_STATS = {"update_balance": "layer_stats_every=2", "depth_growth": "layer_stats_every=2"}
# The three LR-grid experiments run on one --root, so that they share the LR-grid runs (and
# here, on the same variant, the final run too) as they do under runs/claims/lr_grid: the norm
# zoo trains, lr_tolerance and lr_sensitivity collect the same finished runs (check_finished
# compares every field of their configs with the saved ones first).
SHARED_ROOT = {"norm_zoo": "tuned", "lr_tolerance": "tuned", "lr_sensitivity": "tuned"}
# The smallest grid of each experiment (one train run, one seed; depth_growth adds its init
# measurement), and its figures.
SMALLEST = {
    # The LR protocol at its smallest with a choice to make: two grid LRs on the selection
    # seed, no extension, then the final seed at the better one.
    "norm_zoo": (["--variants=geonorm", "--lrs=1e-3,2e-3", "--max_extensions=0"],
                 ["loss_curves.png", "final_loss.png", "loss_vs_lr.png"]),
    # The alpha selection at its smallest: one alpha on the selection seed, no extension, then
    # the final seed at it.
    "geonorm_decay": (["--schedules=harmonic", "--alphas=1", "--counters=sublayers",
                       "--max_extensions=0"], ["loss_vs_alpha.png"]),
    "seq_length": (["--variants=post", "--seq_lens=64"],
                   ["spikes_vs_length.png", "loss_curves_longest.png"]),
    "update_balance": (["--variants=pre"], ["per_layer.png", "first_last_over_training.png"]),
    # The norm zoo's grid and variant: its runs.
    "lr_tolerance": (["--variants=geonorm", "--lrs=1e-3,2e-3", "--max_extensions=0"],
                     ["loss_vs_lr.png"]),
    "depth_growth": (["--variants=pre", "--depths=2", "--trained_depths=2"],
                     ["rms_per_block.png"]),
    "residual_step": (["--variants=peri", "--dts=0.1"], ["loss_vs_dt.png"]),
    "divergence_trials": (["--variants=pre", "--weight_decays=0"], ["loss_curves.png"]),
    # One width, two LRs: the LR-sensitivity number of a two-point grid. The scale's own width
    # (128: no width override, so TINY's d_model=32 is the model) on its default seed, the
    # selection seed: the norm zoo's two grid runs.
    "lr_sensitivity": (["--variants=geonorm", "--widths=128", "--lrs=1e-3,2e-3", "--seeds=100"],
                       ["loss_vs_lr.png", "sensitivity_vs_width.png"]),
}
# Rows of the smallest settings, when not one (a tuned one: selection and final runs).
RUNS = {"depth_growth": 2, "norm_zoo": 3, "lr_tolerance": 3, "lr_sensitivity": 2,
        "geonorm_decay": 2}
LABELS = {"norm_zoo": ["variant", "lr", "stage"],
          "geonorm_decay": ["schedule", "counter", "alpha", "stage"],
          "seq_length": ["variant", "seq_len"], "update_balance": ["variant", "lr"],
          "lr_tolerance": ["variant", "lr", "stage"], "depth_growth": ["phase", "variant", "depth"],
          "residual_step": ["variant", "dt"], "divergence_trials": ["variant", "weight_decay"],
          "lr_sensitivity": ["variant", "width", "lr", "stage"]}


def load(name):
  return claims.load_experiment(name)


# ---------------------------------------------------------------------------
# Shared statistics and definitions, against hand-computed cases.
# ---------------------------------------------------------------------------

def test_fmt_reports_mean_sample_std_and_seed_count():
  assert claims.fmt([1.0, 3.0]) == f"2.000 +- {np.std([1.0, 3.0], ddof=1):.3f} (2 seeds)"
  assert claims.fmt([2.5]) == "2.500 (1 seed)"
  assert claims.fmt([1.0, float("nan"), 3.0]).endswith("(3 seeds, 1 non-finite)")


def test_diverged_is_a_nonfinite_step_or_a_loss_above_its_first_after_warmup():
  curves = [{"name": "r", "split": "train", "key": "loss", "step": s, "value": v}
            for s, v in [(1, 5.5), (2, 6.0), (3, 4.0), (4, 3.0)]]
  row = {"name": "r", "skipped_steps": 0, "final_train_loss": 3.0}
  assert not claims.diverged(row, curves, warmup_steps=2)  # the 6.0 is inside the warmup
  assert claims.diverged(row, curves, warmup_steps=1)
  assert claims.diverged({**row, "skipped_steps": 1}, curves, warmup_steps=2)
  assert claims.diverged({**row, "final_train_loss": float("nan")}, curves, warmup_steps=2)


def test_growth_law_fits():
  fit_law = load("depth_growth").fit_law
  blocks = np.arange(1, 49)
  law, growth = fit_law(0.5 * 1.1 ** blocks)
  assert law == "exponential" and growth == pytest.approx(1.1)
  law, exponent = fit_law(0.3 * blocks ** 0.5)
  assert law == "power" and exponent == pytest.approx(0.5)
  assert fit_law(2.0 * blocks) == ("power", pytest.approx(1.0))
  assert fit_law(1.0 + 0.01 * np.sin(blocks))[0] == "flat"
  assert fit_law([1.0, float("nan")])[0] == "non-finite"


def test_lr_tolerance_is_the_largest_lr_within_the_margin_of_the_optimum():
  tolerance = load("lr_tolerance").tolerance
  grid = {1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.92, 8e-3: 1.97, 1.6e-2: 2.3}
  t = tolerance(grid, sigma=0.0, df=2)  # no seed noise: 4e-3 is 0.02 above, 8e-3 0.07
  assert (t.optimum.x, t.low, t.high) == (2e-3, 4e-3, 4e-3)
  # Within again past a loss outside the margin does not count: the loss must stay within.
  t = tolerance({**grid, 8e-3: 2.5, 1.6e-2: 1.91, 3.2e-2: 1.91}, sigma=0.0, df=2)
  assert (t.low, t.high) == (4e-3, 4e-3)
  # Seed noise: half-width t(0.975, 2) x 0.01 x sqrt(2) = 0.061 leaves 4e-3 and 8e-3 undecided.
  t = tolerance(grid, sigma=0.01, df=2)
  assert t.half_width == pytest.approx(4.302653 * 0.01 * math.sqrt(2), rel=1e-6)
  assert (t.low, t.high) == (2e-3, 8e-3)
  # Nothing above the optimum surely outside: the tolerance may go past the grid.
  assert tolerance({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.92}, sigma=0.0, df=2).high == math.inf
  # A diverged (non-finite) run is outside whatever the noise; no spread: nothing is within.
  t = tolerance({1e-3: 2.0, 2e-3: 1.9, 4e-3: float("nan")}, sigma=float("nan"), df=0)
  assert (t.low, t.high) == (2e-3, 2e-3)


def test_lr_tolerance_shares_the_norm_zoo_lr_grid_runs():
  """Its grid is the norm zoo's continued by doubling to about 0.5; the norm zoo's variants
  are the same runs in the same shared folder, and its LLaMA-backbone ones never collide."""
  zoo, tolerance = load("norm_zoo"), load("lr_tolerance")
  lrs = [float(x) for x in tolerance.TUNED_LRS["judge"].split(",")]
  zoo_lrs = [float(x) for x in zoo.TUNED_LRS["judge"].split(",")]
  assert lrs[:len(zoo_lrs)] == zoo_lrs and 0.4 <= lrs[-1] <= 0.6
  assert all(b == pytest.approx(2 * a) for a, b in zip(lrs, lrs[1:]))
  zoo_runs = {r.name: r for r in claims.make_runs(zoo, claims.parse_args(
      zoo, ["--variants=pre,simplenorm"]))}
  runs = {r.name: r for r in claims.make_runs(tolerance, claims.parse_args(
      tolerance, ["--variants=pre,simplenorm," + ",".join(tolerance.DECIDING)]))}
  assert set(zoo_runs) <= set(runs) and all(runs[n] == zoo_runs[n] for n in zoo_runs)
  for name, run in runs.items():  # the deciding variants: the LLaMA backbone, their own names
    variant = name.split("/")[0]
    llama = variant in tolerance.DECIDING
    assert run.config().model.backbone == ("llama" if llama else "gpt2"), name
    assert llama != (variant in sweep.PLACEMENT_VARIANTS), name


def test_every_grid_has_unique_runs_and_the_cli_train_command():
  for name in EXPERIMENTS:
    module = load(name)
    for scale in module.SCALES:
      args = claims.parse_args(module, [f"--scale={scale}"])
      runs = claims.make_runs(module, args)
      assert runs and len({r.name for r in runs}) == len(runs), (name, scale)
      assert runs[0].config_file == module.SCALES[scale].config_file
      assert runs[0].command()[2:4] == ["geonorm_jax", "train"]
    quick = claims.make_runs(module, claims.parse_args(module, ["--quick"]))
    assert len(quick) <= len(claims.make_runs(module, claims.parse_args(module, []))), name
    # A tuned experiment's quick runs: the one grid LR on the selection seed (final seed 0).
    assert {r.seed for r in quick} <= {0, claims.SELECTION_SEED}, name


# ---------------------------------------------------------------------------
# Paper scale: every run's config is valid; the largest programs lower on a fake mesh.
# ---------------------------------------------------------------------------

def _config_of(run):
  config = sweep.load_config(run.config_file, run.overrides, run.seed)
  # The paper's corpora are not in the repository; the lowering needs only their shapes.
  config.data.source, config.data.path, config.data.val_path = "builtin", "", ""
  config.data.tokenizer = "byte"
  return config


def _paper_runs(name):
  module = load(name)
  return claims.make_runs(module, claims.parse_args(module, ["--scale=paper", "--seeds=0"]))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_paper_scale_configs_are_valid(name):
  for run in _paper_runs(name):
    config = _config_of(run)
    train.validate(config, num_devices=8)
    assert config.model.d_model >= 768, run.name  # the papers' widths, not the tiny model


@pytest.mark.slow  # traces three 124M-1B train steps
@pytest.mark.parametrize("name,pick", [("seq_length", -1), ("lr_tolerance", 0),
                                       ("residual_step", 0)])
def test_paper_scale_lowers_on_a_fake_mesh(name, pick):
  """GeoNorm's 125M at length 4096, SimpleGPT's 1B, GPT-2 124M: no parameter allocated.

  At the paper's width, heads, sequence length, batch and mesh, with two of its blocks: every
  block is the same program with the same shapes and shardings, so the depth changes nothing
  the lowering checks (the full configs are validated above), while tracing 12-18 blocks
  took most of the test's time."""
  run = _paper_runs(name)[pick]
  config = _config_of(run)
  assert config.model.num_layers >= 12, run.name  # the paper's depth, cut here
  config.model.num_layers = 2
  setup = train.make_setup(config)
  abstract = train.sharded_abstract_state(setup)
  shape = (config.train.grad_accum, config.data.batch_size, config.data.seq_len + 1)
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sharding)
  text = train.make_train_step(setup).lower(abstract, tokens).as_text()
  assert "mhlo.num_partitions = 8" in text
  assert f"tensor<{shape[0]}x{shape[1]}x{shape[2]}xi32>" in text


# ---------------------------------------------------------------------------
# Every experiment at its smallest settings, then report on its folder.
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """name -> results folder of each experiment run at its smallest settings (shared)."""
  base = tmp_path_factory.mktemp("claims")
  folders = {}
  with pytest.MonkeyPatch.context() as patch:
    # The train processes' environment (sweep.execute hands os.environ on to them).
    patch.chdir(REPO)  # the runs' config files and data paths are relative to the repository
    # One cache for every program of the runs (tests/fast_compile.py).
    for key, value in fast_compile.subprocess_env(base / "jax_cache").items():
      patch.setenv(key, value)
    for name, (flags, _) in SMALLEST.items():
      extra = claims.join(TINY, "" if name == "depth_growth" else "model.num_layers=1",
                          LAYER_STATS.get(name, ""))
      seeds = [] if any(f.startswith("--seeds=") for f in flags) else ["--seeds=0"]
      folders[name] = base / name
      # What `python experiments/NAME.py ARGS` runs (its __main__), without a Python and JAX
      # start of its own; the train runs are subprocesses as ever, one at a time (under
      # pytest-xdist the other core runs another test file).
      claims.run(load(name), [*flags, *seeds, "--jobs=1", f"--extra={extra}",
                              f"--root={base / 'runs' / SHARED_ROOT.get(name, name)}",
                              f"--out={folders[name]}"])
  return folders


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_writes_its_files_and_columns(results, name):
  folder = results[name]
  rows = claims.read_csv(folder / "results.csv")
  assert len(rows) == RUNS.get(name, 1)
  for column in LABELS[name] + ["name", "seed", "params", "final_eval_loss", "step_time_s",
                                "loss_spikes", "skipped_steps"]:
    assert column in rows[0], column
  assert all(math.isfinite(row["final_eval_loss"]) for row in rows)
  curves = claims.read_csv(folder / "curves.csv")
  assert curves and set(curves[0]) == {"name", "split", "key", "step", "value"}
  assert {c["name"] for c in curves} == {row["name"] for row in rows}
  config = json.loads((folder / "config.json").read_text())
  assert config["experiment"] == name and config["scale"] == "judge"
  trained = {row["name"] for row in rows if row["steps"]}  # depth_growth's init has none
  assert set(config["runs"]) == trained and len(trained) == len(rows) - (name == "depth_growth")
  assert config["command"].startswith(f"python experiments/{name}.py ")
  table = (folder / "table.md").read_text()
  seeds = sorted({row["seed"] for row in rows})
  assert f"Seeds: {', '.join(map(str, seeds))} ({len(rows)} finished runs)" in table
  assert "**Verdict:" in table
  verdict = json.loads((folder / "verdict.json").read_text())
  assert verdict["verdict"] in claims.VERDICTS and verdict["seeds"] == len(seeds)
  for figure in SMALLEST[name][1]:
    assert (folder / figure).stat().st_size > 5000, figure


@pytest.mark.slow
def test_report_rebuilds_every_folder_from_its_files(results):
  before = {name: (folder / "table.md").read_text() for name, folder in results.items()}
  for name, folder in results.items():
    for figure in SMALLEST[name][1] + ["table.md", "verdict.json"]:
      (folder / figure).unlink()
  out = subprocess.run([sys.executable, "-m", "geonorm_jax", "report",
                        *map(str, results.values())], cwd=REPO, check=True,
                       capture_output=True, text=True).stdout
  for name, folder in results.items():
    assert (folder / "table.md").read_text() == before[name]
    assert all((folder / figure).exists() for figure in SMALLEST[name][1])
    assert f"{folder}: " in out


def test_a_bad_override_is_one_error_before_any_run(tmp_path):
  module = load("residual_step")
  args = claims.parse_args(module, ["--extra=no_such_key=1", f"--root={tmp_path}"])
  with pytest.raises(SystemExit, match="no_such_key"):
    claims.make_runs(module, args)
  assert not os.listdir(tmp_path)


def test_report_names_a_folder_that_is_not_a_claim_folder(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    claims.report(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"experiment": "no_such_claim"}))
  with pytest.raises(FileNotFoundError, match="no_such_claim"):
    claims.report(str(tmp_path))


@pytest.mark.slow
def test_print_emits_one_train_command_per_run():
  out = subprocess.run([sys.executable, "experiments/residual_step.py", "--print",
                        "--seeds=0,1"], cwd=REPO, check=True, capture_output=True,
                       text=True).stdout.strip().splitlines()
  module = load("residual_step")
  runs = claims.make_runs(module, claims.parse_args(module, ["--seeds=0,1"]))
  assert [shlex.split(line) for line in out] == [r.command(python="python") for r in runs]
  assert len(out) == len(module.DTS.split(",")) * 2  # Peri-LN's dt x seeds


def test_the_recorded_command_is_the_one_that_trains_the_runs():
  """config.json's command: a reader retypes it to train the runs; --report_only would not,
  and where the runs went or how many ran at once changes no number."""
  experiment = claims.load_experiment("seq_length")
  default = os.path.join(claims.REPO, "results", "seq_length")
  argv = ["--seq_lens=512", "--report_only", "--jobs=2", "--out=/tmp/elsewhere", "--root=runs/x",
          "--recorded_from=results/norm_zoo"]
  assert claims._command(experiment, argv, default) == \
      "python experiments/seq_length.py --seq_lens=512"
  assert claims._command(experiment, argv[:1] + [f"--out={default}"], default) == \
      "python experiments/seq_length.py --seq_lens=512"
  # A folder of the repository other than the default stays, so that the retyped command
  # writes there and not over the default folder.
  other = os.path.join(claims.REPO, "results", "seq_length_wd0")
  assert claims._command(experiment, argv[:1] + [f"--out={other}"], default) == \
      "python experiments/seq_length.py --seq_lens=512 --out=results/seq_length_wd0"
