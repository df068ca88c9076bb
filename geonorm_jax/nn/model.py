"""The decoder: embeddings -> blocks (attention, MLP; residual placement from the registry) -> head.

Two backbones share this one file: `gpt2` (learned positions, LayerNorm with bias, GELU,
tied embeddings) and `llama` (RoPE, RMSNorm, SwiGLU, no biases, untied head, grouped-query
attention). The placement decides which norms exist and how each sublayer updates the
residual stream; see placements.py for the equations.

The blocks are either a list (`blocks.<i>.…` parameters, a Python loop) or, with
`model.scan_layers`, one Block whose parameters carry a leading `layers` axis, run by a
`lax.scan`; what a block reads that depends on its depth (its index, GeoNorm's alpha_k) is
then a scanned array. Both layouts compute the same function of the same numbers
(convert.stack_layers / unstack_layers move parameters between them).

`prefill` and `decode` are the cached inference path (sample.py): `prefill` runs a window
and returns every layer's keys and values, `decode` runs new tokens at an absolute position
against that cache and writes theirs into it. `inspect` is the forward pass of the per-layer
statistics: the streams, and the attention logits and norm inputs measured where the model
computes them (mechanisms.py).
"""
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from geonorm_jax.nn import mechanisms, norms, placements
from geonorm_jax.nn.layers import (Linear, NgptScale, Norm, apply_rope, constant, param,
                                rope_cos_sin, tap)
from geonorm_jax.nn.sharding import constrain
from geonorm_jax.nn.spec import ModelSpec, resolve

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(spec):
  return _DTYPES[spec.dtype]


def init_std(spec, role, layer=None):
  """The std of one weight's normal init: the placement's rule (init_rules.py)."""
  return spec.placement.init_std(spec, role, layer)


# The residual stream: split over the batch only (its width is what FSDP splits in weights).
_STREAM_AXES = ("batch", "length", None)


def attention_impl(spec, backend=None):
  """spec.attention with `auto` resolved for the backend the program is compiled for.

  auto: blocked on a CPU; cuDNN's fused kernel on a GPU when it applies (16-bit compute,
  head_dim a multiple of 8 up to 128); dense otherwise.
  """
  if spec.attention != "auto":
    return spec.attention
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return "blocked"
  fused_ok = (backend in ("gpu", "cuda") and spec.dtype in ("bfloat16", "float16")
              and spec.head_dim % 8 == 0 and spec.head_dim <= 128)
  return "cudnn" if fused_ok else "dense"


def _stream_norm(spec, placement, width, axis_name, site):
  """A norm on the residual stream; `site` (attn, ffn, final) picks DyT's alpha_0."""
  if placement.stream_norm == "dyt":
    return Norm(width, kind="dyt", axis_name=axis_name, gain=spec.norm_gain, bias=spec.norm_bias,
                dyt_alpha=spec.option(f"dyt_alpha_{site}"))
  return Norm(width, kind=spec.norm_kind, axis_name=axis_name, eps=spec.norm_eps,
              gain=spec.norm_gain, bias=spec.norm_bias)


def _inner_norm(spec, width, axis_name):
  """SimpleNorm's norm after a linear map: same kind as the stream norm, gain initialised to 1."""
  return Norm(width, kind=spec.norm_kind, axis_name=axis_name, eps=spec.norm_eps,
              gain=spec.norm_gain, bias=spec.norm_bias)


def _maybe(flag, build):
  return build() if flag else None


def _apply_optional(module, x, stats=None, site=None):
  """A norm the placement may not have: None is the identity. With a `stats` dict (an
  inspecting pass), the norm's input and gain statistics are added to it under `site`."""
  if module is None:
    return x
  if stats is not None:
    stats.update(mechanisms.norm_site(module, x, site))
  return module(x)


class LayerCache(NamedTuple):
  """One layer's keys and values as attention reads them (after RoPE and any q/k norm), one
  slot per absolute position; under scan_layers each array has a leading layer axis."""
  k_BxCxGxK: Any
  v_BxCxGxK: Any


