"""Data: corpus sources and tokenizers, window batches with exact resume, corpus preparation."""
