"""geonorm_decay's selection-seed protocol and its rule, without training: on a fake trainer,
each (schedule, counter) line's alpha grid grows past an edge optimum (on that side, at most
--max_extensions times) on the selection seed only, and the final seeds train exactly each
schedule's best cell; on constructed rows, the verdict reads only the final seeds' runs of the
cells the selection chose and agrees with a hand computation of the paired t intervals."""
import math
import os

import fake_sweep  # tests/ is on sys.path (no __init__.py)
import numpy as np
import pytest
from scipy import stats as scipy_stats

from geonorm_jax.studies import claims, sweep

SEEDS = (0, 1, 2)
SELECT = claims.SELECTION_SEED


def load():
  return claims.load_experiment("geonorm_decay")


# ---------------------------------------------------------------------------
# The protocol on a fake trainer.
# ---------------------------------------------------------------------------

# Each line's loss over alpha: a parabola in log2(alpha) around its best alpha. harmonic's
# sublayers line is the lower of its two; constant is best beyond the grid's top (256: three
# doublings), sqrt below its bottom (0.5), linear far beyond the top (the extensions run out).
BEST_ALPHA = {"harmonic": 16.0, "constant": 256.0, "sqrt": 0.5, "linear": 4096.0}
BASE = {("harmonic", "blocks"): 1.70, ("harmonic", "sublayers"): 1.65}
# A seed's shift, shared by every cell of that seed: the selection seed's is large, so that a
# final seed's loss is never a selection loss.
SEED_SHIFT = {SELECT: 0.3, 0: 0.0, 1: 0.01, 2: -0.005}


def _loss(schedule, counter, alpha, seed):
  return (BASE.get((schedule, counter), 1.75) + SEED_SHIFT[seed]
          + 0.01 * math.log2(alpha / BEST_ALPHA[schedule]) ** 2)


def _run_loss(run):
  labels = dict(run.labels)
  return _loss(labels["schedule"], labels["counter"], labels["alpha"], run.seed)


def _check_alpha(run, config):
  assert config.model.geo_alpha == dict(run.labels)["alpha"], run.name  # the knob's override


def _run(monkeypatch, tmp_path, *flags, unfinished=()):
  trained = []
  monkeypatch.setattr(sweep, "execute",
                      fake_sweep.execute(trained, _run_loss, unfinished, _check_alpha))
  decay = load()
  args = claims.parse_args(decay, [*fake_sweep.dirs(tmp_path), "--schedules=harmonic,constant,sqrt,"
                                   "linear", "--counters=blocks,sublayers", *flags])
  return claims.run_tuned(decay, args), trained


def _grids(runs):
  """{(schedule, counter): sorted selection alphas}, checking every selection run's seed."""
  grids = {}
  for r in runs:
    labels = dict(r.labels)
    if labels["stage"] == "select":
      assert r.seed == SELECT, r.name
      grids.setdefault((labels["schedule"], labels["counter"]), []).append(labels["alpha"])
  return {line: sorted(alphas) for line, alphas in grids.items()}


START = [1.0, 4.0, 16.0, 32.0, 64.0]


def test_each_line_extends_on_its_edge_side_and_the_final_seeds_train_the_best_cells(
    monkeypatch, tmp_path):
  runs, trained = _run(monkeypatch, tmp_path)
  grids = _grids(runs)
  for counter in ("blocks", "sublayers"):
    assert grids[("harmonic", counter)] == START  # 16 interior: nothing added
    assert grids[("constant", counter)] == START + [128.0, 256.0, 512.0]  # 64, 128, 256 edges
    assert grids[("sqrt", counter)] == [0.25, 0.5] + START  # 1, then 0.5 on the bottom edge
    assert grids[("linear", counter)] == START + [128.0, 256.0, 512.0]  # 3 extensions: stop
  final = {(dict(r.labels)["schedule"], dict(r.labels)["counter"], dict(r.labels)["alpha"],
            r.seed) for r in runs if dict(r.labels)["stage"] == "final"}
  # harmonic's best line is sublayers (lower on the selection seed); the others' lines tie, and
  # the first (blocks) wins.
  best = {"harmonic": ("sublayers", 16.0), "constant": ("blocks", 256.0),
          "sqrt": ("blocks", 0.5), "linear": ("blocks", 512.0)}
  assert final == {(s, c, a, seed) for s, (c, a) in best.items() for seed in SEEDS}
  assert len(trained) == len(set(trained)) == len(runs)  # only new runs trained
  assert len(runs) == 2 * (5 + 8 + 7 + 8) + 4 * 3
  for r in runs:  # the layout: the LR in the name, never the earlier .../alpha{a}/{counter}/...
    labels = dict(r.labels)
    assert r.name == (f"{labels['schedule']}/{labels['counter']}/lr0.002/"
                      f"alpha{labels['alpha']:g}/seed{r.seed}")
    assert r.workdir.startswith(str(tmp_path)) and "lr_grid" not in r.workdir
    assert r.config().train.lr == 2e-3  # the judge scale's stated LR


