"""Tests for geonorm_jax.data.windows: sources, windows, resumption, process shards, errors."""
import hashlib
import os
import pickle
import sys
import types

import numpy as np
import pytest
from array_record.python import array_record_module
from pydoc_data import topics

from geonorm_jax.data import windows as data, sources as data_sources
from geonorm_jax.training import config as config_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Shipped with the repository (data/README.md says where it comes from).
SHAKESPEARE = os.path.join(REPO_ROOT, "data", "tinyshakespeare.txt")
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SEQ_LEN = 8
BATCH = 4
# Distinct ids (< 2**16) make each token its own position: a window's first id is its start.
NUM_UNIQUE = 3000
UNIQUE_STREAM = np.arange(NUM_UNIQUE, dtype=np.uint16)


def make_config(**data_overrides):
  config = config_lib.get_base_config()
  config.data.seq_len = SEQ_LEN
  config.data.batch_size = BATCH
  config.train.eval_batches = 3
  config.model.vocab_size = 65536
  for key, value in data_overrides.items():
    setattr(config.data, key, value)
  return config


def write_nanogpt(path, tokens):
  np.asarray(tokens, dtype="<u2").tofile(path)
  return str(path)


def write_fineweb(path, tokens, magic=data_sources.FINEWEB_MAGIC, version=data_sources.FINEWEB_VERSION,
                  num_tokens=None):
  header = np.zeros(256, dtype="<i4")
  header[:3] = magic, version, len(tokens) if num_tokens is None else num_tokens
  with open(path, "wb") as f:
    f.write(header.tobytes())
    f.write(np.asarray(tokens, dtype="<u2").tobytes())
  return str(path)


def write_array_record(path, documents):
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for document in documents:
    writer.write(np.asarray(document, dtype="<i4").tobytes())
  writer.close()
  return str(path)


def full_stream(config):
  train, val = data_sources.load_token_streams(config.data, config.model.vocab_size)
  return np.concatenate([np.asarray(train), np.asarray(val)])


def unique_config(tmp_path, **overrides):
  """nanogpt_bin config over UNIQUE_STREAM: token value == position in the stream."""
  path = write_nanogpt(tmp_path / "unique.bin", UNIQUE_STREAM)
  return make_config(source="nanogpt_bin", path=path, **overrides)


def take(iterator, count):
  return [next(iterator)["tokens"] for _ in range(count)]


# --------------------------------------------------------------------------- sources


def test_builtin_corpus_is_large_and_deterministic():
  config = make_config()
  config.model.vocab_size = 256
  tokens = full_stream(config)
  expected = "".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
  assert len(tokens) > 400_000  # 466,117 bytes with CPython 3.11.7
  np.testing.assert_array_equal(tokens, np.frombuffer(expected, np.uint8))
  assert len(np.unique(tokens)) > 90  # real English text, not a constant fill
  data_sources._load_token_streams_cached.cache_clear()
  np.testing.assert_array_equal(full_stream(config), tokens)


def test_text_source_round_trips_bytes_and_decodes(tmp_path):
  text = "héllo wörld — ünïcode ✓\n" * 20
  path = tmp_path / "corpus.txt"
  path.write_text(text, encoding="utf-8")
  config = make_config(source="text", path=str(path))
  tokens = full_stream(config)
  np.testing.assert_array_equal(tokens, np.frombuffer(text.encode("utf-8"), np.uint8))
  assert data_sources.decode(tokens, config.data) == text


def test_shipped_tinyshakespeare_is_the_published_file():
  with open(SHAKESPEARE, "rb") as f:  # a missing file fails here: it ships with the repo
    raw = f.read()
  assert len(raw) == SHAKESPEARE_BYTES
  assert hashlib.sha256(raw).hexdigest() == SHAKESPEARE_SHA256


