"""early_stop_effect: the same LR grids read as they stopped and as trained to the end, against
a hand computation on a constructed folder. Nothing here trains."""
import csv
import json

import pytest

from geonorm_jax.studies import claims, sweep

L0, SPIKE = 5.5, 7.7  # the seed's initial loss; a high-LR run's first log, already spiked
LRS = (1e-3, 1e-2, 0.1)
# Final losses trained to the end, per (variant, seed), at LRS.
TO_END = {("pre", 100): (2.0, 2.5, 3.3), ("pre", 101): (2.1, 2.6, 3.4),
          ("peri", 100): (1.9, 2.2, 2.8), ("peri", 101): (2.0, 2.3, 6.0)}
# The runs that stopped: (variant, seed) at lr 0.1 -> (steps run, final loss when it stopped).
STOPPED = {("pre", 100): (150, 8.0), ("pre", 101): (150, 9.0), ("peri", 101): (500, 9.5)}


def _name(variant, lr, seed):
  return f"d32/{variant}/lr{lr:g}/seed{seed}"


def _write(tmp_path):
  """(the stopped sweep's results.csv, the trained-to-the-end folder)."""
  folder = tmp_path / "to_end"
  folder.mkdir()
  end_rows, stop_rows, curves = [], [], []
  for (variant, seed), losses in TO_END.items():
    for lr, loss in zip(LRS, losses):
      name = _name(variant, lr, seed)
      row = {"variant": variant, "width": 32, "lr": lr, "stage": "sweep", "name": name,
             "seed": seed, "steps": 2000, "final_eval_loss": loss, "gave_up_step": ""}
      end_rows.append(row)
      steps, stop_loss = STOPPED.get((variant, seed), (2000, loss)) if lr == 0.1 else (2000, loss)
      stop_rows.append(dict(row, steps=steps, final_eval_loss=stop_loss,
                            gave_up_step=steps if steps < 2000 else ""))
      curves.append({"name": name, "split": "train", "key": "loss", "step": 10,
                     "value": L0 if lr == LRS[0] else SPIKE})
  sweep.write_csv(str(folder / "results.csv"), end_rows)
  sweep.write_csv(str(folder / "curves.csv"), curves)
  (folder / "config.json").write_text(json.dumps(
      {"experiment": "lr_sensitivity", "scale": "judge",
       "args": {"widths": "32", "lrs": ",".join(f"{lr:g}" for lr in LRS)}}))
  stopped = tmp_path / "with_stop.csv"
  sweep.write_csv(str(stopped), stop_rows)
  return stopped, folder, end_rows


def test_reads_the_stop_against_a_hand_computation(tmp_path):
  experiment = claims.load_experiment("early_stop_effect")
  stopped, folder, _ = _write(tmp_path)
  out = tmp_path / "out"
  experiment.main([f"--stopped={stopped}", f"--to_end={folder}", f"--out={out}"])
  table = (out / "table.md").read_text()
  # 12 runs of 2000 steps; the stop ran 150 + 150 + 500 of the three stopped runs' 6000.
  assert "12 runs in both readings, 3 of them stopped; the stop saved 21.7%" in table
  assert ("2 of the 3 stopped runs end below their L0 (the stop had counted them at L0), at "
          "3.30 to 3.40; 1 end at or above it: d32/peri/lr0.1/seed101 (6.00)") in table
  # Pre-LN: with the stop (capped at L0 = 5.5, not at the spiked 7.7) S = mean(2.0, 2.5, 5.5)
  # - 2.0 = 1.333 and mean(2.1, 2.6, 5.5) - 2.1 = 1.3; to the end 0.6 on both seeds.
  pre = next(line for line in table.splitlines() if line.startswith("| pre | 32 |"))
  assert "| 2 | 1.317" in pre and "| 0.600" in pre
  # peri - pre, paired: with the stop (0.4 - 1.333, 1.267 - 1.3), to the end (0.4 - 0.6,
  # 1.267 - 0.6); the run that ends above L0 is capped the same in both readings.
  with_stop, to_end = table.split("With the stop:")[1].split("Trained to the end:")
  assert "peri - pre at d=32: -0.483 [" in with_stop
  assert "peri - pre at d=32: +0.233 [" in to_end
  with open(out / "results.csv") as f:
    rows = {r["name"]: r for r in csv.DictReader(f)}
  assert sorted(rows) == sorted(_name(v, 0.1, s) for v, s in STOPPED)
  assert rows[_name("pre", 0.1, 100)]["ends_below_l0"] == "True"
  assert rows[_name("peri", 0.1, 101)]["ends_below_l0"] == "False"
  assert float(rows[_name("pre", 0.1, 100)]["l0"]) == L0


def test_refuses_a_folder_whose_runs_stopped_too(tmp_path):
  experiment = claims.load_experiment("early_stop_effect")
  stopped, folder, end_rows = _write(tmp_path)
  end_rows[2]["gave_up_step"] = 150
  sweep.write_csv(str(folder / "results.csv"), end_rows)
  with pytest.raises(SystemExit, match="--to_end=.*some of its runs stopped early too"):
    experiment.main([f"--stopped={stopped}", f"--to_end={folder}",
                     f"--out={tmp_path / 'out'}"])
  assert not (tmp_path / "out").exists()
