"""The decoder: embeddings -> blocks (attention, MLP; residual placement from the registry) -> head.

Two backbones share this one file: `gpt2` (learned positions, LayerNorm with bias, GELU,
tied embeddings) and `llama` (RoPE, RMSNorm, SwiGLU, no biases, untied head, grouped-query
attention). The placement decides which norms exist and how each sublayer updates the
residual stream; see placements.py for the equations.
"""
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from geonorm_jax import norms, placements
from geonorm_jax.layers import (Linear, NgptScale, Norm, apply_rope, constant, param,
                                rope_cos_sin, tap)
from geonorm_jax.sharding import constrain
from geonorm_jax.spec import ModelSpec, resolve

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(spec):
  return _DTYPES[spec.dtype]


def init_std(spec, role, layer=None):
  """The std of one weight's normal init: the placement's rule (init_rules.py)."""
  return placements.get_placement(spec.placement).init_std(spec, role, layer)


# The residual stream: split over the batch only (its width is what FSDP splits in weights).
_STREAM_AXES = ("batch", "length", None)


def attention_impl(spec):
  """spec.attention with `auto` resolved for the backend the program is compiled for."""
  if spec.attention != "auto":
    return spec.attention
  return "blocked" if jax.default_backend() == "cpu" else "dense"


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


def _apply_optional(module, x):
  """A norm the placement may not have: None is the identity."""
  return x if module is None else module(x)


class Attention(nnx.Module):

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = placements.get_placement(spec.placement)
    name = f"blocks.{layer - 1}.attn"
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
    qk_norm = lambda: Norm(hd, kind="rmsnorm", axis_name="head_dim", eps=spec.norm_eps)
    self.q_head_norm = _maybe(spec.qk_norm, qk_norm)
    self.k_head_norm = _maybe(spec.qk_norm, qk_norm)
    # nGPT: q and k live on the unit sphere per head, rescaled by learnable s_q and s_k.
    self.s_q = _maybe(placement.is_ngpt, lambda: NgptScale(q_width, 1.0, d ** -0.5, "heads"))
    self.s_k = _maybe(placement.is_ngpt, lambda: NgptScale(kv_width, 1.0, d ** -0.5, "kv"))

  def __call__(self, x_BxLxD, perturb=None):
    spec = self.spec
    batch, length, _ = x_BxLxD.shape
    hd, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q = _apply_optional(self.q_out_norm, self.q(x_BxLxD, perturb))
    k = _apply_optional(self.k_out_norm, self.k(x_BxLxD, perturb))
    v = _apply_optional(self.v_out_norm, self.v(x_BxLxD, perturb))
    q_BxLxHxK = _apply_optional(self.q_head_norm, q.reshape(batch, length, heads, hd))
    k_BxLxGxK = _apply_optional(self.k_head_norm, k.reshape(batch, length, kv_heads, hd))
    v_BxLxGxK = v.reshape(batch, length, kv_heads, hd)
    q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "heads", "head_dim"))
    k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "length", "kv", "head_dim"))
    v_BxLxGxK = constrain(v_BxLxGxK, ("batch", "length", "kv", "head_dim"))
    scale = 1.0 / math.sqrt(hd)
    if spec.uses_rope:
      cos, sin = rope_cos_sin(length, hd, spec.rope_theta)
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
    out_BxLxHxK = causal_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, scale,
                                   attention_impl(spec))
    out = self.o(out_BxLxHxK.reshape(batch, length, heads * hd), perturb)
    return _apply_optional(self.o_out_norm, out)


# Queries per block of the blocked attention: small enough that a block's scores stay in a
# CPU core's cache, large enough that the matmuls stay efficient (32-64 measured best).
ATTENTION_BLOCK = 64


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
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxGxK.dtype)
  out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v_BxSxGxK)
  return out.reshape(batch, stop - start, heads, hd)


class MLP(nnx.Module):
  """GELU (gpt2) or SwiGLU (llama); SimpleNorm puts a norm after each of its matrices."""

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = placements.get_placement(spec.placement)
    name = f"blocks.{layer - 1}.mlp"
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

  def __call__(self, x_BxLxD, perturb=None):
    up = _apply_optional(self.up_out_norm, self.up(x_BxLxD, perturb))
    if self.s_up is not None:
      up = up * self.s_up().astype(up.dtype)
    if self.gated:
      gate = _apply_optional(self.gate_out_norm, self.gate(x_BxLxD, perturb))
      if self.s_gate is not None:
        # nGPT: the gate sees unit-norm rows, so sqrt(d) restores the SiLU's working range.
        gate = gate * (self.s_gate() * self.ngpt_input_scale).astype(gate.dtype)
      hidden = jax.nn.silu(gate) * up
    else:
      hidden = jax.nn.gelu(up * self.ngpt_input_scale, approximate=True)
    hidden = constrain(hidden, ("batch", "length", "mlp"))
    return _apply_optional(self.down_out_norm, self.down(hidden, perturb))