class Attention(nnx.Module):

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = spec.placement
    name = "attn"  # tap names are relative to the block
    d, hd = spec.d_model, spec.head_dim
    q_width, kv_width = spec.num_heads * hd, spec.num_kv_heads * hd
    dtype = compute_dtype(spec)
    std = functools.partial(init_std, spec, layer=layer)

    def linear(role, d_in, d_out, axes):
      return Linear(d_in, d_out, name=f"{name}.{role}", axes=axes, std=std(role),
                    bias=spec.has_bias, dtype=dtype, rngs=rngs)

    self.spec = spec
    self.q = linear("q", d, q_width, ("embed", "heads"))
    self.k = linear("k", d, kv_width, ("embed", "kv"))
    self.v = linear("v", d, kv_width, ("embed", "kv"))
    self.o = linear("o", q_width, d, ("heads", "embed"))
    simple = placement.norm_after_every_linear
    self.q_out_norm = _maybe(simple, lambda: _inner_norm(spec, q_width, "heads"))
    self.k_out_norm = _maybe(simple, lambda: _inner_norm(spec, kv_width, "kv"))
    self.v_out_norm = _maybe(simple, lambda: _inner_norm(spec, kv_width, "kv"))
    self.o_out_norm = _maybe(simple, lambda: _inner_norm(spec, d, "embed"))
    # qk_norm, scope head: RMSNorm over each head's head_dim (a head_dim gain, always);
    # scope full: over the whole projected q (width d) and k (num_kv_heads*head_dim) before the
    # split into heads, a full-width gain iff norm_gain. Both before RoPE.
    head_scope, full_scope = (spec.qk_norm and spec.qk_norm_scope == s for s in ("head", "full"))
    qk_norm = lambda: Norm(hd, kind="rmsnorm", axis_name="head_dim", eps=spec.norm_eps)
    self.q_head_norm = _maybe(head_scope, qk_norm)
    self.k_head_norm = _maybe(head_scope, qk_norm)
    full_norm = lambda width, axis: Norm(width, kind="rmsnorm", axis_name=axis,
                                         eps=spec.norm_eps, gain=spec.norm_gain)
    self.q_norm = _maybe(full_scope, lambda: full_norm(q_width, "heads"))
    self.k_norm = _maybe(full_scope, lambda: full_norm(kv_width, "kv"))
    # nGPT: q and k live on the unit sphere per head, rescaled by learnable s_q and s_k.
    self.s_q = _maybe(placement.is_ngpt, lambda: NgptScale(q_width, 1.0, d ** -0.5, "heads"))
    self.s_k = _maybe(placement.is_ngpt, lambda: NgptScale(kv_width, 1.0, d ** -0.5, "kv"))

  def __call__(self, x_BxLxD, perturb=None):
    return self.attend(x_BxLxD, perturb)[0]

  def attend(self, x_BxLxD, perturb=None, cache=None, position=None, stats=None):
    """(output, LayerCache of the keys and values attended to).

    Without a cache the L tokens are positions 0..L-1 and attend causally to each other.
    With one (and `position`, maybe traced), they are positions position..position+L-1:
    their keys and values are written into the cache's slots there, and each reads the
    slots up to its own position. `stats` (a dict, no cache): the attention logits' and this
    sublayer's norms' statistics are added to it (mechanisms.py).
    """
    spec = self.spec
    batch, length, _ = x_BxLxD.shape
    hd, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
    norm = lambda name, x: _apply_optional(getattr(self, name), x, stats, f"attn.{name}")
    q = norm("q_norm", norm("q_out_norm", self.q(x_BxLxD, perturb)))
    k = norm("k_norm", norm("k_out_norm", self.k(x_BxLxD, perturb)))
    v = norm("v_out_norm", self.v(x_BxLxD, perturb))
    q_BxLxHxK = norm("q_head_norm", q.reshape(batch, length, heads, hd))
    k_BxLxGxK = norm("k_head_norm", k.reshape(batch, length, kv_heads, hd))
    v_BxLxGxK = v.reshape(batch, length, kv_heads, hd)
    q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "heads", "head_dim"))
    k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "length", "kv", "head_dim"))
    v_BxLxGxK = constrain(v_BxLxGxK, ("batch", "length", "kv", "head_dim"))
    scale = 1.0 / math.sqrt(hd)
    if spec.uses_rope:
      cos, sin = rope_cos_sin(length, hd, spec.rope_theta, 0 if position is None else position)
      q_BxLxHxK = apply_rope(q_BxLxHxK, cos, sin)
      k_BxLxGxK = apply_rope(k_BxLxGxK, cos, sin)
    if self.s_q is not None:
      # nGPT (NVIDIA/ngpt model.py): RoPE first, then unit vectors per head times s_qk; the
      # per-dimension s_qk does not commute with the rotation, so the order matters.
      s_q_HxK = self.s_q().reshape(heads, hd).astype(q.dtype)
      s_k_GxK = self.s_k().reshape(kv_heads, hd).astype(k.dtype)
      q_BxLxHxK = norms.l2_normalize(q_BxLxHxK) * s_q_HxK
      k_BxLxGxK = norms.l2_normalize(k_BxLxGxK) * s_k_GxK
      scale = math.sqrt(hd)  # unit vectors: undo the 1/sqrt(d) that random vectors need
    if cache is None:
      if stats is not None:  # the scores softmax reads, from the same q, k and scale
        stats.update(mechanisms.attention_logits(q_BxLxHxK, k_BxLxGxK, scale))
      out_BxLxHxK = causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, scale,
                                     attention_impl(spec))
      cache = LayerCache(k_BxLxGxK, v_BxLxGxK)
    else:
      write = lambda slots, new: jax.lax.dynamic_update_slice_in_dim(
          slots, new.astype(slots.dtype), position, axis=1)
      cache = LayerCache(write(cache.k_BxCxGxK, k_BxLxGxK), write(cache.v_BxCxGxK, v_BxLxGxK))
      out_BxLxHxK = cached_attention(q_BxLxHxK, cache.k_BxCxGxK, cache.v_BxCxGxK, position,
                                     scale)
    out = self.o(out_BxLxHxK.reshape(batch, length, heads * hd), perturb)
    return norm("o_out_norm", out), cache


