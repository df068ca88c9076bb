"""compare_runs reads every number back from the run folders; nothing is passed by hand."""
import csv
import json
import math

from geonorm_jax.studies import report, sweep
from geonorm_jax.training import metrics


def _fake_run(path, train_losses, eval_losses, summary=None):
  writer = metrics.MetricsWriter(path, is_main_process=True)
  for step, loss in enumerate(train_losses, start=1):
    writer.write_scalars(step, {"loss": loss, "tokens_per_s": 100.0 * step})
  for step, loss in eval_losses.items():
    writer.write_scalars(step, {"loss": loss}, split="eval")
  writer.close()
  if summary is not None:
    (path / "summary.json").write_text(json.dumps(summary))


def test_compare_runs_writes_plot_and_tables_from_the_runs(tmp_path):
  _fake_run(tmp_path / "a", [3.0, 2.5, 2.0], {2: 2.6, 3: 2.2},
            summary={"tokens_per_s": 1234.0, "wall_s": 56.7})
  _fake_run(tmp_path / "b", [3.0, 2.4], {2: 2.1})  # no summary.json: logged tokens/s, no wall
  rows = report.compare_runs({"A": str(tmp_path / "a"), "B": str(tmp_path / "b")},
                             str(tmp_path / "out"))

  assert rows[0] == {"placement": "A", "final step": 3, "final train loss": 2.0,
                     "final eval loss": 2.2, "tokens/s": 1234.0, "wall time (s)": 56.7}
  assert rows[1]["final step"] == 2 and rows[1]["final eval loss"] == 2.1
  assert rows[1]["tokens/s"] == 200.0 and math.isnan(rows[1]["wall time (s)"])
  assert report.best_run(rows)["placement"] == "B"

  table = (tmp_path / "out" / "summary.md").read_text()
  assert "| A | 3 | 2.0000 | 2.2000 | 1,234 | 56.7 |" in table
  assert "| B | 2 | 2.4000 | 2.1000 | 200 | n/a |" in table
  with open(tmp_path / "out" / "summary.csv", newline="") as f:
    assert [r["placement"] for r in csv.DictReader(f)] == ["A", "B"]
  assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_never_evaluated_is_not_the_best(tmp_path):
  _fake_run(tmp_path / "a", [1.0], {})
  _fake_run(tmp_path / "b", [3.0], {1: 3.0})
  rows = [report.run_row("A", str(tmp_path / "a")), report.run_row("B", str(tmp_path / "b"))]
  assert report.best_run(rows)["placement"] == "B"


def test_results_csv_reads_back_what_a_sweep_wrote(tmp_path):
  rows = [{"variant": "pre", "lr": "1e-3", "seed": 0, "final_eval_loss": 2.5,
           "collapse_step": None, "token_cosine": float("nan")},
          {"variant": "geonorm", "lr": "3e-3", "seed": 2, "final_eval_loss": 3.25,
           "collapse_step": 125, "token_cosine": 0.97}]
  path = tmp_path / "results.csv"
  sweep.write_csv(path, rows)
  read = report.read_results_csv(path)
  assert [r["variant"] for r in read] == ["pre", "geonorm"]
  assert read[0]["collapse_step"] is None and read[1]["collapse_step"] == 125
  assert isinstance(read[1]["seed"], int) and read[1]["final_eval_loss"] == 3.25
  assert read[0]["lr"] == 1e-3 and math.isnan(read[0]["token_cosine"])
