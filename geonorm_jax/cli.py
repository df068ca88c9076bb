"""geonorm_jax: train, evaluate, sample and analyse Transformers with different norm placements.

Usage:
  python -m geonorm_jax <command> --workdir=DIR [--config=configs/FILE.py[:ARG]] [flags]

Commands:
  train    Train the model of --config in --workdir, resuming from its latest checkpoint.
           Writes metrics.jsonl, tensorboard events, checkpoints and config.json there.
           Override any config key: --config.model.placement=geonorm --config.train.steps=50
           --step=S resumes from checkpoint S (later ones are moved aside, not deleted).
  eval     Validation loss of a checkpoint (--step, default the latest). Uses --config when
           given (e.g. to evaluate on other data), else the run's saved config.json.
  sample   Generate text from a checkpoint: --prompt, --num_tokens, --temperature, --top_k,
           --seed, --step. Reads the run's config.json; prints the decoded text.
  hessian  Hessian spectrum of checkpoints (geonorm_jax.hessian.cli): prints its cost, then
           a progress bar. --step=S|latest|all (--every=K), several --workdir to
           compare runs (figures in --out), --estimates=top,density,trace,precond,
           --lanczos_steps, --probes, --lanes, --batches, --eigenvalues, --hvp, --seed.
  replay   Rerun steps of a run on its own batches with the per-layer statistics at every
           step: --from_step=S --to_step=E restores the newest checkpoint at or before S and
           trains to E into RUN/replays/NAME/ (--name, default from the steps and overrides);
           --config.X=... branches it (e.g. --config.train.lr=3e-4): the run's config.json
           is the config, RUN itself is never written.
  main     The README's main job: GeoNorm (harmonic) vs Pre-LN on the built-in corpus,
           tiny model, both runs under --workdir, then loss_curves.png, summary.md and a
           sample from the better run.
  report   DIR... : rebuild the tables, figures and verdicts of claim results folders
           (results/<claim>/, written by experiments/<claim>.py) from their files alone; a
           training run's folder gets RUN/mechanisms.png (max attention logit, attention
           entropy per layer, log Z over steps, from its metrics.jsonl).
  compare  A B : two sets of runs from claim results folders (FOLDER:RUN, RUN a run name
           without its /seedN), their final validation losses seed by seed and the paired
           difference A - B with its 95% t interval (geonorm_jax/studies/compare.py).
  prepare  Your corpus (text, .jsonl, .parquet: --input) -> token shards in --output_dir
           (--tokenizer=byte|gpt2, --val_tokens); prints the config overrides to train on them.
  export   A checkpoint (--step, default the latest) as a Hugging Face `transformers`
           folder in --out (config.json + model.safetensors, for from_pretrained): Pre-LN
           on gpt2 is GPT2LMHeadModel, on llama LlamaForCausalLM; anything else is refused.

Examples:
  python -m geonorm_jax train --config=configs/tiny.py --workdir=/tmp/tiny
  python -m geonorm_jax train --config=configs/tiny.py:placement=geonorm --workdir=/tmp/geo \\
      --config.train.steps=100
  python -m geonorm_jax sample --workdir=/tmp/tiny --prompt="The " --num_tokens=200
  python -m geonorm_jax hessian --workdir=/tmp/tiny --workdir=/tmp/geo --step=all
  python -m geonorm_jax replay --workdir=/tmp/tiny --from_step=150 --to_step=180 \\
      --config.train.skip_spikes=true
  python -m geonorm_jax main --workdir=runs/main
  python -m geonorm_jax compare results/geonorm_decay:harmonic/blocks/lr0.002/alpha4 \\
      results/norm_zoo:post/lr0.004
  python -m geonorm_jax prepare --input='corpus/*.jsonl' --output_dir=data/my_corpus
  python -m geonorm_jax export --workdir=/tmp/tiny --out=/tmp/tiny_hf

Config files live in configs/; each one's docstring gives its exact command.

Exit codes: 0 done (or already finished), 1 a runtime failure (a failed save, a busy
workdir, an unreadable checkpoint), 2 a bad command line or config, 3 training diverged
(train.on_divergence=stop), 75 preempted by SIGTERM after saving (rerun to resume),
130 stopped by Ctrl-C after saving. Errors are one line; --verbosity=0 adds the traceback.
"""
import json
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from geonorm_jax.data import prepare  # defines the prepare command's flags

