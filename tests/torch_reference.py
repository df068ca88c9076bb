"""A compact PyTorch decoder written from the placements' equations, for the wiring test only.

It shares no code with geonorm_jax: every norm, the attention, RoPE, the MLPs and each
placement's residual update are written here again from the papers' definitions (README's
placements table and the nGPT / DyT / SimpleGPT / DeepNet / GeoNorm papers and code). Its
parameters carry the same dotted names as geonorm_jax's (`blocks.0.attn.q.kernel`), so a test
can load geonorm_jax's weights into it with `load_state_dict(strict=True)`: a parameter that one
side has and the other lacks, or of another shape, is an error, not a silent default.

Defaults that geonorm_jax resolves from `auto` (norm kind, norm bias, tied head) are resolved
here again from the backbone, so a wrong resolution on either side shows up as a missing key.
"""
import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Placements whose stream ends in a norm before the head.
_FINAL_NORM = ("pre", "peri", "reordered", "geonorm", "simplenorm", "lns", "mixln", "dyt",
               "scaled_pre")


@dataclasses.dataclass(frozen=True)
class Hyper:
  """The model's hyperparameters; None means 'the backbone's default'."""
  backbone: str = "gpt2"  # gpt2 | llama
  placement: str = "pre"
  num_layers: int = 2
  d_model: int = 32
  num_heads: int = 4
  num_kv_heads: int = 0  # 0 -> num_heads
  d_ff: int = 64
  vocab_size: int = 64
  max_seq_len: int = 16
  norm_kind: Optional[str] = None  # layernorm (gpt2) | rmsnorm (llama)
  norm_bias: Optional[bool] = None  # true iff layernorm on gpt2
  tie_embeddings: Optional[bool] = None  # gpt2 tied, llama untied
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  qk_norm: bool = False
  qk_norm_scope: str = "head"  # head: RMSNorm per head | full: over the whole projected q, k
  dt: float = 1.0
  embed_norm: bool = False
  geo_alpha: float = 1.0
  geo_schedule: str = "harmonic"
  geo_counter: str = "blocks"
  geo_theta_max: float = 0.0  # 0: no clamp
  geo_sublayer_input: str = "norm"  # norm: F reads N(x) | raw: F reads x
  geo_radius: str = "sqrt_d"  # sqrt_d | embedding
  mixln_fraction: float = 0.25
  ngpt_alpha_init: float = 0.05

  @property
  def gpt2(self):
    return self.backbone == "gpt2"

  @property
  def kv_heads(self):
    return self.num_kv_heads or self.num_heads

  @property
  def head_dim(self):
    return self.d_model // self.num_heads

  @property
  def kind(self):
    return self.norm_kind or ("layernorm" if self.gpt2 else "rmsnorm")

  @property
  def bias(self):
    if self.norm_bias is not None:
      return self.norm_bias
    return self.gpt2 and self.kind == "layernorm"

  @property
  def tied(self):
    return self.gpt2 if self.tie_embeddings is None else self.tie_embeddings


def unit(x):
  """x / |x| along the features (nGPT's justnorm)."""
  return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


class Norm(nn.Module):
  """LayerNorm (biased variance), RMSNorm or DyT `gain * tanh(alpha x) + bias`, last axis."""

  def __init__(self, width, kind, eps, bias):
    super().__init__()
    self.kind, self.eps = kind, eps
    self.gain = nn.Parameter(torch.ones(width))
    self.bias = nn.Parameter(torch.zeros(width)) if bias else None
    self.alpha = nn.Parameter(torch.tensor(0.5)) if kind == "dyt" else None

  def forward(self, x):
    if self.kind == "layernorm":
      centered = x - x.mean(-1, keepdim=True)
      y = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
    elif self.kind == "rmsnorm":
      y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    else:
      y = torch.tanh(self.alpha * x)
    y = y * self.gain
    return y if self.bias is None else y + self.bias


