"""Does the loss curvature depend on the scale of the weights? SimpleNorm's claim, measured.

SimpleGPT (arXiv 2602.01212) argues that with a norm after every linear map, y = Norm(Wx),
the Hessian of the loss w.r.t. the activations does not depend on ||W||, while for a plain
y = Wx it grows like ||W||^2 -- and that this is why SimpleNorm tolerates larger learning
rates. For a tiny model of each placement (pre, pre + qk_norm, simplenorm, geonorm) trained
TRAIN_STEPS steps on the builtin corpus, this script scales linear maps W -> cW (on gpt2 also
their bias b -> cb, so that the map's output is scaled; Norm(cWx + b) is not invariant; llama
has no biases) for c in SCALES and measures, on one validation batch, by Lanczos (NUM_STEPS
steps):

  act_in    lambda_max of d2L/dx2, x the activation ENTERING the map (tap `<map>.in`).
            This is the claim's quantity: for Norm(cWx) the loss is the same function
            of x for every c, so this is flat; for a plain map it is c^2 W^T H_y W.
  act_out   lambda_max w.r.t. the map's output before any norm (tap `<map>.out`): the
            activation a plain map hands to the next op; for SimpleNorm it is the pre-norm
            z = cWx, where 0-homogeneity of Norm gives a 1/c^2 law.
            The point AFTER SimpleNorm's norm has no tap and needs none: its value
            Norm(cWx) and everything downstream of it are the same for every c, so its
            Hessian is invariant by construction and a measurement would show nothing.
  params    lambda_max of d2L/dtheta2 over the scaled maps' kernels (and biases) (the
            diagonal block of the parameter Hessian; computed as M H M with M the 0/1 mask
            of those maps inside the block of all linear maps, one compiled function for
            every scope).

Backbones (--backbone), same sizes and training (2 blocks, d=64, 4 heads, seq 64, batch 16,
TRAIN_STEPS AdamW steps at lr 1e-3, byte-level):
  llama  (default) SimpleGPT's own architecture (Ocram7/SimpleGPT), the `tiny_llama` preset:
         RMSNorm with gain, SwiGLU (gate, up, down), RoPE, no biases, untied head (the
         preset's default); d_ff = 176, LLaMA's 2/3 of 4d rounded up to a multiple of 16, so
         the three MLP matrices hold about as many weights as gpt2's two of width 4d.
  gpt2   the `tiny` preset's GPT-2 backbone: LayerNorm with bias, GELU, linear biases,
         learned positions, tied head (as its results were made).
Under simplenorm every linear map of a block gets its own norm on both backbones: q, k, v,
o, up, down, and on llama the gate too; so `up` scaled alone is a Norm(Wx) case, its output
normalised before SwiGLU's product silu(gate) * up (gpt2: before the GELU).

Scopes: `q` = blocks.0.attn.q, `up` = blocks.0.mlp.up, `all` = every attention and MLP
linear map of every block, the gate included (activation taps: those of blocks.0.attn.q and
blocks.0.mlp.up). Embedding and head are never scaled. Note pre + qk_norm normalises q per
head after the q map, so its `q` scope is a Norm(Wx) case too; geonorm's maps are plain.

  python experiments/hessian_vs_weight_scale.py [--backbone=llama|gpt2] [--seeds=0,1,2]
      [--report_only]

Each seed trains every placement from its own init and data order (config.seed = data.seed),
and its Lanczos runs start from their own random vector. Writes
results/hessian_vs_weight_scale/<backbone>/{results.csv, results.md, verdict.json,
loglog.png}; trained checkpoints are kept in runs/hessian_vs_weight_scale/<backbone>/ and
reused on a second run (--report_only too: it trains what is missing, for the eval losses and
SimpleNorm's pre-norm scale), and seeds already in results.csv are not measured again. About
8-10 minutes a seed on a 2-core CPU for gpt2 (most of it XLA compilation and training).
Verdict (the claim's quantity, lambda_max w.r.t. the input of the normalised map): reproduced
when, in every seed, SimpleNorm's `up` input Hessian and Pre-LN + qk_norm's `q` input Hessian
vary by less than FLAT_SPREAD (max/min over c) while a plain map's (Pre-LN's `up`) grows with a
fitted log-log slope above PLAIN_SLOPE; not reproduced when a normalised one is not flat in some
seed; unresolved otherwise.
"""
import argparse
import json
import os
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from geonorm_jax import hessian
from geonorm_jax.hessian.progress import HessianProgress, Stage
from geonorm_jax.nn import losses, paths
from geonorm_jax.studies import claims, report, sweep
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import metrics, train

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS_DIR = REPO_ROOT / "results" / "hessian_vs_weight_scale"  # /<backbone>
RUNS_DIR = REPO_ROOT / "runs" / "hessian_vs_weight_scale"  # /<backbone>
TRAIN_STEPS = 300
_TRAINING = ("num_layers=2,d_model=64,num_heads=4,max_seq_len=64,seq_len=64,batch_size=16,"
             f"steps={TRAIN_STEPS},warmup_steps=30,lr=1e-3,eval_every={TRAIN_STEPS},"
             f"eval_batches=1,log_every=50,progress_bar=false,checkpoint.every={TRAIN_STEPS},"
             "keep_last=1,async_save=false,")