# Queries per block of the blocked attention: small enough that a block's scores stay in a
# CPU core's cache, large enough that the matmuls stay efficient (32-64 measured best).
ATTENTION_BLOCK = 64


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def softmax(x, axis=-1):
  """jax.nn.softmax with its derivative written out: y * (dx - sum(y * dx)).

  jax.nn.softmax, while `jax_softmax_custom_jvp` stays off (its default), is differentiated
  through the exp, the sum and the division; the gradient then takes more passes over the
  scores. On a CPU the tiny train step ran 1.09x faster with this one
  (results/bench/train.json, ablation `jax_nn_softmax`).
  """
  unnormalized = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis, keepdims=True)))
  return unnormalized / jnp.sum(unnormalized, axis, keepdims=True)


@softmax.defjvp
def _softmax_jvp(axis, primals, tangents):
  (x,), (dx,) = primals, tangents
  y = softmax(x, axis)
  return y, y * (dx - jnp.sum(y * dx, axis, keepdims=True))


def causal_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale, impl="dense"):
  """Grouped-query causal attention; query head h reads KV head h // (H/G), as in HF LLaMA.

  impl: "dense" computes the full L x L scores and masks the upper triangle; "blocked" splits
  the queries into blocks of ATTENTION_BLOCK that read only the keys up to their last
  position, so most of the masked triangle is never computed (1.7-2x faster forward and
  backward on a CPU; results/bench/train.json); "cudnn" is jax.nn.dot_product_attention's
  fused kernel on NVIDIA GPUs.
  """
  if impl == "cudnn":
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale=scale,
                                        is_causal=True, implementation="cudnn")
  length = q_BxLxHxK.shape[1]
  block = ATTENTION_BLOCK if impl == "blocked" else length
  outs = [_causal_attention_block(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale, start,
                                  min(start + block, length))
          for start in range(0, length, block)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _causal_attention_block(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, scale, start, stop):
  """Outputs of queries start..stop-1, which see keys 0..stop-1 (causal)."""
  batch, _, heads, hd = q_BxLxHxK.shape
  kv_heads = k_BxMxGxK.shape[2]
  q_BxNxGxRxK = q_BxLxHxK[:, start:stop].reshape(batch, stop - start, kv_heads,
                                                 heads // kv_heads, hd)
  k_BxSxGxK, v_BxSxGxK = k_BxMxGxK[:, :stop], v_BxMxGxK[:, :stop]
  scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BxNxGxRxK, k_BxSxGxK,
                      preferred_element_type=jnp.float32) * scale
  visible_NxS = jnp.arange(stop)[None, :] <= jnp.arange(start, stop)[:, None]
  scores = jnp.where(visible_NxS, scores, jnp.finfo(jnp.float32).min)
  probs = softmax(scores, axis=-1).astype(v_BxSxGxK.dtype)
  out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxSxGxK)
  return out.reshape(batch, stop - start, heads, hd)


