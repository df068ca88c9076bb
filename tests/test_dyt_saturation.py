"""dyt_saturation: the final DyT's saturation read against the plateau, per evaluation step,
against a hand count on constructed run folders. Nothing here trains."""
import csv
import json

import pytest

from geonorm_jax.studies import claims


def _run(path, placement, alpha, records, warmup=100):
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(
      {"seed": 101, "train": {"lr": 0.016, "warmup_steps": warmup},
       "model": {"placement": placement, "dyt_alpha_final": alpha, "d_model": 32,
                 "num_layers": 4}}))
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _layers(step, fraction):
  return {"step": step, "split": "layers", "collapse/tanh_saturated_final": fraction,
          "norm_input_rms/final_norm": 10 * fraction, "residual_rms/layer_00": fraction ** 2}


def _eval(step, loss):
  return {"step": step, "split": "eval", "loss": loss}


def test_counts_each_eval_step_where_both_are_logged(tmp_path):
  experiment = claims.load_experiment("dyt_saturation")
  _run(tmp_path / "dyt" / "a", "dyt", 0.0, [
      _layers(250, 1.0), _eval(250, 3.36),    # saturated, on the plateau
      _layers(500, 0.99), _eval(500, 2.9),    # saturated only
      _layers(750, 0.10), _eval(750, 2.4),    # neither
      _eval(1000, 2.2)])                      # no saturation logged: not read
  _run(tmp_path / "dyt" / "b", "dyt", 3.0, [
      _layers(250, 0.5), _eval(250, 3.4),     # on the plateau only
      _layers(500, 0.96), _eval(500, 3.31)])  # both
  _run(tmp_path / "dyt" / "b2", "dyt", 3.0, [_layers(250, 0.3), _eval(250, 3.4)])
  _run(tmp_path / "dyt" / "c", "pre", 0.0, [_layers(250, 1.0), _eval(250, 3.4)])  # skipped
  out = tmp_path / "out"
  experiment.main([f"--runs={tmp_path}/dyt/*", f"--out={out}"])
  with open(out / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert [(r["alpha_0"], r["step"], r["saturated"], r["on_plateau"]) for r in rows] == [
      # 0 at d = 32: the paper's table's value there, 1.
      ("1.0", "250", "True", "True"), ("1.0", "500", "True", "False"),
      ("1.0", "750", "False", "False"), ("3.0", "250", "False", "True"),
      ("3.0", "500", "True", "True"), ("3.0", "250", "False", "True")]
  assert [float(r["input_rms"]) for r in rows] == pytest.approx([10, 9.9, 1, 5, 9.6, 3])
  table = (out / "table.md").read_text()
  assert "(3 DyT runs, 6 readings" in table
  assert "| 1 | 1 | 1 | 1 | 0 | 2 of 3 |" in table
  assert "| 3 | 1 | 0 | 0 | 2 | 1 of 3 |" in table
  assert "| all | 2 | 1 | 1 | 2 | 3 of 6 |" in table
  # Step 250 at lr 0.016: alpha_0 1 one run (RMS 10, saturated); alpha_0 3 two (RMS 5 and 3,
  # median 4, neither saturated).
  assert "| 0.016 | 10, 10, 1 of 1 | 4, 12, 0 of 2 |" in table
  # The embedding's RMS there: 1 of 10 at alpha_0 1; medians 0.17 (0.25, 0.09) of 4 at 3.
  assert [float(r["embed_rms"]) for r in rows] == pytest.approx(
      [1, 0.9801, 0.01, 0.25, 0.9216, 0.09])
  assert "| lr | alpha_0 1: RMS, share | alpha_0 3: RMS, share |" in table
  assert "| 0.016 | 1, 0.10 | 0.17, 0.04 |" in table


def test_a_different_warmup_is_its_own_group(tmp_path):
  experiment = claims.load_experiment("dyt_saturation")
  _run(tmp_path / "dyt" / "a", "dyt", 1.0, [_layers(250, 1.0), _eval(250, 3.36)])
  _run(tmp_path / "dyt" / "w", "dyt", 1.0, [_layers(250, 0.5), _eval(250, 3.2)], warmup=500)
  experiment.main([f"--runs={tmp_path}/dyt/*", f"--out={tmp_path / 'out'}"])
  table = (tmp_path / "out" / "table.md").read_text()
  assert "| 1, warmup 100 | 1 | 0 | 0 | 0 | 1 of 1 |" in table
  assert "| 1, warmup 500 | 0 | 1 | 0 | 0 | 1 of 1 |" in table
  assert "| all | 1 | 1 | 0 | 0 | 2 of 2 |" in table
  assert ("| lr | alpha_0 1, warmup 100: RMS, alpha_0 x RMS, saturated | alpha_0 1, warmup 500: "
          "RMS, alpha_0 x RMS, saturated |") in table
  assert "| 0.016 | 10, 10, 1 of 1 | 5, 5, 0 of 1 |" in table


def test_no_dyt_run_is_one_error_naming_the_flag(tmp_path):
  experiment = claims.load_experiment("dyt_saturation")
  _run(tmp_path / "c", "pre", 0.0, [_layers(250, 1.0), _eval(250, 3.4)])
  with pytest.raises(SystemExit, match="--runs"):
    experiment.main([f"--runs={tmp_path}/*", f"--out={tmp_path / 'out'}"])
  assert not (tmp_path / "out").exists()
