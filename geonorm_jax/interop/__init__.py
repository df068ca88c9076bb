"""Interop: Hugging Face checkpoints in and out, and the scan/unrolled parameter layouts."""
