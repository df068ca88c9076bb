"""The environment for a test's JAX subprocesses that compile many small programs.

Every program goes into one compilation cache (JAX caches only compilations over a second by
default, which leaves the eval, init and finiteness programs out), so the subprocesses of one
test module compile each program once. (LLVM's optimization passes are off for every test
process and its subprocesses already: conftest.py.)
"""


def subprocess_env(cache_dir):
  """{name: value} to lay over os.environ for the subprocesses."""
  return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
