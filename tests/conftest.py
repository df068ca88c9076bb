"""Eight fake CPU devices, set before any JAX op, so sharding is tested for real.

LLVM runs without its optimization passes, here and in every subprocess a test starts with
this environment: the suite compiles hundreds of small programs and runs each for a few
steps, so the passes cost more than they save (test_model + test_scan_layers: 440 s of CPU
time with them, 284 s without). What a test compares is computed on both sides under the
same flags.
"""
import os

_UNOPTIMIZED_LLVM = "--xla_backend_optimization_level=0"
if _UNOPTIMIZED_LLVM not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_UNOPTIMIZED_LLVM}".strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
