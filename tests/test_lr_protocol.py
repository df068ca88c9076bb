"""The learning-rate protocol of claims.run_tuned on a fake trainer: the grid grows past an edge
optimum until the optimum is interior (or the extensions run out), the final seeds train at each
variant's best LR, and a finished run of another config is never reused."""
import json
import math
import os
import types

import fake_sweep  # tests/ is on sys.path (no __init__.py)
import pytest

from geonorm_jax.studies import claims, sweep
from geonorm_jax.training import checkpoint


def _experiment():
  return types.SimpleNamespace(
      __doc__="A fake tuned experiment.\n", NAME="fake",
      SCALES={"judge": claims.Scale("configs/judge.py", "", "0,1,2", "fake")},
      TUNED_LRS={"judge": "1e-3,2e-3,4e-3"},
      grid=lambda args, scale: [claims.variant("a", "placement=pre", variant="a"),
                                claims.variant("b", "placement=post", variant="b")])


# Loss of each variant against the peak LR: a is best at 8e-3 (beyond the starting grid's
# top), b at 2e-3 (inside it). Final runs add the seed so their losses differ.
OPTIMUM = {"a": 8e-3, "b": 2e-3}


def _loss(run):
  labels = dict(run.labels)
  return 1.5 + math.log2(labels["lr"] / OPTIMUM[labels["variant"]]) ** 2 + 0.01 * run.seed


def _run(monkeypatch, tmp_path, *flags):
  trained = []
  monkeypatch.setattr(sweep, "execute", fake_sweep.execute(trained, _loss))
  experiment = _experiment()
  args = claims.parse_args(experiment, [*fake_sweep.dirs(tmp_path), *flags])
  return claims.run_tuned(experiment, args), trained


def test_an_edge_optimum_extends_the_grid_until_it_is_interior(monkeypatch, tmp_path):
  runs, trained = _run(monkeypatch, tmp_path)
  selection = sorted(dict(r.labels)["lr"] for r in runs
                     if dict(r.labels)["stage"] == "select" and dict(r.labels)["variant"] == "a")
  assert selection == [1e-3, 2e-3, 4e-3, 8e-3, 16e-3]  # 4e-3 and then 8e-3 were edges
  final = {(dict(r.labels)["variant"], dict(r.labels)["lr"], r.seed) for r in runs
           if dict(r.labels)["stage"] == "final"}
  assert final == {(v, OPTIMUM[v], s) for v in "ab" for s in (0, 1, 2)}
  assert all(r.workdir.startswith(str(tmp_path / "lr_grid")) for r in runs
             if dict(r.labels)["stage"] == "select")
  assert len(trained) == len(set(trained)) == len(runs)  # nothing trained twice
  rows = [dict(r.labels, name=r.name, seed=r.seed, final_eval_loss=r.summary()["final_eval_loss"])
          for r in runs]
  optima = claims.tuned_lrs(rows)
  assert optima["a"].x == 8e-3 and not optima["a"].at_edge and optima["b"].x == 2e-3
  assert claims.at_edge(optima) is None


def test_report_only_reads_the_finished_extensions_and_trains_nothing(monkeypatch, tmp_path):
  experiment = _experiment()
  monkeypatch.setattr(sweep, "execute", lambda args, runs: None)  # --report_only trains nothing
  report_only = [*fake_sweep.dirs(tmp_path), "--report_only"]
  before = claims.run_tuned(experiment, claims.parse_args(experiment, report_only))
  # Nothing finished: the starting grid only, no extension, no final run.
  assert sorted((dict(r.labels)["variant"], dict(r.labels)["lr"]) for r in before) == sorted(
      (v, lr) for v in "ab" for lr in (1e-3, 2e-3, 4e-3))
  full, _ = _run(monkeypatch, tmp_path)  # trains, extending a's grid to 8e-3 and 16e-3
  monkeypatch.setattr(sweep, "execute", lambda args, runs: None)
  after = claims.run_tuned(experiment, claims.parse_args(experiment, report_only))
  assert sorted(r.name for r in after) == sorted(r.name for r in full)


