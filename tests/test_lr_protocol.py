"""The learning-rate protocol of claims.run_tuned on a fake trainer: the grid grows past an edge
optimum until the optimum is interior (or the extensions run out), the final seeds train at each
variant's best LR, and a finished run of another config is never reused."""
import json
import math
import os
import types

import pytest

from geonorm_jax import checkpoint, claims, sweep


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


def _fake_execute(trained):
  def execute(args, runs):
    del args
    for run in runs:
      if run.summary() is not None:
        continue
      labels = dict(run.labels)
      loss = 1.5 + math.log2(labels["lr"] / OPTIMUM[labels["variant"]]) ** 2 + 0.01 * run.seed
      os.makedirs(run.workdir, exist_ok=True)
      checkpoint.save_config_json(run.workdir, run.config())
      with open(os.path.join(run.workdir, "summary.json"), "w") as f:
        json.dump({"final_eval_loss": loss, "final_step": 10}, f)
      trained.append(run.name)
  return execute


def _run(monkeypatch, tmp_path, *flags):
  trained = []
  monkeypatch.setattr(sweep, "execute", _fake_execute(trained))
  experiment = _experiment()
  args = claims.parse_args(experiment, [f"--root={tmp_path}", *flags])
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
    claims.parse_args(_experiment(), [f"--root={tmp_path}", "--seeds=0,100"])


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


def test_core_groups_split_the_cores_between_jobs():
  assert sweep.core_groups(2, [0, 1]) == [{0}, {1}]
  assert sweep.core_groups(2, [0, 1, 2, 3]) == [{0, 1}, {2, 3}]
  assert sweep.core_groups(1, [0, 1]) is None and sweep.core_groups(3, [0, 1]) is None
