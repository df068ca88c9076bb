"""Token sources: five corpus formats in, two 1-D token streams (train, validation) out.

What a source is, read from disk and checked; data.py cuts the streams into windows.

Sources (`data.source`):
  builtin       CPython's own documentation text (`pydoc_data.topics`), topics in sorted
                order, UTF-8 bytes as tokens. Needs no file, always the same.
  text          UTF-8 text file(s) at data.path, byte tokens or GPT-2 BPE (tiktoken, only
                when its encoding is already cached: nothing is downloaded).
  nanogpt_bin   nanoGPT's train.bin / val.bin: raw little-endian uint16, no header.
  fineweb_bin   llm.c / modded-nanogpt shards: 256 int32 header (magic 20240520,
                version 1, token count) then uint16 tokens. data.path may be a glob.
                `python -m geonorm_jax prepare` writes them from text, jsonl or parquet.
  array_record  ArrayRecord file(s); each record is one document whose bytes are a
                little-endian int32 token array (`np.asarray(ids, '<i4').tobytes()`).
                Records are concatenated in file then record order, with no separator
                added: put an end-of-text token in the records if documents need one.

Every file-backed source accepts a glob in data.path / data.val_path (files are read in
sorted order and concatenated). text and array_record streams are loaded into memory; the
two .bin formats stay on disk as memmaps (see `TokenFileStream`).
"""
import dataclasses
import functools
import glob
import hashlib
import operator
import os
import tempfile
from typing import Iterator, Sequence
from unittest import mock

import grain
import ml_collections
import numpy as np

SOURCES = ("builtin", "text", "nanogpt_bin", "fineweb_bin", "array_record")
TOKENIZERS = ("byte", "gpt2")

BYTE_VOCAB_SIZE = 256
FINEWEB_MAGIC = 20240520
FINEWEB_VERSION = 1
FINEWEB_HEADER_INT32S = 256
FINEWEB_HEADER_BYTES = FINEWEB_HEADER_INT32S * 4
ARRAY_RECORD_DTYPE = np.dtype("<i4")
BIN_DTYPE = np.dtype("<u2")

# Vocabulary checks on disk-backed corpora read this many tokens at a time, so a
# multi-gigabyte memmap never has to fit in memory at once.
_RANGE_CHECK_CHUNK = 1 << 24


# ----------------------------------------------------------------------------- tokenizers


# tiktoken builds its GPT-2 encoding from these two files of OpenAI's and caches each under
# the sha1 of its URL; this project reads that cache and never downloads.
_GPT2_FILE_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}
GPT2_END_OF_TEXT = 50256  # <|endoftext|>
GPT2_VOCAB_SIZE = 50257
_GPT2_NEEDS = ("The GPT-2 tokenizer (data.tokenizer='gpt2', or prepare --tokenizer=gpt2) needs "
               "the tiktoken package and its two GPT-2 files, vocab.bpe and encoder.json, "
               "in tiktoken's cache; nothing is downloaded")


def gpt2_tokenizer_files() -> dict[str, str]:
  """Where tiktoken looks for each GPT-2 file: {name: path in its cache folder}."""
  cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR",
                             os.environ.get("DATA_GYM_CACHE_DIR",
                                            os.path.join(tempfile.gettempdir(), "data-gym-cache")))
  return {name: os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
          for name, url in _GPT2_FILE_URLS.items()}


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
  """tiktoken's GPT-2 encoding, loaded from its local cache only."""
  try:
    import tiktoken  # pylint: disable=g-import-not-at-top
    import tiktoken.load  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(f"{_GPT2_NEEDS}. tiktoken is not installed (pip install tiktoken); "
                     "or use the byte tokenizer.") from e
  missing = [f"{name} (expected at {path})"
             for name, path in gpt2_tokenizer_files().items() if not os.path.isfile(path)]
  if missing:
    raise ValueError(
        f"{_GPT2_NEEDS}. Missing: {'; '.join(missing)}. Copy the files from "
        f"{os.path.dirname(_GPT2_FILE_URLS['vocab.bpe'])}/ to those paths (TIKTOKEN_CACHE_DIR "
        "chooses the folder), or use the byte tokenizer.")
  original_read_file = tiktoken.load.read_file

  def read_local_file_only(blobpath):
    # tiktoken falls back to downloading when its cache misses (or holds a file whose hash
    # is wrong); this project never downloads, so that becomes an error instead.
    if "://" in blobpath:
      raise OSError(f"{blobpath} is not in tiktoken's local cache, or its hash is wrong")
    return original_read_file(blobpath)

  try:
    with mock.patch.object(tiktoken.load, "read_file", read_local_file_only):
      return tiktoken.get_encoding("gpt2")
  except Exception as e:  # tiktoken raises several types for a cache miss
    raise ValueError(f"{_GPT2_NEEDS}. Loading them failed: {e}") from e