def test_the_extensions_stop_at_max_extensions(monkeypatch, tmp_path):
  runs, _ = _run(monkeypatch, tmp_path, "--max_extensions=1")
  grids = _grids(runs)
  assert grids[("constant", "blocks")] == START + [128.0]
  assert grids[("sqrt", "blocks")] == [0.5] + START
  assert grids[("harmonic", "blocks")] == START


def test_an_unfinished_selection_run_extends_nothing(monkeypatch, tmp_path):
  runs, _ = _run(monkeypatch, tmp_path, unfinished={"constant/blocks/lr0.002/alpha4/seed100"})
  grids = _grids(runs)
  assert grids[("constant", "blocks")] == START  # its best, 64, is an edge: no extension
  assert grids[("constant", "sublayers")] == START + [128.0, 256.0, 512.0]


def test_quick_is_one_alpha_and_no_extension(monkeypatch, tmp_path):
  runs, trained = _run(monkeypatch, tmp_path, "--quick")
  assert {(dict(r.labels)["alpha"], dict(r.labels)["counter"], dict(r.labels)["stage"], r.seed)
          for r in runs} == {(1.0, "blocks", "select", SELECT), (1.0, "blocks", "final", 0)}
  assert len(runs) == len(trained) == 8  # 4 schedules x (one selection run + one final)


@pytest.mark.parametrize("flag,message", [
    ("--alphas=0,1,4", "every alpha must be > 0"),
    ("--alphas=1,x", "not a comma list of numbers"),
    ("--lr=fast", "--lr: 'fast' is not a number"),
])
def test_a_bad_grid_is_one_error_before_any_run(tmp_path, flag, message):
  decay = load()
  with pytest.raises(SystemExit, match=message):
    claims.make_runs(decay, claims.parse_args(decay, [*fake_sweep.dirs(tmp_path), flag]))
  assert not os.listdir(tmp_path)


def test_the_selection_seed_is_never_a_final_seed(tmp_path):
  with pytest.raises(SystemExit):
    claims.parse_args(load(), [*fake_sweep.dirs(tmp_path), f"--seeds=0,{SELECT}"])


# ---------------------------------------------------------------------------
# The rule on constructed rows.
# ---------------------------------------------------------------------------

ALPHAS = (1.0, 4.0, 16.0, 32.0, 64.0)
SCHEDULES = ("constant", "harmonic", "sqrt", "linear", "linear_paper")
CONFIG = {"scale": "judge", "experiment": "geonorm_decay", "args": {"lr": "2e-3"}}


def row(schedule, counter, alpha, stage, seed, loss):
  return {"schedule": schedule, "counter": counter, "alpha": alpha, "stage": stage,
          "name": f"{schedule}/{counter}/lr0.002/alpha{alpha:g}/seed{seed}", "seed": seed,
          "final_eval_loss": loss, "final_train_loss": loss, "steps": 2000, "params": 1000,
          "step_time_s": 0.3, "tokens": 0, "loss_spikes": 0, "skipped_steps": 0}


def decay_rows(final, best_alpha=None, select_base=None):
  """Selection rows of every schedule's blocks line (a parabola in log2 alpha around
  best_alpha[schedule], default 16: interior), and final rows of the selected cell:
  final[schedule] = [loss at seed 0, 1, 2]."""
  best_alpha, select_base = best_alpha or {}, select_base or {}
  rows = []
  for schedule, losses in final.items():
    best = best_alpha.get(schedule, 16.0)
    for alpha in ALPHAS:
      rows.append(row(schedule, "blocks", alpha, "select", SELECT, select_base.get(
          schedule, 1.70) + 0.02 * math.log2(alpha / best) ** 2))
    chosen = min(ALPHAS, key=lambda a: abs(math.log2(a / best)))
    rows += [row(schedule, "blocks", chosen, "final", seed, loss)
             for seed, loss in zip(SEEDS, losses)]
  return rows


OTHERS = {"constant": [1.66, 1.69, 1.65], "sqrt": [1.67, 1.70, 1.66],
          "linear": [1.68, 1.70, 1.67], "linear_paper": [1.66, 1.70, 1.66]}


def _hand_interval(a, b):
  """mean(a - b) with its 95% t interval over the seeds, from the formula."""
  d = np.asarray(a) - np.asarray(b)
  half = scipy_stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
  return f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"


