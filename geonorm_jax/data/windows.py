"""Batches: fixed-length windows cut from the token streams of sources.py.

The trainer only ever sees batches `dict(tokens=np.int32[local_batch, seq_len + 1])` cut
from a source's training stream (inputs are `tokens[:, :-1]`, targets `tokens[:, 1:]`):
random windows or packed (consecutive, reshuffled every epoch), through one grain pipeline
whose iterator state is checkpointed with the model.

Determinism: what a process sees at step s depends only on (config, s, process index), so a
restored iterator state reproduces the batches exactly, and the rows of all processes
concatenate to the single-process global batch.
"""
import grain
import ml_collections
import numpy as np

from geonorm_jax.data.sources import (SOURCES, TOKENIZERS, check_choice, check_val_fraction,
                                      load_token_streams)

SAMPLINGS = ("random", "packed")

# Data already sits in memory: reader threads would only fight over the GIL.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64 finaliser: a cheap, well-mixed, stateless hash of uint64 arrays."""
  # uint64 array arithmetic wraps modulo 2**64, which is what the hash relies on.
  x = x + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _global_rows(step: int, batch_size: int, rows: slice) -> range:
  """Indices, in the endless stream of windows, of this process's rows at `step`."""
  return range(step * batch_size + rows.start, step * batch_size + rows.stop)


class _RandomStarts:
  """Training step -> start of each local row's window, hashed from (seed, row index)."""

  def __init__(self, seed: int, batch_size: int, rows: slice, num_starts: int):
    self._seed_key = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))
    self._batch_size = batch_size
    self._rows = rows
    self._num_starts = np.uint64(num_starts)

  def __call__(self, step: int) -> np.ndarray:
    row_range = _global_rows(step, self._batch_size, self._rows)
    rows = np.arange(row_range.start, row_range.stop, dtype=np.uint64)
    # Modulo bias is below num_starts / 2**64: irrelevant for any corpus.
    return (_splitmix64(rows ^ self._seed_key) % self._num_starts).astype(np.int64)


class _PackedStarts:
  """Training step -> start of each local row's window; windows reshuffled every epoch.

  Row g of the endless stream is window `permutation_epoch(g % W)` with epoch = g // W,
  so batches run across epoch boundaries and each epoch visits all W windows once. The
  permutation is grain's stateless index_shuffle (what MapDataset.shuffle().repeat()
  uses), called directly per row: the same order, without per-element dataset overhead.
  """

  def __init__(self, seed: int, batch_size: int, rows: slice, num_windows: int, stride: int):
    self._seed = seed
    self._batch_size = batch_size
    self._rows = rows
    self._num_windows = num_windows
    self._stride = stride

  def __call__(self, step: int) -> np.ndarray:
    window_ids = []
    for row in _global_rows(step, self._batch_size, self._rows):
      epoch, index_in_epoch = divmod(row, self._num_windows)
      window_ids.append(grain.experimental.index_shuffle(
          index_in_epoch, max_index=self._num_windows - 1,
          seed=(self._seed + epoch) % 2**32, rounds=4))
    return np.asarray(window_ids, dtype=np.int64) * self._stride


class _ReadBatch:
  """Window starts -> batch dict of the windows' tokens."""

  def __init__(self, tokens, window_length: int):
    self._tokens = tokens
    self._window_length = window_length

  def __call__(self, starts: np.ndarray) -> dict[str, np.ndarray]:
    if isinstance(self._tokens, np.ndarray):
      windows = self._tokens[starts[:, None] + np.arange(self._window_length)]
    else:
      windows = np.stack([self._tokens[s:s + self._window_length] for s in starts])
    return dict(tokens=windows.astype(np.int32))


def _num_packed_windows(num_tokens: int, seq_len: int) -> int:
  # Stride seq_len: consecutive windows share one boundary token (last target of one,
  # first input of the next), so every token but the first is a target once per epoch.
  return (num_tokens - 1) // seq_len


def _window_starts_dataset(data_config, num_tokens: int, rows: slice) -> grain.MapDataset:
  """MapDataset whose element `step` is the window starts of this process's rows.

  Every process computes starts from the same global row indices, so the local rows of
  all processes, concatenated, are exactly the single-process global batch.
  """
  seq_len, batch_size = data_config.seq_len, data_config.batch_size
  if data_config.sampling == "random":
    starts = _RandomStarts(data_config.seed, batch_size, rows, num_tokens - seq_len)
  else:
    starts = _PackedStarts(data_config.seed, batch_size, rows,
                           _num_packed_windows(num_tokens, seq_len), seq_len)
  # A virtual index space of steps that no run can exhaust; elements are computed from
  # the step alone, never stored, so an iterator state (the next step) resumes exactly.
  return grain.MapDataset.range(2**62).map(starts)


def _process_rows(config, process_index, process_count, data_parallel_size) -> slice:
  """This process's contiguous block of rows of every global batch."""
  process_index, process_count = _process_position(process_index, process_count)
  validate_data_config(config, process_count=process_count,
                       data_parallel_size=data_parallel_size)
  local_batch = config.data.batch_size // process_count
  return slice(process_index * local_batch, (process_index + 1) * local_batch)


def _process_position(process_index, process_count) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} outside [0, {process_count})")
  return process_index, process_count


