"""The instability mechanisms of Wortsman et al. 2023 (arXiv 2309.14322), measured where they
happen: attention-logit growth (its remedy QK-norm) and output-logit divergence (z-loss), and
what every norm site sees and scales by.

Pure functions of arrays, each returning {name: float32 scalar}; the model calls them inside
its forward pass when asked (`Transformer.inspect`), so they see the tensors as the model
computes them (after QK-norm and RoPE, per layer under `model.scan_layers` too). All in
float32 whatever the compute dtype.
"""
import jax
import jax.numpy as jnp


def attention_logits(q_BxLxHxK, k_BxLxGxK, scale):
  """{attn_logit_max, attn_entropy} of causal grouped-query attention.

  attn_logit_max: the largest score softmax reads, scale * q.k (q.k / sqrt(head_dim) but for
  nGPT's unit vectors), over batch, heads and visible (causal) pairs; attn_entropy: the
  entropy in nats of each query's attention row over the keys it sees, averaged over batch,
  heads and queries (0: every query reads one key; log(i+1) at most for query i).

  Dense L x L scores whatever `model.attention` is: the fused and blocked kernels never hold
  them, and this runs only in the statistics function, not in the train step.
  """
  batch, length, heads, hd = q_BxLxHxK.shape
  kv_heads = k_BxLxGxK.shape[2]
  q_BxLxGxRxK = q_BxLxHxK.reshape(batch, length, kv_heads, heads // kv_heads, hd)
  scores = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK,
                      preferred_element_type=jnp.float32) * scale
  visible_LxL = jnp.arange(length)[None, :] <= jnp.arange(length)[:, None]
  # Masked pairs leave the max and the rows alone: -inf has probability exactly 0.
  masked = jnp.where(visible_LxL, scores, -jnp.inf)
  log_z = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
  probs = jnp.exp(masked - log_z)
  # H = log Z - sum_m p_m s_m over the visible keys (where: 0 * -inf would be NaN).
  mean_score = jnp.sum(jnp.where(visible_LxL, probs * scores, 0.0), axis=-1)
  entropy = log_z[..., 0] - mean_score
  return {"attn_logit_max": jnp.max(masked), "attn_entropy": jnp.mean(entropy)}


def output_logits(logits_BxLxV):
  """{logits/log_z_mean, logits/max}: the mean over tokens of log Z = logsumexp of the logits
  (what z-loss pulls to 0) and the largest logit."""
  logits = jnp.asarray(logits_BxLxV, jnp.float32)
  return {"logits/log_z_mean": jnp.mean(jax.nn.logsumexp(logits, axis=-1)),
          "logits/max": jnp.max(logits)}


def norm_site(norm, x, site):
  """{norm_input_rms/<site>, and with a gain norm_gain_mean/<site>, norm_gain_max_abs/<site>}
  of one Norm module (layers.Norm) about to normalise x: the RMS of x over every entry, the
  mean of its gain and the largest |gain|."""
  x32 = jnp.asarray(x, jnp.float32)
  out = {f"norm_input_rms/{site}": jnp.sqrt(jnp.mean(jnp.square(x32)))}
  if norm.gain is not None:
    gain = jnp.asarray(norm.gain[...], jnp.float32)
    out[f"norm_gain_mean/{site}"] = jnp.mean(gain)
    out[f"norm_gain_max_abs/{site}"] = jnp.max(jnp.abs(gain))
  return out


def recorded(norm, site, stats):
  """`norm` (None stays None) that first adds its norm_site statistics to the dict `stats`.

  For the norms a placement calls itself (placements.SublayerNorms): the update function
  stays unaware of the measurement. `stats` must be returned by the traced function that
  owns it (Block.apply), never kept past it.
  """
  if norm is None or stats is None:
    return norm

  def call(x):
    stats.update(norm_site(norm, x, site))
    return norm(x)
  return call