def encode_text(text: str, tokenizer: str) -> np.ndarray:
  if tokenizer == "byte":
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
  # encode_ordinary: a literal "<|endoftext|>" in a corpus is text, not a special token.
  return np.asarray(_gpt2_encoding().encode_ordinary(text), dtype=np.uint16)


def decode(tokens, data_config: ml_collections.ConfigDict) -> str:
  """Token ids -> text with data.tokenizer; undecodable ids or bytes become U+FFFD."""
  check_choice("data.tokenizer", data_config.tokenizer, TOKENIZERS)
  ids = np.asarray(tokens).reshape(-1).astype(np.int64)
  # 0xFF never occurs in UTF-8, so it stands in for an id outside the tokenizer's
  # vocabulary (a model with a padded vocab can sample those) and decodes as U+FFFD.
  if data_config.tokenizer == "byte":
    raw = np.where((ids >= 0) & (ids < BYTE_VOCAB_SIZE), ids, 0xFF).astype(np.uint8).tobytes()
  else:
    encoding = _gpt2_encoding()
    raw = b"".join(
        encoding.decode_single_token_bytes(int(i)) if 0 <= i < encoding.n_vocab else b"\xff"
        for i in ids)
  return raw.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------- on-disk streams


@dataclasses.dataclass(frozen=True)
class _TokenFile:
  path: str
  byte_offset: int  # where the uint16 payload starts (after any header)
  num_tokens: int


class TokenFileStream:
  """Read-only 1-D uint16 token array kept on disk: the payloads of files, concatenated.

  Supports what the pipeline and trainer need from a numpy array: len, integer and slice
  indexing (which return ndarrays) and np.asarray. It pickles as file names, so grain
  worker processes reopen memmaps instead of receiving a copy of the corpus.
  """

  def __init__(self, files: Sequence[_TokenFile], start: int = 0, stop: int | None = None):
    self._files = tuple(files)
    self._file_starts = np.cumsum([0] + [f.num_tokens for f in self._files])
    self._start = start
    self._stop = int(self._file_starts[-1]) if stop is None else stop
    self._memmaps = {}

  def __len__(self) -> int:
    return self._stop - self._start

  def __getitem__(self, key):
    if isinstance(key, slice):
      start, stop, step = key.indices(len(self))
      if step != 1:
        raise ValueError("TokenFileStream only supports contiguous slices")
      return self._read(self._start + start, self._start + max(start, stop))
    index = operator.index(key)
    if index < 0:
      index += len(self)
    if not 0 <= index < len(self):
      raise IndexError(f"index {key} out of range for {len(self)} tokens")
    return self._read(self._start + index, self._start + index + 1)[0]

  def __array__(self, dtype=None, copy=None):
    del copy  # reading from disk always makes a fresh array
    tokens = self._read(self._start, self._stop)
    return tokens if dtype is None else tokens.astype(dtype)

  def subrange(self, start: int, stop: int) -> "TokenFileStream":
    """Lazy view of tokens [start, stop) of this stream (no data is read)."""
    if not 0 <= start <= stop <= len(self):
      raise IndexError(f"subrange [{start}, {stop}) outside [0, {len(self)})")
    return TokenFileStream(self._files, self._start + start, self._start + stop)

  def chunks_by_file(self, chunk_size: int) -> Iterator[tuple[str, np.ndarray]]:
    """(file path, tokens) pieces covering the stream in order, at most chunk_size long."""
    for i, token_file in enumerate(self._files):
      lo = max(self._start, int(self._file_starts[i]))
      hi = min(self._stop, int(self._file_starts[i + 1]))
      for chunk_start in range(lo, hi, chunk_size):
        yield token_file.path, self._read(chunk_start, min(hi, chunk_start + chunk_size))

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_memmaps"] = {}  # open file maps do not travel between processes
    return state

  def _memmap(self, file_index: int) -> np.memmap:
    if file_index not in self._memmaps:
      token_file = self._files[file_index]
      self._memmaps[file_index] = np.memmap(
          token_file.path, dtype=BIN_DTYPE, mode="r", offset=token_file.byte_offset,
          shape=(token_file.num_tokens,))
    return self._memmaps[file_index]

  def _read(self, start: int, stop: int) -> np.ndarray:
    """Copy of absolute tokens [start, stop), which may span several files."""
    pieces = []
    position = start
    while position < stop:
      file_index = int(np.searchsorted(self._file_starts, position, side="right")) - 1
      file_start = int(self._file_starts[file_index])
      piece_stop = min(stop, int(self._file_starts[file_index + 1]))
      pieces.append(self._memmap(file_index)[position - file_start:piece_stop - file_start])
      position = piece_stop
    if not pieces:
      return np.zeros((0,), BIN_DTYPE)
    return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])


