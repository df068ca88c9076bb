"""Where every norm sits in the whole model: geonorm_jax against an independent PyTorch model.

tests/torch_reference.py rebuilds each placement from its equations, with none of
geonorm_jax's code. Both models get the same weights (geonorm_jax's init, then every parameter
nudged with noise so gains are not 1, biases not 0 and nGPT's eigen learning rates change
sign somewhere), loaded by dotted parameter name with strict=True. The logits and the gradient
of the mean cross-entropy with respect to every parameter must agree to 1e-5; geonorm_jax runs
in float32, the reference in float64, so the tolerance bounds geonorm_jax's own error.
A norm moved, dropped or doubled changes the logits, and a norm that exists on one side only
is a missing parameter.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from geonorm_jax.nn import losses, model as model_lib, paths, placements
from geonorm_jax.training import config as config_lib

torch = pytest.importorskip("torch")
import torch_reference  # noqa: E402  (pytest puts tests/ on sys.path: it has no __init__.py)

TOLERANCE = 1e-5
BATCH, LENGTH, VOCAB = 2, 8, 64
_SMALL = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, vocab_size=VOCAB, max_seq_len=16)
_BACKBONES = {"gpt2": dict(backbone="gpt2", tie_embeddings=True),
              "llama": dict(backbone="llama", num_kv_heads=2, tie_embeddings=False)}


def _case(backbone, placement, **overrides):
  """One model: the config overrides, read by both sides."""
  case_id = "-".join([placement, backbone] + [f"{k}={v}" for k, v in overrides.items()])
  return pytest.param({**_SMALL, **_BACKBONES[backbone], "placement": placement, **overrides},
                      id=case_id)


CASES = [
    *[_case(b, "pre") for b in _BACKBONES],
    *[_case(b, "pre", qk_norm=True) for b in _BACKBONES],
    *[_case(b, "post") for b in _BACKBONES],
    _case("gpt2", "post", tie_embeddings=False),
    *[_case(b, "peri", dt=0.1) for b in _BACKBONES],
    _case("gpt2", "peri", dt=0.1, embed_norm=True),
    *[_case(b, "reordered") for b in _BACKBONES],
    # OLMo 2's own setting: RMSNorm at eps 1e-6, QK-norm over the whole projected q and k.
    _case("llama", "reordered", qk_norm=True, qk_norm_scope="full", norm_eps=1e-6, dt=0.5),
    *[_case(b, "deepnorm") for b in _BACKBONES],
    *[_case(b, "simplenorm") for b in _BACKBONES],
    *[_case(b, "lns") for b in _BACKBONES],
    *[_case(b, "mixln", mixln_fraction=0.5) for b in _BACKBONES],
    _case("llama", "mixln", num_layers=4),  # floor(0.25 * 4) = 1 Post-LN block, then 3 Pre-LN
    *[_case(b, "ngpt") for b in _BACKBONES],
    *[_case(b, "dyt") for b in _BACKBONES],
    *[_case(b, "scaled_pre") for b in _BACKBONES],
    *[_case(b, "geonorm") for b in _BACKBONES],  # harmonic, k counts blocks
    *[_case("gpt2" if s in ("constant", "sqrt") else "llama", "geonorm", geo_schedule=s,
            geo_counter=c, geo_alpha=2.0, num_layers=3)
      for s in ("constant", "harmonic", "sqrt", "linear", "linear_paper")
      for c in ("blocks", "sublayers") if (s, c) != ("constant", "sublayers")],  # same model
    _case("gpt2", "geonorm", geo_alpha=4.0, geo_theta_max=0.9),
    _case("llama", "geonorm", geo_sublayer_input="raw", geo_radius="embedding"),
]


def _config_string(overrides):
  text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
  return "tiny," + ",".join(f"{k}={text(v)}" for k, v in overrides.items())


def _perturbed(state, seed):
  """Every parameter plus noise: matrices by 0.05, vectors and scalars by 0.3."""
  rng = np.random.default_rng(seed)
  def nudge(x):
    scale = 0.05 if x.ndim >= 2 else 0.3
    return x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)
  return jax.tree.map(nudge, state)


def _ours(overrides, tokens_BxL1):
  """Our float32 logits and gradients (by dotted name), with the weights we used."""
  model = model_lib.build(config_lib.get_config(_config_string(overrides)).model)
  graphdef, state = nnx.split(model)
  state = _perturbed(state, seed=0)
  tokens_BxL1 = jnp.asarray(tokens_BxL1, jnp.int32)

  def loss(state):
    logits_BxLxV = nnx.merge(graphdef, state)(tokens_BxL1[:, :-1])
    return losses.cross_entropy(logits_BxLxV, tokens_BxL1[:, 1:])[0], logits_BxLxV

  # Eager on purpose: op-by-op dispatch reuses its per-primitive compilations across cases,
  # where a jit of each case's whole graph costs seconds of XLA compilation per case.
  (_, logits_BxLxV), grads = jax.value_and_grad(loss, has_aux=True)(state)
  named = lambda tree: dict(zip(paths.leaf_paths(tree), map(np.asarray, jax.tree.leaves(tree))))
  return named(state), np.asarray(logits_BxLxV), named(grads)


def _reference(hyper, weights, tokens_BxL1):
  """The reference's float64 logits and gradients, and the model (for GeoNorm's angles)."""
  reference = torch_reference.ReferenceTransformer(hyper).double()
  # strict: a parameter missing on either side, or of another shape, raises here.
  reference.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in weights.items()},
                            strict=True)
  tokens = torch.from_numpy(tokens_BxL1)
  logits_BxLxV = reference(tokens[:, :-1])
  loss = torch.nn.functional.cross_entropy(logits_BxLxV.reshape(-1, VOCAB),
                                           tokens[:, 1:].reshape(-1))
  loss.backward()
  grads = {}
  for name, parameter in reference.named_parameters():
    assert parameter.grad is not None, f"{name} does not reach the loss in the reference"
    grads[name] = parameter.grad.numpy()
  return logits_BxLxV.detach().numpy(), grads, reference


def _compare(overrides):
  """(max |logit diff|, worst gradient's name, its max |diff|, reference logits, reference
  gradients, reference model) of geonorm_jax against the reference on one model."""
  tokens_BxL1 = np.random.default_rng(0).integers(0, VOCAB, (BATCH, LENGTH + 1))
  weights, logits, grads = _ours(overrides, tokens_BxL1)
  hyper = torch_reference.Hyper(**overrides)
  ref_logits, ref_grads, reference = _reference(hyper, weights, tokens_BxL1)
  assert logits.dtype == np.float32 and logits.shape == ref_logits.shape
  assert sorted(grads) == sorted(ref_grads)
  logit_error = float(np.max(np.abs(logits - ref_logits)))
  grad_errors = {k: float(np.max(np.abs(grads[k] - ref_grads[k]))) for k in grads}
  worst = max(grad_errors, key=grad_errors.get)
  print(f"max |logit diff| {logit_error:.2e}, max |grad diff| {grad_errors[worst]:.2e} ({worst})")
  return logit_error, worst, grad_errors[worst], ref_logits, ref_grads, reference


@pytest.mark.parametrize("overrides", CASES)
def test_logits_and_gradients_match_the_torch_reference(overrides):
  logit_error, worst, grad_error, ref_logits, ref_grads, reference = _compare(overrides)
  assert logit_error < TOLERANCE, logit_error
  assert grad_error < TOLERANCE, (worst, grad_error)
  # The comparison means something only if the logits and gradients are not trivially small.
  assert np.std(ref_logits) > 0.05
  assert max(float(np.max(np.abs(g))) for g in ref_grads.values()) > 1e-2
  if overrides.get("geo_theta_max"):
    # The clamp must bite on some tokens and not on others, or this case tests neither branch.
    thetas = torch.cat([t.flatten() for t in reference.geodesic_angles()])
    theta_max = overrides["geo_theta_max"]
    assert (thetas > theta_max).any() and (thetas < theta_max).any()


# Wrong wirings of the reordered norm with the same parameters (so the strict load passes and
# only the numbers can tell): the reference must reject each one.
_WRONG_REORDERED = {
    "output_norm_dropped": lambda x, f, norms, ctx: x + ctx.dt * f(x),
    "norm_moved_to_the_input": lambda x, f, norms, ctx: x + ctx.dt * f(norms.output(x)),
    "norm_moved_onto_the_sum": lambda x, f, norms, ctx: norms.output(x + ctx.dt * f(x)),
}


@pytest.mark.parametrize("wrong", sorted(_WRONG_REORDERED))
@pytest.mark.parametrize("backbone", sorted(_BACKBONES))
def test_a_wrong_reordered_norm_fails_the_reference(backbone, wrong, monkeypatch):
  """Breaking `reordered` on purpose: the same comparison as above must fail by far."""
  broken = dataclasses.replace(placements.PLACEMENTS["reordered"],
                               update=_WRONG_REORDERED[wrong])
  monkeypatch.setitem(placements.PLACEMENTS, "reordered", broken)
  overrides = {**_SMALL, **_BACKBONES[backbone], "placement": "reordered"}
  logit_error, worst, grad_error, *_ = _compare(overrides)
  assert logit_error > 1000 * TOLERANCE, logit_error
  assert grad_error > 1000 * TOLERANCE, (worst, grad_error)
