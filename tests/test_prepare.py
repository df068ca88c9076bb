"""`prepare`: text, jsonl and parquet in, fineweb_bin shards out, read back by the trainer's loader."""
import io
import json
import os
import shlex
import subprocess
import sys
import types

import numpy as np
import pytest

from geonorm_jax.data import windows as data, sources as data_sources, prepare
from geonorm_jax.training import config as config_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE = os.path.join(REPO_ROOT, "data", "tinyshakespeare.txt")


def read_shard(path):
  """An independent reader of the llm.c layout: 256 int32 header, then uint16 tokens."""
  raw = open(path, "rb").read()
  header = np.frombuffer(raw[:1024], dtype="<i4")
  tokens = np.frombuffer(raw[1024:], dtype="<u2")
  assert (header[0], header[1], header[2]) == (20240520, 1, len(tokens))
  return tokens


def config_from(summary, **data_overrides):
  """The config that `summary["train_with"]` describes, on the tiny model."""
  items = [item.removeprefix("--config.") for item in shlex.split(summary["train_with"])]
  config = config_lib.get_config(",".join(["tiny"] + items))
  for key, value in data_overrides.items():
    setattr(config.data, key, value)
  return config


class FakeEncoding:
  """Stands in for tiktoken's GPT-2 encoding, so the gpt2 path is tested offline."""
  n_vocab = 50257

  def encode_ordinary(self, text):
    return [1000 + len(word) for word in text.split()]


def test_text_file_becomes_shards_the_loader_reads_back(tmp_path):
  summary = prepare.prepare([SHAKESPEARE], str(tmp_path / "out"), shard_tokens=400_000,
                            val_tokens=100_000, progress_stream=io.StringIO())
  expected = np.frombuffer(open(SHAKESPEARE, "rb").read(), np.uint8)
  assert summary["documents"] == 1 and summary["vocab_size"] == 256
  assert [len(read_shard(p)) for p in summary["val_shards"]] == [100_000]
  assert [len(read_shard(p)) for p in summary["train_shards"]] == [400_000, 400_000, 215_394]
  written = np.concatenate([read_shard(p)
                            for p in summary["val_shards"] + summary["train_shards"]])
  np.testing.assert_array_equal(written, expected)  # val is the head, train the rest, in order

  config = config_from(summary)
  data.validate_data_config(config)  # the printed overrides make a valid training config
  train, val = data_sources.load_token_streams(config.data, config.model.vocab_size)
  np.testing.assert_array_equal(np.asarray(val), expected[:100_000])
  np.testing.assert_array_equal(np.asarray(train), expected[100_000:])


def test_text_pieces_cut_at_line_ends_keep_every_byte(tmp_path, monkeypatch):
  monkeypatch.setattr(prepare, "_TEXT_PIECE_BYTES", 5)  # cuts inside multi-byte characters
  text = "héllo wörld ✓\nß\n\nlast line without newline ✓"
  (tmp_path / "a.txt").write_text(text, encoding="utf-8")
  (tmp_path / "b.txt").write_text("second file\n", encoding="utf-8")
  summary = prepare.prepare([str(tmp_path / "*.txt")], str(tmp_path / "out"),
                            progress_stream=io.StringIO())
  assert summary["documents"] == 2
  written = np.concatenate([read_shard(p) for p in summary["train_shards"]])
  expected = (text + "second file\n").encode("utf-8")  # sorted file order, no separator
  np.testing.assert_array_equal(written, np.frombuffer(expected, np.uint8))


def test_jsonl_with_gpt2_starts_every_document_with_end_of_text(tmp_path, monkeypatch):
  monkeypatch.setattr(data_sources, "_gpt2_encoding", FakeEncoding)
  lines = [json.dumps({"text": "a bb", "id": 1}), "", json.dumps({"text": "ccc"})]
  (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  summary = prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"),
                            tokenizer="gpt2", val_tokens=2, progress_stream=io.StringIO())
  assert summary["documents"] == 2 and summary["vocab_size"] == 50257
  np.testing.assert_array_equal(read_shard(summary["val_shards"][0]), [50256, 1001])
  np.testing.assert_array_equal(read_shard(summary["train_shards"][0]), [1002, 50256, 1003])
  assert "--config.data.tokenizer=gpt2" in summary["train_with"]
  assert "--config.model.vocab_size=50257" in summary["train_with"]


@pytest.mark.parametrize("line,expected", [
    ('{"body": "x"}', r"docs.jsonl, line 2: no 'text' field \(found \['body'\]\).*--text_field"),
    ("not json", r"docs.jsonl, line 2: not a JSON object"),
    ('{"text": 3}', r"docs.jsonl, line 2: field 'text' is not a string"),
])
def test_bad_jsonl_line_is_named(tmp_path, line, expected):
  (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
  with pytest.raises(ValueError, match=expected):
    prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"),
                    progress_stream=io.StringIO())


