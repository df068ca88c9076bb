"""The `tiny_llama` size: `tiny`'s shape and data on the LLaMA backbone, about tiny's size."""
import jax.numpy as jnp

from geonorm_jax.nn import model as model_lib
from geonorm_jax.nn import paths
from geonorm_jax.nn import spec as spec_lib
from geonorm_jax.training import config as config_lib


def test_tiny_llama_resolves_to_the_llama_architecture_at_tiny_shape():
  config = config_lib.get_config("tiny_llama")
  tiny = config_lib.get_config("tiny")
  spec = spec_lib.resolve(config.model)
  assert (spec.backbone, spec.num_layers, spec.d_model, spec.num_heads, spec.num_kv_heads,
          spec.max_seq_len, spec.vocab_size) == ("llama", 4, 128, 4, 4, 256, 256)
  assert (config.data.seq_len, config.data.batch_size) == (tiny.data.seq_len,
                                                            tiny.data.batch_size) == (128, 16)
  assert spec.norm_kind == "rmsnorm" and spec.norm_gain and not spec.norm_bias
  assert not spec.tie_embeddings
  assert not spec.has_bias
  assert spec.gated_mlp and spec.uses_rope
  assert spec.d_ff == 368
  assert spec.placement.name == "pre"


def test_tiny_llama_params_no_biases_no_positions_and_about_tiny_size():
  sizes = {}
  for name in ("tiny", "tiny_llama"):
    _, abstract = model_lib.abstract_params(
        spec_lib.resolve(config_lib.get_config(name).model))
    sizes[name] = model_lib.count_params(abstract)
    if name == "tiny_llama":
      names = paths.leaf_paths(abstract)
  assert sizes == {"tiny": 891_648, "tiny_llama": 894_080}
  assert not [n for n in names if n.endswith(".bias")]
  assert "positions" not in names and "head" in names
  assert "blocks.0.mlp.gate.kernel" in names


def test_tiny_llama_runs_with_a_placement_override():
  config = config_lib.get_config("tiny_llama,placement=dyt,num_layers=1")
  model = model_lib.build(config.model)
  logits = model(jnp.zeros((1, 8), jnp.int32))
  assert logits.shape == (1, 8, 256)
  assert bool(jnp.all(jnp.isfinite(logits)))
