"""SimpleNorm's curvature claim on an untrained tiny model, with W -> cW on one linear map.

Three separate statements (docs/hessian.md), checked on blocks.0.mlp.up:
  * Norm(cWx): the Hessian w.r.t. the map's input x (the `.in` tap) does not depend on
    c, because Norm(c(Wx + b)) == Norm(Wx + b) up to the norm's eps;
  * Norm(cWx): the Hessian w.r.t. the map's own parameters scales exactly as 1/c^2
    (L(cW) == L(W), so d2L/dW2 at cW is c^-2 times the one at W);
  * plain cWx (Pre-LN): the Hessian w.r.t. the input does change with c (~c^2 while the
    downstream nonlinearity is not saturated).
The bias is scaled with the kernel: the claim is about the affine map's output scale, and
Norm(cWx + b) would not be invariant. eps is set to 1e-9: with the default 1e-5 and this
init (std 0.02, so mean((Wx)^2) ~ 3e-3) the input Hessian measured 3.8% higher at c=0.25
than at c=1, and 0.2% lower at c=4 -- the eps caveat of HESSIAN.md, not a failure of the
invariance.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax import hessian
from geonorm_jax.nn import losses, paths, model as model_lib
from geonorm_jax.training import config as config_lib

_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
TINY = ("tiny,num_layers=2,d_model=16,num_heads=2,d_ff=32,vocab_size=32,max_seq_len=8,"
        "seq_len=8,norm_eps=1e-9,")
MAP = "blocks.0.mlp.up"
SCALES = (0.25, 1.0, 4.0)
NUM_STEPS = 20


def scale_map(params, prefix, c):
  """params with the kernel and bias of the linear map `prefix` multiplied by c."""
  def scale(path, leaf):
    name = paths.path_to_string(path)
    if name in (prefix + ".kernel", prefix + ".bias"):
      return leaf * c
    return leaf
  return jax.tree_util.tree_map_with_path(scale, params)


@pytest.fixture(scope="module", params=["simplenorm", "pre"])
def measured(request):
  """placement -> {c: (lambda_max w.r.t. MAP.in, lambda_max w.r.t. MAP's params)}."""
  config = config_lib.get_config(TINY + "placement=" + request.param)
  graphdef, params = nnx.split(model_lib.build(config.model))
  tokens_BxL1 = jax.random.randint(jax.random.key(1), (4, 9), 0, config.model.vocab_size)
  like = jnp.zeros((4, 8, config.model.d_model), jnp.float32)

  def measure(p, c, key):
    p = scale_map(p, MAP, c)
    loss_of_delta = lambda d: losses.lm_loss(nnx.merge(graphdef, p), tokens_BxL1,
                                             perturb={MAP + ".in": d})
    activation = hessian.lanczos(hessian.activation_matvec(loss_of_delta, like), like,
                                 NUM_STEPS, key)
    loss_fn = lambda q, t: losses.lm_loss(nnx.merge(graphdef, q), t)
    matvec, subset = hessian.subset_matvec(loss_fn, p, "^" + MAP.replace(".", r"\.") + r"\.",
                                           tokens_BxL1)
    weights = hessian.lanczos(matvec, subset, NUM_STEPS, key)
    return activation.ritz_values[0], weights.ritz_values[0]

  c_arg = jnp.float32(1.0)
  compiled = jax.jit(measure).lower(params, c_arg, jax.random.key(0)).compile(
      compiler_options=_FAST_COMPILE)
  values = {c: tuple(float(v) for v in compiled(params, jnp.float32(c), jax.random.key(0)))
            for c in SCALES}
  return request.param, values


def test_claim(measured):
  placement, values = measured
  act = np.array([values[c][0] for c in SCALES])
  weight = np.array([values[c][1] for c in SCALES])
  assert np.all(act > 0) and np.all(weight > 0), values
  if placement == "simplenorm":
    # Measured spread: ~1e-6 relative (float32 rounding of the same operator).
    np.testing.assert_allclose(act, act[1], rtol=1e-3)
    np.testing.assert_allclose(weight * np.square(SCALES), weight[1], rtol=1e-3)
  else:
    # A plain map: the input Hessian moves by far more than the tolerance above.
      assert act[2] / act[0] > 4.0, act