COMMANDS = ("train", "eval", "sample", "hessian", "main", "prepare", "report", "compare",
            "export", "replay")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, `configs/FILE.py` or `configs/FILE.py:ARG`; override keys "
    "with --config.SECTION.KEY=VALUE.", lock_config=True)
_WORKDIR = flags.DEFINE_multi_string("workdir", None, "Run directory: checkpoints, metrics, "
                                     "config. hessian accepts several.")
_STEP = flags.DEFINE_string("step", None, "Checkpoint step for eval/sample/hessian/export; "
                            "default the latest. hessian also takes `all`.")
_PROMPT = flags.DEFINE_string("prompt", "The ", "sample: text to continue.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", None, "sample: tokens to generate; "
                                   "default config.train.sample_tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "sample: softmax temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample: keep only the k likeliest tokens; 0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "sample, hessian: random seed.")
_EVERY = flags.DEFINE_integer("every", 1, "hessian --step=all: every K-th checkpoint (and the last).")
_ESTIMATES = flags.DEFINE_string("estimates", "top,density,trace", "hessian: which of "
                                 "top,density,trace,precond to compute.")
_LANCZOS_STEPS = flags.DEFINE_integer("lanczos_steps", 50, "hessian: Lanczos steps (top run "
                                      "and every density probe).")
_PROBES = flags.DEFINE_integer("probes", 8, "hessian: density/trace probes (the top run counts).")
_LANES = flags.DEFINE_integer("lanes", 0, "hessian: probes per compiled call; 0 = one on CPU, "
                              "all on accelerators.")
_BATCHES = flags.DEFINE_integer("batches", 4, "hessian: validation batches in the loss.")
_EIGENVALUES = flags.DEFINE_integer("eigenvalues", 10, "hessian: how many top eigenvalues.")
_HVP = flags.DEFINE_enum("hvp", "linearized", ["linearized", "recomputed"], "hessian: linearize "
                         "the gradient once (fast) or recompute it per product (less memory).")
_FROM_STEP = flags.DEFINE_integer("from_step", None, "replay: the first step to rerun comes "
                                  "after the newest checkpoint at or before this step.")
_TO_STEP = flags.DEFINE_integer("to_step", None, "replay: the last step to rerun.")
_NAME = flags.DEFINE_string("name", None, "replay: folder under RUN/replays/; default from the "
                            "steps and the overrides.")
_OUT = flags.DEFINE_string("out", None, "hessian with several --workdir: where the comparison "
                           "figures go; default hessian_compare/ next to the runs. export: the "
                           "new (or empty) folder to write.")
flags.adopt_module_key_flags(prepare)  # --help lists them with the others


EXIT_RUNTIME_ERROR = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a scheduler should requeue the same command
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


class CommandError(Exception):
  """A mistake in the command line or config, reported as one line instead of a traceback."""


def _root_message(err):
  """The innermost cause's last line: ml_collections and absl wrap the useful message
  (e.g. "config key 'foo' is unknown") in a traceback-shaped string."""
  while (err.__cause__ or err.__context__) is not None:
    err = err.__cause__ or err.__context__
  lines = [line.strip() for line in str(err).splitlines() if line.strip()]
  message = lines[-1] if lines else type(err).__name__
  if isinstance(err, (AttributeError, KeyError)):
    message = f"unknown config key {message}"
  return message


def _config_value():
  """--config, loaded (ml_collections loads the file lazily and hides why it failed)."""
  try:
    config = _CONFIG.value
    if config is not None:
      config.keys()  # the placeholder of a file that failed to load raises only when read
    return config
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f"--config: {_root_message(e)}") from None


def _require_workdir():
  if not _WORKDIR.value:
    raise CommandError("--workdir is required")
  if len(_WORKDIR.value) > 1:
    raise CommandError("give one --workdir (only `hessian` compares several runs)")
  return _WORKDIR.value[0]


def _step():
  """--step as an int (None: the latest), for the commands that read one checkpoint."""
  if _STEP.value in (None, "latest"):
    return None
  try:
    return int(_STEP.value)
  except ValueError:
    raise CommandError(f"--step={_STEP.value!r} must be an integer") from None


def _require_config(command):
  config = _config_value()
  if config is None:
    raise CommandError(f"`{command}` needs --config=configs/FILE.py[:ARG]")
  return config


def _validate(config):
  """Config errors as a CommandError naming the field, before anything is compiled."""
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  try:
    train.validate(config)
  except (ValueError, FileNotFoundError) as e:
    raise CommandError(str(e)) from None