def test_tinyshakespeare_as_text_source():
  config = make_config(source="text", path=SHAKESPEARE, seq_len=64)
  config.model.vocab_size = 256
  train, val = data_sources.load_token_streams(config.data, 256)
  assert len(train) + len(val) == SHAKESPEARE_BYTES
  assert len(val) == int(SHAKESPEARE_BYTES * 0.1)
  assert data_sources.decode(train[:14], config.data) == "First Citizen:"
  batch = next(data.make_train_iterator(config, 0, 1))["tokens"]
  assert batch.shape == (BATCH, 65) and batch.max() < 128  # tinyshakespeare is ASCII


def test_nanogpt_bin_round_trip(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 50257, 1000).astype(np.uint16)
  config = make_config(source="nanogpt_bin", path=write_nanogpt(tmp_path / "t.bin", tokens))
  np.testing.assert_array_equal(full_stream(config), tokens)


def test_fineweb_bin_glob_concatenates_shards_in_order(tmp_path):
  shards = [np.arange(i * 100, i * 100 + 100, dtype=np.uint16) for i in range(3)]
  for i, shard in reversed(list(enumerate(shards))):  # file creation order is irrelevant
    write_fineweb(tmp_path / f"fw_train_{i:06d}.bin", shard)
  config = make_config(source="fineweb_bin", path=str(tmp_path / "fw_train_*.bin"))
  np.testing.assert_array_equal(full_stream(config), np.concatenate(shards))
  train, _ = data_sources.load_token_streams(config.data, config.model.vocab_size)
  np.testing.assert_array_equal(train[95:205], np.arange(95, 205))  # spans three files


def test_array_record_round_trip(tmp_path):
  documents = [[1, 2, 3], [70000, 5], list(range(10, 200))]
  path = write_array_record(tmp_path / "docs.array_record", documents)
  config = make_config(source="array_record", path=path)
  config.model.vocab_size = 100_000
  np.testing.assert_array_equal(full_stream(config), np.concatenate(documents))


def test_val_path_is_used_as_validation(tmp_path):
  train_tokens = np.arange(500, dtype=np.uint16)
  val_tokens = np.arange(1000, 1100, dtype=np.uint16)
  config = make_config(source="nanogpt_bin",
                       path=write_nanogpt(tmp_path / "train.bin", train_tokens),
                       val_path=write_nanogpt(tmp_path / "val.bin", val_tokens))
  train, val = data_sources.load_token_streams(config.data, config.model.vocab_size)
  np.testing.assert_array_equal(np.asarray(train), train_tokens)
  np.testing.assert_array_equal(np.asarray(val), val_tokens)


def test_split_is_the_tail_and_deterministic(tmp_path):
  config = unique_config(tmp_path, val_fraction=0.25)
  train, val = data_sources.load_token_streams(config.data, config.model.vocab_size)
  split = NUM_UNIQUE - int(NUM_UNIQUE * 0.25)
  np.testing.assert_array_equal(np.asarray(train), UNIQUE_STREAM[:split])
  np.testing.assert_array_equal(np.asarray(val), UNIQUE_STREAM[split:])
  data_sources._load_token_streams_cached.cache_clear()
  train_again, _ = data_sources.load_token_streams(config.data, config.model.vocab_size)
  assert len(train_again) == split


def test_file_stream_pickles_without_its_data(tmp_path):
  config = unique_config(tmp_path)
  train, _ = data_sources.load_token_streams(config.data, config.model.vocab_size)
  pickled = pickle.dumps(train)
  assert len(pickled) < 1000  # file names, not 5,400 bytes of tokens
  np.testing.assert_array_equal(np.asarray(pickle.loads(pickled)), np.asarray(train))


def test_gpt2_tokenizer_loads_offline_or_names_the_field(tmp_path):
  path = tmp_path / "t.txt"
  path.write_text("Hello world, hello tokens.", encoding="utf-8")
  config = make_config(source="text", path=str(path), tokenizer="gpt2", seq_len=2)
  try:
    encoding = data_sources._gpt2_encoding()
  except ValueError as e:
    assert "data.tokenizer" in str(e)
    with pytest.raises(ValueError, match="data.tokenizer"):
      data_sources.load_token_streams(config.data, config.model.vocab_size)
    return
  tokens = full_stream(config)
  np.testing.assert_array_equal(tokens, encoding.encode_ordinary(path.read_text()))
  assert data_sources.decode(tokens, config.data) == path.read_text()


