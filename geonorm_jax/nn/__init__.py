"""The model: norms, placements, layers, init rules, the Transformer, losses, its spec, sharding annotations, sampling."""
