"""experiments/hessian_vs_weight_scale.py's seed statistics and verdict, on synthetic rows whose
slopes and spreads are known in closed form (the measurement itself is exercised by the
hessian notebook's test against the committed results)."""
import csv
import importlib.util
import json
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def experiment():
  path = os.path.join(REPO, "experiments", "hessian_vs_weight_scale.py")
  spec = importlib.util.spec_from_file_location("hessian_vs_weight_scale", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rows(experiment, laws, seeds=(0, 1, 2)):
  """One row per seed and c: lambda_max = a_seed * c**slope for each (key -> slope)."""
  rows = []
  for seed in seeds:
    for (placement, scope, quantity, where), slope in laws.items():
      for c in experiment.SCALES:
        rows.append(dict(placement=placement, scope=scope, c=c, quantity=quantity,
                         where=where, lambda_max=(1.0 + seed) * c ** slope,
                         residual_bound=0.0, loss=2.0, seed=seed))
  return rows


def _laws(experiment, normalised_slope, plain_slope):
  laws = {key: normalised_slope for key in experiment.NORMALISED}
  laws[experiment.PLAIN] = plain_slope
  return laws


def test_over_seeds_recovers_each_seeds_slope_and_spread(experiment):
  per_seed = experiment.over_seeds(_rows(experiment, _laws(experiment, 0.0, 2.0)))
  c = np.asarray(experiment.SCALES)
  for seed, slope, spread in per_seed[experiment.PLAIN]:
    assert slope == pytest.approx(2.0)
    assert spread == pytest.approx((c.max() / c.min()) ** 2)
  assert [seed for seed, _, _ in per_seed[experiment.PLAIN]] == [0, 1, 2]
  for key in experiment.NORMALISED:
    assert all(spread == pytest.approx(1.0) for _, _, spread in per_seed[key])


@pytest.mark.parametrize("normalised_slope,plain_slope,expected", [
    (0.0, 2.0, "reproduced"),
    # c**0.05 over c in 0.25..8 is a max/min of 32**0.05 = 1.19: not flat.
    (0.05, 2.0, "not at this scale"),
    # Flat, but the plain map does not grow either: nothing to contrast with.
    (0.0, 0.1, "unresolved"),
])
def test_verdict_rule(experiment, normalised_slope, plain_slope, expected):
  per_seed = experiment.over_seeds(_rows(experiment, _laws(experiment, normalised_slope,
                                                           plain_slope)))
  assert experiment.verdict(per_seed)[0] == expected


def test_one_seed_that_is_not_flat_decides(experiment):
  rows = _rows(experiment, _laws(experiment, 0.0, 2.0))
  key = experiment.NORMALISED[0]
  for row in rows:
    if row["seed"] == 2 and (row["placement"], row["scope"], row["quantity"],
                             row["where"]) == key:
      row["lambda_max"] *= row["c"] ** 0.1
  assert experiment.verdict(experiment.over_seeds(rows))[0] == "not at this scale"


def test_a_results_file_without_seeds_reads_as_seed_0_and_reports(experiment, tmp_path):
  rows = _rows(experiment, _laws(experiment, 0.0, 2.0), seeds=(0,))
  path = tmp_path / "results.csv"
  with open(path, "w", newline="") as f:
    fields = [k for k in rows[0] if k != "seed"]
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows({k: r[k] for k in fields} for r in rows)
  read = experiment.read_csv(path)
  assert {r["seed"] for r in read} == {0}
  outcome, result = experiment.write_verdict(experiment.over_seeds(read),
                                             tmp_path / "verdict.json", "gpt2")
  with open(tmp_path / "verdict.json") as f:
    stored = json.load(f)
  assert (stored["verdict"], stored["result"], stored["seeds"]) == (outcome, result, 1)
  assert stored["backbone"] == "gpt2"
  assert outcome == "reproduced"