def test_gpt2_error_names_each_missing_tokenizer_file(tmp_path, monkeypatch):
  fake_tiktoken = types.ModuleType("tiktoken")  # installed, but its cache is empty
  fake_tiktoken.load = types.ModuleType("tiktoken.load")
  monkeypatch.setitem(sys.modules, "tiktoken", fake_tiktoken)
  monkeypatch.setitem(sys.modules, "tiktoken.load", fake_tiktoken.load)
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
  data_sources._gpt2_encoding.cache_clear()
  # The names tiktoken gives its cached copies of the two GPT-2 files.
  vocab_path = tmp_path / "6d1cbeee0f20b3d9449abfede4726ed8212e3aee"
  encoder_path = tmp_path / "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"
  assert data_sources.gpt2_tokenizer_files() == {"vocab.bpe": str(vocab_path),
                                                 "encoder.json": str(encoder_path)}
  with pytest.raises(ValueError, match=f"vocab.bpe \\(expected at {vocab_path}\\).*"
                     f"encoder.json \\(expected at {encoder_path}\\)"):
    data_sources._gpt2_encoding()
  vocab_path.write_text("#version: 0.2\n")
  data_sources._gpt2_encoding.cache_clear()
  with pytest.raises(ValueError, match="Missing: encoder.json") as error:
    data_sources._gpt2_encoding()
  assert "vocab.bpe (expected" not in str(error.value)
  data_sources._gpt2_encoding.cache_clear()


def test_gpt2_error_names_the_missing_package(monkeypatch):
  monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails as if not installed
  data_sources._gpt2_encoding.cache_clear()
  with pytest.raises(ValueError, match="data.tokenizer='gpt2'.*pip install tiktoken"):
    data_sources._gpt2_encoding()
  data_sources._gpt2_encoding.cache_clear()


def test_gpt2_text_path_uses_the_encoding(tmp_path, monkeypatch):
  class FakeEncoding:  # stands in for tiktoken so the path is tested offline
    n_vocab = 50257

    def encode_ordinary(self, text):
      return [50000 + len(word) for word in text.split()]

    def decode_single_token_bytes(self, token):
      return b"w%d " % (token - 50000)

  monkeypatch.setattr(data_sources, "_gpt2_encoding", FakeEncoding)
  path = tmp_path / "g.txt"
  path.write_text("a bb ccc dddd", encoding="utf-8")
  config = make_config(source="text", path=str(path), tokenizer="gpt2", val_fraction=0.5,
                       seq_len=1)
  np.testing.assert_array_equal(full_stream(config), [50001, 50002, 50003, 50004])
  assert data_sources.decode([50002, 60000], config.data) == "w2 \ufffd"
  config.model.vocab_size = 50257
  data.validate_data_config(config)


def test_decode_replaces_bad_bytes_and_out_of_range_ids():
  config = make_config()
  assert data_sources.decode([104, 105], config.data) == "hi"
  assert data_sources.decode([104, 0xC3, 300, 105], config.data) == "h\ufffd\ufffdi"


# ---------------------------------------------------------------------------- windows


@pytest.mark.parametrize("sampling", data.SAMPLINGS)
def test_windows_are_slices_of_the_training_split(tmp_path, sampling):
  config = unique_config(tmp_path, sampling=sampling)
  train, _ = data_sources.load_token_streams(config.data, config.model.vocab_size)
  for batch in take(data.make_train_iterator(config, 0, 1), 20):
    assert batch.dtype == np.int32 and batch.shape == (BATCH, SEQ_LEN + 1)
    for row in batch:
      start = row[0]
      np.testing.assert_array_equal(row, train[start:start + SEQ_LEN + 1])
      # inputs row[:-1] and targets row[1:] are the same slice shifted by one token
      np.testing.assert_array_equal(row[1:], np.asarray(train[start + 1:start + SEQ_LEN + 1]))
      assert row[-1] < len(train)  # never reaches into validation
      if sampling == "packed":
        assert start % SEQ_LEN == 0