def test_extensions_run_out_and_the_edge_is_reported(monkeypatch, tmp_path):
  runs, _ = _run(monkeypatch, tmp_path, "--max_extensions=1")
  rows = [dict(r.labels, name=r.name, seed=r.seed, final_eval_loss=r.summary()["final_eval_loss"])
          for r in runs]
  optima = claims.tuned_lrs(rows)
  assert optima["a"].x == 8e-3 and optima["a"].at_edge
  assert "optimum at the grid edge" in claims.at_edge(optima) and "a: best lr 0.008" in \
      claims.at_edge(optima)


def test_the_selection_seed_is_never_a_final_seed(tmp_path):
  with pytest.raises(SystemExit):
    claims.parse_args(_experiment(), [*fake_sweep.dirs(tmp_path), "--seeds=0,100"])


def test_a_finished_run_of_another_config_is_an_error(tmp_path):
  run = sweep.Run("pre/seed0", "configs/judge.py", "placement=pre,lr=1e-3", 0, str(tmp_path))
  os.makedirs(run.workdir)
  checkpoint.save_config_json(run.workdir, run.config())
  with open(os.path.join(run.workdir, "summary.json"), "w") as f:
    json.dump({"final_eval_loss": 2.0}, f)
  sweep.check_finished(run)  # the same config: fine
  changed = sweep.Run("pre/seed0", "configs/judge.py", "placement=pre,lr=2e-3", 0, str(tmp_path))
  with pytest.raises(SystemExit, match="pre/seed0 holds a finished run of another config"):
    sweep.check_finished(changed)


def test_give_up_steps_only_matters_for_a_run_that_gave_up(tmp_path):
  """The LR-sensitivity sweep sets train.give_up_steps and shares the LR-grid runs that did
  not: a finished run that never gave up computed the same numbers, one that gave up did not."""
  run = sweep.Run("pre/seed0", "configs/judge.py", "placement=pre", 0, str(tmp_path))
  os.makedirs(run.workdir)
  checkpoint.save_config_json(run.workdir, run.config())
  summary = os.path.join(run.workdir, "summary.json")
  with open(summary, "w") as f:
    json.dump({"final_eval_loss": 2.0, "gave_up_step": None}, f)
  with_give_up = sweep.Run("pre/seed0", "configs/judge.py", "placement=pre,give_up_steps=100",
                           0, str(tmp_path))
  sweep.check_finished(with_give_up)
  with open(summary, "w") as f:
    json.dump({"final_eval_loss": 5.0, "gave_up_step": 300}, f)
  with pytest.raises(SystemExit, match="train.give_up_steps: 0 != 100"):
    sweep.check_finished(with_give_up)


def test_core_groups_split_the_cores_between_jobs():
  assert sweep.core_groups(2, [0, 1]) == [{0}, {1}]
  assert sweep.core_groups(2, [0, 1, 2, 3]) == [{0, 1}, {2, 3}]
  assert sweep.core_groups(1, [0, 1]) is None and sweep.core_groups(3, [0, 1]) is None


# ---------------------------------------------------------------------------
# norm_zoo's rule on constructed results (tuned rows: a 3-LR grid on the selection seed, then
# three final seeds at the best LR).
# ---------------------------------------------------------------------------

def _zoo_rows(final_losses, edge=()):
  """final_losses: {variant: [loss per seed 0, 1, 2]}; variants in `edge` have their best
  grid LR on the grid's edge."""
  rows = []
  for variant, losses in final_losses.items():
    grid = {1e-3: 2.0, 2e-3: 1.8, 4e-3: 1.9} if variant not in edge else \
        {1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8}
    for lr, loss in grid.items():
      rows.append(dict(variant=variant, lr=lr, stage="select", seed=100, final_eval_loss=loss,
                       name=f"{variant}/lr{lr:g}/seed100", step_time_s=0.1))
    best = 4e-3 if variant in edge else 2e-3
    for seed, loss in enumerate(losses):
      rows.append(dict(variant=variant, lr=best, stage="final", seed=seed, final_eval_loss=loss,
                       name=f"{variant}/lr{best:g}/seed{seed}", step_time_s=0.1))
  return rows


