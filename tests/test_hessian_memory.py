"""The Lanczos basis is sharded like the parameters and held once: per-device memory of a
compiled Lanczos on an 8-device FSDP mesh (conftest's fake CPU devices), lowered on abstract
arrays as benchmarks/bench_hessian.py --memory does for llama2_7b."""
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np

from geonorm_jax import hessian
from geonorm_jax.hessian import analysis as hessian_analysis
from geonorm_jax.nn import model as model_lib
from geonorm_jax.training import config as config_lib
from geonorm_jax.training import train
from tests.test_hessian import mlp, mlp_loss  # noqa: F401

# 1.2M parameters: a basis row's shard (0.56 MiB) is well above the compiler's rounding.
SMALL = ("tiny,backbone=llama,num_layers=1,d_model=256,num_heads=4,d_ff=1024,vocab_size=256,"
         "max_seq_len=16,seq_len=16,batch_size=8,mesh.data=1,mesh.fsdp=8")


def temp_bytes(num_steps):
  config = config_lib.get_config(SMALL)
  setup = train.make_setup(config)
  params = train.sharded_abstract_state(setup)["params"]
  tokens = jax.ShapeDtypeStruct((1, 8, 17), jnp.int32, sharding=setup.batch_sharding)
  analyser = hessian_analysis.Analyser(setup, hessian_analysis.Settings(hvp="recomputed"))
  shardings = setup.state_shardings["params"]
  run = jax.jit(lambda p, t, k: hessian.lanczos(analyser._matvec(p, t), p, num_steps, k,  # pylint: disable=protected-access
                                                shardings=shardings).ritz_values)
  compiled = run.lower(params, tokens, jax.random.key(0)).compile()
  return compiled.memory_analysis().temp_size_in_bytes, model_lib.count_params(params)


def test_basis_is_held_once_and_sharded_over_fsdp():
  """Each extra Lanczos step adds exactly one basis row's shard (N / 8 floats) per device.

  Held twice (a copy in the loop carry, a reorthogonalisation materialising the basis, an
  update that is not in place) the slope would be 2; replicated, 8. What does not grow
  with the steps is the HVP's own working set (here mostly activations, which GSPMD keeps
  replicated over fsdp for this small batch) and a few vectors.
  """
  short, num_params = temp_bytes(5)
  long, _ = temp_bytes(20)
  row_per_device = num_params * 4 / 8
  slope = (long - short) / (15 * row_per_device)
  assert 0.95 < slope < 1.05, slope  # measured 1.000


def test_sharded_lanczos_matches_dense(mlp):  # noqa: F811
  params, batch, _, eig = mlp
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  shardings = jax.tree.map(lambda a: jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*([None] * (a.ndim - 1)), "fsdp")
      if a.shape[-1] % 8 == 0 else jax.sharding.PartitionSpec()), params)
  sharded = jax.tree.map(jax.device_put, params, shardings)
  run = jax.jit(lambda p: hessian.lanczos(hessian.params_matvec(mlp_loss, p, batch), p, 30,
                                          jax.random.key(3), shardings=shardings,
                                          return_vectors=True))
  result = run(sharded)
  np.testing.assert_allclose(np.asarray(result.ritz_values[:5]), eig[:5], atol=1e-5 * eig[0])
  # The Ritz vectors come back in the parameters' layout.
  kernel = result.ritz_vectors["dense1"]["kernel"]
  assert kernel.shape == (30,) + params["dense1"]["kernel"].shape
  u_N = np.asarray(ravel_pytree(jax.tree.map(lambda x: x[0], result.ritz_vectors))[0])
  assert abs(np.linalg.norm(u_N) - 1) < 1e-5