class Block(nnx.Module):
  """One attention and one MLP sublayer, each applied through the configured placement."""

  def __init__(self, spec: ModelSpec, layer: int, rngs):
    placement = placements.get_placement(spec.placement)
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

  def _context(self, sublayer, sublayer_index):
    spec = self.spec
    placement = placements.get_placement(spec.placement)
    constants = {} if placement.constants is None else placement.constants(
        spec, self.layer, sublayer_index)
    params = {name: _array(getattr(self, f"{sublayer}_{name}"))
              for name in self.update_param_names}
    return placements.ResidualContext(layer=self.layer, num_layers=spec.num_layers, dt=spec.dt,
                                      constants=constants, params=params)

  def __call__(self, x_BxLxD, perturb=None):
    update = placements.get_placement(self.spec.placement).update
    x_BxLxD = constrain(x_BxLxD, _STREAM_AXES)
    x_BxLxD = tap(perturb, f"blocks.{self.layer - 1}.input", x_BxLxD)
    attn_norms = placements.SublayerNorms(self.attn_in_norm, self.attn_out_norm)
    x_BxLxD = update(x_BxLxD, lambda h: self.attn(h, perturb), attn_norms,
                     self._context("attn", 1))
    mlp_norms = placements.SublayerNorms(self.mlp_in_norm, self.mlp_out_norm)
    x_BxLxD = update(x_BxLxD, lambda h: self.mlp(h, perturb), mlp_norms, self._context("mlp", 2))
    return constrain(x_BxLxD, _STREAM_AXES)


def _array(parameter):
  """A placement parameter's value: a module computes it (nGPT's scales), a Param holds it."""
  return parameter() if isinstance(parameter, nnx.Module) else parameter[...]


class Transformer(nnx.Module):
  """Token ids (B, L) -> float32 logits (B, L, V)."""

  def __init__(self, spec: ModelSpec, rngs: nnx.Rngs):
    placement = placements.get_placement(spec.placement)
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
    self.blocks = nnx.List([Block(spec, layer, rngs) for layer in range(1, spec.num_layers + 1)])
    self.final_norm = _maybe(placement.final_norm,
                             lambda: _stream_norm(spec, placement, d, "embed", "final"))
    self.head = _maybe(not spec.tie_embeddings, lambda: param(
        rngs, (d, spec.vocab_size), init_std(spec, "head"), ("embed", "vocab")))
    self.s_z = _maybe(placement.is_ngpt, lambda: NgptScale(spec.vocab_size, 1.0, d ** -0.5,
                                                           "vocab"))

  def embed_tokens(self, tokens_BxL):
    spec = self.spec
    dtype = compute_dtype(spec)
    x_BxLxD = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(dtype)
    if self.positions is not None:
      x_BxLxD = x_BxLxD + self.positions[: tokens_BxL.shape[1]].astype(dtype)
    if self.embed_norm is not None:
      x_BxLxD = self.embed_norm(x_BxLxD)
    output = placements.get_placement(spec.placement).embedding_output
    if output == "sphere" and spec.option("geo_radius") == "sqrt_d":
      # The sphere of radius sqrt(d), exactly: an eps here would shrink small embeddings.
      x_BxLxD = norms.l2_normalize(x_BxLxD) * jnp.asarray(math.sqrt(spec.d_model), x_BxLxD.dtype)
    elif output == "unit":
      x_BxLxD = norms.l2_normalize(x_BxLxD)
    elif output == "scaled":
      x_BxLxD = x_BxLxD * self.embed_scale[...].astype(x_BxLxD.dtype)
    return x_BxLxD

  def logits(self, x_BxLxD):
    if self.final_norm is not None:
      x_BxLxD = self.final_norm(x_BxLxD)
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

  def __call__(self, tokens_BxL, perturb=None, return_streams=False):
    """Logits; with return_streams, also the residual stream entering each block and the last."""
    x_BxLxD = self.embed_tokens(tokens_BxL)
    streams = [x_BxLxD]
    for block in self.blocks:
      if self.spec.remat:
        x_BxLxD = nnx.remat(lambda blk, x, p: blk(x, p))(block, x_BxLxD, perturb)
      else:
        x_BxLxD = block(x_BxLxD, perturb)
      streams.append(x_BxLxD)
    logits_BxLxV = self.logits(x_BxLxD)
    return (logits_BxLxV, streams) if return_streams else logits_BxLxV


def build(model_config_or_spec, seed=0):
  """A Transformer from config.model (validated first) or a ModelSpec."""
  spec = model_config_or_spec
  if not isinstance(spec, ModelSpec):
    spec = resolve(spec)
  model = Transformer(spec, nnx.Rngs(params=seed))
  after_update = placements.get_placement(spec.placement).after_update
  if after_update is not None:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, after_update(state))
  return model


def abstract_params(model_config_or_spec):
  """(graphdef, abstract state) without allocating: the way to count or shard big models."""
  return nnx.split(nnx.eval_shape(lambda: build(model_config_or_spec)))


def count_params(state):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