# --------------------------------------------------------------------------- readers


def builtin_text() -> str:
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  return "".join(topics.topics[name] for name in sorted(topics.topics))


def expand_pattern(pattern: str, field: str, missing: str) -> list[str]:
  """The files a path or glob names, sorted; a glob matching nothing, or a path that is not a
  file, is an error naming `field` (`missing` formats the latter with the path)."""
  if glob.has_magic(pattern):
    paths = sorted(glob.glob(pattern))
    if not paths:
      raise FileNotFoundError(f"{field}={pattern!r} matches no file")
  else:
    paths = [pattern]
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(missing.format(path=path))
  return paths


def _resolve_files(pattern: str, field: str) -> list[str]:
  """Files named by a path or glob; missing or empty files are errors naming `field`."""
  if not pattern:
    raise ValueError(f"{field} is empty, but this data.source reads its tokens from a file")
  paths = expand_pattern(pattern, field, f"{field}: data file {{path!r}} does not exist")
  for path in paths:
    if os.path.getsize(path) == 0:
      raise ValueError(f"{field}: data file {path!r} is empty")
  return paths


def _text_tokens(paths: Sequence[str], tokenizer: str, field: str) -> np.ndarray:
  texts = []
  for path in paths:
    with open(path, "rb") as f:
      raw = f.read()
    try:
      texts.append(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise ValueError(f"{field}: {path!r} is not UTF-8 text ({e})") from e
  return encode_text("".join(texts), tokenizer)


def _nanogpt_file(path: str, field: str) -> _TokenFile:
  size = os.path.getsize(path)
  if size % BIN_DTYPE.itemsize:
    raise ValueError(
        f"{field}: {path!r} has {size} bytes, not a whole number of uint16 tokens "
        "(expected nanoGPT's raw uint16 .bin layout)")
  return _TokenFile(path, 0, size // BIN_DTYPE.itemsize)


def _fineweb_file(path: str, field: str) -> _TokenFile:
  size = os.path.getsize(path)
  if size < FINEWEB_HEADER_BYTES:
    raise ValueError(
        f"{field}: shard {path!r} has {size} bytes, fewer than the "
        f"{FINEWEB_HEADER_BYTES}-byte header of a fineweb_bin shard")
  header = np.fromfile(path, dtype="<i4", count=FINEWEB_HEADER_INT32S)
  magic, version, num_tokens = (int(v) for v in header[:3])
  if magic != FINEWEB_MAGIC:
    raise ValueError(f"{field}: shard {path!r} has magic {magic}, expected {FINEWEB_MAGIC}")
  if version != FINEWEB_VERSION:
    raise ValueError(
        f"{field}: shard {path!r} has version {version}, expected {FINEWEB_VERSION}")
  expected_size = FINEWEB_HEADER_BYTES + num_tokens * BIN_DTYPE.itemsize
  if num_tokens <= 0 or size != expected_size:
    raise ValueError(
        f"{field}: shard {path!r} header says {num_tokens} tokens, so expected "
        f"{expected_size} bytes, but the file has {size} bytes")
  return _TokenFile(path, FINEWEB_HEADER_BYTES, num_tokens)


def write_fineweb_shard(path: str, tokens) -> None:
  """Writes token ids as one fineweb_bin shard (the layout `_fineweb_file` reads).

  Written to a temporary name and renamed, so an interrupted write leaves no half shard.
  """
  tokens = np.asarray(tokens)
  if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(BIN_DTYPE).max):
    raise ValueError(f"{path}: token ids must lie in [0, 65535] for a uint16 shard, got "
                     f"[{int(tokens.min())}, {int(tokens.max())}]")
  header = np.zeros(FINEWEB_HEADER_INT32S, dtype="<i4")
  header[:3] = FINEWEB_MAGIC, FINEWEB_VERSION, len(tokens)
  partial_path = path + ".partial"
  with open(partial_path, "wb") as f:
    f.write(header.tobytes())
    f.write(tokens.astype(BIN_DTYPE).tobytes())
  os.replace(partial_path, path)


def _array_record_tokens(paths: Sequence[str], field: str) -> np.ndarray:
  documents = []
  for path in paths:  # one source per file, so an error can name the file
    records = grain.sources.ArrayRecordDataSource([path])
    for i in range(len(records)):
      record = records[i]
      if len(record) % ARRAY_RECORD_DTYPE.itemsize:
        raise ValueError(
            f"{field}: record {i} of {path!r} has {len(record)} bytes, not a whole number "
            "of int32 tokens (each record must be np.asarray(ids, '<i4').tobytes())")
      documents.append(np.frombuffer(record, dtype=ARRAY_RECORD_DTYPE))
  tokens = np.concatenate(documents) if documents else np.zeros((0,), ARRAY_RECORD_DTYPE)
  if tokens.size == 0:
    raise ValueError(f"{field}: ArrayRecord file(s) {list(paths)} hold no tokens")
  return tokens


def _read_source(source: str, pattern: str, tokenizer: str, field: str):
  """One token stream (ndarray or TokenFileStream) from data.source files at `pattern`."""
  paths = _resolve_files(pattern, field)
  if source == "text":
    return _text_tokens(paths, tokenizer, field)
  if source == "nanogpt_bin":
    return TokenFileStream([_nanogpt_file(p, field) for p in paths])
  if source == "fineweb_bin":
    return TokenFileStream([_fineweb_file(p, field) for p in paths])
  return _array_record_tokens(paths, field)


def _named_chunks(tokens, name: str) -> Iterator[tuple[str, np.ndarray]]:
  if isinstance(tokens, TokenFileStream):
    yield from tokens.chunks_by_file(_RANGE_CHECK_CHUNK)
  else:
    yield name, tokens


def _check_token_range(tokens, name: str, vocab_size: int) -> None:
  for where, chunk in _named_chunks(tokens, name):
    if chunk.size == 0:
      continue
    low, high = int(chunk.min()), int(chunk.max())
    if high >= vocab_size or low < 0:
      bad = high if high >= vocab_size else low
      raise ValueError(
          f"{where} contains token id {bad}, outside [0, model.vocab_size={vocab_size}); "
          "raise model.vocab_size or check data.source / data.tokenizer")


# ----------------------------------------------------------------------- token streams


def _file_signature(pattern: str) -> tuple:
  """(path, size, mtime) of each file, so the stream cache notices rewritten files."""
  if not pattern:
    return ()
  paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
  return tuple((p, os.path.getsize(p), os.stat(p).st_mtime_ns) if os.path.isfile(p) else (p,)
               for p in paths)


def load_token_streams(data_config: ml_collections.ConfigDict, vocab_size: int):
  """(train_tokens, val_tokens): 1-D arrays (in memory) or TokenFileStreams (on disk).

  Validation is data.val_path when set, else the last data.val_fraction of data.path's
  stream. Every id is checked against vocab_size. Results are cached (read-only) so the
  trainer's validate / iterator / eval calls read and check a corpus once.
  """
  check_choice("data.source", data_config.source, SOURCES)
  check_choice("data.tokenizer", data_config.tokenizer, TOKENIZERS)
  return _load_token_streams_cached(
      data_config.source, data_config.path, data_config.val_path, data_config.tokenizer,
      float(data_config.val_fraction), int(vocab_size),
      _file_signature(data_config.path), _file_signature(data_config.val_path))


@functools.lru_cache(maxsize=4)
def _load_token_streams_cached(source, path, val_path, tokenizer, val_fraction, vocab_size,
                               path_signature, val_path_signature):
  del path_signature, val_path_signature  # only part of the cache key
  if source == "builtin":
    if tokenizer != "byte":
      raise ValueError(f"data.source='builtin' is byte-level; data.tokenizer={tokenizer!r} "
                       "must be 'byte'")
    tokens = encode_text(builtin_text(), "byte")
    name = "data.source='builtin' corpus"
  else:
    tokens = _read_source(source, path, tokenizer, "data.path")
    name = f"data.path {path!r}"
  _check_token_range(tokens, name, vocab_size)

  if val_path:
    if source == "builtin":
      raise ValueError("data.val_path is set, but data.source='builtin' reads no files")
    train_tokens = tokens
    val_tokens = _read_source(source, val_path, tokenizer, "data.val_path")
    _check_token_range(val_tokens, f"data.val_path {val_path!r}", vocab_size)
  else:
    check_val_fraction(val_fraction)
    split = len(tokens) - int(len(tokens) * val_fraction)
    train_tokens, val_tokens = _split_stream(tokens, split)
  return _read_only(train_tokens), _read_only(val_tokens)


def _split_stream(tokens, split: int):
  if isinstance(tokens, TokenFileStream):
    return tokens.subrange(0, split), tokens.subrange(split, len(tokens))
  return tokens[:split], tokens[split:]


def _read_only(tokens):
  if isinstance(tokens, np.ndarray):
    tokens = tokens.view()
    tokens.flags.writeable = False  # cached: a caller must not change the next caller's data
  return tokens


def check_choice(field: str, value, choices: Sequence[str]) -> None:
  if value not in choices:
    raise ValueError(f"{field}={value!r} is not one of {', '.join(choices)}")


def check_val_fraction(val_fraction: float) -> None:
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(
        f"data.val_fraction={val_fraction} must be in (0, 1) when data.val_path is empty")
