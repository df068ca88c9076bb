"""`python -m geonorm_jax prepare`: your own corpus in, the token shards the trainer reads out.

    python -m geonorm_jax prepare --input='corpus/*.jsonl' --output_dir=data/my_corpus \\
        [--tokenizer=byte|gpt2] [--text_field=text] [--val_tokens=1000000]

Inputs, by file extension (or --input_format for all of them):
  .jsonl    one JSON object per line; the document is its --text_field (default "text")
  .parquet  one document per row of the --text_field column (needs pyarrow, not installed
            with the package: `pip install pyarrow`)
  other     UTF-8 text; the whole file is one document
Tokens: bytes (vocab 256), or GPT-2 BPE when tiktoken and its GPT-2 files are on this machine
(nothing is downloaded; a missing file is named in the error). With GPT-2, every document
starts with <|endoftext|> as in llm.c; byte documents are concatenated as they are, since a
byte vocabulary has no spare id.

Output: `train_000000.bin, train_000001.bin, ...` in --output_dir (and `val_*.bin` holding
the first --val_tokens tokens, llm.c's convention), each a fineweb_bin shard of at most
--shard_tokens tokens. The command ends by printing the config overrides that train on them.
An output folder that already holds shards is refused, so nothing is overwritten.
"""
import glob
import json
import os
import shlex
import sys
import time
from typing import Iterator, TextIO

import numpy as np
from absl import flags

TOKENIZERS = ("byte", "gpt2")
INPUT_FORMATS = ("auto", "text", "jsonl", "parquet")
SPLITS = ("val", "train")  # val first: it holds the first --val_tokens tokens
# Text files are read and tokenized in pieces of about this many bytes, cut at line ends so
# that no character or word is split between two pieces.
_TEXT_PIECE_BYTES = 1 << 22

_INPUT = flags.DEFINE_list("input", None, "prepare: text, .jsonl or .parquet files or globs, "
                           "comma-separated.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "prepare: folder for the token shards.")
_TOKENIZER = flags.DEFINE_enum("tokenizer", "byte", TOKENIZERS, "prepare: byte tokens, or "
                               "GPT-2 BPE (tiktoken with its GPT-2 files cached locally).")
_INPUT_FORMAT = flags.DEFINE_enum("input_format", "auto", INPUT_FORMATS,
                                  "prepare: auto = by extension (.jsonl, .parquet, else text).")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "prepare: the JSON key or parquet "
                                  "column that holds a document's text.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 100_000_000, "prepare: tokens per shard.")
_VAL_TOKENS = flags.DEFINE_integer("val_tokens", 0, "prepare: the first N tokens go to "
                                   "val_*.bin; 0 = none (training then holds out "
                                   "data.val_fraction of the train shards).")


# ------------------------------------------------------------------------------ inputs


def _resolve_inputs(patterns) -> list[str]:
  if not patterns:
    raise ValueError("--input is required: text, .jsonl or .parquet files (globs allowed)")
  paths = []
  from geonorm_jax.data import sources as data_sources  # pylint: disable=g-import-not-at-top
  for pattern in patterns:
    for path in data_sources.expand_pattern(
        pattern, "--input", "--input: {path!r} does not exist or is not a file"):
      if path not in paths:
        paths.append(path)
  return paths


def _format_of(path: str, input_format: str) -> str:
  if input_format != "auto":
    return input_format
  extension = os.path.splitext(path)[1].lower()
  return {".jsonl": "jsonl", ".parquet": "parquet"}.get(extension, "text")


def _decode_utf8(raw: bytes, path: str, where: str) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: {where} is not UTF-8 text ({e})") from None


def _text_pieces(path: str) -> Iterator[tuple[str, bool, int]]:
  """(text, starts a document, bytes read) pieces of one text file: one document."""
  with open(path, "rb") as f:
    first = True
    offset = 0
    while True:
      raw = f.read(_TEXT_PIECE_BYTES)
      if not raw:
        break
      raw += f.readline()  # finish the line, so no word is cut in two
      yield _decode_utf8(raw, path, f"the piece at byte {offset}"), first, len(raw)
      first = False
      offset += len(raw)


def _jsonl_documents(path: str, text_field: str) -> Iterator[tuple[str, bool, int]]:
  with open(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      if not raw.strip():
        yield "", False, len(raw)  # blank lines only count as progress
        continue
      where = f"{path}, line {line_number}"
      try:
        record = json.loads(_decode_utf8(raw, path, f"line {line_number}"))
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e})") from None
      if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no {text_field!r} field (found {keys}); choose the field "
                         "with --text_field")
      if not isinstance(record[text_field], str):
        raise ValueError(f"{where}: field {text_field!r} is not a string")
      yield record[text_field], True, len(raw)


