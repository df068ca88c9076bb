"""Cost first, then progress: what a Hessian analysis will compute, what it costs, where it is.

A plan is a list of `Stage`s (an estimate and the Hessian-vector products it needs). Before
the first product, `HessianProgress.start` prints the plan; as soon as one product has
been timed it prints the estimated total time; then a progress bar (metrics.ProgressBar's
style: redrawn on a terminal, plain lines in a log) counts products with a rate and an
ETA. The estimators call the object (via `jax.debug.callback`) with the number of products
just finished, so the bar moves inside one compiled loop.
"""
import dataclasses
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

from geonorm_jax.training import metrics


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str  # "top", "density", ...
  method: str  # how, in words: "Lanczos, 50 steps"
  products: int  # Hessian-vector products it runs
  lanes: int = 1  # products per compiled call (batched probes)


def format_plan(stages: Sequence[Stage], header: str) -> str:
  total = sum(stage.products for stage in stages)
  lines = [f"{header}: {total:,} Hessian-vector products"]
  for stage in stages:
    batched = f", {stage.lanes} per call" if stage.lanes > 1 else ""
    lines.append(f"  {stage.name:<9} {stage.method:<52} {stage.products:>6,}{batched}")
  return "\n".join(lines)


class _ProductBar(metrics.ProgressBar):
  """metrics.ProgressBar counting Hessian-vector products, labelled with the stage."""

  stage_name = ""

  def render(self, now: Optional[float] = None) -> str:
    line = super().render(now).replace("step ", "HVP ", 1).replace("steps/s", "HVP/s")
    return f"{line} ({self.stage_name})" if self.stage_name else line


class HessianProgress:
  """Prints the plan and the estimated time, then a progress bar over all the products."""

  def __init__(self, stages: Sequence[Stage], header: str, *, stream: Optional[TextIO] = None,
               enabled: bool = True, redraw: Optional[bool] = None):
    self.stages = list(stages)
    self.header = header
    self.total = sum(stage.products for stage in self.stages)
    self.stream = sys.stderr if stream is None else stream
    self.enabled = enabled
    self.done = 0
    self.seconds_per_product: Optional[float] = None
    self._bar = _ProductBar(max(self.total, 1), stream=self.stream, enabled=enabled,
                            plain_every=max(1, self.total // 10))
    if redraw is not None:
      self._bar.is_tty = redraw
    self._lock = threading.Lock()
    self._timing_from: Optional[tuple[float, int]] = None
    self._stage_lanes = 1

  def _write(self, text: str) -> None:
    if self.enabled:
      if self._bar.is_tty and self.done:
        text = "\n" + text
      self.stream.write(text + "\n")
      self.stream.flush()

  def start(self) -> None:
    self._write(format_plan(self.stages, self.header))

  def stage(self, name: str) -> None:
    """The next products belong to stage `name` (its compilation happens before them, so
    the rate is measured afresh from its first product)."""
    with self._lock:
      self._bar.stage_name = name
      self._bar._first_time = None  # pylint: disable=protected-access
      self._stage_lanes = next((s.lanes for s in self.stages if s.name == name), 1)
      self._timing_from = None

  def __call__(self, count: int) -> None:
    """`count` more products finished (called from the compiled loop's host callback)."""
    with self._lock:
      now = time.monotonic()
      self.done += int(count)
      if self.seconds_per_product is None and count:
        if self._timing_from is None:
          self._timing_from = (now, self.done)
        elif self.done - self._timing_from[1] >= self._stage_lanes:
          elapsed = now - self._timing_from[0]
          self.seconds_per_product = elapsed / (self.done - self._timing_from[1])
          remaining = (self.total - self.done) * self.seconds_per_product
          self._write(f"one Hessian-vector product took {self.seconds_per_product:.3g} s: "
                      f"about {metrics._format_duration(remaining)} for the remaining "  # pylint: disable=protected-access
                      f"{self.total - self.done:,} (batched probes are cheaper per product)")
      self._bar.update(min(self.done, self.total))

  def message(self, text: str) -> None:
    """A line of results between stages (e.g. the top eigenvalues as soon as they exist)."""
    with self._lock:
      self._write(text)

  def close(self) -> None:
    self._bar.close()
