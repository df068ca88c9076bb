"""The statistics every verdict stands on: differences over seeds with t intervals, and
Holm's correction when one verdict rests on several comparisons.

Runs with the same seed share the init seed and the data order, so two variants are compared
seed by seed (a paired difference) when they share at least two seeds; otherwise Welch's
unpaired difference with the Welch-Satterthwaite degrees of freedom. Intervals come from the t
distribution at the actual degrees of freedom, never a normal approximation: at 3 seeds a
95% interval is the mean +- 4.30 standard errors, not 2.
"""
import dataclasses
import math

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.95  # the confidence level of every verdict unless an experiment states another


@dataclasses.dataclass(frozen=True)
class Difference:
  """mean(a) - mean(b) with its two-sided t interval at `level` and the p-value of zero."""
  mean: float
  low: float
  high: float
  p: float
  n: int  # seed pairs (paired) or the smaller side's count (unpaired)
  df: float
  paired: bool
  level: float

  @property
  def outcome(self):
    """'lower' (a below b: the whole interval under 0), 'higher', or 'unresolved'."""
    if self.high < 0:
      return "lower"
    if self.low > 0:
      return "higher"
    return "unresolved"

  def describe(self):
    kind = f"paired over {self.n} seeds" if self.paired else f"unpaired, df {self.df:.1f}"
    return (f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] ({self.level:.0%} t interval, "
            f"{kind})")


def _finite(by_seed):
  return {s: float(v) for s, v in by_seed.items() if v is not None and math.isfinite(float(v))}


def difference(a_by_seed, b_by_seed, level=LEVEL):
  """The Difference of a - b, each given as {seed: value}; non-finite values are dropped.

  Paired when the two share two or more seeds (on the shared seeds only), else Welch. Too few
  values for an interval (one pair, or fewer than two on a side) give an infinite interval.
  """
  a, b = _finite(a_by_seed), _finite(b_by_seed)
  shared = sorted(set(a) & set(b))
  quantile = lambda df: float(scipy_stats.t.ppf(0.5 + level / 2, df))
  if len(shared) >= 2:
    d = np.asarray([a[s] - b[s] for s in shared])
    mean, error, df = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1
    paired, n = True, len(d)
  elif len(a) >= 2 and len(b) >= 2:
    xa, xb = np.asarray(list(a.values())), np.asarray(list(b.values()))
    va, vb = xa.var(ddof=1) / len(xa), xb.var(ddof=1) / len(xb)
    mean, error = float(xa.mean() - xb.mean()), math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(xa) - 1) + vb ** 2 / (len(xb) - 1)) if error else 1.0
    paired, n = False, min(len(xa), len(xb))
  else:
    # One shared seed is a pair of one: its own difference, not the means over unequal seed sets
    # (a seed one side has alone would enter a mean the label calls paired).
    if shared:
      mean = a[shared[0]] - b[shared[0]]
    else:
      mean = (float(np.mean(list(a.values())) - np.mean(list(b.values()))) if a and b
              else float("nan"))
    return Difference(mean, -math.inf, math.inf, 1.0, len(shared), 0.0, bool(shared), level)
  if error == 0:  # identical differences: the sign is certain, the interval a point
    p = 0.0 if mean else 1.0
    return Difference(mean, mean, mean, p, n, float(df), paired, level)
  half = quantile(df) * error
  p = float(2 * scipy_stats.t.sf(abs(mean) / error, df))
  return Difference(mean, mean - half, mean + half, p, n, float(df), paired, level)


def by_seed(rows, key):
  """{seed: row[key]} of result rows (one row per seed)."""
  return {row["seed"]: row[key] for row in rows}


def holm(p_values, level=LEVEL):
  """Holm's step-down: which of the hypotheses are rejected at family-wise error 1 - level."""
  alpha = 1 - level
  order = sorted(range(len(p_values)), key=lambda i: p_values[i])
  rejected = [False] * len(p_values)
  for rank, i in enumerate(order):
    if p_values[i] > alpha / (len(p_values) - rank):
      break
    rejected[i] = True
  return rejected


def outcomes(differences, level=LEVEL):
  """{name: 'lower' | 'higher' | 'unresolved'} for several Differences that one verdict rests
  on, each side decided by Holm's correction over all of them (family-wise 1 - level); a
  difference that Holm rejects has its interval's sign."""
  names = list(differences)
  rejected = holm([differences[n].p for n in names], level)
  return {n: (("lower" if differences[n].mean < 0 else "higher") if r else "unresolved")
          for n, r in zip(names, rejected)}