def make_train_iterator(config: ml_collections.ConfigDict, process_index: int | None = None,
                        process_count: int | None = None, *,
                        data_parallel_size: int | None = None) -> grain.DatasetIterator:
  """Endless, checkpointable iterator of this process's training batches.

  Yields dict(tokens=np.int32[data.batch_size // process_count, data.seq_len + 1]).
  `get_state()` / `set_state()` (or grain's orbax checkpoint handler) resume it exactly.
  Process defaults come from jax; data_parallel_size, when given, must divide the batch.
  """
  rows = _process_rows(config, process_index, process_count, data_parallel_size)
  data_config = config.data
  train_tokens, _ = load_token_streams(data_config, config.model.vocab_size)
  batches = _window_starts_dataset(data_config, len(train_tokens), rows).map(
      _ReadBatch(train_tokens, data_config.seq_len + 1))
  dataset = batches.to_iter_dataset(_READ_OPTIONS)
  if data_config.num_workers > 0:
    _ensure_absl_flags_parsed()
    dataset = dataset.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=data_config.num_workers))
  return iter(dataset)


def _ensure_absl_flags_parsed() -> None:
  # grain's worker processes read absl flags; outside an absl app (pytest, notebooks)
  # nothing has parsed them, so accept their defaults.
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _eval_starts(num_tokens: int, seq_len: int, num_windows: int) -> np.ndarray:
  """Starts of num_windows packed windows spread evenly over the validation stream."""
  available = _num_packed_windows(num_tokens, seq_len)
  if num_windows == 0:
    return np.zeros((0,), np.int64)
  if num_windows <= available:
    window_ids = np.arange(num_windows, dtype=np.int64) * available // num_windows
  else:  # a short validation split: reuse windows rather than refuse to evaluate
    window_ids = np.arange(num_windows, dtype=np.int64) % available
  return window_ids * seq_len


def make_eval_batches(config: ml_collections.ConfigDict, process_index: int | None = None,
                      process_count: int | None = None, *,
                      data_parallel_size: int | None = None) -> list[dict[str, np.ndarray]]:
  """The fixed validation set: train.eval_batches batches, the same on every call.

  Each batch has this process's rows, in the training batch format. Windows are packed
  windows spread evenly over the whole validation stream.
  """
  rows = _process_rows(config, process_index, process_count, data_parallel_size)
  data_config = config.data
  _, val_tokens = load_token_streams(data_config, config.model.vocab_size)
  batch_size, num_batches = data_config.batch_size, config.train.eval_batches
  starts = _eval_starts(len(val_tokens), data_config.seq_len, num_batches * batch_size)
  read_batch = _ReadBatch(val_tokens, data_config.seq_len + 1)
  return [read_batch(starts[b * batch_size:(b + 1) * batch_size][rows])
          for b in range(num_batches)]


# -------------------------------------------------------------------------- validation


def _check_batch_divisible(config, process_count, data_parallel_size) -> None:
  """The global batch splits over processes and into train.grad_accum micro-batches, and each
  micro-batch splits over the data-parallel mesh axes."""
  batch_size = config.data.batch_size
  if batch_size < 1:
    raise ValueError(f"data.batch_size={batch_size} must be >= 1")
  for what, divisor in (("the process count", process_count),
                        ("train.grad_accum", config.train.grad_accum)):
    if divisor is None:
      continue
    if divisor < 1:
      raise ValueError(f"{what}={divisor} must be >= 1")
    if batch_size % divisor:
      raise ValueError(
          f"data.batch_size={batch_size} (global batch) is not divisible by {what} "
          f"({divisor})")
  micro_batch = batch_size // config.train.grad_accum
  if data_parallel_size is not None and micro_batch % data_parallel_size:
    raise ValueError(
        f"data.batch_size={batch_size} gives micro-batches of {micro_batch} "
        f"(train.grad_accum={config.train.grad_accum}), not divisible by the data-parallel "
        f"mesh size ({data_parallel_size}), i.e. mesh.data x mesh.fsdp")


def _check_split_length(tokens, split_name: str, seq_len: int) -> None:
  if len(tokens) < seq_len + 1:
    raise ValueError(
        f"data.seq_len={seq_len} needs windows of {seq_len + 1} tokens, but the "
        f"{split_name} split has only {len(tokens)} tokens")


def validate_data_config(config: ml_collections.ConfigDict, *,
                         process_count: int | None = None,
                         data_parallel_size: int | None = None) -> None:
  """Raises ValueError / FileNotFoundError for any data problem, before compilation.

  Checks the config fields, then reads (and caches) the corpus: files exist and are
  well-formed, ids fit model.vocab_size, both splits hold at least one window.
  process_count / data_parallel_size are checked only when given.
  """
  data_config = config.data
  check_choice("data.source", data_config.source, SOURCES)
  check_choice("data.tokenizer", data_config.tokenizer, TOKENIZERS)
  check_choice("data.sampling", data_config.sampling, SAMPLINGS)
  if data_config.seq_len < 1:
    raise ValueError(f"data.seq_len={data_config.seq_len} must be >= 1")
  if data_config.seq_len > config.model.max_seq_len:
    raise ValueError(
        f"data.seq_len={data_config.seq_len} exceeds "
        f"model.max_seq_len={config.model.max_seq_len}")
  _check_batch_divisible(config, process_count, data_parallel_size)
  if not data_config.val_path:
    check_val_fraction(data_config.val_fraction)
  if data_config.num_workers < 0:
    raise ValueError(f"data.num_workers={data_config.num_workers} must be >= 0")
  if config.train.eval_batches < 0:
    raise ValueError(f"train.eval_batches={config.train.eval_batches} must be >= 0")
  train_tokens, val_tokens = load_token_streams(data_config, config.model.vocab_size)
  _check_split_length(train_tokens, "training", data_config.seq_len)
  _check_split_length(val_tokens, "validation", data_config.seq_len)
