"""`compare`: runs of two results folders, paired over their fresh seeds, against a hand t test."""
import json

import numpy as np
import pytest
from scipy import stats as scipy_stats

from geonorm_jax import cli
from geonorm_jax.studies import compare, sweep


def _folder(path, run, losses, config_file="configs/judge.py", steps=2000, select=None):
  """A results folder holding RUN on seeds 0.. with `losses`, and on selection seed 100."""
  path.mkdir()
  rows = [{"name": f"{run}/seed{seed}", "seed": seed, "stage": "final", "steps": steps,
           "tokens": steps * 2048, "final_eval_loss": loss} for seed, loss in enumerate(losses)]
  if select is not None:
    rows.append({"name": f"{run}/seed100", "seed": 100, "stage": "select", "steps": steps,
                 "tokens": steps * 2048, "final_eval_loss": select})
  sweep.write_csv(str(path / "results.csv"), rows)
  (path / "config.json").write_text(json.dumps(
      {"config_file": config_file, "runs": {f"{run}/seed0": f"placement={run.split('/')[0]}"}}))
  return f"{path}:{run}"


def test_paired_difference_over_the_fresh_seeds(tmp_path):
  a_losses, b_losses = [1.70, 1.66, 1.68], [1.60, 1.59, 1.62]
  # The selection seed's runs would move the mean a lot: they must be left out.
  a = _folder(tmp_path / "a", "geonorm/lr0.002", a_losses, select=9.0)
  b = _folder(tmp_path / "b", "post/lr0.004", b_losses + [1.5], select=1.0)  # seed 3: unpaired
  lines, difference = compare.compare(a, b)
  d = np.subtract(a_losses, b_losses)
  half = scipy_stats.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
  assert difference.paired and difference.n == 3
  assert difference.mean == pytest.approx(d.mean())
  assert (difference.low, difference.high) == pytest.approx((d.mean() - half, d.mean() + half))
  assert difference.p == pytest.approx(scipy_stats.ttest_rel(a_losses, b_losses).pvalue)
  assert "seeds 0, 1, 2:" in lines[-1] and "seed 100" not in "\n".join(lines)
  assert lines[0].startswith(f"A: {a} (placement=geonorm)")


@pytest.mark.parametrize("other,message", [
    ({"config_file": "configs/gpt2.py"}, "not one recipe"),
    ({"steps": 1000}, "differ in steps"),
])
def test_refuses_runs_of_two_recipes(tmp_path, other, message):
  a = _folder(tmp_path / "a", "pre/lr0.004", [1.6, 1.7])
  b = _folder(tmp_path / "b", "post/lr0.004", [1.5, 1.6], **other)
  with pytest.raises(ValueError, match=message):
    compare.compare(a, b)


def test_bad_specs_are_one_clear_error(tmp_path):
  a = _folder(tmp_path / "a", "pre/lr0.004", [1.6, 1.7], select=1.5)
  with pytest.raises(cli.CommandError, match="not FOLDER:RUN"):
    cli.run_compare(str(tmp_path / "a"), a)
  with pytest.raises(cli.CommandError, match="no run 'post/lr0.004'.*pre/lr0.004"):
    cli.run_compare(a, f"{tmp_path / 'a'}:post/lr0.004")
  with pytest.raises(cli.CommandError, match="results.csv not found"):
    cli.run_compare(a, f"{tmp_path / 'missing'}:pre/lr0.004")
  with pytest.raises(cli.CommandError, match="give two"):
    cli.run_compare(a)