@pytest.mark.parametrize("sampling,seq_len,expected_starts", [
    ("random", 12, {0, 1, 2}),  # 15 training tokens hold windows of 13 at 0, 1, 2 only
    ("packed", 5, {0, 5}),  # 15 tokens: [0, 6) and [5, 11); a third would need 16
])
def test_windows_reach_the_end_of_the_split_but_not_past(tmp_path, sampling, seq_len,
                                                          expected_starts):
  path = write_nanogpt(tmp_path / "short.bin", np.arange(30))
  config = make_config(source="nanogpt_bin", path=path, val_fraction=0.5, sampling=sampling,
                       seq_len=seq_len)
  batches = take(data.make_train_iterator(config, 0, 1), 30)
  assert set(np.concatenate([b[:, 0] for b in batches]).tolist()) == expected_starts


def test_random_windows_cover_the_split_and_depend_on_seed(tmp_path):
  config = unique_config(tmp_path)
  starts = np.concatenate([b[:, 0] for b in take(data.make_train_iterator(config, 0, 1), 100)])
  num_starts = NUM_UNIQUE - int(NUM_UNIQUE * 0.1) - SEQ_LEN
  assert starts.min() >= 0 and starts.max() < num_starts
  assert len(np.unique(starts)) > 300  # 400 draws from 2,692 starts are mostly distinct
  config.data.seed = 1
  other = np.concatenate([b[:, 0] for b in take(data.make_train_iterator(config, 0, 1), 100)])
  assert not np.array_equal(starts, other)


def test_packed_epoch_visits_every_window_once_then_reshuffles(tmp_path):
  config = unique_config(tmp_path, sampling="packed", seq_len=100)
  train, _ = data_sources.load_token_streams(config.data, config.model.vocab_size)
  num_windows = (len(train) - 1) // 100  # 26, so 6 full batches of 4 + 2 spill over
  starts = np.concatenate([b[:, 0] for b in take(data.make_train_iterator(config, 0, 1), 13)])
  first, second = starts[:num_windows], starts[num_windows:2 * num_windows]
  np.testing.assert_array_equal(np.sort(first), np.arange(num_windows) * 100)
  np.testing.assert_array_equal(np.sort(second), np.arange(num_windows) * 100)
  assert not np.array_equal(first, second)
  assert not np.array_equal(first, np.sort(first))


@pytest.mark.parametrize("sampling", data.SAMPLINGS)
def test_resume_from_state_is_exact(tmp_path, sampling):
  config = unique_config(tmp_path, sampling=sampling)
  iterator = data.make_train_iterator(config, 0, 1)
  reference = take(iterator, 7)
  iterator = data.make_train_iterator(config, 0, 1)
  take(iterator, 3)
  state = iterator.get_state()
  take(iterator, 2)  # the original keeps going; the saved state must not move with it
  resumed = data.make_train_iterator(config, 0, 1)
  resumed.set_state(state)
  for expected, got in zip(reference[3:], take(resumed, 4)):
    np.testing.assert_array_equal(got, expected)
  assert not np.array_equal(reference[3], reference[4])