def _print_json(result):
  print(json.dumps(result, indent=2, sort_keys=True, default=str))


def run_train():
  from geonorm_jax.hessian import callback as hessian_callback  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  config = _require_config("train")
  workdir = _require_workdir()
  _validate(config)
  try:
    summary = train.train(config, workdir, step=_step(),
                          loggers=hessian_callback.step_loggers(config))
  except train.DivergenceError:
    raise
  except ValueError as e:  # a checkpoint written with another config
    raise CommandError(str(e)) from None
  _print_json(summary)
  if summary.get("interrupted"):
    sys.exit(EXIT_INTERRUPTED)
  if summary.get("preempted"):
    sys.exit(EXIT_PREEMPTED)


def run_eval():
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  workdir = _require_workdir()
  config = _config_value()
  if config is not None:
    _validate(config)
  try:
    result = train.evaluate(config, workdir, step=_step())
  except (FileNotFoundError, ValueError) as e:  # not a run folder, no checkpoint, other model
    raise CommandError(str(e)) from None
  _print_json(result)


def run_sample():
  from geonorm_jax.nn import sample  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import train
  workdir = _require_workdir()
  try:
    config, model = train.load_model(workdir, step=_step())
  except (FileNotFoundError, ValueError) as e:  # not a run folder, no checkpoint, other model
    raise CommandError(str(e)) from None
  num_tokens = config.train.sample_tokens if _NUM_TOKENS.value is None else _NUM_TOKENS.value
  try:
    text = sample.generate_text(model, config, _PROMPT.value, num_tokens,
                                temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                                seed=_SEED.value)
  except ValueError as e:  # an empty prompt, a bad temperature or top_k
    raise CommandError(str(e)) from None
  print(_PROMPT.value + text)


def run_hessian():
  from geonorm_jax.hessian import analysis as hessian_analysis, cli as hessian_cli  # pylint: disable=g-import-not-at-top
  if not _WORKDIR.value:
    raise CommandError("--workdir is required")
  try:
    settings = hessian_analysis.Settings(
        estimates=tuple(e.strip() for e in _ESTIMATES.value.split(",") if e.strip()),
        num_steps=_LANCZOS_STEPS.value, num_probes=_PROBES.value, lanes=_LANES.value,
        num_batches=_BATCHES.value, top_k=_EIGENVALUES.value, hvp=_HVP.value,
        seed=_SEED.value).validate()
    result = hessian_cli.run(_WORKDIR.value, _STEP.value, every=_EVERY.value,
                             settings=settings, out=_OUT.value)
  except (ValueError, FileNotFoundError) as e:  # a bad flag, workdir or step; a non-finite HVP
    raise CommandError(str(e)) from None
  _print_json(result)


def run_export():
  from geonorm_jax.interop import export  # pylint: disable=g-import-not-at-top
  workdir = _require_workdir()
  if not _OUT.value:
    raise CommandError("`export` needs --out=DIR, a new (or empty) folder")
  try:
    result = export.export(workdir, _OUT.value, step=_step())
  except (FileNotFoundError, ValueError) as e:  # not a run, a placement HF lacks, DIR not empty
    raise CommandError(str(e)) from None
  _print_json(result)


def run_replay():
  from geonorm_jax.hessian import callback as hessian_callback  # pylint: disable=g-import-not-at-top
  from geonorm_jax.training import replay, train  # pylint: disable=g-import-not-at-top
  workdir = _require_workdir()
  if _FROM_STEP.value is None or _TO_STEP.value is None:
    raise CommandError("replay needs --from_step=S and --to_step=E")
  config = _config_value()  # the run's config.json with the overrides (see _parse_flags)
  try:
    summary = replay.replay(workdir, _FROM_STEP.value, _TO_STEP.value, config=config,
                            name=_NAME.value, loggers=hessian_callback.step_loggers(config))
  except train.DivergenceError:
    raise
  except (ValueError, FileNotFoundError) as e:  # a bad range, name, override or workdir
    raise CommandError(str(e)) from None
  _print_json(summary)


def run_main():
  from geonorm_jax import main_job  # pylint: disable=g-import-not-at-top
  main_job.run(_require_workdir())


def run_prepare():
  try:
    _print_json(prepare.run_from_flags())
  except (ValueError, FileNotFoundError) as e:  # a missing input, tokenizer file or package
    raise CommandError(str(e)) from None


