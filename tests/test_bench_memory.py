"""benchmarks/bench_memory.py's table: compiled per-device memory of a tiny train step on a
2-device FSDP mesh (conftest's fake CPU devices), its linear extrapolation in depth and the
markdown columns."""
import importlib.util
import math
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_memory.py"
_SPEC = importlib.util.spec_from_file_location("bench_memory", _PATH)
bench_memory = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_memory)

TINY = "d_model=64,num_heads=2,vocab_size=256,max_seq_len=32"


def compiled(num_layers):
  config = bench_memory.config_for("tiny", "fsdp", 2, num_layers=num_layers, seq=32, extra=TINY,
                                   tokens_per_replica=64)
  return {"size": "tiny", "kind": "fsdp", "num_devices": 2, "num_layers": num_layers,
          **bench_memory.step_memory(config, 2)}


@pytest.fixture(scope="module")
def rows():
  return [compiled(1), compiled(2), compiled(3)]


def test_per_device_bytes(rows):
  one, _, three = rows
  # Every tiny matrix has an even width, so FSDP over 2 devices halves the float32 params.
  assert one["params"] == pytest.approx(one["num_params"] * 4 / 2, rel=0.02)
  # The donated input holds params + AdamW's two moments (+ the small batch and counters).
  assert 3 * one["params"] <= one["arguments"] < 3.1 * one["params"] + 2**16
  assert one["aliased"] > 0.9 * one["arguments"]  # the state is updated in place
  for row in rows:
    assert row["total"] == (row["arguments"] + row["outputs"] - row["aliased"] +
                            row["temporaries"])
  assert three["temporaries"] > one["temporaries"]


def test_depth_extrapolation_is_exact_for_parameters(rows):
  one, two, three = rows
  predicted = bench_memory.extrapolate({1: one, 2: two}, 3)
  assert predicted["num_params"] == three["num_params"]
  assert predicted["params"] == three["params"]
  assert predicted["arguments"] == pytest.approx(three["arguments"], rel=1e-3)


def test_markdown_table_columns(rows):
  table = bench_memory.table_rows(rows[:2])  # tiny's own depth (4) from 1 and 2 blocks
  (row,) = table
  assert row["num_layers"] == 4 and row["from_layers"] == [1, 2]
  big = dict(row, size="made_up", total=20 * bench_memory.GIB,
             fits={"16GiB": False, "95GiB": True})
  text = bench_memory.markdown({"date": "d", "jax": "j", "device": {"table": [row, big]}})
  lines = [l for l in text.splitlines() if l.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  assert header == ["size", "devices", "mesh (data, fsdp, tensor)", "batch x seq per replica",
                    "params/device", "arguments", "temporaries", "total/device", "fits 16 GiB",
                    "fits 95 GiB"]
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:4]]
  assert all(len(c) == len(header) for c in cells)
  assert cells[0][4] == f"{row['params'] / 2**30:,.2f}"
  assert cells[1][7:] == ["20.00", "**no**", "yes"]
  assert math.isclose(float(cells[0][7]), row["total"] / 2**30, abs_tol=0.01)
