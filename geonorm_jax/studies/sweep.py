"""Sweeps as plain `train` commands: one run, one workdir, one command line.

An experiment expands its grid (placements x seeds x learning rates x ...) into `Run`s. Each
run is the ordinary CLI command `python -m geonorm_jax train --config=FILE:ARG --workdir=DIR`,
so a sweep runs the same way here (in sequence, or a few processes at once), on a cluster
(`--print` the commands, one per job) or on a TPU slice (the same command on every host).
A run whose workdir holds a finished summary.json is skipped, so a rerun resumes the sweep.
"""
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time


@dataclasses.dataclass(frozen=True)
class Run:
  name: str  # unique within the sweep, e.g. "post/untied/seed1"; also the workdir's subpath
  config_file: str  # e.g. configs/shakespeare.py (relative to the repository root)
  overrides: str  # the preset string after the colon: "placement=post,tie_embeddings=true"
  seed: int = 0  # params init and data order both
  root: str = "runs/sweep"
  labels: tuple = ()  # (key, value) pairs the tables group by
  # A results folder's record of this run (results_folder.Recorded), finished on a machine
  # that no longer holds its workdir; None for a run known only by its workdir.
  record: object = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def workdir(self):
    return os.path.join(self.root, self.name)

  def command(self, python=None):
    config = f"{self.config_file}:{self.overrides}" if self.overrides else self.config_file
    return [python or sys.executable, "-m", "geonorm_jax", "train", f"--config={config}",
            f"--config.seed={self.seed}", f"--config.data.seed={self.seed}",
            f"--workdir={self.workdir}"]

  def config(self):
    return load_config(self.config_file, self.overrides, self.seed)

  def _own_summary(self):
    path = os.path.join(self.workdir, "summary.json")
    if not os.path.exists(path):
      return None
    with open(path) as f:
      summary = json.load(f)
    return None if summary.get("preempted") else summary

  def summary(self):
    """The run's summary.json, else its record's numbers, or None while it has not finished."""
    own = self._own_summary()
    if own is None and self.record is not None:
      return self.record.summary()
    return own

  def from_record(self):
    """Finished by its record only: no finished summary.json in the workdir here."""
    return self.record is not None and self._own_summary() is None


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(config_file, overrides, seed=0):
  """What `train --config=config_file:overrides --config.seed=S --config.data.seed=S` trains
  (config_file relative to the repository root)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.path.join(REPO, config_file)
  spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(overrides)
  config.seed = config.data.seed = seed
  return config


def print_commands(runs):
  for run in runs:
    print(shlex.join(run.command(python="python")))


def core_groups(jobs, cpus=None):
  """The CPU cores each of `jobs` concurrent runs is pinned to: the usable cores split into
  `jobs` groups (None when there are fewer cores than jobs, or no affinity to set).

  On this project's 2-core machine two runs pinned to one core each finish a sweep 1.19x
  sooner than one run at a time on both cores (results/calibration/table.md: 112 s for one
  run alone, 189 s for two at once): XLA's CPU step does not scale 2x from one core to two."""
  if cpus is None:
    if not hasattr(os, "sched_getaffinity"):
      return None
    cpus = sorted(os.sched_getaffinity(0))
  if jobs < 2 or len(cpus) < jobs:
    return None
  size = len(cpus) // jobs
  return [set(cpus[i * size:(i + 1) * size]) for i in range(jobs)]