def cached_attention(q_BxLxHxK, k_BxCxGxK, v_BxCxGxK, position, scale):
  """Grouped-query attention of L queries at positions position..position+L-1 over C cache
  slots: a query reads slot m iff m <= its position (later slots are stale or padding)."""
  batch, length, heads, hd = q_BxLxHxK.shape
  capacity, kv_heads = k_BxCxGxK.shape[1], k_BxCxGxK.shape[2]
  q_BxLxGxRxK = q_BxLxHxK.reshape(batch, length, kv_heads, heads // kv_heads, hd)
  scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxCxGxK,
                      preferred_element_type=jnp.float32) * scale
  visible_LxC = jnp.arange(capacity)[None, :] <= position + jnp.arange(length)[:, None]
  scores = jnp.where(visible_LxC, scores, jnp.finfo(jnp.float32).min)
  probs = softmax(scores, axis=-1).astype(v_BxCxGxK.dtype)
  out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxCxGxK)
  return out.reshape(batch, length, heads, hd)


class MLP(nnx.Module):
  """GELU (gpt2) or SwiGLU (llama); SimpleNorm puts a norm after each of its matrices."""

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = spec.placement
    name = "mlp"
    d, f = spec.d_model, spec.d_ff
    dtype = compute_dtype(spec)
    std = functools.partial(init_std, spec, layer=layer)

    def linear(role, d_in, d_out, axes):
      return Linear(d_in, d_out, name=f"{name}.{role}", axes=axes, std=std(role),
                    bias=spec.has_bias, dtype=dtype, rngs=rngs)

    self.gated = spec.gated_mlp
    self.up = linear("up", d, f, ("embed", "mlp"))
    self.gate = _maybe(self.gated, lambda: linear("gate", d, f, ("embed", "mlp")))
    self.down = linear("down", f, d, ("mlp", "embed"))
    simple = placement.norm_after_every_linear
    self.up_out_norm = _maybe(simple, lambda: _inner_norm(spec, f, "mlp"))
    self.gate_out_norm = _maybe(simple and self.gated, lambda: _inner_norm(spec, f, "mlp"))
    self.down_out_norm = _maybe(simple, lambda: _inner_norm(spec, d, "embed"))
    ngpt = placement.is_ngpt
    self.s_up = _maybe(ngpt, lambda: NgptScale(f, 1.0, 1.0, "mlp"))
    self.s_gate = _maybe(ngpt and self.gated, lambda: NgptScale(f, 1.0, 1.0, "mlp"))
    self.ngpt_input_scale = math.sqrt(d) if ngpt else 1.0

  def __call__(self, x_BxLxD, perturb=None, stats=None):
    """F(x); `stats` (a dict): its norms' statistics are added to it (mechanisms.py)."""
    norm = lambda name, x: _apply_optional(getattr(self, name), x, stats, f"mlp.{name}")
    up = norm("up_out_norm", self.up(x_BxLxD, perturb))
    if self.s_up is not None:
      up = up * self.s_up().astype(up.dtype)
    if self.gated:
      gate = norm("gate_out_norm", self.gate(x_BxLxD, perturb))
      if self.s_gate is not None:
        # nGPT: the gate sees unit-norm rows, so sqrt(d) restores the SiLU's working range.
        gate = gate * (self.s_gate() * self.ngpt_input_scale).astype(gate.dtype)
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(up * self.ngpt_input_scale, approximate=True)
    hidden = constrain(hidden, ("batch", "length", "mlp"))
    return norm("down_out_norm", self.down(hidden, perturb))


class BlockOutput(NamedTuple):
  """What Block.apply returns; what was not asked for is None."""
  x_BxLxD: Any
  cache: LayerCache  # the attention's keys and values
  midstream_BxLxD: Any = None  # the stream between the attention's and the MLP's updates
  stats: Any = None  # {name: float32 scalar}: the block's mechanisms.py statistics


