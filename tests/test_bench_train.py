"""bench_train's results file: a rerun part replaces its figures and keeps the earlier ones in
`history` with their date; a part not rerun keeps its figures and date."""
import importlib.util
import json
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
_SPEC = importlib.util.spec_from_file_location("bench_train", _PATH)
bench_train = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_train)


def test_rerun_parts_keep_their_earlier_figures_in_history(tmp_path, monkeypatch):
  monkeypatch.chdir(pathlib.Path.cwd())  # main() moves to the repository root
  output = tmp_path / "train.json"
  runs = iter(range(100))
  monkeypatch.setattr(bench_train, "PARTS", {
      "fast": lambda args: {"run": next(runs)}, "slow": lambda args: {"run": next(runs)}})
  dates = iter(["2026-01-01T00:00:00", "2026-01-02T00:00:00", "2026-01-03T00:00:00"])

  def run(parts):
    monkeypatch.setattr(bench_train, "_now", lambda date=next(dates): date)
    monkeypatch.setattr(sys, "argv", ["bench_train", f"--parts={parts}", f"--output={output}"])
    bench_train.main()
    return json.loads(output.read_text())

  run("fast,slow")
  run("fast")
  result = run("fast")
  assert result["fast"] == {"run": 3} and result["slow"] == {"run": 1}
  assert result["part_dates"] == {"fast": "2026-01-03T00:00:00", "slow": "2026-01-01T00:00:00"}
  assert result["history"] == {"fast": [
      {"date": "2026-01-01T00:00:00", "figures": {"run": 0}},
      {"date": "2026-01-02T00:00:00", "figures": {"run": 2}}]}
