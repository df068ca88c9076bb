"""Eight fake CPU devices, set before any JAX op, so sharding is tested for real."""
import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