class Block(nnx.Module):
  """One attention and one MLP sublayer, each applied through the configured placement."""

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = spec.placement
    self.spec, self.layer = spec, layer
    self.attn = Attention(spec, layer, rngs)
    self.mlp = MLP(spec, layer, rngs)
    has_in = placement.has_input_norm(layer, spec)
    has_out = placement.has_output_norm(layer, spec)
    d = spec.d_model
    norm = lambda site: _stream_norm(spec, placement, d, "embed", site)
    self.attn_in_norm = _maybe(has_in, lambda: norm("attn"))
    self.attn_out_norm = _maybe(has_out, lambda: norm("attn"))
    self.mlp_in_norm = _maybe(has_in, lambda: norm("ffn"))
    self.mlp_out_norm = _maybe(has_out, lambda: norm("ffn"))
    # The placement's own learnable parameters, one set per sublayer: attn_<name>, mlp_<name>.
    self.update_param_names = ()
    if placement.sublayer_params is not None:
      for sublayer in ("attn", "mlp"):
        named = placement.sublayer_params(spec, layer)
        for name, module in named.items():
          setattr(self, f"{sublayer}_{name}", module)
      self.update_param_names = tuple(named)

  def _context(self, constants, sublayer):
    params = {name: _array(getattr(self, f"{sublayer}_{name}"))
              for name in self.update_param_names}
    return placements.ResidualContext(layer=constants["layer"], num_layers=self.spec.num_layers,
                                      dt=self.spec.dt, constants=constants[sublayer],
                                      params=params)

  def __call__(self, x_BxLxD, perturb=None):
    return self.apply(x_BxLxD, perturb).x_BxLxD

  def apply(self, x_BxLxD, perturb=None, constants=None, cache=None, position=None,
            with_midstream=False, with_stats=False):
    """BlockOutput: x', the attention's LayerCache, with_midstream the stream between the
    attention's and the MLP's residual updates, with_stats this block's statistics
    (mechanisms.py: its attention logits, and every norm it calls, named by its path in the
    block: `attn_in_norm`, `attn.q_head_norm`, `mlp.up_out_norm`, ...).

    `perturb`: this block's taps, named without the `blocks.<i>.` prefix (`input`,
    `attn.q.in`, ...). `constants`: layer_constants of this block (the default; a scanned
    block has no index of its own and is handed its slice). `cache`, `position`: as
    Attention.attend.
    """
    constants = layer_constants(self.spec, self.layer) if constants is None else constants
    update = self.spec.placement.update
    x_BxLxD = constrain(x_BxLxD, _STREAM_AXES)
    x_BxLxD = tap(perturb, "input", x_BxLxD)
    caches = []  # the placement calls F once; its K/V leave the closure through this list
    # Filled while this function is traced and returned from it, so the values leave a remat
    # or a scan body as outputs, never as captured tracers.
    stats = {} if with_stats else None

    def attention(h):
      out, layer_cache = self.attn.attend(h, perturb, cache, position, stats)
      caches.append(layer_cache)
      return out

    def sublayer_norms(sublayer):
      return placements.SublayerNorms(*(
          mechanisms.recorded(getattr(self, name), name, stats)
          for name in (f"{sublayer}_in_norm", f"{sublayer}_out_norm")))

    x_BxLxD = update(x_BxLxD, attention, sublayer_norms("attn"),
                     self._context(constants, "attn"))
    mid_BxLxD = x_BxLxD
    x_BxLxD = update(x_BxLxD, lambda h: self.mlp(h, perturb, stats), sublayer_norms("mlp"),
                     self._context(constants, "mlp"))
    return BlockOutput(constrain(x_BxLxD, _STREAM_AXES), caches[0],
                       mid_BxLxD if with_midstream else None, stats)


def layer_constants(spec, layer):
  """What block `layer` (1-based) reads that depends on its depth: its index and each
  sublayer's placement constants (GeoNorm's alpha_k, DeepNorm's alpha)."""
  placement = spec.placement

  def sublayer(index):
    return {} if placement.constants is None else dict(placement.constants(spec, layer, index))
  return {"layer": layer, "attn": sublayer(1), "mlp": sublayer(2)}


def split_over_depth(trees):
  """[one tree per layer] -> (xs, rebuild): the leaves that differ between layers stacked into
  arrays along the layer axis (a scan's xs), and rebuild(slice of xs) -> one layer's tree.

  Leaves equal in every layer (DeepNorm's alpha, an unset clamp None) stay Python values, so
  what is static in the unrolled model stays static in the scan.
  """
  flat = [jax.tree.flatten(tree) for tree in trees]
  treedef = flat[0][1]
  columns = list(zip(*(leaves for leaves, _ in flat)))
  varies = [any(value != column[0] for value in column) for column in columns]
  xs = [jnp.asarray(column) for column, vary in zip(columns, varies) if vary]

  def rebuild(xs_slice):
    values = iter(xs_slice)
    return jax.tree.unflatten(treedef, [next(values) if vary else column[0]
                                        for column, vary in zip(columns, varies)])
  return xs, rebuild