BASES = {
    "llama": "tiny_llama," + _TRAINING + "d_ff=176,",
    "gpt2": "tiny," + _TRAINING + "tie_embeddings=true,",  # as results/.../gpt2 were made
}
BACKBONES = tuple(BASES)
# results.md's title and model line, per backbone.
TITLES = {"llama": "tiny LLaMA-style GPT (SimpleGPT's architecture)", "gpt2": "tiny GPT"}
MODELS = {
    "llama": ("llama backbone (RMSNorm with gain, SwiGLU, RoPE, no biases, untied head), "
              "2 blocks, d=64, d_ff=176, 4 heads, seq 64"),
    "gpt2": "gpt2 backbone, 2 blocks, d=64, 4 heads, seq 64",
}
SCALED = {"llama": "W -> cW (no biases)", "gpt2": "W -> cW with the map's bias scaled too"}
PLACEMENTS = {
    "pre": "placement=pre",
    "pre_qk_norm": "placement=pre,qk_norm=true",
    "simplenorm": "placement=simplenorm",
    "geonorm": "placement=geonorm",
}
# SimpleNorm's trained weights analysed again with the norms' eps at 1e-12 (same params,
# only the analysis graph differs): separates the eps effect from the invariance itself.
EPS_VARIANT = "simplenorm_eps1e-12"
SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
NUM_STEPS = 20
HESSIAN_BATCH = 8  # sequences of the first validation batch
TAP_MAPS = ("blocks.0.attn.q", "blocks.0.mlp.up")
SCOPES = {"q": ("blocks.0.attn.q",), "up": ("blocks.0.mlp.up",), "all": None}
LINEAR = r"^blocks\.\d+\.(attn\.(q|k|v|o)|mlp\.(up|gate|down))\.(kernel|bias)$"


FLAT_SPREAD = 1.05
PLAIN_SLOPE = 0.5
DEFAULT_SEEDS = "0,1,2"


def make_config(backbone, name, extra=""):
  return config_lib.get_config(BASES[backbone] + PLACEMENTS[name] + extra)


