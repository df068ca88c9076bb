"""geonorm_jax: where should normalization sit in a Transformer? JAX/Flax NNX research code."""
from setuptools import find_packages, setup

setup(
    name="geonorm_jax",
    version="0.1.0",
    description="Normalization placements (GeoNorm, SimpleNorm, Peri-LN, ...) in JAX/Flax NNX",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["geonorm_jax", "geonorm_jax.*"]),
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "grain==0.2.18",
        "ml-collections==1.1.0",
        "tensorboard==2.21.0",
        "tensorboardX==2.6.5",
        "absl-py==2.5.1",
        "numpy==2.4.6",
        "scipy==1.17.1",
        "matplotlib==3.11.2",
    ],
    extras_require={
        # The accelerator builds of the same jax: `pip install -e ".[cuda12]"` on an NVIDIA
        # machine (CUDA 12 and cuDNN come as pip wheels), `pip install -e ".[tpu]"` on a Cloud
        # TPU VM (libtpu). Without an extra, jax runs on the CPU.
        "cuda12": ["jax[cuda12]==0.10.2"],
        "tpu": ["jax[tpu]==0.10.2"],
        # Weights & Biases tracking (train.wandb=online|offline), imported only when it is on.
        "wandb": ["wandb==0.31.0"],
        # Only the test suite needs these. torch 2.13.0 is pinned exactly to its CPU wheel
        # (the Hugging Face parity tests need no GPU), which keeps pip from pulling a
        # multi-GB CUDA build. wandb: the suite runs train.wandb=offline.
        "test": [
            "pytest==9.2.0",
            "pytest-xdist==3.8.0",
            "hypothesis==6.170.17",
            "torch==2.13.0",
            "transformers==5.24.0",
            "wandb==0.31.0",
            "nbformat",
            "nbclient",
            "ipykernel",
        ],
    },
)