def _fake_pyarrow(monkeypatch, row_groups, columns=("text",)):
  """A pyarrow.parquet stand-in with ParquetFile's reading API, over in-memory row groups."""

  class ParquetFile:
    def __init__(self, path):
      del path
      self.schema_arrow = types.SimpleNamespace(names=list(columns))
      self.num_row_groups = len(row_groups)

    def read_row_group(self, group, columns):
      assert columns == ["text"]
      texts = row_groups[group]
      return types.SimpleNamespace(column=lambda i: types.SimpleNamespace(to_pylist=lambda: texts))

  parquet = types.ModuleType("pyarrow.parquet")
  parquet.ParquetFile = ParquetFile
  pyarrow = types.ModuleType("pyarrow")
  pyarrow.parquet = parquet
  monkeypatch.setitem(sys.modules, "pyarrow", pyarrow)
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)


def test_parquet_rows_are_documents_in_row_group_order(tmp_path, monkeypatch):
  _fake_pyarrow(monkeypatch, [["ab", "c"], ["de"]])
  path = tmp_path / "part.parquet"
  path.write_bytes(b"PAR1" * 10)
  stream = io.StringIO()
  summary = prepare.prepare([str(path)], str(tmp_path / "out"), progress_stream=stream)
  assert summary["documents"] == 3
  np.testing.assert_array_equal(read_shard(summary["train_shards"][0]), list(b"abcde"))
  assert "100.0% 0.0/0.0 MB" in stream.getvalue()  # all 40 bytes counted


def test_parquet_without_the_column_lists_the_columns(tmp_path, monkeypatch):
  _fake_pyarrow(monkeypatch, [["x"]], columns=("id", "content"))
  (tmp_path / "p.parquet").write_bytes(b"PAR1")
  with pytest.raises(ValueError, match=r"p.parquet: no column 'text' \(columns: id, content\)"):
    prepare.prepare([str(tmp_path / "p.parquet")], str(tmp_path / "out"),
                    progress_stream=io.StringIO())


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as if not installed
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
  (tmp_path / "p.parquet").write_bytes(b"PAR1")
  with pytest.raises(ValueError, match=r"p.parquet: reading parquet needs the pyarrow package.*"
                                       r"pip install pyarrow"):
    prepare.prepare([str(tmp_path / "p.parquet")], str(tmp_path / "out"),
                    progress_stream=io.StringIO())


def test_missing_gpt2_files_fail_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "tiktoken", None)
  data_sources._gpt2_encoding.cache_clear()
  out = tmp_path / "out"
  with pytest.raises(ValueError, match="vocab.bpe and encoder.json"):
    prepare.prepare([SHAKESPEARE], str(out), tokenizer="gpt2", progress_stream=io.StringIO())
  assert not out.exists()
  data_sources._gpt2_encoding.cache_clear()


def test_existing_shards_are_never_overwritten(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "train_000000.bin").write_bytes(b"precious")
  with pytest.raises(ValueError, match="already holds shards.*train_000000.bin"):
    prepare.prepare([SHAKESPEARE], str(out), progress_stream=io.StringIO())
  assert (out / "train_000000.bin").read_bytes() == b"precious"
  assert sorted(os.listdir(out)) == ["train_000000.bin"]


def test_output_dir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "out").write_bytes(b"keep")
  with pytest.raises(ValueError, match="--output_dir=.*out' is a file"):
    prepare.prepare([SHAKESPEARE], str(tmp_path / "out"), progress_stream=io.StringIO())
  assert (tmp_path / "out").read_bytes() == b"keep"


def test_validation_taking_every_token_is_refused_and_cleaned_up(tmp_path):
  (tmp_path / "small.txt").write_text("tiny", encoding="utf-8")
  out = tmp_path / "out"
  with pytest.raises(ValueError, match="4 tokens, none left for training.*--val_tokens=10"):
    prepare.prepare([str(tmp_path / "small.txt")], str(out), val_tokens=10,
                    progress_stream=io.StringIO())
  assert os.listdir(out) == []


@pytest.mark.parametrize("inputs,error,expected", [
    ([], ValueError, "--input is required"),
    (["empty_dir/*.txt"], FileNotFoundError, r"--input='.*empty_dir/\*.txt' matches no file"),
    (["missing.txt"], FileNotFoundError, r"--input: '.*missing.txt' does not exist"),
])
def test_bad_inputs_are_named(tmp_path, inputs, error, expected):
  with pytest.raises(error, match=expected):
    prepare.prepare([str(tmp_path / name) for name in inputs], str(tmp_path / "out"),
                    progress_stream=io.StringIO())
  assert not (tmp_path / "out").exists()


def test_progress_lines_in_a_log_reach_100_percent(tmp_path):
  (tmp_path / "docs.jsonl").write_text(
      "".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(40)), encoding="utf-8")
  stream = io.StringIO()
  prepare.prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), progress_stream=stream)
  lines = stream.getvalue().splitlines()
  assert 5 <= len(lines) <= 11  # about one line per 10% in a log, not one per document
  assert lines[-1].startswith("prepare [#") and "100.0%" in lines[-1]
  assert lines[-1].endswith("2,000 tokens")


@pytest.mark.slow  # subprocess
def test_prepare_command_prints_a_summary_or_one_line_error(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "geonorm_jax", "prepare", f"--input={SHAKESPEARE}",
             f"--output_dir={tmp_path / 'out'}", "--val_tokens=1000"]
  result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads(result.stdout)
  assert summary["train_tokens"] + summary["val_tokens"] == 1_115_394
  assert "100.0%" in result.stderr
  again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
  assert again.returncode == 2
  assert "already holds shards" in again.stderr and "Traceback" not in again.stderr
