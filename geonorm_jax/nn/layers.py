"""The NNX building blocks: Linear, Norm (RMSNorm, LayerNorm, DyT), RoPE and nGPT's scales;
Attention, MLP and the blocks are in model.py.

Every parameter carries `logical_axes` metadata (embed, heads, kv, head_dim, mlp, vocab,
length); sharding.py maps those names to mesh axes, so the model never names a device axis.
Parameters are float32; each layer casts them to the compute dtype at use.
Softmax, norm statistics and logits are float32.

`perturb` is a dict {tap name: array} added at named activations (a zero perturbation there
gives the Hessian w.r.t. that activation); taps are `<linear name>.in` and `<linear name>.out`,
a block's linear names relative to the block (`attn.q`): model.py adds the `blocks.<i>.` prefix.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from geonorm_jax.nn import norms


def param(rngs, shape, std, logical_axes):
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32),
                   logical_axes=logical_axes)


def constant(shape, value, logical_axes):
  return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=logical_axes)


def tap(perturb, name, x):
  if perturb and name in perturb:
    return x + perturb[name].astype(x.dtype)
  return x


class Linear(nnx.Module):
  """y = x W (+ b); W is (in, out) with logical axes, `name` is its tap and path label."""

  def __init__(self, d_in, d_out, *, name, axes, std, bias, dtype, rngs):
    self.name = name
    self.dtype = dtype
    self.kernel = param(rngs, (d_in, d_out), std, axes)
    self.bias = constant((d_out,), 0.0, axes[1:]) if bias else None

  def __call__(self, x, perturb=None):
    x = tap(perturb, self.name + ".in", x.astype(self.dtype))
    # One 2-D matmul over all tokens: with the batch axes kept, XLA's CPU backend lays out
    # the gradient's x^T dy as transposes plus a slow dot (the whole step was 1.3x slower).
    x_NxI = x.reshape(-1, x.shape[-1])
    y = (x_NxI @ self.kernel[...].astype(self.dtype)).reshape(*x.shape[:-1], -1)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return tap(perturb, self.name + ".out", y)


class Norm(nnx.Module):
  """RMSNorm, LayerNorm or DyT over the last axis, with optional learnable gain and bias."""

  def __init__(self, width, *, kind, axis_name, eps=1e-5, gain=True, bias=False,
               dyt_alpha=0.5):
    self.kind = kind
    self.eps = eps
    self.gain = constant((width,), 1.0, (axis_name,)) if gain else None
    self.bias = constant((width,), 0.0, (axis_name,)) if bias else None
    self.alpha = constant((), dyt_alpha, ()) if kind == "dyt" else None

  def __call__(self, x):
    gain = None if self.gain is None else self.gain[...]
    bias = None if self.bias is None else self.bias[...]
    if self.kind == "rmsnorm":
      y = norms.rms_norm(x, gain, self.eps)
      return y if bias is None else y + bias.astype(y.dtype)
    if self.kind == "layernorm":
      return norms.layer_norm(x, gain, bias, self.eps)
    if self.kind == "dyt":
      return norms.dyt(x, self.alpha[...], gain, bias)
    raise ValueError(f"unknown norm kind {self.kind!r}")


def rope_cos_sin(seq_len, head_dim, theta, start=0):
  """Rotary tables in the rotate-half layout of Hugging Face LLaMA: (L, head_dim) each, for
  positions start..start+L-1 (`start` may be traced: a decoding step's position)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  positions_L = jnp.arange(seq_len, dtype=jnp.float32) + jnp.asarray(start, jnp.float32)
  angles_LxH = positions_L[:, None] * inv_freq[None, :]
  angles_LxD = jnp.concatenate([angles_LxH, angles_LxH], axis=-1)
  return jnp.cos(angles_LxD), jnp.sin(angles_LxD)


def apply_rope(x_BxLxHxD, cos_LxD, sin_LxD):
  x = x_BxLxHxD.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_LxD[None, :, None, :] + rotated * sin_LxD[None, :, None, :]
  return out.astype(x_BxLxHxD.dtype)


class NgptScale(nnx.Module):
  """nGPT's learnable scale with the 'scale trick': stored s0, used s0 * init / s0_init.

  Storing a small s0_init (1/sqrt(d)) and rescaling lets Adam move the effective value at
  a rate matched to the other parameters, as in NVIDIA/ngpt.
  """

  def __init__(self, width, init, stored_init, axis_name):
    self.ratio = init / stored_init
    self.scale = constant((width,), stored_init, (axis_name,))

  def __call__(self):
    return self.scale[...] * self.ratio