def _block_taps(perturb, index):
  """Block `index`'s taps from a model-wide perturb dict, without their `blocks.<i>.` prefix."""
  prefix = f"blocks.{index}."
  return {name[len(prefix):]: value for name, value in (perturb or {}).items()
          if name.startswith(prefix)}


def _stacked_taps(perturb, num_layers):
  """Every block's taps stacked along the layer axis; a block without one adds zeros."""
  per_block = [_block_taps(perturb, index) for index in range(num_layers)]
  stacked = {}
  for name in sorted(set().union(*per_block)):
    like = next(taps[name] for taps in per_block if name in taps)
    stacked[name] = jnp.stack([taps.get(name, jnp.zeros_like(like)) for taps in per_block])
  return stacked


def _stack_blocks(blocks):
  """T blocks -> one Block whose parameters carry a leading `layers` axis (block l at l-1)."""
  for block in blocks:
    block.layer = None  # the scan hands each block its depth; it must not be static
  split = [nnx.split(block) for block in blocks]
  graphdef = split[0][0]
  if any(other != graphdef for other, _ in split[1:]):
    raise ValueError(f"model.scan_layers=true: the blocks of model.placement="
                     f"{blocks[0].spec.placement.name} differ in structure; set model.scan_layers=false")

  def stack(*variables):
    axes = variables[0].get_metadata().get("logical_axes") or ()
    return variables[0].replace(jnp.stack([v[...] for v in variables]),
                                logical_axes=("layers",) + tuple(axes))
  stacked = jax.tree.map(stack, *(state for _, state in split),
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, stacked)


def _array(parameter):
  """A placement parameter's value: a module computes it (nGPT's scales), a Param holds it."""
  return parameter() if isinstance(parameter, nnx.Module) else parameter[...]


