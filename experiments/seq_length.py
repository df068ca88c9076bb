"""Sequence length: does Post-LN spike or collapse at long sequences while GeoNorm stays stable?

  python experiments/seq_length.py [--scale=cpu|paper] [--seeds=0,1,2] [--quick]
      [--variants=pre,post,geonorm] [--seq_lens=128,256,512] [--spike_factor=1.5] [--print]

The tokens per step stay fixed (batch x seq_len), so each length sees the same token budget.
A loss spike (train.py's SpikeDetector, every step): a finite train loss above spike_factor x
the median of the previous 100 finite losses (judged once 10 are known). A non-finite step is
skipped (train.on_divergence=skip) and counted apart. CPU scale: configs/shakespeare.py cut to
300 steps, 2048 tokens a step, lengths 128/256/512 (512 is the longest whose attention fits
the 30-minute budget here): 27 runs, about 20 minutes on a quiet 2-core CPU; --quick: the
longest length only, one seed. Paper scale: configs/geonorm_paper.py:125m at 512 to 4096,
0.5M tokens a step. Writes results/seq_length/{results.csv, curves.csv, table.md,
config.json, verdict.json, spikes_vs_length.png, loss_curves_longest.png}.
Verdict: reproduced when, at the longest length, Post-LN is unstable (a spike or a non-finite
step) in at least one seed and GeoNorm in none; not reproduced when Post-LN is stable in
every seed or GeoNorm is unstable.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from geonorm_jax import claims  # pylint: disable=g-import-not-at-top

NAME = "seq_length"
CLAIM = "Post-LN spikes and collapses at long sequence length; GeoNorm stays stable"
PAPER_NUMBER = "runs up to sequence length 4096 (GeoNorm paper)"
TOKENS_PER_STEP = {"cpu": 2048, "paper": 524288}
SEQ_LENS = {"cpu": "128,256,512", "paper": "512,1024,2048,4096"}
SCALES = {
    "cpu": claims.Scale("configs/shakespeare.py", claims.steps_overrides(300), "0,1,2",
                        "tiny model (4 blocks x 128, untied head), character-level "
                        "tinyshakespeare, 300 steps x 2048 tokens, lr 3e-3."),
    "paper": claims.Scale("configs/geonorm_paper.py", "125m", "0,1,2",
                          "GeoNorm's 125M (12 x 768, RoPE, untied), 20k steps x 0.5M tokens, "
                          "lr 6e-4 (configs/geonorm_paper.py)."),
}
CURVES = (("train", "loss"), ("events", "loss_spike"), ("events", "skipped"))


def add_arguments(parser):
  claims.add_variants_argument(parser, ("pre", "post", "geonorm"))
  parser.add_argument("--seq_lens", default=None, help="default 128,256,512 (cpu), "
                      "512,...,4096 (paper)")
  parser.add_argument("--spike_factor", type=float, default=1.5)


def grid(args, scale):
  del scale
  lengths = [int(s) for s in (args.seq_lens or SEQ_LENS[args.scale]).split(",")]
  if args.quick:
    lengths = lengths[-1:]
  tokens = TOKENS_PER_STEP[args.scale]
  out = []
  for name, overrides in claims.variant_list(args):
    for length in lengths:
      if tokens % length:
        raise SystemExit(f"--seq_lens: {length} does not divide {tokens} tokens a step")
      out.append(claims.variant(
          f"{name}/seq{length}",
          claims.join(overrides, f"seq_len={length},max_seq_len={length},"
                      f"batch_size={tokens // length},spike_factor={args.spike_factor},"
                      "on_divergence=skip"),
          variant=name, seq_len=length))
  return out


def _unstable(run):
  return run["loss_spikes"] > 0 or run["skipped_steps"] > 0


def summarize(rows, curves, config):
  table = ["| variant | seq_len | seeds | loss spikes per run | runs with a spike or a "
           "non-finite step | final validation loss |", "|---|---|---|---|---|---|"]
  for (name, length), runs in sorted(claims.group(rows, "variant", "seq_len").items()):
    table.append(f"| {name} | {length} | {len(runs)} | {claims.cell(runs, 'loss_spikes', 1)} | "
                 f"{sum(map(_unstable, runs))}/{len(runs)} | "
                 f"{claims.cell(runs, 'final_eval_loss')} |")
  factor = config["args"]["spike_factor"]
  table += ["", f"A spike: train loss > {factor:g} x the running median of the previous 100 "
            "finite losses."]
  longest = max(row["seq_len"] for row in rows)
  at = {name: runs for (name, length), runs in claims.group(rows, "variant", "seq_len").items()
        if length == longest}
  holds = None
  if "post" in at and "geonorm" in at:
    post, geo = sum(map(_unstable, at["post"])), sum(map(_unstable, at["geonorm"]))
    holds = post > 0 and geo == 0
  result = (f"at seq_len {longest}, runs with a spike or a non-finite step: " + ", ".join(
      f"{name} {sum(map(_unstable, runs))}/{len(runs)}" for name, runs in at.items()) + ".")

  def spikes(figure):
    axes = figure.add_subplot(1, 1, 1)
    for i, ((name,), runs) in enumerate(claims.group(rows, "variant").items()):
      lengths, means, stds = claims.curve_over(runs, "seq_len", "loss_spikes")
      axes.errorbar(lengths, means, yerr=stds, marker="o", capsize=3, color=f"C{i}", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel(f"loss spikes per run (loss > {factor:g} x running median)")
    axes.set_title("spikes vs sequence length, same tokens per step (mean +- std)", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)

  longest_rows = [row for row in rows if row["seq_len"] == longest]
  figures = {"spikes_vs_length.png": spikes,
             "loss_curves_longest.png": lambda fig: claims.plot_curves(
                 fig, curves, longest_rows, lambda row: row["variant"],
                 title=f"train loss at seq_len {longest} (every seed)")}
  return claims.Summary(table, claims.verdict(config, holds), result, figures)


if __name__ == "__main__":
  claims.run(sys.modules[__name__])