def default_jobs():
  """Runs at a time: one per core on a CPU-only JAX, else one (an accelerator is shared)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "cpu" or not hasattr(os, "sched_getaffinity"):
    return 1
  return len(os.sched_getaffinity(0))


# Config fields that change how a run is carried out, not what it computes.
_OPERATIONAL = ("train.progress_bar", "data.num_workers", "checkpoint", "mesh")
# A run that did not give up computed the same numbers whatever train.give_up_steps was, so
# it serves a sweep that sets it or not (the records of lr_sensitivity's grids from before they
# ran every run to the end serve its runs this way); a run that gave up is compared on it like
# any other field.
_GIVE_UP = "train.give_up_steps"


def _flat(config):
  out = {}
  for section, values in config.to_dict().items():
    for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
      name = f"{section}.{key}" if key else section
      if not any(name == o or name.startswith(o + ".") for o in _OPERATIONAL):
        out[name] = value
  return out


def config_differences(saved, wanted, gave_up_step=None):
  """The fields, sorted, in which a finished run's config `saved` and the requested `wanted`
  differ in a way that changes the numbers (all but _OPERATIONAL; train.give_up_steps only
  for a run that gave up, at gave_up_step)."""
  saved, wanted = _flat(saved), _flat(wanted)
  if not gave_up_step:
    saved.pop(_GIVE_UP, None)
    wanted.pop(_GIVE_UP, None)
  return [(k, saved.get(k), wanted.get(k)) for k in sorted(set(saved) | set(wanted))
          if saved.get(k) != wanted.get(k)]


def check_finished(run):
  """A finished run is skipped: it must be the run asked for. Its saved config.json has to
  match the requested config in every field that changes the numbers (config_differences),
  or a changed grid would silently reuse another run."""
  from geonorm_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  with open(os.path.join(run.workdir, "config.json")) as f:
    saved = config_lib.from_dict(json.load(f))
  changed = config_differences(saved, run.config(), (run.summary() or {}).get("gave_up_step"))
  if changed:
    detail = ", ".join(f"{k}: {a!r} != {b!r}" for k, a, b in changed[:4])
    raise SystemExit(f"sweep: {run.workdir} holds a finished run of another config ({detail}); "
                     "move it away or choose another --root")


def run_all(runs, jobs=1, cwd=None, env=None):
  """Run the unfinished runs, `jobs` processes at a time; returns the names of failed runs.

  Each run's output goes to WORKDIR/train.log. Runs are independent processes, so one that
  fails (a diverging placement that stops, say) does not stop the sweep. With several jobs
  each process is pinned to its own share of the cores (core_groups).
  """
  groups = core_groups(jobs)
  free_slots = list(range(jobs))
  # Seed-major order: the first seed of every variant compiles, the later seeds of the same
  # program then find it in the compilation cache instead of compiling it concurrently.
  pending = sorted((run for run in runs if run.summary() is None), key=lambda run: run.seed)
  print(f"sweep: {len(runs) - len(pending)} of {len(runs)} runs already finished; "
        f"{len(pending)} to run, {jobs} at a time", flush=True)
  active, failed, done = [], [], 0
  started = time.perf_counter()
  while pending or active:
    while pending and len(active) < jobs:
      run = pending.pop(0)
      os.makedirs(os.path.join(cwd or ".", run.workdir), exist_ok=True)
      log = open(os.path.join(cwd or ".", run.workdir, "train.log"), "w")
      slot = free_slots.pop(0)
      # The sweep's last run, alone on the machine, gets every core.
      alone = not pending and not active
      pin = (None if groups is None or alone else
             (lambda cores=groups[slot]: os.sched_setaffinity(0, cores)))
      process = subprocess.Popen(run.command(), cwd=cwd, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, preexec_fn=pin)
      active.append((run, process, log, slot))
    time.sleep(0.2)
    for entry in list(active):
      run, process, log, slot = entry
      if process.poll() is None:
        continue
      log.close()
      free_slots.append(slot)
      active.remove(entry)
      done += 1
      status = "ok" if process.returncode == 0 else f"FAILED (exit {process.returncode})"
      if process.returncode != 0:
        failed.append(run.name)
      print(f"sweep: [{done}/{done + len(pending) + len(active)}] {run.name}: {status} "
            f"({time.perf_counter() - started:.0f} s)", flush=True)
  return failed


# Named placement variants that the comparison experiments share: name -> preset overrides.
PLACEMENT_VARIANTS = {
    "pre": "placement=pre",
    "pre_qknorm": "placement=pre,qk_norm=true",
    "pre_qknorm_full": "placement=pre,qk_norm=true,qk_norm_scope=full",
    "post": "placement=post",
    "peri": "placement=peri",
    "peri_dt0.1": "placement=peri,dt=0.1",
    # Peri-LN's optional norm after the embedding (Kim et al., 2025): the stream starts at
    # RMS 1, the scale of the normalised sublayer outputs added to it, not at init_std.
    "peri_embed_norm": "placement=peri,embed_norm=true",
    "reordered": "placement=reordered",  # OLMo 2's norm on the sublayer output only
    "deepnorm": "placement=deepnorm",
    "geonorm": "placement=geonorm",  # harmonic alpha/k, alpha=1
    # The step scale geonorm_decay's selection seed chose for harmonic at the judge scale
    # (results/geonorm_decay/table.md), so the norm zoo can tune GeoNorm's LR at it.
    "geonorm_alpha4": "placement=geonorm,geo_alpha=4",
    "geonorm_constant": "placement=geonorm,geo_schedule=constant",
    "geonorm_sqrt": "placement=geonorm,geo_schedule=sqrt",
    "geonorm_linear": "placement=geonorm,geo_schedule=linear",
    "geonorm_linear_paper": "placement=geonorm,geo_schedule=linear_paper",
    "simplenorm": "placement=simplenorm",
    "lns": "placement=lns",
    "mixln": "placement=mixln",
    "ngpt": "placement=ngpt",
    "dyt": "placement=dyt",
    # DyT with alpha_0 = 3 at every site: the norm zoo's controls (results/norm_zoo/controls),
    # which left the unigram plateau at d = 128 where the paper's table extrapolated (1.0) did
    # not (results/dyt_saturation_d128 reads why; results/lr_sensitivity, other widths).
    "dyt_alpha3": "placement=dyt,dyt_alpha_attn=3,dyt_alpha_ffn=3,dyt_alpha_final=3",
    # DyT with alpha_0 = 0.5 at every site (the DyT paper's default outside LLMs): tanh saturates
    # at twice the stream's RMS of alpha_0 = 1, the counter-test of dyt_saturation's reading.
    "dyt_alpha0.5": "placement=dyt,dyt_alpha_attn=0.5,dyt_alpha_ffn=0.5,dyt_alpha_final=0.5",
    # DyT with a 500-step warmup (the judge recipe's is 100), holding back the stream's growth
    # that saturates the final DyT: at step 250 the growth is about halved, and every run from
    # 5e-4 up is still saturated (results/dyt_saturation).
    "dyt_warmup500": "placement=dyt,train.warmup_steps=500",
}


def _final(series):
  return float(series[-1]) if len(series) else float("nan")


def run_row(run):
  """The numbers of one finished run: losses, throughput and the last collapse diagnostics."""
  from geonorm_jax.training import metrics  # pylint: disable=g-import-not-at-top
  summary = run.summary() or {}
  row = dict(run.labels)
  row.update(name=run.name, seed=run.seed,
             final_eval_loss=summary.get("final_eval_loss", float("nan")),
             final_train_loss=summary.get("final_train_loss", float("nan")),
             tokens_per_s=summary.get("tokens_per_s", float("nan")),
             collapse_step=summary.get("collapse_step"))
  for key in ("collapse/token_cosine", "collapse/logit_spread"):
    _, values = metrics.read_scalar_series(run.workdir, key, split="layers")
    row[key.split("/")[1]] = _final(values)
  return row


def aggregate(rows, group_keys, value_key):
  """Mean, sample std, min, max and count of value_key over the rows of each group."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  groups = {}
  for row in rows:
    groups.setdefault(tuple(row[k] for k in group_keys), []).append(row[value_key])
  out = []
  for key, values in groups.items():
    values = np.asarray(values, float)
    finite = values[np.isfinite(values)]
    out.append({**dict(zip(group_keys, key)), "n": len(values),
                "mean": float(finite.mean()) if len(finite) else float("nan"),
                "std": float(finite.std(ddof=1)) if len(finite) > 1 else float("nan"),
                "min": float(finite.min()) if len(finite) else float("nan"),
                "max": float(finite.max()) if len(finite) else float("nan")})
  return out