@pytest.mark.slow  # a grain worker process
def test_resume_with_worker_processes(tmp_path):
  config = unique_config(tmp_path, num_workers=1)
  reference = take(data.make_train_iterator(unique_config(tmp_path), 0, 1), 5)
  iterator = data.make_train_iterator(config, 0, 1)
  resumed = data.make_train_iterator(config, 0, 1)
  try:
    first = take(iterator, 3)
    resumed.set_state(iterator.get_state())
    rest = take(resumed, 2)
  finally:
    iterator.close()
    resumed.close()
  for expected, got in zip(reference, first + rest):
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("sampling", data.SAMPLINGS)
@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_concatenate_to_global_batch(tmp_path, sampling, process_count):
  config = unique_config(tmp_path, sampling=sampling, batch_size=8)
  global_train = take(data.make_train_iterator(config, 0, 1), 5)
  global_eval = data.make_eval_batches(config, 0, 1)
  local_train = [take(data.make_train_iterator(config, p, process_count), 5)
                 for p in range(process_count)]
  local_eval = [data.make_eval_batches(config, p, process_count)
                for p in range(process_count)]
  for step in range(5):
    assert local_train[0][step].shape == (8 // process_count, SEQ_LEN + 1)
    np.testing.assert_array_equal(
        np.concatenate([local[step] for local in local_train]), global_train[step])
  for b, expected in enumerate(global_eval):
    np.testing.assert_array_equal(
        np.concatenate([local[b]["tokens"] for local in local_eval]), expected["tokens"])


def test_eval_batches_fixed_and_from_validation_only(tmp_path):
  config = unique_config(tmp_path)
  split = NUM_UNIQUE - int(NUM_UNIQUE * 0.1)
  first = data.make_eval_batches(config, 0, 1)
  second = data.make_eval_batches(config, 0, 1)
  assert len(first) == config.train.eval_batches
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  rows = np.concatenate([batch["tokens"] for batch in first])
  assert rows.shape == (3 * BATCH, SEQ_LEN + 1) and rows.dtype == np.int32
  assert rows.min() >= split  # disjoint from the training region
  np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(SEQ_LEN + 1))
  assert len(np.unique(rows[:, 0])) == len(rows)


def test_short_validation_split_reuses_windows(tmp_path):
  config = unique_config(tmp_path, val_fraction=0.005)  # 15 tokens: one 9-token window
  batches = data.make_eval_batches(config, 0, 1)
  assert all((b["tokens"] == batches[0]["tokens"][0]).all() for b in batches)


# ----------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
  config = make_config(source="text", path=str(tmp_path / "nope.txt"))
  with pytest.raises(FileNotFoundError, match="nope.txt"):
    data.validate_data_config(config)


def test_glob_without_match(tmp_path):
  config = make_config(source="fineweb_bin", path=str(tmp_path / "shard_*.bin"))
  with pytest.raises(FileNotFoundError, match=r"data.path=.*shard_\*\.bin"):
    data.validate_data_config(config)


def test_empty_file(tmp_path):
  path = tmp_path / "empty.txt"
  path.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.txt.*empty"):
    data.validate_data_config(make_config(source="text", path=str(path)))


def test_empty_path_for_file_source():
  with pytest.raises(ValueError, match="data.path"):
    data.validate_data_config(make_config(source="nanogpt_bin", path=""))


def test_empty_array_record(tmp_path):
  path = write_array_record(tmp_path / "none.array_record", [[]])
  with pytest.raises(ValueError, match="none.array_record"):
    data.validate_data_config(make_config(source="array_record", path=path))


def test_array_record_with_partial_token(tmp_path):
  path = tmp_path / "bad.array_record"
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  writer.write(b"\x01\x00\x00")
  writer.close()
  with pytest.raises(ValueError, match="bad.array_record.*int32"):
    data.validate_data_config(make_config(source="array_record", path=str(path)))


def test_odd_sized_nanogpt_file(tmp_path):
  path = tmp_path / "odd.bin"
  path.write_bytes(b"\x01\x00\x02")
  with pytest.raises(ValueError, match="odd.bin.*uint16"):
    data.validate_data_config(make_config(source="nanogpt_bin", path=str(path)))


def test_token_ids_beyond_vocab(tmp_path):
  config = unique_config(tmp_path)
  config.model.vocab_size = 2000
  with pytest.raises(ValueError, match=r"unique.bin.*2999.*model.vocab_size=2000"):
    data.validate_data_config(config)


def test_byte_text_beyond_small_vocab(tmp_path):
  path = tmp_path / "accents.txt"
  path.write_text("café " * 10, encoding="utf-8")
  config = make_config(source="text", path=str(path))
  config.model.vocab_size = 128
  with pytest.raises(ValueError, match="accents.txt.*model.vocab_size=128"):
    data.validate_data_config(config)


