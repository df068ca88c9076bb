"""The Lanczos basis is sharded like the parameters: per-device memory of a compiled
Lanczos on an 8-device FSDP mesh (conftest's fake CPU devices), lowered on abstract
arrays as experiments/bench_hessian.py --memory does for llama2_7b."""
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np

from geonorm_jax import config as config_lib
from geonorm_jax import hessian, hessian_analysis, train
from geonorm_jax import model as model_lib
from tests.test_hessian import mlp, mlp_loss  # noqa: F401

# Parameters dominate: ~0.9M of them against a few thousand activations per layer.
SMALL = ("tiny,backbone=llama,num_layers=1,d_model=256,num_heads=4,d_ff=1024,vocab_size=256,"
         "max_seq_len=16,seq_len=16,batch_size=8,mesh.data=1,mesh.fsdp=8")
STEPS = 20


def temp_bytes(sharded):
  config = config_lib.get_config(SMALL)
  setup = train.make_setup(config)
  params = train.sharded_abstract_state(setup)["params"]
  tokens = jax.ShapeDtypeStruct((1, 8, 17), jnp.int32, sharding=setup.batch_sharding)
  analyser = hessian_analysis.Analyser(setup, hessian_analysis.Settings(hvp="recomputed"))
  shardings = setup.state_shardings["params"] if sharded else None
  run = jax.jit(lambda p, t, k: hessian.lanczos(analyser._matvec(p, t), p, STEPS, k,  # pylint: disable=protected-access
                                                shardings=shardings).ritz_values)
  compiled = run.lower(params, tokens, jax.random.key(0)).compile()
  return compiled.memory_analysis().temp_size_in_bytes, model_lib.count_params(params)


def test_basis_is_sharded_over_fsdp():
  sharded, num_params = temp_bytes(True)
  basis = (STEPS + 1) * num_params * 4  # the old replicated (M+1, N) float32 buffer
  # A replicated basis alone would be >= basis. Measured 0.28 basis: one eighth of it per
  # device, held about twice (the loop's initial value and its carry), plus the HVP's own
  # temporaries. With the lanes axis behind the step axis it was 0.41 (a transposed copy).
  assert sharded < 0.35 * basis, (sharded, basis)


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
