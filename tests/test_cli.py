"""The command line, as a user runs it: `python -m geonorm_jax <command>` in a subprocess."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

import fast_compile  # tests/ is on sys.path (no __init__.py)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("train", "eval", "sample", "hessian", "main", "replay", "compare")

# Small enough that a subprocess trains it in a few seconds on one CPU core.
TINY_OVERRIDES = [
    "--config.model.num_layers=1", "--config.model.d_model=32", "--config.model.num_heads=2",
    "--config.model.max_seq_len=16", "--config.data.seq_len=16", "--config.data.batch_size=4",
    "--config.train.steps=4", "--config.train.eval_every=2", "--config.train.eval_batches=2",
    "--config.train.warmup_steps=1", "--config.train.log_every=1",
    "--config.train.progress_bar=false",
    # No per-layer statistics: no test here reads them, and they are one program more to compile.
    "--config.train.layer_stats_every=0",
]


# Set for this module's subprocesses by _compile_cache.
_CACHE_ENV = {}


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
  """One compilation cache for this module's commands, empty at its start: the eval and
  sample after a train, and a second sample, find the programs the first one compiled
  (tests/fast_compile.py)."""
  _CACHE_ENV.update(fast_compile.subprocess_env(tmp_path_factory.mktemp("jax_cache")))
  yield
  _CACHE_ENV.clear()


def _env():
  return dict(os.environ, JAX_PLATFORMS="cpu", **_CACHE_ENV)


def _run_cli(*args, timeout=120):
  return subprocess.run([sys.executable, "-m", "geonorm_jax", *args], cwd=REPO_ROOT, env=_env(),
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow  # subprocess
def test_help_lists_every_command_with_an_example():
  result = _run_cli("--help")  # absl exits 1 after printing help; the text is what matters
  for command in COMMANDS:
    assert f"\n  {command} " in result.stdout, command
  assert "python -m geonorm_jax train --config=configs/tiny.py" in result.stdout
  assert "--workdir" in result.stdout and "--num_tokens" in result.stdout


@pytest.mark.slow  # subprocess
def test_unknown_command_is_a_usage_error():
  result = _run_cli("trian")
  assert result.returncode != 0
  assert "one of: train, eval, sample, hessian, main" in result.stderr


@pytest.mark.slow  # subprocess
def test_bad_placement_fails_fast_naming_the_field_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  result = _run_cli("train", "--config=configs/tiny.py", f"--workdir={workdir}",
                    "--config.model.placement=foo")
  assert result.returncode != 0
  assert "model.placement" in result.stderr and "'foo'" in result.stderr
  assert "Traceback" not in result.stderr
  # Training creates the workdir before it builds or compiles anything, so its absence
  # shows the error came first.
  assert not workdir.exists()


@pytest.mark.slow  # subprocess
def test_hessian_on_a_directory_without_a_run_is_one_line(tmp_path):
  result = _run_cli("hessian", f"--workdir={tmp_path}")
  assert result.returncode != 0
  assert "config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # subprocess
def test_train_then_eval_then_sample_end_to_end(tmp_path):
  workdir = str(tmp_path / "run")
  trained = _run_cli("train", "--config=configs/tiny.py", f"--workdir={workdir}",
                     *TINY_OVERRIDES)
  assert trained.returncode == 0, trained.stderr[-3000:]
  summary = json.loads(trained.stdout[trained.stdout.index("{"):])
  assert summary["final_step"] == 4
  assert os.path.exists(os.path.join(workdir, "config.json"))

  evaluated = _run_cli("eval", f"--workdir={workdir}")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  eval_result = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])
  assert eval_result["step"] == 4
  assert abs(eval_result["eval_loss"] - summary["final_eval_loss"]) < 1e-4

  sample_args = ("sample", f"--workdir={workdir}", "--prompt=The ", "--num_tokens=24",
                 "--temperature=0")
  sampled = _run_cli(*sample_args)
  assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert sampled.stdout.startswith("The ")
  assert len(sampled.stdout.rstrip("\n")) > len("The ")
  # Greedy decoding of a saved checkpoint is reproducible across processes.
  assert _run_cli(*sample_args).stdout == sampled.stdout



CONFIG_ARGS = {
    "tiny": [None, "placement=geonorm"],
    "shakespeare": [None, "placement=peri"],
    "gpt2": ["124m", "350m", "774m", "1.5b,placement=geonorm"],
    "llama": ["llama2_1b", "llama2_7b", "llama3_8b,placement=simplenorm"],
    "geonorm_paper": ["125m", "1.3b,placement=pre"],
}


def _load_config_file(name):
  path = os.path.join(REPO_ROOT, "configs", f"{name}.py")
  module_spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", sorted(CONFIG_ARGS))
def test_every_config_file_builds_a_valid_model_spec(name):
  from geonorm_jax.nn import spec  # pylint: disable=g-import-not-at-top
  module = _load_config_file(name)
  assert f"python -m geonorm_jax train --config=configs/{name}.py" in module.__doc__
  for arg in CONFIG_ARGS[name]:
    config = module.get_config(arg)
    spec.resolve(config.model)
    assert config.data.seq_len <= config.model.max_seq_len
    if arg and "placement=" in arg:
      assert config.model.placement == arg.split("placement=")[1]


def test_paper_warmup_follows_steps_set_on_the_command_line():
  config = _load_config_file("geonorm_paper").get_config("125m")
  config.train.steps = 5000  # what --config.train.steps=5000 does after get_config
  assert config.train.warmup_steps == 50


@pytest.mark.parametrize("args,expected", [
    (["--config=configs/tiny.py", "--config.model.nonexistent=1"],
     "--config.model.nonexistent: unknown config key"),
    (["--config=configs/does_not_exist.py"], "does_not_exist.py"),
    (["--config=configs/tiny.py:foo=1"], "config key 'foo' is unknown"),
    (["--config=configs/tiny.py", "--config.train.lr=-1"], "train.lr=-1.0 must be positive"),
    (["--config=configs/tiny.py", "--config.mesh.distributed=maybe"], "mesh.distributed='maybe'"),
])
def test_bad_config_is_one_line_without_a_traceback(tmp_path, args, expected):
  result = _run_cli("train", f"--workdir={tmp_path / 'run'}", *args)
  assert result.returncode == 2, result.stderr
  assert expected in result.stderr
  assert "Traceback" not in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not (tmp_path / "run").exists()


def test_workdir_that_cannot_be_created_is_one_line(tmp_path):
  (tmp_path / "a_file").write_text("")
  result = _run_cli("train", "--config=configs/tiny.py", f"--workdir={tmp_path}/a_file/run",
                    *TINY_OVERRIDES)
  assert result.returncode == 1
  assert "a_file/run" in result.stderr and "Traceback" not in result.stderr


def test_eval_on_a_mistyped_workdir_is_one_line_and_creates_nothing(tmp_path):
  typo = tmp_path / "typo"
  result = _run_cli("eval", "--config=configs/tiny.py", f"--workdir={typo}", *TINY_OVERRIDES)
  assert result.returncode == 2, result.stderr
  assert "Traceback" not in result.stderr and str(typo) in result.stderr
  assert not typo.exists()


def test_divergence_exits_3_with_one_line(tmp_path):
  result = _run_cli("train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
                    *TINY_OVERRIDES, "--config.train.lr=1e3", "--config.train.steps=12",
                    "--config.train.warmup_steps=1")
  assert result.returncode == 3, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  assert "training diverged at step" in result.stderr.strip().splitlines()[-1]


def test_preemption_saves_and_exits_75(tmp_path):
  """SIGTERM (a preempted TPU VM, a SLURM requeue): save the current step, exit 75 so the
  scheduler knows to rerun the same command."""
  import signal  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  overrides = [o for o in TINY_OVERRIDES if "train.steps" not in o]
  proc = subprocess.Popen(
      [sys.executable, "-m", "geonorm_jax", "train", "--config=configs/tiny.py",
       f"--workdir={workdir}", *overrides, "--config.train.steps=100000",
       "--config.train.eval_every=100000", "--config.checkpoint.every=100000"],
      cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not (workdir / "metrics.jsonl").exists() or (workdir / "metrics.jsonl").stat().st_size < 500:
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 75, stderr[-3000:]
  summary = json.loads(stdout[stdout.index("{"):])
  assert summary["preempted"] is True
  assert sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()) == [
      summary["final_step"]]