def _parquet_documents(path: str, text_field: str) -> Iterator[tuple[str, bool, int]]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"{path}: reading parquet needs the pyarrow package, which is not "
                     "installed (pip install pyarrow)") from None
  parquet_file = pq.ParquetFile(path)
  columns = parquet_file.schema_arrow.names
  if text_field not in columns:
    raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)}); "
                     "choose one with --text_field")
  size = os.path.getsize(path)
  num_groups = parquet_file.num_row_groups
  for group in range(num_groups):
    texts = parquet_file.read_row_group(group, columns=[text_field]).column(0).to_pylist()
    # Progress moves by row group: the share of the file's bytes is the best estimate.
    group_bytes = size * (group + 1) // num_groups - size * group // num_groups
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise ValueError(f"{path}: row group {group}, row {i}: {text_field!r} is not a string")
      yield text, True, group_bytes if i == len(texts) - 1 else 0


def _pieces(path: str, input_format: str, text_field: str):
  kind = _format_of(path, input_format)
  if kind == "jsonl":
    return _jsonl_documents(path, text_field)
  if kind == "parquet":
    return _parquet_documents(path, text_field)
  return _text_pieces(path)


# ----------------------------------------------------------------------------- outputs


class _ShardWriter:
  """Tokens in, `<split>_NNNNNN.bin` fineweb_bin shards of shard_tokens tokens out."""

  def __init__(self, output_dir: str, split: str, shard_tokens: int):
    self._output_dir, self._split, self._shard_tokens = output_dir, split, shard_tokens
    self._pending: list[np.ndarray] = []
    self._pending_count = 0
    self.paths: list[str] = []
    self.num_tokens = 0

  def add(self, tokens: np.ndarray) -> None:
    self._pending.append(tokens)
    self._pending_count += len(tokens)
    self.num_tokens += len(tokens)
    while self._pending_count >= self._shard_tokens:
      buffered = np.concatenate(self._pending)
      self._write(buffered[:self._shard_tokens])
      rest = buffered[self._shard_tokens:]
      self._pending, self._pending_count = [rest], len(rest)

  def close(self) -> None:
    if self._pending_count:
      self._write(np.concatenate(self._pending))
    self._pending, self._pending_count = [], 0

  def _write(self, tokens: np.ndarray) -> None:
    from geonorm_jax.data import sources as data_sources  # pylint: disable=g-import-not-at-top
    path = os.path.join(self._output_dir, f"{self._split}_{len(self.paths):06d}.bin")
    data_sources.write_fineweb_shard(path, tokens)
    self.paths.append(path)


class _ByteProgress:
  """A progress line over input bytes: redrawn in place on a terminal, every 10% in a log."""

  def __init__(self, total_bytes: int, stream: TextIO):
    self._total = max(1, total_bytes)
    self._stream = stream
    self._is_tty = bool(getattr(stream, "isatty", lambda: False)())
    self._done = 0
    self._started = time.monotonic()
    self._last_draw = 0.0
    self._last_decile = -1

  def update(self, num_bytes: int, num_tokens: int) -> None:
    self._done += num_bytes
    now = time.monotonic()
    fraction = min(1.0, self._done / self._total)
    if self._is_tty:
      if now - self._last_draw >= 0.1 or fraction == 1.0:
        self._last_draw = now
        self._stream.write("\r" + self._render(fraction, num_tokens, now))
    elif int(fraction * 10) > self._last_decile:
      self._last_decile = int(fraction * 10)
      self._stream.write(self._render(fraction, num_tokens, now) + "\n")

  def close(self) -> None:
    if self._is_tty:
      self._stream.write("\n")
    self._stream.flush()

  def _render(self, fraction: float, num_tokens: int, now: float) -> str:
    filled = int(round(30 * fraction))
    rate = self._done / max(now - self._started, 1e-9) / 1e6
    return (f"prepare [{'#' * filled}{'-' * (30 - filled)}] {100 * fraction:5.1f}% "
            f"{self._done / 1e6:,.1f}/{self._total / 1e6:,.1f} MB {rate:,.1f} MB/s "
            f"{num_tokens:,} tokens")


