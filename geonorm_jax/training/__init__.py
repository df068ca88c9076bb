"""Training: the config, the loop, optimizer, checkpoints, metrics, collapse monitor, input validation."""