class Transformer(nnx.Module):
  """Token ids (B, L) -> float32 logits (B, L, V)."""

  def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
    placement = spec.placement
    self.spec = spec
    d = spec.d_model
    self.embed = param(rngs, (spec.vocab_size, d), init_std(spec, "embed"),
                       ("vocab", "embed"))
    self.positions = _maybe(spec.backbone == "gpt2", lambda: param(
        rngs, (spec.max_seq_len, d), init_std(spec, "positions"), ("length", "embed")))
    self.embed_norm = _maybe(spec.embed_norm,
                             lambda: _stream_norm(spec, placement, d, "embed", "attn"))
    self.embed_scale = _maybe(placement.embedding_output == "scaled",
                              lambda: constant((), math.sqrt(d), ()))
    # Built one by one in both layouts, so a seed gives the same numbers either way.
    blocks = [Block(spec, layer, rngs) for layer in range(1, spec.num_layers + 1)]
    self.blocks = _stack_blocks(blocks) if spec.scan_layers else nnx.List(blocks)
    self.final_norm = _maybe(placement.final_norm,
                             lambda: _stream_norm(spec, placement, d, "embed", "final"))
    self.head = _maybe(not spec.tie_embeddings, lambda: param(
        rngs, (d, spec.vocab_size), init_std(spec, "head"), ("embed", "vocab")))
    self.s_z = _maybe(placement.is_ngpt, lambda: NgptScale(spec.vocab_size, 1.0, d ** -0.5,
                                                           "vocab"))

  def embed_tokens(self, tokens_BxL, start=None, stats=None):
    """The stream entering block 1; the tokens sit at positions start.. (None: from 0).
    `stats` (a dict): the embedding norm's statistics are added to it (mechanisms.py)."""
    spec = self.spec
    dtype = compute_dtype(spec)
    x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(dtype)
    if self.positions is not None:
      length = tokens_BxL.shape[1]
      positions_LxD = (self.positions[:length] if start is None else
                       jax.lax.dynamic_slice_in_dim(self.positions[...], start, length))
      x_BxLxD = x_BxLxD + positions_LxD.astype(dtype)
    x_BxLxD = _apply_optional(self.embed_norm, x_BxLxD, stats, "embed_norm")
    output = spec.placement.embedding_output
    if output == "sphere" and spec.option("geo_radius") == "sqrt_d":
      # The sphere of radius sqrt(d), exactly: an eps here would shrink small embeddings.
      x_BxLxD = norms.l2_normalize(x_BxLxD) * jnp.asarray(math.sqrt(spec.d_model), x_BxLxD.dtype)
    elif output == "unit":
      x_BxLxD = norms.l2_normalize(x_BxLxD)
    elif output == "scaled":
      x_BxLxD = x_BxLxD * self.embed_scale[...].astype(x_BxLxD.dtype)
    return x_BxLxD

  def logits(self, x_BxLxD, stats=None):
    """The head's float32 logits of the last block's output; `stats` (a dict): the final
    norm's statistics are added to it (mechanisms.py)."""
    x_BxLxD = _apply_optional(self.final_norm, x_BxLxD, stats, "final_norm")
    head_DxV = self.embed[...].T if self.head is None else self.head[...]
    # Operands in the compute dtype, accumulation and logits in float32 (as MaxText): GPT-2's
    # head + loss took 67 ms in float32 against 59 ms with bf16 operands on an H200
    # (results/bench/accelerator_nvidia_h200.json, probes.head).
    dtype = compute_dtype(self.spec)
    logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD.astype(dtype), head_DxV.astype(dtype),
                              preferred_element_type=jnp.float32)
    if self.s_z is not None:
      logits_BxLxV = logits_BxLxV * self.s_z()
    return constrain(logits_BxLxV, ("batch", "length", "vocab"))

  def hidden(self, tokens_BxL, perturb=None):
    """The last block's output: what logits() turns into logits (final norm, then head)."""
    return self._run_blocks(self.embed_tokens(tokens_BxL), perturb=perturb)[0]

  def __call__(self, tokens_BxL, perturb=None, return_streams=False,
               return_sublayer_streams=False):
    """Logits; with return_streams, also the residual stream entering each block and the last;
    with return_sublayer_streams, (logits, those streams, the stream between block i's
    attention and MLP updates at i), so that each sublayer's update can be measured apart.

    `perturb` {tap name: array} names block taps model-wide: `blocks.<i>.input`,
    `blocks.<i>.attn.q.in`, ... (layers.py).
    """
    x_BxLxD = self.embed_tokens(tokens_BxL)
    out_BxLxD, streams, _, _ = self._run_blocks(
        x_BxLxD, perturb=perturb, keep_streams=return_streams or return_sublayer_streams,
        keep_midstreams=return_sublayer_streams)
    logits_BxLxV = self.logits(out_BxLxD)
    if not (return_streams or return_sublayer_streams):
      return logits_BxLxV
    layers = range(self.spec.num_layers)
    if return_sublayer_streams:
      midstreams, streams = streams
      return (logits_BxLxV, [x_BxLxD] + [streams[i] for i in layers],
              [midstreams[i] for i in layers])
    return logits_BxLxV, [x_BxLxD] + [streams[i] for i in layers]

  def inspect(self, tokens_BxL):
    """(logits, streams, midstreams, stats): model(tokens, return_sublayer_streams=True)'s
    three, and the instability mechanisms (mechanisms.py) as {name: float32 scalar}:
    `attn_logit_max/layer_XX`, `attn_entropy/layer_XX`, `logits/log_z_mean`, `logits/max`,
    and per norm site `norm_input_rms/<site>` (`norm_gain_mean/<site>`,
    `norm_gain_max_abs/<site>` where it has a gain), a block's sites named by their path in
    the block with `/layer_XX` after (`attn_in_norm/layer_00`, `attn.q_head_norm/layer_01`),
    `embed_norm` and `final_norm` as they are. Block XX is the 0-based block index.

    The same numbers as __call__ (same q, k and norms), in both layouts; costs one dense
    L x L score matrix per layer more, so it is for statistics, not for the train step.
    """
    stats = {}
    x_BxLxD = self.embed_tokens(tokens_BxL, stats=stats)
    out_BxLxD, (midstreams, streams), _, block_stats = self._run_blocks(
        x_BxLxD, keep_streams=True, keep_midstreams=True, keep_stats=True)
    logits_BxLxV = self.logits(out_BxLxD, stats)
    stats.update(mechanisms.output_logits(logits_BxLxV))
    layers = range(self.spec.num_layers)
    for index in layers:
      # Unrolled: one dict per block (Mix-LN's blocks have different norms); scanned: one
      # dict of arrays over the layer axis.
      layer_stats = (block_stats[index] if isinstance(block_stats, list) else
                     {name: values[index] for name, values in block_stats.items()})
      for name, value in layer_stats.items():
        stats[f"{name}/layer_{index:02d}"] = value
    return (logits_BxLxV, [x_BxLxD] + [streams[i] for i in layers],
            [midstreams[i] for i in layers], stats)

  def prefill(self, tokens_BxL):
    """(logits, caches) of a window at positions 0..L-1: caches holds every layer's keys and
    values (a list of LayerCache, or one stacked LayerCache under scan_layers), L slots."""
    x_BxLxD = self.embed_tokens(tokens_BxL)
    out_BxLxD, _, caches, _ = self._run_blocks(x_BxLxD, keep_caches=True)
    return self.logits(out_BxLxD), caches

  def decode(self, tokens_BxS, caches, position):
    """(logits, caches) of S tokens at positions position..position+S-1 (may be traced): they
    read the cache slots up to their own position and their keys and values are written in."""
    x_BxSxD = self.embed_tokens(tokens_BxS, start=position)
    out_BxSxD, _, caches, _ = self._run_blocks(x_BxSxD, caches=caches, position=position,
                                               keep_caches=True)
    return self.logits(out_BxSxD), caches

  def block(self, index):
    """Block `index` (0-based) as a module in either layout; under scan_layers a read-only
    slice of the stacked parameters."""
    if not self.spec.scan_layers:
      return self.blocks[index]
    graphdef, stacked = nnx.split(self.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], stacked))

  def _run_blocks(self, x_BxLxD, perturb=None, caches=None, position=None,
                  keep_streams=False, keep_caches=False, keep_midstreams=False,
                  keep_stats=False):
    """(output, streams after each block or None, caches or None, stats or None); with
    keep_midstreams the streams are a pair (the streams between each block's two updates,
    those after it); stats: each block's BlockOutput.stats, a list (unrolled) or one dict of
    arrays along the layer axis (scanned)."""
    if self.spec.scan_layers:
      return self._scan_blocks(x_BxLxD, perturb, caches, position, keep_streams, keep_caches,
                               keep_midstreams, keep_stats)
    streams, midstreams, new_caches, stats = [], [], [], []
    for index, block in enumerate(self.blocks):
      run = lambda blk, x, taps, cache: blk.apply(x, taps, None, cache, position,
                                                  keep_midstreams, keep_stats)
      if self.spec.remat:
        run = nnx.remat(run)
      out = run(block, x_BxLxD, _block_taps(perturb, index),
                None if caches is None else caches[index])
      x_BxLxD = out.x_BxLxD
      streams.append(x_BxLxD)
      midstreams.append(out.midstream_BxLxD)
      new_caches.append(out.cache)
      stats.append(out.stats)
    if keep_midstreams:
      streams = (midstreams, streams)
    return (x_BxLxD, streams, new_caches if keep_caches else None,
            stats if keep_stats else None)

  def _scan_blocks(self, x_BxLxD, perturb, caches, position, keep_streams, keep_caches,
                   keep_midstreams=False, keep_stats=False):
    spec = self.spec
    graphdef, stacked = nnx.split(self.blocks)
    constants_xs, rebuild = split_over_depth(
        [layer_constants(spec, layer) for layer in range(1, spec.num_layers + 1)])

    def body(x, xs):
      params, constants, taps, cache = xs
      block = nnx.merge(graphdef, params)
      out = block.apply(x, taps, rebuild(constants), cache, position, keep_midstreams,
                        keep_stats)
      x = out.x_BxLxD
      stream = (out.midstream_BxLxD, x) if keep_midstreams else x
      return x, (stream if keep_streams else None, out.cache if keep_caches else None,
                 out.stats)

    if spec.remat:
      body = jax.checkpoint(body)
    xs = (stacked, constants_xs, _stacked_taps(perturb, spec.num_layers), caches)
    out_BxLxD, (streams, new_caches, stats) = jax.lax.scan(body, x_BxLxD, xs)
    return out_BxLxD, streams, new_caches, stats


def build(model_config_or_spec, seed=0):
  """A Transformer from config.model (validated first) or a ModelSpec."""
  spec = model_config_or_spec
  if not isinstance(spec, ModelSpec):
    spec = resolve(spec)
  model = Transformer(spec, nnx.Rngs(params=seed))
  after_update = spec.placement.after_update
  if after_update is not None:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, after_update(state))
  return model


def abstract_params(model_config_or_spec):
  """(graphdef, abstract state) without allocating: the way to count or shard big models."""
  return nnx.split(nnx.eval_shape(lambda: build(model_config_or_spec)))


def count_params(state):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
