"""divergence_by_lr: two lr_sensitivity folders (with and without weight decay) read as diverged
counts per LR, against a hand count on constructed folders. Nothing here trains."""
import json
import math

import pytest

from geonorm_jax.studies import claims, sweep

L0, SPIKE = 5.5, 7.7  # the seed's initial loss; a high-LR run's first log, already spiked


def _folder(path, finals, extra=""):
  """An lr_sensitivity results folder of Pre-LN at d = 32: finals {(lr, seed): final loss}.
  The lowest LR's run logs L0 first, every other run SPIKE (a cap read from them would be
  too high)."""
  path.mkdir()
  lowest = min(lr for lr, _ in finals)
  rows, curves, runs = [], [], {}
  for (lr, seed), loss in sorted(finals.items()):
    name = f"d32/pre/lr{lr:g}/seed{seed}"
    rows.append({"variant": "pre", "width": 32, "lr": lr, "stage": "sweep", "name": name,
                 "seed": seed, "final_eval_loss": loss})
    curves.append({"name": name, "split": "train", "key": "loss", "step": 10,
                   "value": L0 if lr == lowest else SPIKE})
    runs[name] = claims.join("placement=pre,d_model=32,num_heads=1", f"lr={lr:g}", extra)
  sweep.write_csv(str(path / "results.csv"), rows)
  sweep.write_csv(str(path / "curves.csv"), curves)
  (path / "config.json").write_text(json.dumps(
      {"experiment": "lr_sensitivity", "config_file": "configs/judge.py", "runs": runs}))
  return str(path)


WITH = {(2.5e-4, 100): 2.2, (2.5e-4, 101): 2.3,
        (0.256, 100): 2.0, (0.256, 101): 2.1,
        (0.512, 100): 6.0, (0.512, 101): 3.0}   # diverged: 0.512 on seed 100 (6.0 >= L0)
WITHOUT = {(0.256, 100): 5.6, (0.256, 101): 2.5,
           (0.512, 100): math.nan, (0.512, 101): 6.0}  # diverged: all but 0.256 on seed 101


def test_counts_per_lr_with_the_cap_of_the_lowest_lr_run(tmp_path):
  experiment = claims.load_experiment("divergence_by_lr")
  out = tmp_path / "out"
  experiment.main([f"--with_wd={_folder(tmp_path / 'a', WITH)}",
                   f"--without_wd={_folder(tmp_path / 'b', WITHOUT, 'weight_decay=0')}",
                   f"--out={out}"])
  table = (out / "table.md").read_text()
  # Only the LRs of the folder without weight decay; the cap is 5.5, not the spiked 7.7 (with
  # it, 6.0 and 5.6 would not count as diverged).
  assert "| pre | 32 | 0.256 | 0/2 | 1/2 |" in table
  assert "| pre | 32 | 0.512 | 1/2 | 2/2 |" in table
  assert "| pre | 32 | 0.00025 |" not in table
  assert "- pre d=32: wd 0.1: 0.512, -; wd 0: 0.256, 0.512" in table
  rows = (out / "results.csv").read_text().splitlines()
  assert len(rows) == 1 + 8 and rows[0].startswith("variant,width,lr,seed,weight_decay")
  # The paired difference at 0.256: (5.6 - 2.0, 2.5 - 2.1) over two seeds.
  assert "+2.000 [" in table.split("| 0.256 |")[1].splitlines()[0]


def test_refuses_a_pair_not_split_by_weight_decay(tmp_path):
  experiment = claims.load_experiment("divergence_by_lr")
  a = _folder(tmp_path / "a", WITH)
  b = _folder(tmp_path / "b", WITHOUT)  # weight decay 0.1 too
  with pytest.raises(SystemExit, match="--without_wd=.* with 0.1: the second must be 0"):
    experiment.main([f"--with_wd={a}", f"--without_wd={b}", f"--out={tmp_path / 'out'}"])
  assert not (tmp_path / "out").exists()