# -------------------------------------------------------------------------------- main


def prepare(inputs, output_dir: str, *, tokenizer: str = "byte", input_format: str = "auto",
            text_field: str = "text", shard_tokens: int = 100_000_000, val_tokens: int = 0,
            progress_stream: TextIO | None = None) -> dict:
  """Tokenizes `inputs` (paths or globs) into fineweb_bin shards; returns a summary dict.

  Every argument is checked, and the tokenizer loaded, before anything is written.
  """
  from geonorm_jax.data import sources as data_sources  # pylint: disable=g-import-not-at-top
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"--tokenizer={tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
  if input_format not in INPUT_FORMATS:
    raise ValueError(f"--input_format={input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
  if shard_tokens < 1:
    raise ValueError(f"--shard_tokens={shard_tokens} must be >= 1")
  if val_tokens < 0:
    raise ValueError(f"--val_tokens={val_tokens} must be >= 0")
  if not output_dir:
    raise ValueError("--output_dir is required: the folder for the token shards")
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise ValueError(f"--output_dir={output_dir!r} is a file, not a folder")
  paths = _resolve_inputs(inputs)
  existing = sorted(p for split in SPLITS
                    for p in glob.glob(os.path.join(glob.escape(output_dir), f"{split}_*.bin")))
  if existing:
    raise ValueError(f"--output_dir={output_dir!r} already holds shards ({existing[0]}, ...); "
                     "choose another folder or delete them first")
  if tokenizer == "gpt2":
    data_sources._gpt2_encoding()  # pylint: disable=protected-access  # fails before any write
  os.makedirs(output_dir, exist_ok=True)

  writers = {split: _ShardWriter(output_dir, split, shard_tokens) for split in SPLITS}
  progress = _ByteProgress(sum(os.path.getsize(p) for p in paths),
                           sys.stderr if progress_stream is None else progress_stream)
  num_documents = num_tokens = 0
  for path in paths:
    for text, starts_document, num_bytes in _pieces(path, input_format, text_field):
      tokens = data_sources.encode_text(text, tokenizer)
      if starts_document:
        num_documents += 1
        if tokenizer == "gpt2":
          tokens = np.concatenate([[data_sources.GPT2_END_OF_TEXT], tokens]).astype(np.uint16)
      to_val = min(len(tokens), max(0, val_tokens - num_tokens))
      if to_val:
        writers["val"].add(tokens[:to_val])
      if to_val < len(tokens):
        writers["train"].add(tokens[to_val:])
      num_tokens += len(tokens)
      progress.update(num_bytes, num_tokens)
  progress.close()
  for writer in writers.values():
    writer.close()

  train, val = writers["train"], writers["val"]
  if train.num_tokens == 0:
    for path in val.paths:  # an unusable result: leave the folder as it was
      os.remove(path)
    raise ValueError(f"{', '.join(paths)} gave {num_tokens} tokens, none left for training "
                     f"(--val_tokens={val_tokens})")
  vocab_size = (data_sources.BYTE_VOCAB_SIZE if tokenizer == "byte"
                else data_sources.GPT2_VOCAB_SIZE)
  overrides = ["data.source=fineweb_bin", f"data.path={os.path.join(output_dir, 'train_*.bin')}",
               f"data.tokenizer={tokenizer}"]
  if val.paths:
    overrides.append(f"data.val_path={os.path.join(output_dir, 'val_*.bin')}")
  overrides.append(f"model.vocab_size={vocab_size}")
  return {
      "output_dir": output_dir, "tokenizer": tokenizer, "documents": num_documents,
      "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
      "train_shards": train.paths, "val_shards": val.paths, "vocab_size": vocab_size,
      "train_with": " ".join(shlex.quote(f"--config.{item}") for item in overrides),
  }


def run_from_flags() -> dict:
  """The `prepare` command: flags in, summary out (cli.py prints it)."""
  return prepare(_INPUT.value, _OUTPUT_DIR.value, tokenizer=_TOKENIZER.value,
                 input_format=_INPUT_FORMAT.value, text_field=_TEXT_FIELD.value,
                 shard_tokens=_SHARD_TOKENS.value, val_tokens=_VAL_TOKENS.value)