class Linear(nn.Module):
  """y = x W + b with W stored (in, out), as geonorm_jax stores it."""

  def __init__(self, d_in, d_out, bias):
    super().__init__()
    self.kernel = nn.Parameter(torch.zeros(d_in, d_out))
    self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

  def forward(self, x):
    y = x @ self.kernel
    return y if self.bias is None else y + self.bias


class Scale(nn.Module):
  """nGPT's stored-small learnable scale: the value used is `scale * init / stored_init`."""

  def __init__(self, width, init, stored_init):
    super().__init__()
    self.ratio = init / stored_init
    self.scale = nn.Parameter(torch.full((width,), stored_init))

  def forward(self):
    return self.scale * self.ratio


def _maybe(flag, make):
  return make() if flag else None


def rotate_half_rope(x_BxLxHxK, theta):
  """RoPE in the rotate-half layout: pairs (i, i + K/2) turn by position * theta^(-2i/K)."""
  length, hd = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
  freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
  angle_LxK = torch.arange(length, dtype=torch.float64)[:, None] * torch.cat([freqs, freqs])[None]
  cos, sin = (f(angle_LxK).to(x_BxLxHxK.dtype)[None, :, None, :] for f in (torch.cos, torch.sin))
  first, second = x_BxLxHxK[..., : hd // 2], x_BxLxHxK[..., hd // 2:]
  return x_BxLxHxK * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):

  def __init__(self, hp: Hyper):
    super().__init__()
    self.hp = hp
    d, q_width, kv_width = hp.d_model, hp.d_model, hp.kv_heads * hp.head_dim
    self.q, self.k = Linear(d, q_width, hp.gpt2), Linear(d, kv_width, hp.gpt2)
    self.v, self.o = Linear(d, kv_width, hp.gpt2), Linear(q_width, d, hp.gpt2)
    simple = hp.placement == "simplenorm"
    inner = lambda width: Norm(width, hp.kind, hp.norm_eps, hp.bias)
    # SimpleNorm: one norm over each projection's full width (not per head).
    self.q_out_norm = _maybe(simple, lambda: inner(q_width))
    self.k_out_norm = _maybe(simple, lambda: inner(kv_width))
    self.v_out_norm = _maybe(simple, lambda: inner(kv_width))
    self.o_out_norm = _maybe(simple, lambda: inner(d))
    head_scope = hp.qk_norm and hp.qk_norm_scope == "head"
    full_scope = hp.qk_norm and hp.qk_norm_scope == "full"
    head_norm = lambda: Norm(hp.head_dim, "rmsnorm", hp.norm_eps, bias=False)
    self.q_head_norm = _maybe(head_scope, head_norm)
    self.k_head_norm = _maybe(head_scope, head_norm)
    # Full scope (OLMo-core's use_head_qk_norm=False): one RMSNorm over q's whole width and one
    # over k's, before the split into heads.
    self.q_norm = _maybe(full_scope, lambda: Norm(q_width, "rmsnorm", hp.norm_eps, bias=False))
    self.k_norm = _maybe(full_scope, lambda: Norm(kv_width, "rmsnorm", hp.norm_eps, bias=False))
    ngpt = hp.placement == "ngpt"
    self.s_q = _maybe(ngpt, lambda: Scale(q_width, 1.0, d ** -0.5))
    self.s_k = _maybe(ngpt, lambda: Scale(kv_width, 1.0, d ** -0.5))

  def forward(self, x_BxLxD):
    hp = self.hp
    batch, length, _ = x_BxLxD.shape
    heads, kv_heads, hd = hp.num_heads, hp.kv_heads, hp.head_dim
    project = lambda linear, norm: linear(x_BxLxD) if norm is None else norm(linear(x_BxLxD))
    q_BxLxHK, k_BxLxGK = project(self.q, self.q_out_norm), project(self.k, self.k_out_norm)
    if self.q_norm is not None:
      q_BxLxHK, k_BxLxGK = self.q_norm(q_BxLxHK), self.k_norm(k_BxLxGK)
    q_BxLxHxK = q_BxLxHK.reshape(batch, length, heads, hd)
    k_BxLxGxK = k_BxLxGK.reshape(batch, length, kv_heads, hd)
    v_BxLxGxK = project(self.v, self.v_out_norm).reshape(batch, length, kv_heads, hd)
    if self.q_head_norm is not None:
      q_BxLxHxK, k_BxLxGxK = self.q_head_norm(q_BxLxHxK), self.k_head_norm(k_BxLxGxK)
    if not hp.gpt2:
      q_BxLxHxK = rotate_half_rope(q_BxLxHxK, hp.rope_theta)
      k_BxLxGxK = rotate_half_rope(k_BxLxGxK, hp.rope_theta)
    scale = hd ** -0.5
    if self.s_q is not None:
      # nGPT (NVIDIA/ngpt model.py): the rotated q, k go on the unit sphere per head and are
      # scaled by s_qk; the softmax scale becomes sqrt(d_head).
      q_BxLxHxK = unit(q_BxLxHxK) * self.s_q().reshape(heads, hd)
      k_BxLxGxK = unit(k_BxLxGxK) * self.s_k().reshape(kv_heads, hd)
      scale = hd ** 0.5
    # Grouped-query attention: query head h reads KV head h // (H / G).
    k_BxLxHxK = k_BxLxGxK.repeat_interleave(heads // kv_heads, dim=2)
    v_BxLxHxK = v_BxLxGxK.repeat_interleave(heads // kv_heads, dim=2)
    scores_BxHxLxM = torch.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK) * scale
    future_LxM = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs_BxHxLxM = scores_BxHxLxM.masked_fill(future_LxM, float("-inf")).softmax(-1)
    out_BxLxHxK = torch.einsum("bhlm,bmhk->blhk", probs_BxHxLxM, v_BxLxHxK)
    out_BxLxD = self.o(out_BxLxHxK.reshape(batch, length, heads * hd))
    return out_BxLxD if self.o_out_norm is None else self.o_out_norm(out_BxLxD)


class MLP(nn.Module):
  """gpt2: gelu_tanh(x W_up) W_down;  llama: (silu(x W_gate) * x W_up) W_down."""

  def __init__(self, hp: Hyper):
    super().__init__()
    self.hp = hp
    d, f = hp.d_model, hp.d_ff
    self.up = Linear(d, f, hp.gpt2)
    self.gate = _maybe(not hp.gpt2, lambda: Linear(d, f, hp.gpt2))
    self.down = Linear(f, d, hp.gpt2)
    simple = hp.placement == "simplenorm"
    inner = lambda width: Norm(width, hp.kind, hp.norm_eps, hp.bias)
    self.up_out_norm = _maybe(simple, lambda: inner(f))
    self.gate_out_norm = _maybe(simple and not hp.gpt2, lambda: inner(f))
    self.down_out_norm = _maybe(simple, lambda: inner(d))
    ngpt = hp.placement == "ngpt"
    self.s_up = _maybe(ngpt, lambda: Scale(f, 1.0, 1.0))
    self.s_gate = _maybe(ngpt and not hp.gpt2, lambda: Scale(f, 1.0, 1.0))

  def forward(self, x_BxLxD):
    hp = self.hp
    # nGPT paper: u <- u s_u, v <- v s_v sqrt(d): sqrt(d) on the activation's input only.
    ngpt_input_scale = hp.d_model ** 0.5 if hp.placement == "ngpt" else 1.0
    up_BxLxF = self.up(x_BxLxD)
    if self.up_out_norm is not None:
      up_BxLxF = self.up_out_norm(up_BxLxF)
    if self.s_up is not None:
      up_BxLxF = up_BxLxF * self.s_up()
    if hp.gpt2:
      hidden_BxLxF = F.gelu(up_BxLxF * ngpt_input_scale, approximate="tanh")
    else:
      gate_BxLxF = self.gate(x_BxLxD)
      if self.gate_out_norm is not None:
        gate_BxLxF = self.gate_out_norm(gate_BxLxF)
      if self.s_gate is not None:
        gate_BxLxF = gate_BxLxF * self.s_gate() * ngpt_input_scale
      hidden_BxLxF = F.silu(gate_BxLxF) * up_BxLxF
    out_BxLxD = self.down(hidden_BxLxF)
    return out_BxLxD if self.down_out_norm is None else self.down_out_norm(out_BxLxD)


def geonorm_step_size(hp: Hyper, k, total):
  """alpha_k of the k-th (1-based) geodesic update out of `total`."""
  a = hp.geo_alpha
  return {"constant": a, "harmonic": a / k, "sqrt": a / math.sqrt(k),
          "linear": a * (total - k + 1) / total,  # the last update still moves
          "linear_paper": a * (total - k) / total}[hp.geo_schedule]


class Block(nn.Module):

  def __init__(self, hp: Hyper, layer):
    super().__init__()
    self.hp, self.layer = hp, layer  # layer is 1-based
    self.attn, self.mlp = Attention(hp), MLP(hp)
    p = hp.placement
    post_here = p == "mixln" and layer <= math.floor(hp.mixln_fraction * hp.num_layers)
    has_in = (p in ("pre", "peri", "lns", "dyt", "scaled_pre") or (p == "mixln" and not post_here)
              or (p == "geonorm" and hp.geo_sublayer_input == "norm"))
    has_out = p in ("post", "peri", "reordered", "deepnorm") or post_here
    self.mode = "post" if post_here else ("pre" if p == "mixln" else p)
    kind = "dyt" if p == "dyt" else hp.kind
    stream_norm = lambda: Norm(hp.d_model, kind, hp.norm_eps, hp.bias)
    self.attn_in_norm, self.mlp_in_norm = _maybe(has_in, stream_norm), _maybe(has_in, stream_norm)
    self.attn_out_norm, self.mlp_out_norm = (_maybe(has_out, stream_norm),
                                             _maybe(has_out, stream_norm))
    ngpt_alpha = lambda: Scale(hp.d_model, hp.ngpt_alpha_init, hp.d_model ** -0.5)
    self.attn_alpha = _maybe(p == "ngpt", ngpt_alpha)
    self.mlp_alpha = _maybe(p == "ngpt", ngpt_alpha)
    # scaled_pre: a learnable scalar on each sublayer's output.
    self.attn_scale = _maybe(p == "scaled_pre", lambda: nn.Parameter(torch.tensor(1.0)))
    self.mlp_scale = _maybe(p == "scaled_pre", lambda: nn.Parameter(torch.tensor(1.0)))
    self.geodesic_angles = []  # GeoNorm's theta before any clamp, for the test to inspect

  def _update(self, x, sublayer, norm_in, norm_out, alpha, scale, sublayer_index):
    hp, mode, dt = self.hp, self.mode, self.hp.dt
    if mode in ("pre", "dyt"):
      return x + dt * sublayer(norm_in(x))
    if mode == "scaled_pre":
      return x + dt * scale * sublayer(norm_in(x))
    if mode == "post":
      return norm_out(x + dt * sublayer(x))
    if mode == "peri":
      return x + dt * norm_out(sublayer(norm_in(x)))
    if mode == "reordered":  # OLMo 2: the norm on F's output only
      return x + dt * norm_out(sublayer(x))
    if mode == "deepnorm":
      return norm_out((2 * hp.num_layers) ** 0.25 * x + dt * sublayer(x))
    if mode == "lns":
      return x + dt * sublayer(norm_in(x) / math.sqrt(self.layer))
    if mode == "simplenorm":
      return x + dt * sublayer(x)
    if mode == "ngpt":
      return unit(x + alpha().abs() * (unit(sublayer(x)) - x))
    if mode == "geonorm":
      return self._geodesic(x, sublayer(x if norm_in is None else norm_in(x)), sublayer_index)
    raise ValueError(mode)

  def _geodesic(self, x, g, sublayer_index):
    """x' = cos(theta') x + alpha sin(theta')/theta v, theta' = min(theta, theta_max).

    v = g - (<x,g>/<x,x>) x is g's part tangent to the sphere at x; theta = alpha |v| / |x|.
    """
    hp = self.hp
    if hp.geo_counter == "blocks":
      k, total = self.layer, hp.num_layers
    else:
      k, total = 2 * (self.layer - 1) + sublayer_index, 2 * hp.num_layers
    alpha = geonorm_step_size(hp, k, total)
    dot = lambda a, b: (a * b).sum(-1, keepdim=True)
    v = g - dot(x, g) / dot(x, x) * x
    if alpha == 0.0:
      return x + 0.0 * v  # theta = 0 and sinc(0) = 1: x' = x, and F's parameters get zero gradient
    theta = alpha * torch.sqrt(dot(v, v) / dot(x, x))
    self.geodesic_angles.append(theta.detach())
    turned = theta if hp.geo_theta_max <= 0 else theta.clamp(max=hp.geo_theta_max)
    return torch.cos(turned) * x + alpha * torch.sin(turned) / theta * v

  def forward(self, x_BxLxD):
    x_BxLxD = self._update(x_BxLxD, self.attn, self.attn_in_norm, self.attn_out_norm,
                           self.attn_alpha, self.attn_scale, 1)
    return self._update(x_BxLxD, self.mlp, self.mlp_in_norm, self.mlp_out_norm, self.mlp_alpha,
                        self.mlp_scale, 2)


class ReferenceTransformer(nn.Module):
  """Token ids (B, L) -> logits (B, L, V); parameter names as in geonorm_jax."""

  def __init__(self, hp: Hyper):
    super().__init__()
    self.hp = hp
    d, p = hp.d_model, hp.placement
    self.embed = nn.Parameter(torch.zeros(hp.vocab_size, d))
    self.positions = nn.Parameter(torch.zeros(hp.max_seq_len, d)) if hp.gpt2 else None
    # DyT's language-model recipe: a learnable scalar on the embedding output, init sqrt(d).
    self.embed_scale = nn.Parameter(torch.tensor(d ** 0.5)) if p == "dyt" else None
    final_kind = "dyt" if p == "dyt" else hp.kind
    self.embed_norm = _maybe(hp.embed_norm, lambda: Norm(d, final_kind, hp.norm_eps, hp.bias))
    self.blocks = nn.ModuleList([Block(hp, layer) for layer in range(1, hp.num_layers + 1)])
    self.final_norm = _maybe(p in _FINAL_NORM, lambda: Norm(d, final_kind, hp.norm_eps, hp.bias))
    self.head = None if hp.tied else nn.Parameter(torch.zeros(d, hp.vocab_size))
    self.s_z = _maybe(p == "ngpt", lambda: Scale(hp.vocab_size, 1.0, d ** -0.5))

  def forward(self, tokens_BxL):
    hp = self.hp
    x_BxLxD = self.embed[tokens_BxL]
    if self.positions is not None:
      x_BxLxD = x_BxLxD + self.positions[: tokens_BxL.shape[1]]
    if self.embed_scale is not None:
      x_BxLxD = x_BxLxD * self.embed_scale
    if self.embed_norm is not None:
      x_BxLxD = self.embed_norm(x_BxLxD)
    if hp.placement == "geonorm" and hp.geo_radius == "sqrt_d":
      x_BxLxD = unit(x_BxLxD) * hp.d_model ** 0.5  # the sphere of radius sqrt(d)
    if hp.placement == "ngpt":
      x_BxLxD = unit(x_BxLxD)  # the stream entering block 1 is on the unit sphere
    for block in self.blocks:
      x_BxLxD = block(x_BxLxD)
    if self.final_norm is not None:
      x_BxLxD = self.final_norm(x_BxLxD)
    head_DxV = self.embed.T if self.head is None else self.head
    logits_BxLxV = x_BxLxD @ head_DxV
    return logits_BxLxV if self.s_z is None else logits_BxLxV * self.s_z()

  def geodesic_angles(self):
    return [theta for block in self.blocks for theta in block.geodesic_angles]
