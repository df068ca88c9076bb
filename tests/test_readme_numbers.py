"""The README's LR-sensitivity numbers are the results folder's: none is typed in by hand.

The stability section's paired table (variant - baseline, width, seeds, the S difference and
the best-loss difference) and its run count are copied from results/lr_sensitivity/table.md
after each merge of new runs. A row edited by hand, or left behind by a merge that moved the
numbers, would put a number in the README that no results file holds; this reads both files
and names the row that disagrees.
"""
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, "README.md")
TABLE_NAME = "results/lr_sensitivity/table.md"
TABLE = os.path.join(REPO_ROOT, *TABLE_NAME.split("/"))

# | claim read | `variant` - `baseline` | d | seeds | S difference [CI] | best-loss difference [CI] |
ROW = re.compile(r"^  \|[^|]*\| `(\S+)` - `(\S+)` \| (\d+) \| (\d+) \| ([^|]+?) \| ([^|]+?) \|$",
                 re.M)
BEST_LOSS_HEADING = "Best losses, each seed at its own best LR"


def _read(path):
  with open(path) as f:
    return f.read()


def _reading(variant, baseline, width, seeds, cell):
  """table.md's text of one paired difference; a one-seed row has no interval in the README,
  where table.md writes the degenerate [-inf, +inf]."""
  if "[" not in cell:
    cell += " [-inf, +inf]"
  return f"{variant} - {baseline} at d={width}: {cell} (95% t interval, paired over {seeds} seeds)"


def test_readme_paired_rows_are_the_results_folders():
  readme, table = _read(README), _read(TABLE)
  # The best-loss list runs from its heading to the next blank line; every S difference is
  # outside it (the other pairs above it, SimpleGPT's in the verdict below it).
  start = table.index(BEST_LOSS_HEADING)
  end = table.find("\n\n", start)
  end = len(table) if end < 0 else end
  best_part, s_part = table[start:end], table[:start] + table[end:]
  rows = ROW.findall(readme)
  assert len(rows) >= 20, f"README's paired table not found ({len(rows)} rows)"
  for variant, baseline, width, seeds, s_cell, best_cell in rows:
    s_text = _reading(variant, baseline, width, seeds, s_cell)
    best_text = _reading(variant, baseline, width, seeds, best_cell)
    assert s_text in s_part, f"README's S row is not in {TABLE_NAME}: {s_text}"
    assert best_text in best_part, f"README's best-loss row is not in {TABLE_NAME}: {best_text}"


def test_readme_run_count_is_the_results_folders():
  readme_count = re.search(r"(\d+) runs in `results/lr_sensitivity`", _read(README))
  table_count = re.search(r"\((\d+) finished runs", _read(TABLE))
  assert readme_count and table_count
  assert readme_count.group(1) == table_count.group(1), (
      f"README counts {readme_count.group(1)} runs, {TABLE_NAME} {table_count.group(1)}")
