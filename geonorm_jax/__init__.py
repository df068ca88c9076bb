"""geonorm_jax: normalization placements in Transformers, in JAX/Flax NNX."""