def train_or_restore(backbone, name, seed):
  """(setup, params, eval loss) of the trained run; trains only what is missing."""
  workdir = str(RUNS_DIR / backbone / (name if seed == 0 else f"{name}_seed{seed}"))
  config = make_config(backbone, name)
  config.seed = config.data.seed = seed
  started = time.perf_counter()
  train.train(config, workdir)  # resumes; a finished run returns at once
  _, setup, state = train.restore_params(workdir)
  # From metrics.jsonl: a resumed, already finished run reports no eval in its summary.
  evals = [r for r in metrics.read_metrics(workdir) if r["split"] == "eval"]
  eval_loss = evals[-1]["loss"] if evals else float("nan")
  print(f"[{backbone} {name} seed {seed}] trained to step {int(state['step'])}, eval loss "
        f"{eval_loss:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
  return setup, state["params"], eval_loss


# SimpleNorm's norms after block 0's maps whose input scale results.md reports: the two tapped
# maps, and on llama the gate, which reads the same input as `up`.
PRENORM_MAPS = ("blocks.0.attn.q", "blocks.0.mlp.up", "blocks.0.mlp.gate")


def simplenorm_prenorm_scale(setup, params, tokens_BxL1):
  """{map: mean(z^2)}, z = Wx (+ b) entering SimpleNorm's norm after each of block 0's
  PRENORM_MAPS that the model has, at c=1.

  Norm(cz) == Norm(z) only while eps << mean(z^2); block 0's q reads the raw embedding,
  whose scale is set by the embedding init, so this is the number that says whether eps
  can matter. Read from the norms' own input statistics in the model's inspecting pass
  (`norm_input_rms/<site>`), so it follows the backbone's block as the model computes it.
  """
  model = nnx.merge(setup.graphdef, params)
  stats = model.inspect(tokens_BxL1[:, :-1])[3]
  out = {}
  for path in PRENORM_MAPS:
    sublayer, role = path.split(".")[2:]
    rms = stats.get(f"norm_input_rms/{sublayer}.{role}_out_norm/layer_00")
    if rms is not None:
      out[path] = float(rms) ** 2
  return out


def linear_paths(params):
  pattern = re.compile(LINEAR)
  return [p for p in paths.leaf_paths(params) if pattern.search(p)]


def in_scope(path, maps):
  return maps is None or any(path.startswith(m + ".") for m in maps)


def make_measure(setup, tokens_BxL1, progress=None):
  """jit(params, scales, mask, key): lambda_max and residual bound of every quantity.

  `scales` and `mask` are dicts path -> scalar over the linear maps' leaves, so one
  compilation serves every scope and every c. `progress(count)` is called after every
  product of every Lanczos run (a HessianProgress).
  """
  graphdef = setup.graphdef
  batch, length = tokens_BxL1.shape[0], tokens_BxL1.shape[1] - 1
  spec = setup.spec
  tap_widths = {"blocks.0.attn.q.in": spec.d_model, "blocks.0.attn.q.out": spec.d_model,
                "blocks.0.mlp.up.in": spec.d_model, "blocks.0.mlp.up.out": spec.d_ff}

  def top(result):
    return result.ritz_values[0], result.residual_bounds[0]

  def measure(params, scales, mask, key):
    def scale(path, leaf):
      factor = scales.get(paths.path_to_string(path))
      return leaf if factor is None else leaf * factor
    scaled = jax.tree_util.tree_map_with_path(scale, params)
    out = {}
    for tap, width in tap_widths.items():
      like = jnp.zeros((batch, length, width), jnp.float32)
      loss_of_delta = lambda d, tap=tap: losses.lm_loss(nnx.merge(graphdef, scaled),
                                                        tokens_BxL1, perturb={tap: d})
      out[tap] = top(hessian.lanczos(hessian.activation_matvec(loss_of_delta, like), like,
                                     NUM_STEPS, key, progress=progress))
    loss_fn = lambda p, t: losses.lm_loss(nnx.merge(graphdef, p), t)
    block_matvec, like = hessian.subset_matvec(loss_fn, scaled, LINEAR, tokens_BxL1)
    masked = lambda v: {k: mask[k] * h for k, h in block_matvec(
        {k: mask[k] * x for k, x in v.items()}).items()}
    out["params"] = top(hessian.lanczos(masked, like, NUM_STEPS, key, progress=progress))
    out["loss"] = loss_fn(scaled, tokens_BxL1)  # saturation and breakage show up here
    return out

  return jax.jit(measure)


RUNS_PER_MEASURE = 5  # four activation taps and the parameter block


def measure_placement(name, seed, setup, params, tokens_BxL1):
  paths = linear_paths(params)
  products = RUNS_PER_MEASURE * NUM_STEPS * len(SCALES)
  # The plan, the estimated time after the first product and a bar with an ETA, as the CLI's
  # `hessian` command prints them.
  progress = HessianProgress(
      [Stage(scope, f"{len(SCALES)} scales x {RUNS_PER_MEASURE} Lanczos, {NUM_STEPS} steps",
             products) for scope in SCOPES], f"Hessian vs weight scale [{name}, seed {seed}]")
  measure = make_measure(setup, tokens_BxL1, progress)
  key = jax.random.key(seed)
  rows = []
  progress.start()
  try:
    for scope, maps in SCOPES.items():
      progress.stage(scope)
      rows += [dict(r, seed=seed) for r in _measure_scope(name, scope, maps, measure, params,
                                                          paths, key, progress)]
  finally:
    jax.effects_barrier()  # the last progress callbacks have run
    progress.close()
  return rows


def _measure_scope(name, scope, maps, measure, params, paths, key, progress):
  """The rows of one scope: every scale c, one compiled call each."""
  rows = []
  mask = {p: jnp.float32(in_scope(p, maps)) for p in paths}
  for c in SCALES:
    scales = {p: jnp.float32(c if in_scope(p, maps) else 1.0) for p in paths}
    started = time.perf_counter()
    out = jax.device_get(measure(params, scales, mask, key))
    for tap_map in TAP_MAPS:
      if maps is not None and tap_map not in maps:
        continue  # a tap of a map this scope does not scale: not part of the question
      for kind in ("in", "out"):
        value, bound = out[f"{tap_map}.{kind}"]
        rows.append(dict(placement=name, scope=scope, c=c, quantity=f"act_{kind}",
                         where=f"{tap_map}.{kind}", lambda_max=float(value),
                         residual_bound=float(bound), loss=float(out["loss"])))
    value, bound = out["params"]
    rows.append(dict(placement=name, scope=scope, c=c, quantity="params",
                     where="+".join(maps) if maps else "all linear maps",
                     lambda_max=float(value), residual_bound=float(bound),
                     loss=float(out["loss"])))
    progress.message(f"[{name}] scope={scope} c={c}: "
                     + ", ".join(f"{r['quantity']}@{r['where']}={r['lambda_max']:.4g}"
                                 for r in rows if r["scope"] == scope and r["c"] == c)
                     + f", loss={float(out['loss']):.3f} ({time.perf_counter() - started:.1f} s)")
  return rows


def fit_slopes(rows):
  """(placement, scope, quantity, where) -> least-squares slope of log lambda vs log c."""
  groups = {}
  for r in rows:
    groups.setdefault((r["placement"], r["scope"], r["quantity"], r["where"]), []).append(r)
  slopes = {}
  for key, group in groups.items():
    c = np.array([r["c"] for r in group])
    lam = np.array([r["lambda_max"] for r in group])
    if np.all(lam > 0):
      slope, _ = np.polyfit(np.log(c), np.log(lam), 1)
      # Also the steepest and flattest local slopes, to show saturation.
      local = np.diff(np.log(lam)) / np.diff(np.log(c))
      slopes[key] = (float(slope), float(local.min()), float(local.max()))
    else:
      slopes[key] = (float("nan"),) * 3
  return slopes


def over_seeds(rows):
  """(placement, scope, quantity, where) -> [(seed, fitted slope, max/min of lambda over c)]."""
  out = {}
  for seed in sorted({r["seed"] for r in rows}):
    subset = [r for r in rows if r["seed"] == seed]
    for key, (slope, _, _) in fit_slopes(subset).items():
      values = [r["lambda_max"] for r in subset
                if (r["placement"], r["scope"], r["quantity"], r["where"]) == key]
      spread = max(values) / min(values) if min(values) > 0 else float("nan")
      out.setdefault(key, []).append((seed, slope, spread))
  return out


NORMALISED = (("simplenorm", "up", "act_in", "blocks.0.mlp.up.in"),
              ("pre_qk_norm", "q", "act_in", "blocks.0.attn.q.in"))
PLAIN = ("pre", "up", "act_in", "blocks.0.mlp.up.in")


def verdict(per_seed):
  """The rule of the docstring: (verdict, result text) from over_seeds()."""
  if not all(per_seed.get(key) for key in NORMALISED + (PLAIN,)):
    return "unresolved", "a placement or tap of the rule was not measured"
  spreads = {key: [spread for _, _, spread in per_seed[key]] for key in NORMALISED}
  plain_slopes = [slope for _, slope, _ in per_seed[PLAIN]]
  result = ("lambda_max of the input Hessian, max/min over c in "
            f"{min(SCALES):g}..{max(SCALES):g}: "
            + "; ".join(f"{key[0]} `{key[1]}` {claims.fmt(spreads[key], 4)}" for key in NORMALISED)
            + f"; a plain map (pre `up`) grows with slope {claims.fmt(plain_slopes, 2)}")
  if not all(v < FLAT_SPREAD for values in spreads.values() for v in values):
    return "not at this scale", result
  if all(v > PLAIN_SLOPE for v in plain_slopes):
    return "reproduced", result
  return "unresolved", result


def write_verdict(per_seed, path, backbone):
  outcome, result = verdict(per_seed)
  seeds = sorted({seed for values in per_seed.values() for seed, _, _ in values})
  with open(path, "w") as f:
    json.dump({"experiment": "hessian_vs_weight_scale", "backbone": backbone,
               "claim": "the curvature at the input of Norm(Wx) does not depend on the weight "
                        "scale", "verdict": outcome, "result": result, "seeds": len(seeds)},
              f, indent=2)
  return outcome, result


def plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top

  quantities = ("act_in", "act_out", "params")
  titles = {"act_in": "d2L/dx2, x entering the map", "act_out": "d2L/dz2, z = Wx (pre-norm)",
            "params": "d2L/dW2 of the scaled maps"}
  fig, axes = plt.subplots(len(quantities), len(SCOPES), figsize=(13, 10), squeeze=False)
  names = list(PLACEMENTS) + [EPS_VARIANT]
  colors = dict(zip(names, ("C0", "C1", "C2", "C3", "C4")))
  c = np.array(SCALES)
  for i, quantity in enumerate(quantities):
    for j, scope in enumerate(SCOPES):
      ax = axes[i][j]
      for name in names:
        for where, style in (("blocks.0.mlp.up", "-"), ("blocks.0.attn.q", "--")):
          sel = [r for r in rows if r["placement"] == name and r["scope"] == scope
                 and r["quantity"] == quantity
                 and (quantity == "params" or r["where"].startswith(where))]
          if quantity == "params" and style == "--":
            continue
          if not sel:
            continue
          label = name if quantity == "params" else f"{name} ({where.split('.')[-1]})"
          by_c = {}
          for r in sel:
            by_c.setdefault(r["c"], []).append(max(r["lambda_max"], 1e-30))
          cs = sorted(by_c)
          ax.loglog(cs, [np.exp(np.mean(np.log(by_c[v]))) for v in cs], style,
                    marker="o", ms=3, color=colors[name], label=label)
          ax.fill_between(cs, [min(by_c[v]) for v in cs], [max(by_c[v]) for v in cs],
                          color=colors[name], alpha=0.15, lw=0)
      for slope, ls in ((0, ":"), (2, ":"), (-2, ":")):
        ref = [r["lambda_max"] for r in rows if r["scope"] == scope
               and r["quantity"] == quantity and r["c"] == 1.0]
        if ref:
          anchor = float(np.exp(np.mean(np.log(np.maximum(ref, 1e-30)))))
          ax.loglog(c, anchor * c**slope, ls, color="gray", lw=0.8)
      ax.set_title(f"{titles[quantity]} | scope {scope}", fontsize=9)
      ax.set_xticks(c)
      ax.set_xticklabels([f"{v:g}" for v in c])
      ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
      ax.set_xlabel("c (W -> cW)")
      ax.set_ylabel("lambda_max")
      if (i == 0 and j < 2) or (quantity == "params" and j == 0):
        ax.legend(fontsize=7)
  seeds = len({r["seed"] for r in rows})
  fig.suptitle(f"Top Hessian eigenvalue vs weight scale, geometric mean over {seeds} seed(s), "
               "band: min-max. Activation taps: solid blocks.0.mlp.up, dashed blocks.0.attn.q; "
               "gray: slopes 0, +2, -2", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


class _Seed:
  """One seed's rows and fitted slopes, looked up by (placement, scope, quantity, where):
  `where` is a prefix of the row's (`blocks.0.mlp.up` matches `blocks.0.mlp.up.in`)."""

  def __init__(self, rows, slopes):
    self.rows, self.slopes = rows, slopes

  def pick(self, name, scope, quantity, where):
    """(lambda_max, loss) over c, ascending."""
    sel = sorted((r for r in self.rows if r["placement"] == name and r["scope"] == scope
                  and r["quantity"] == quantity and r["where"].startswith(where)),
                 key=lambda r: r["c"])
    return [r["lambda_max"] for r in sel], [r["loss"] for r in sel]

  def spread(self, name, scope, quantity, where):
    values, _ = self.pick(name, scope, quantity, where)
    return max(values) / min(values)

  def slope(self, name, scope, quantity, where):
    for (n, sc, q, w), value in self.slopes.items():
      if (n, sc, q) == (name, scope, quantity) and w.startswith(where):
        return value
    return (float("nan"),) * 3

  def series(self, name, scope, quantity, where):
    return ", ".join(f"{v:.3g}" for v in self.pick(name, scope, quantity, where)[0])

  def loss_of(self, name, scope):
    return self.pick(name, scope, "params", "")[1]


def reading(rows, slopes, prenorm, backbone):
  """The write-up: the three statements kept apart, every number read from `rows`.

  gpt2's prose was written for the run recorded in its results.csv, llama's before its first
  run (it says what each number measures, not what it shows); the numbers are filled in from
  the data, so a rerun with a different outcome shows up as prose and numbers that disagree.
  """
  data = _Seed(rows, slopes)
  return (_reading_gpt2 if backbone == "gpt2" else _reading_llama)(data, prenorm)


def _plain_lines(data):
  """Statement 3's list: the input Hessian's fitted slope of each plain map scaled alone,
  and the loss it leaves; then all of Pre-LN's maps together."""
  up, q = "blocks.0.mlp.up", "blocks.0.attn.q"
  lines = []
  for name, scope, where in PLAIN_MAPS:
    fit, lo, hi = data.slope(name, scope, "act_in", where)
    losses_c = data.loss_of(name, scope)
    lines.append(f"- {name}, `{where}`: {fit:+.2f} [{lo:+.2f}, {hi:+.2f}]; loss at c = 0.25 / "
                 f"1 / 8: {losses_c[0]:.2f} / {losses_c[2]:.2f} / {losses_c[-1]:.2f}.")
  lines.append(f"- All linear maps of Pre-LN scaled together compound: `{q}.in` "
               f"{data.slope('pre', 'all', 'act_in', q)[0]:+.2f}, `{up}.in` "
               f"{data.slope('pre', 'all', 'act_in', up)[0]:+.2f}.")
  return lines


# (placement, scope, tapped map) of statement 3: plain maps scaled alone.
PLAIN_MAPS = (("pre", "up", "blocks.0.mlp.up"), ("pre", "q", "blocks.0.attn.q"),
              ("pre_qk_norm", "up", "blocks.0.mlp.up"), ("geonorm", "q", "blocks.0.attn.q"),
              ("geonorm", "up", "blocks.0.mlp.up"))


def _reading_gpt2(data, prenorm):
  """Written for seed 0's gpt2 run (GELU, biases, a tied embedding of std 0.02)."""
  up, q = "blocks.0.mlp.up", "blocks.0.attn.q"
  ratio_q = prenorm.get(q, float("nan")) / 1e-5
  geo_up_loss = data.loss_of("geonorm", "up")
  geo_all_loss = data.loss_of("geonorm", "all")
  lines = [
      "## Reading: three statements, kept apart",
      "",
      "Prose written for seed 0's run; every number is read from results.csv.",
      "",
      "**1. The Hessian w.r.t. the input x of Norm(Wx) does not depend on c (the claim's "
      "quantity, tap `.in`).**",
      f"- SimpleNorm, `{up}` scaled alone: lambda_max = "
      f"{data.series('simplenorm', 'up', 'act_in', up)} (max/min "
      f"{data.spread('simplenorm', 'up', 'act_in', up):.5f}). Flat.",
      f"- Pre-LN + qk_norm, `{q}` scaled alone (q is RMS-normalised per head right after "
      f"the map): max/min {data.spread('pre_qk_norm', 'q', 'act_in', q):.4f}. Flat: qk_norm "
      "makes W_q a Norm(Wx) map too.",
      f"- SimpleNorm, `{q}` scaled alone: {data.series('simplenorm', 'q', 'act_in', q)} "
      f"(max/min {data.spread('simplenorm', 'q', 'act_in', q):.2f}): not flat; it moves most "
      "at small c. "
      "Block 0's q reads the raw token + position embedding (SimpleNorm has no input norm), "
      f"so mean((Wx + b)^2) entering its norm is only {prenorm.get(q, float('nan')):.3g} at "
      f"c=1 ({ratio_q:.0f}x the norm's eps 1e-5; 1/16 of that at c=0.25). The same "
      f"trained weights analysed with eps = 1e-12 (`{EPS_VARIANT}`) give "
      f"{data.series(EPS_VARIANT, 'q', 'act_in', q)} (max/min "
      f"{data.spread(EPS_VARIANT, 'q', 'act_in', q):.4f}): the departure is the norm's eps, "
      "the caveat of the toy check, not a failure of the invariance. It matters in "
      "practice wherever a normalised map reads small activations.",
      f"- All linear maps scaled: SimpleNorm's `{up}.in` max/min "
      f"{data.spread('simplenorm', 'all', 'act_in', up):.3f} (block 0's q/k/v eps effect reaches "
      f"it through the attention output); with eps = 1e-12: "
      f"{data.spread(EPS_VARIANT, 'all', 'act_in', up):.4f}.",
      "- Invariance is not smallness: levels differ across placements because the tapped "
      "activations differ (Pre-LN's `.in` is a LayerNorm output of scale 1; SimpleNorm's is "
      "the raw stream, here the small embedding for block 0's q, and d2L/dx2 grows as x "
      f"shrinks: {data.pick('simplenorm', 'q', 'act_in', q)[0][2]:.3g} against Pre-LN's "
      f"{data.pick('pre', 'q', 'act_in', q)[0][2]:.3g} at c=1). This experiment tests the "
      "dependence on c, not which placement has the smaller Hessian.",
      "",
      "**2. The Hessian w.r.t. a normalised map's own parameters falls as 1/c^2** (scale "
      "invariance L(cW) = L(W), so d2L/dW2 at cW is c^-2 times that at W). Fitted slopes: "
      f"SimpleNorm `up` {data.slope('simplenorm', 'up', 'params', up)[0]:+.2f}, `q` "
      f"{data.slope('simplenorm', 'q', 'params', q)[0]:+.2f}, all linear maps "
      f"{data.slope('simplenorm', 'all', 'params', 'all')[0]:+.2f} (eps = 1e-12: "
      f"{data.slope(EPS_VARIANT, 'all', 'params', 'all')[0]:+.2f}); Pre-LN + qk_norm `q` "
      f"{data.slope('pre_qk_norm', 'q', 'params', q)[0]:+.2f}. The pre-norm output z = cWx "
      f"(tap `.out`) follows the same law (SimpleNorm `up` "
      f"{data.slope('simplenorm', 'up', 'act_out', up)[0]:+.2f}, qk_norm `q` "
      f"{data.slope('pre_qk_norm', 'q', 'act_out', q)[0]:+.2f}), since Norm is 0-homogeneous. "
      "This is a different statement from 1: it is about parameters, and it says that a "
      "normalised weight that grows lowers its own curvature.",
      "",
      "**3. For a plain map, the Hessian w.r.t. its input grows with c, roughly as c^2 only "
      "while nothing downstream saturates.** Fitted slopes [local min, max]:",
  ]
  plain_fits = [data.slope(name, scope, "act_in", where)[0] for name, scope, where in PLAIN_MAPS]
  pre_up_last = np.diff(np.log(data.pick("pre", "up", "act_in", up)[0][-2:]))[0] / np.log(
      SCALES[-1] / SCALES[-2])
  lines += _plain_lines(data)
  lines += [
      "",
      "A trained small model is not the toy: single plain maps give slopes between "
      f"{min(plain_fits):+.1f} and {max(plain_fits):+.1f} rather than a clean +2, with the "
      "growth flattening at large c (GELU and softmax saturating; Pre-LN's MLP input Hessian "
      f"grows with a local slope of {pre_up_last:+.2f} from c={SCALES[-2]:g} to "
      f"{SCALES[-1]:g}). GeoNorm "
      "is plain at its linear maps, and its residual update rotates the stream by an angle "
      "proportional to the sublayer output (no clamp by default): scaling the MLP's `up` "
      "map moves its loss from "
      f"{geo_up_loss[2]:.2f} (c=1) to {geo_up_loss[3]:.2f} (c=2) and {geo_up_loss[-1]:.2f} "
      f"(c=8), and scaling all maps from {geo_all_loss[2]:.2f} to {geo_all_loss[-1]:.2f}, "
      "with the parameter Hessian of `up` alternating "
      f"({data.series('geonorm', 'up', 'params', up)}) and every all-maps Hessian exploding "
      f"(up to {max(data.pick('geonorm', 'all', 'params', 'all')[0]):.3g}): there, curvature "
      "is not a smooth function of the weight scale at all.",
      "",
  ]
  return lines


def _reading_llama(data, prenorm):
  """Written before the first llama run: what each number measures and what the model's
  structure implies (SwiGLU, no biases, RoPE), nothing about what the numbers show."""
  up, q = "blocks.0.mlp.up", "blocks.0.attn.q"
  ratio_q = prenorm.get(q, float("nan")) / 1e-5
  lines = [
      "## Reading: three statements, kept apart",
      "",
      "Prose written before the first llama run: it says what each number measures, not what "
      "it shows; every number is read from results.csv.",
      "",
      "**1. The Hessian w.r.t. the input x of Norm(Wx), the claim's quantity (tap `.in`).**",
      f"- SimpleNorm, `{up}` scaled alone: lambda_max = "
      f"{data.series('simplenorm', 'up', 'act_in', up)} (max/min "
      f"{data.spread('simplenorm', 'up', 'act_in', up):.5f}). Its output is RMS-normalised "
      "(with a gain) before SwiGLU multiplies it by silu(gate), so only the norm's eps can "
      "make this depend on c.",
      f"- Pre-LN + qk_norm, `{q}` scaled alone (q is RMS-normalised per head right after the "
      f"map, before RoPE): max/min {data.spread('pre_qk_norm', 'q', 'act_in', q):.4f}.",
      f"- SimpleNorm, `{q}` scaled alone: {data.series('simplenorm', 'q', 'act_in', q)} "
      f"(max/min {data.spread('simplenorm', 'q', 'act_in', q):.4f}). Block 0's q reads the raw "
      f"token embedding; mean((Wx)^2) entering its norm is {prenorm.get(q, float('nan')):.3g} "
      f"at c=1 ({ratio_q:.0f}x the norm's eps 1e-5; 1/16 of that at c=0.25). The same trained "
      f"weights analysed with eps = 1e-12 (`{EPS_VARIANT}`): "
      f"{data.series(EPS_VARIANT, 'q', 'act_in', q)} (max/min "
      f"{data.spread(EPS_VARIANT, 'q', 'act_in', q):.4f}).",
      f"- All linear maps scaled, the gate included: SimpleNorm's `{up}.in` max/min "
      f"{data.spread('simplenorm', 'all', 'act_in', up):.4f}; with eps = 1e-12: "
      f"{data.spread(EPS_VARIANT, 'all', 'act_in', up):.4f}.",
      "",
      "**2. The Hessian w.r.t. a normalised map's own parameters** (scale invariance "
      "L(cW) = L(W) makes d2L/dW2 at cW c^-2 times that at W: a slope of -2). Fitted slopes: "
      f"SimpleNorm `up` {data.slope('simplenorm', 'up', 'params', up)[0]:+.2f}, `q` "
      f"{data.slope('simplenorm', 'q', 'params', q)[0]:+.2f}, all linear maps "
      f"{data.slope('simplenorm', 'all', 'params', 'all')[0]:+.2f} (eps = 1e-12: "
      f"{data.slope(EPS_VARIANT, 'all', 'params', 'all')[0]:+.2f}); Pre-LN + qk_norm `q` "
      f"{data.slope('pre_qk_norm', 'q', 'params', q)[0]:+.2f}. The pre-norm output z = cWx "
      "(tap `.out`), where the norm's 0-homogeneity predicts the same -2: SimpleNorm `up` "
      f"{data.slope('simplenorm', 'up', 'act_out', up)[0]:+.2f}, qk_norm `q` "
      f"{data.slope('pre_qk_norm', 'q', 'act_out', q)[0]:+.2f}.",
      "",
      "**3. For a plain map, the Hessian w.r.t. its input** (c^2 W^T H W, a slope of +2 while "
      "H, the curvature of everything downstream at cWx, does not change with c). Fitted "
      "slopes [local min, max]:",
  ]
  lines += _plain_lines(data)
  lines += [
      "",
      "On SwiGLU the MLP's output is linear in a plain `up`'s scale (silu(gate) * cWx enters "
      "`down`; the gate reads x through its own map, unscaled in this scope), so there a "
      "departure from +2 is the downstream curvature H changing with c, not the MLP's own "
      "activation.",
      "",
  ]
  return lines


def _significant(values):
  """'12.3 +- 0.4 (3 seeds)' with 3 significant digits: max/min runs from 1 to 1e7 here."""
  mean, std, n = claims.mean_spread(values)
  text = f"{mean:.4g}" + (f" +- {std:.2g}" if np.isfinite(std) else "")
  return text + f" ({n} seed{'s' if n != 1 else ''})"


def write_markdown(rows, eval_losses, prenorm, path, wall_s, backbone):
  """results.md: the verdict and the slopes over seeds, then seed 0's run in full."""
  per_seed = over_seeds(rows)
  outcome, result = verdict(per_seed)
  first = min(r["seed"] for r in rows)
  rows = [r for r in rows if r["seed"] == first]
  slopes = fit_slopes(rows)
  lines = [
      f"# Hessian vs weight scale (W -> cW), {TITLES[backbone]}, 4 placements",
      "",
      "Written by `experiments/hessian_vs_weight_scale.py`"
      + ("" if wall_s is None else f" in {wall_s / 60:.1f} min") + " on a 2-core CPU. "
      f"`loglog.png`: one panel per quantity and scope. Models: {MODELS[backbone]}, byte-level "
      f"builtin corpus, {TRAIN_STEPS} AdamW steps (lr 1e-3, batch 16), then "
      f"{SCALED[backbone]}. Hessians on {HESSIAN_BATCH} validation sequences; lambda_max "
      f"by {NUM_STEPS}-step Lanczos (residual bounds in results.csv).",
      "",
      f"**Verdict: {outcome}.** {result} (rule: the script's docstring; FLAT_SPREAD = "
      f"{FLAT_SPREAD}, PLAIN_SLOPE = {PLAIN_SLOPE}).",
      "",
      "## Over seeds: fitted slope and max/min of lambda_max over c, mean +- sample std",
      "",
      "| placement | scope | quantity | where | slope | max/min over c |",
      "|---|---|---|---|---|---|",
  ]
  for (name, scope, quantity, where), values in per_seed.items():
    lines.append(f"| {name} | {scope} | {quantity} | {where} | "
                 f"{claims.fmt([v[1] for v in values], 2)} | "
                 f"{_significant([v[2] for v in values])} |")
  lines += ["", "| placement | seed | eval loss after training |", "|---|---|---|"]
  for (name, seed), loss in eval_losses.items():
    lines.append(f"| {name} | {seed} | {loss:.3f} |")
  lines += ["", f"Everything below is seed {first}'s run."]
  if prenorm:
    z = "Wx + b" if backbone == "gpt2" else "Wx"  # llama's maps have no bias
    lines += ["", f"SimpleNorm, mean(({z})^2) entering the norm at c=1 (norm eps = 1e-5): "
              + ", ".join(f"{k}: {v:.3g}" for k, v in prenorm.items()) + "."]
  lines += [""] + reading(rows, slopes, prenorm, backbone)
  lines += [f"## Fitted log-log slopes d log(lambda_max) / d log(c), seed {first}", "",
            "Least squares over c in {" + ", ".join(f"{c:g}" for c in SCALES) + "}; "
            "[min, max] of the local slopes between neighbouring c in brackets.", ""]
  lines.append("| placement | scope | quantity | where | slope | local [min, max] |")
  lines.append("|---|---|---|---|---|---|")
  for (name, scope, quantity, where), (slope, lo, hi) in slopes.items():
    lines.append(f"| {name} | {scope} | {quantity} | {where} | {slope:+.2f} | "
                 f"[{lo:+.2f}, {hi:+.2f}] |")
  lines += ["", f"## lambda_max per c, seed {first}", "",
            "| placement | scope | quantity | where | " + " | ".join(f"c={c:g}" for c in SCALES)
            + " |", "|---|---|---|---|" + "---|" * len(SCALES)]
  table = {}
  for r in rows:
    table.setdefault((r["placement"], r["scope"], r["quantity"], r["where"]), {})[r["c"]] = r
  for (name, scope, quantity, where), by_c in table.items():
    lines.append(f"| {name} | {scope} | {quantity} | {where} | "
                 + " | ".join(f"{by_c[c]['lambda_max']:.3g}" for c in SCALES) + " |")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def read_csv(path):
  """results.csv's rows; a file written before seeds existed holds seed 0."""
  rows = report.read_results_csv(path)
  for r in rows:
    r["seed"] = int(r.get("seed") or 0)
  return rows


def main(argv=None):
  """Train (or reuse), measure the seeds not yet in results.csv, write; with --report_only,
  rebuild results.md, verdict.json and the figure from results.csv."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--backbone", default="llama", choices=BACKBONES,
                      help="llama: SimpleGPT's architecture (tiny_llama); gpt2: tiny's")
  parser.add_argument("--seeds", default=DEFAULT_SEEDS, help="comma list (init and data order)")
  parser.add_argument("--report_only", action="store_true")
  args = parser.parse_args(argv)
  backbone = args.backbone
  started = time.perf_counter()
  out_dir = RESULTS_DIR / backbone
  csv_path = out_dir / "results.csv"
  if args.report_only and not csv_path.exists():
    sys.exit(f"{csv_path} does not exist: nothing to report (run without --report_only)")
  os.makedirs(out_dir, exist_ok=True)
  kept = read_csv(csv_path) if csv_path.exists() else []
  done = {r["seed"] for r in kept}
  seeds = sorted(done) if args.report_only else [int(s) for s in args.seeds.split(",")]
  others = [r for r in kept if r["seed"] not in seeds]  # stay in the file, not in this report
  rows = [r for r in kept if r["seed"] in seeds]
  eval_losses, prenorm = {}, {}
  for seed in seeds:
    for name in PLACEMENTS:
      setup, params, eval_losses[name, seed] = train_or_restore(backbone, name, seed)
      tokens = np.asarray(jax.device_get(train.eval_batches(setup)[0]))[0, :HESSIAN_BATCH]
      tokens = jnp.asarray(tokens, jnp.int32)
      measure = not args.report_only and seed not in done
      if measure:
        rows += measure_placement(name, seed, setup, params, tokens)
      if name == "simplenorm":
        if seed == seeds[0]:
          prenorm = simplenorm_prenorm_scale(setup, params, tokens)
        if measure:
          eps_setup = train.make_setup(make_config(backbone, name, ",norm_eps=1e-12"))
          rows += measure_placement(EPS_VARIANT, seed, eps_setup, params, tokens)
    if not args.report_only and seed not in done:
      sweep.write_csv(csv_path, sorted(others + rows, key=lambda r: r["seed"]))  # resumable
  wall_s = time.perf_counter() - started
  plot(rows, out_dir / "loglog.png")
  write_markdown(rows, eval_losses, prenorm, out_dir / "results.md",
                 None if args.report_only else wall_s, backbone)
  outcome, result = write_verdict(over_seeds(rows), out_dir / "verdict.json", backbone)
  print(f"verdict: {outcome}: {result}")
  print(f"wrote {out_dir} in {wall_s:.0f} s")


if __name__ == "__main__":
  main()