@pytest.mark.parametrize("harmonic,others,expected", [
    ([1.60, 1.64, 1.59], OTHERS, "reproduced"),  # 0.06-0.08 below every other, every seed
    ([1.60, 1.64, 1.59], {**OTHERS, "constant": [1.55, 1.575, 1.54]}, "not at this scale"),
    ([1.60, 1.75, 1.55], OTHERS, "unresolved"),  # below on average, in noise
])
def test_the_rule_agrees_with_a_hand_computation(harmonic, others, expected):
  summary = load().summarize(decay_rows({"harmonic": harmonic, **others}), [], CONFIG)
  assert summary.verdict == expected, summary.result
  for schedule, losses in others.items():
    assert f"{schedule} (alpha 16, k=blocks) {_hand_interval(harmonic, losses)}" in \
        summary.result


def test_contradicted_at_paper_scale():
  rows = decay_rows({"harmonic": [1.60, 1.64, 1.59], **OTHERS,
                     "constant": [1.55, 1.575, 1.54]})
  assert load().summarize(rows, [], {**CONFIG, "scale": "paper"}).verdict == "contradicted"


def test_an_edge_optimum_is_unresolved():
  rows = decay_rows({"harmonic": [1.60, 1.64, 1.59], **OTHERS}, best_alpha={"harmonic": 128.0})
  summary = load().summarize(rows, [], CONFIG)
  assert summary.verdict == "unresolved"
  assert "optimum at the grid edge" in summary.result
  assert "harmonic, k=blocks: best alpha 64" in summary.result
  assert "| harmonic | blocks | 64 (edge) |" in "\n".join(summary.table)


def test_the_verdict_reads_only_the_final_seeds_of_the_selected_cells():
  """The selection seed (its rows: harmonic 1.70, constant 1.20 at the chosen alpha) says
  constant is far below harmonic, and final-stage rows of a cell the selection did not choose
  (harmonic at alpha 4, far below everything) are present: neither changes the verdict or its
  numbers, those of the chosen cells' three final seeds."""
  harmonic = [1.60, 1.64, 1.59]
  rows = decay_rows({"harmonic": harmonic, **OTHERS}, select_base={"constant": 1.20})
  decoy = [row("harmonic", "blocks", 4.0, "final", s, 1.0) for s in SEEDS]
  for extra in ([], decoy):
    summary = load().summarize(rows + extra, [], CONFIG)
    assert summary.verdict == "reproduced", summary.result
    assert f"constant (alpha 16, k=blocks) {_hand_interval(harmonic, OTHERS['constant'])}" in \
        summary.result
    assert "paired over 3 seeds" in summary.result
  table = "\n".join(summary.table)
  assert "| constant | blocks | 16 | 1: 1.520, 4: 1.280, 16: 1.200, 32: 1.220, 64: 1.280 |" in \
      table
  assert f"| harmonic | 16 | blocks | 3 | {claims.fmt(harmonic)} | 1.590-1.640 |" in table


def test_the_best_line_of_a_schedule_is_chosen_on_the_selection_seed():
  """harmonic's sublayers line is lower on the selection seed: its cell is the one compared."""
  rows = decay_rows({"harmonic": [1.80, 1.80, 1.80], **OTHERS})  # the blocks line's finals
  harmonic = [1.60, 1.64, 1.59]
  rows += [row("harmonic", "sublayers", a, "select", SELECT,
               1.60 + 0.02 * math.log2(a / 4.0) ** 2) for a in ALPHAS]
  rows += [row("harmonic", "sublayers", 4.0, "final", s, x) for s, x in zip(SEEDS, harmonic)]
  decay = load()
  cells = decay.best_cells(rows)
  assert cells["harmonic"][:2] == (4.0, "sublayers")
  assert [r["seed"] for r in cells["harmonic"][2]] == list(SEEDS)
  summary = decay.summarize(rows, [], CONFIG)
  assert summary.verdict == "reproduced", summary.result
  assert "harmonic's best cell (alpha 4, k=sublayers)" in summary.result


def test_pending_final_seeds_are_no_verdict():
  rows = [r for r in decay_rows({"harmonic": [1.60, 1.64, 1.59], **OTHERS})
          if not (r["schedule"] == "sqrt" and r["stage"] == "final")]
  summary = load().summarize(rows, [], CONFIG)
  assert summary.verdict == "unresolved" and "Final seeds pending: sqrt" in summary.result


def test_the_figure_draws():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = decay_rows({"harmonic": [1.60, 1.64, 1.59], **OTHERS})
  summary = load().summarize(rows, [], CONFIG)
  figure = plt.figure()
  summary.figures["loss_vs_alpha.png"](figure)
  axes = figure.axes[0]
  assert len(axes.lines) >= len(SCHEDULES)  # one selection curve per line
  labels = axes.get_legend_handles_labels()[1]
  assert sum("final seeds (3)" in label for label in labels) == len(SCHEDULES)
  plt.close(figure)