def add_arguments(parser, variants, seeds="0,1,2", root="runs/sweep"):
  """The flags every sweep experiment shares."""
  parser.add_argument("--variants", default=",".join(variants),
                      help=f"comma list of {', '.join(PLACEMENT_VARIANTS)}")
  parser.add_argument("--seeds", default=seeds, help="comma list; each seeds init and data order")
  parser.add_argument("--jobs", type=int, default=None, help="runs at a time (processes), "
                      "each pinned to its share of the cores; default one per core on a CPU")
  parser.add_argument("--root", default=root, help="folder of the runs' workdirs")
  parser.add_argument("--print", action="store_true", dest="print_only",
                      help="print one train command per run (for a cluster) and exit")
  parser.add_argument("--report_only", action="store_true",
                      help="rebuild the tables from the finished runs without training")


def variant_overrides(name):
  if name not in PLACEMENT_VARIANTS:
    raise SystemExit(f"--variants: {name!r} is unknown; valid: {', '.join(PLACEMENT_VARIANTS)}")
  return PLACEMENT_VARIANTS[name]


def execute(args, runs):
  """Print, or run what is unfinished (a shared compilation cache across the processes)."""
  if args.print_only:
    print_commands(runs)
    raise SystemExit(0)
  for run in runs:
    if run.summary() is not None and not run.from_record():
      check_finished(run)
  if not args.report_only:
    env = dict(os.environ)
    # Seeds of one variant compile to the same program: the cache compiles it once.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(os.path.join(args.root, ".jax_cache")))
    failed = run_all(runs, jobs=args.jobs or default_jobs(), env=env)
    if failed:
      print(f"sweep: {len(failed)} runs failed (see their train.log): {', '.join(failed)}")
  return [run_row(run) for run in runs if run.summary() is not None and not run.from_record()]


def write_config(path, **fields):
  """The experiment's settings, with the machine and the date, as config.json."""
  import time  # pylint: disable=g-import-not-at-top
  with open(path, "w") as f:
    json.dump({**fields, "machine": machine_description(), "date": time.strftime("%Y-%m-%d")},
              f, indent=2)


def write_csv(path, rows):
  import csv  # pylint: disable=g-import-not-at-top
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def machine_description():
  """What the runs ran on, for the results' config.json."""
  import platform  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  return (f"{platform.machine()}, {os.cpu_count()} cpus, jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}")


def placement_grid(variants, ties, lrs, seeds, steps, config_file, root):
  """Runs of variant x tied/untied head x LR x seed on config_file cut to `steps` steps."""
  runs = []
  for variant in variants:
    for tie in ties:
      head = "tied" if tie == "true" else "untied"
      for lr in lrs:
        for seed in seeds:
          overrides = (f"{variant_overrides(variant)},tie_embeddings={tie},lr={lr},"
                       f"steps={steps},warmup_steps={steps // 10},eval_every={steps},"
                       f"checkpoint.every={steps},progress_bar=false")
          runs.append(Run(f"{variant}/{head}/lr{lr}/seed{seed}", config_file, overrides, seed,
                          root, labels=(("variant", variant), ("head", head), ("lr", lr))))
  return runs