def run_report(*results_dirs):
  from geonorm_jax.studies import claims, report  # pylint: disable=g-import-not-at-top
  if not results_dirs:
    raise CommandError("report: give one or more results folders, e.g. results/norm_zoo, "
                       "or training run folders")
  for results_dir in results_dirs:
    try:
      if report.is_run_dir(results_dir):
        print(f"{results_dir}: {report.plot_mechanisms(results_dir)}")
        continue
      summary = claims.report(results_dir)
    except (ValueError, FileNotFoundError) as e:  # not a claim folder, or a file missing
      raise CommandError(str(e)) from None
    print(f"{results_dir}: {summary.verdict}: {summary.result}")


def run_compare(*specs):
  from geonorm_jax.studies import compare  # pylint: disable=g-import-not-at-top
  if len(specs) != 2:
    raise CommandError("compare: give two FOLDER:RUN, e.g. results/norm_zoo:pre/lr0.004 "
                       "results/norm_zoo:post/lr0.004")
  try:
    lines, _ = compare.compare(*specs)
  except (ValueError, FileNotFoundError) as e:
    raise CommandError(str(e)) from None
  print("\n".join(lines))


_RUNNERS = {"train": run_train, "eval": run_eval, "sample": run_sample,
            "hessian": run_hessian, "replay": run_replay, "main": run_main,
            "prepare": run_prepare, "report": run_report, "compare": run_compare,
            "export": run_export}


def _exit_code(err):
  from geonorm_jax.training import train  # pylint: disable=g-import-not-at-top
  if isinstance(err, CommandError):
    return EXIT_USAGE
  if isinstance(err, train.DivergenceError):
    return EXIT_DIVERGED
  return EXIT_RUNTIME_ERROR


def main(argv):
  commands = argv[1:]
  if not commands or commands[0] not in _RUNNERS or (
      len(commands) > 1 and commands[0] not in ("report", "compare")):
    raise app.UsageError(f"give exactly one command, one of: {', '.join(COMMANDS)} "
                         f"(got {' '.join(commands) or 'none'})")
  verbose = flags.FLAGS["verbosity"].present
  if not verbose:
    # Orbax logs every checkpoint save and restore at INFO, and a failed background save
    # as a page of tracebacks at ERROR; the trainer reports those failures itself, in one
    # line. -v 0 (or --verbosity=0) brings orbax's lines and Python tracebacks back.
    logging.set_verbosity(logging.FATAL)
  try:
    _RUNNERS[commands[0]](*commands[1:])  # only report and compare take arguments
  except KeyboardInterrupt:
    print(f"geonorm_jax {commands[0]}: interrupted", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)
  except Exception as e:  # pylint: disable=broad-except
    if verbose:
      raise
    message = str(e) if isinstance(e, CommandError) else f"{type(e).__name__}: {e}"
    print(f"geonorm_jax {commands[0]}: error: {message}", file=sys.stderr)
    sys.exit(_exit_code(e))


def _with_run_config(argv):
  """`replay` without --config: --config=<saved_config.py>:RUN goes first, so that RUN's own
  config.json is the config and --config.X=... overrides apply to it (config_flags defines the
  override flags only for a config file it loaded)."""
  if "replay" not in argv[1:] or any(re.match(r"^--?config(=|$)", arg) for arg in argv):
    return argv
  workdirs = [value for flag, value in zip(argv, argv[1:]) if flag in ("--workdir", "-workdir")]
  workdirs += [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--workdir=", "-workdir="))]
  if len(workdirs) != 1:
    return argv  # run_replay names the problem
  loader = os.path.join(os.path.dirname(os.path.abspath(__file__)), "training", "saved_config.py")
  return [argv[0], f"--config={loader}:{workdirs[0]}", *argv[1:]]


def _parse_flags(argv):
  """absl's parsing, with a bad flag or config override as one line (exit 2)."""
  argv = _with_run_config(argv)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    if any(arg.startswith(("--verbosity", "-v")) for arg in argv[1:]):
      raise
    message = _root_message(e)
    if message.startswith("unknown config key"):
      key = message.rsplit(" ", 1)[1].strip("'\"")
      named = [arg.split("=")[0] for arg in argv if arg.startswith("--config.")
               and arg.split("=")[0].endswith("." + key)]
      message = f"{named[0]}: unknown config key" if named else message
    print(f"geonorm_jax: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def run():
  app.run(main, flags_parser=_parse_flags)