def test_vocab_check_is_chunkwise_and_names_the_shard(tmp_path, monkeypatch):
  monkeypatch.setattr(data_sources, "_RANGE_CHECK_CHUNK", 64)
  read_sizes = []
  original_read = data_sources.TokenFileStream._read

  def recording_read(self, start, stop):
    read_sizes.append(stop - start)
    return original_read(self, start, stop)

  monkeypatch.setattr(data_sources.TokenFileStream, "_read", recording_read)
  write_fineweb(tmp_path / "s_0.bin", np.arange(500) % 100)
  bad = np.arange(500) % 100
  bad[333] = 40000  # inside the sixth chunk of the second shard
  write_fineweb(tmp_path / "s_1.bin", bad)
  config = make_config(source="fineweb_bin", path=str(tmp_path / "s_*.bin"))
  config.model.vocab_size = 30000
  with pytest.raises(ValueError, match=r"s_1.bin.*40000.*model.vocab_size=30000"):
    data.validate_data_config(config)
  assert read_sizes and max(read_sizes) <= 64  # never the whole memmap at once


@pytest.mark.parametrize("field,value,expected", [
    ("magic", 12345, "magic 12345, expected 20240520"),
    ("version", 7, "version 7, expected 1"),
    ("num_tokens", 200, "200 tokens.*1424 bytes.*1224 bytes"),
])
def test_bad_fineweb_header(tmp_path, field, value, expected):
  path = write_fineweb(tmp_path / "shard.bin", np.arange(100), **{field: value})
  config = make_config(source="fineweb_bin", path=path)
  with pytest.raises(ValueError, match=f"shard.bin.*{expected}"):
    data.validate_data_config(config)


def test_truncated_fineweb_header(tmp_path):
  path = tmp_path / "short.bin"
  path.write_bytes(b"\x00" * 100)
  with pytest.raises(ValueError, match="short.bin.*1024-byte header"):
    data.validate_data_config(make_config(source="fineweb_bin", path=str(path)))


@pytest.mark.parametrize("val_fraction,seq_len,split,num_tokens", [
    (0.1, 2999, "training", 2700),
    (0.01, 100, "validation", 30),
])
def test_seq_len_longer_than_split(tmp_path, val_fraction, seq_len, split, num_tokens):
  config = unique_config(tmp_path, val_fraction=val_fraction, seq_len=seq_len)
  config.model.max_seq_len = 4096
  with pytest.raises(ValueError,
                     match=f"data.seq_len={seq_len}.*{split} split has only {num_tokens}"):
    data.validate_data_config(config)


def test_seq_len_beyond_model_max():
  config = make_config(seq_len=256)
  config.model.max_seq_len = 128
  with pytest.raises(ValueError, match=r"data.seq_len=256.*model.max_seq_len=128"):
    data.validate_data_config(config)


@pytest.mark.parametrize("field,valid", [
    ("source", "builtin, text, nanogpt_bin, fineweb_bin, array_record"),
    ("tokenizer", "byte, gpt2"),
    ("sampling", "random, packed"),
])
def test_unknown_choice_lists_valid_values(field, valid):
  with pytest.raises(ValueError, match=f"data.{field}='bogus' is not one of {valid}"):
    data.validate_data_config(make_config(**{field: "bogus"}))


def test_batch_not_divisible_by_processes():
  config = make_config(batch_size=6)
  with pytest.raises(ValueError, match=r"data.batch_size=6.*process count \(4\)"):
    data.make_train_iterator(config, 0, 4)
  with pytest.raises(ValueError, match=r"data.batch_size=6.*process count \(4\)"):
    data.make_eval_batches(config, 0, 4)


def test_batch_not_divisible_by_data_parallel_mesh():
  config = make_config(batch_size=6)
  with pytest.raises(ValueError, match=r"data.batch_size=6.*data-parallel mesh size \(4\)"):
    data.validate_data_config(config, process_count=1, data_parallel_size=4)


def test_bad_val_fraction():
  with pytest.raises(ValueError, match="data.val_fraction"):
    data.validate_data_config(make_config(val_fraction=0.0))