BASE = {"pre": [1.60, 1.62, 1.61], "post": [1.65, 1.66, 1.64], "peri": [1.61, 1.63, 1.62],
        "deepnorm": [1.70, 1.71, 1.69]}
CONFIG = {"scale": "judge", "experiment": "norm_zoo", "args": {}}


@pytest.mark.parametrize("geonorm,edge,expected", [
    ([1.55, 1.57, 1.56], (), "reproduced"),  # 0.05 below the best baseline on every seed
    ([1.65, 1.67, 1.66], (), "not at this scale"),  # above pre and peri on every seed
    ([1.50, 1.70, 1.58], (), "unresolved"),  # below on average, but noisy
    ([1.55, 1.57, 1.56], ("pre",), "unresolved"),  # pre's tuned LR is on the grid's edge
])
def test_norm_zoo_rule(geonorm, edge, expected):
  zoo = claims.load_experiment("norm_zoo")
  summary = zoo.summarize(_zoo_rows({**BASE, "geonorm": geonorm}, edge), [], CONFIG)
  assert summary.verdict == expected, summary.result
  if edge:
    assert "optimum at the grid edge" in summary.result


@pytest.mark.parametrize("geonorm,expected", [([1.55, 1.57, 1.56], "reproduced"),
                                              ([1.65, 1.67, 1.66], "not at this scale")])
def test_norm_zoo_reports_reordered_without_reading_it(geonorm, expected):
  """OLMo 2's reordered norm runs by default and gets its table row, but the verdict is the
  claim's: reordered far below GeoNorm, or tuned on the grid's edge, changes nothing."""
  zoo = claims.load_experiment("norm_zoo")
  assert "reordered" in zoo.DEFAULT_VARIANTS and "reordered" not in zoo.BASELINES
  for reordered_edge in ((), ("reordered",)):
    rows = _zoo_rows({**BASE, "geonorm": geonorm, "reordered": [1.40, 1.41, 1.42]},
                     reordered_edge)
    summary = zoo.summarize(rows, [], CONFIG)
    assert summary.verdict == expected, summary.result
    assert "reordered" not in summary.result
    assert any(line.startswith("| reordered | ") for line in summary.table)


def test_norm_zoo_waits_for_every_baseline():
  """GeoNorm clearly above Pre-LN, the other baselines not run: Holm's family is all four."""
  zoo = claims.load_experiment("norm_zoo")
  rows = _zoo_rows({"pre": BASE["pre"], "geonorm": [1.75, 1.74, 1.79]})
  summary = zoo.summarize(rows, [], CONFIG)
  assert summary.verdict == "unresolved" and "post, deepnorm, peri pending" in summary.result


def test_a_quick_run_is_never_a_verdict(tmp_path):
  rows = _zoo_rows({**BASE, "geonorm": [1.55, 1.57, 1.56]})
  sweep.write_csv(tmp_path / "results.csv", rows)
  sweep.write_csv(tmp_path / "curves.csv", [{"name": rows[0]["name"], "split": "eval",
                                             "key": "loss", "step": 1, "value": 2.0}])
  for row in rows:
    row["steps"] = 10
  sweep.write_csv(tmp_path / "results.csv", rows)
  (tmp_path / "config.json").write_text(json.dumps(dict(
      CONFIG, claim="c", command="python experiments/norm_zoo.py --quick", scale_note="n",
      args={"quick": True})))
  summary = claims.report(str(tmp_path))
  assert summary.verdict == "unresolved" and "not a verdict" in summary.result
  assert "reproduced" in summary.result  # what the rule read is still shown
