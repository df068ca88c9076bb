"""The install flavours: `make run` and the main job never need the test-only packages."""
import ast
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# safetensors comes with transformers; export writes the format with numpy alone.
TEST_ONLY = ("torch", "transformers", "safetensors", "pytest", "nbclient", "nbformat",
             "ipykernel")
# Never a core dependency and never imported by the core: test-only packages and the optional
# W&B tracking (`pip install -e ".[wandb]"`, imported only when train.wandb is on).
OPTIONAL = TEST_ONLY + ("wandb",)


def _setup_kwargs():
  tree = ast.parse(open(os.path.join(REPO_ROOT, "setup.py")).read())
  call = next(node for node in ast.walk(tree)
              if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
  return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
          if kw.arg in ("install_requires", "extras_require")}


def _name(requirement):
  return requirement.split("=")[0].split("[")[0].split(">")[0].split("<")[0]


def test_test_only_packages_are_extras_and_accelerators_have_theirs():
  kwargs = _setup_kwargs()
  assert not {_name(r) for r in kwargs["install_requires"]} & set(OPTIONAL)
  extras = kwargs["extras_require"]
  assert "torch==2.13.0" in extras["test"]  # the CPU wheel; never a CUDA build
  [wandb_pin] = extras["wandb"]
  assert _name(wandb_pin) == "wandb" and "==" in wandb_pin
  assert wandb_pin in extras["test"]  # the suite runs the offline mode
  jax_pin = next(r for r in kwargs["install_requires"] if _name(r) == "jax")
  version = jax_pin.split("==")[1]
  assert extras["cuda12"] == [f"jax[cuda12]=={version}"]
  assert extras["tpu"] == [f"jax[tpu]=={version}"]


def _make_dry_run(target, tmp_path):
  # -B: print every recipe as for a fresh clone, whatever .venv holds; -n: run none of them.
  result = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"],
                          cwd=REPO_ROOT, capture_output=True, text=True, check=True)
  return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_make_run_installs_without_test_extras_and_make_test_with_them(tmp_path):
  run_installs = _make_dry_run("run", tmp_path)
  assert any(line.endswith("install --quiet -e .") for line in run_installs), run_installs
  assert not any("[test]" in line for line in run_installs)
  for target in ("test", "test-fast"):
    assert any('-e ".[test]"' in line for line in _make_dry_run(target, tmp_path))


@pytest.mark.slow  # subprocess: a fresh interpreter, so nothing a test imported counts
def test_main_job_and_cli_import_no_optional_package():
  code = ("import sys\n"
          "import geonorm_jax.cli, geonorm_jax.main_job, geonorm_jax.data.prepare\n"
          "import geonorm_jax.interop.export\n"
          "import geonorm_jax.training.train, geonorm_jax.training.tracking\n"
          f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == "[]"
