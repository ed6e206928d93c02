"""lra_core: a JAX/Flax framework for efficient long-sequence transformers."""

from setuptools import find_packages, setup

setup(
    name="lra_core",
    version="0.1.0",
    description="One trainer, many efficient long-sequence transformers (JAX/Flax NNX).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["lra_core*", "models*", "kernels*", "configs*"]),
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "ml-collections>=1.0",
        "tensorflow-datasets>=4.9",
        "grain>=0.2.12",
        "sentencepiece>=0.2",
        "einops>=0.8",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "absl-py>=2.1",
        "numpy>=1.26",
    ],
    extras_require={
        # libtpu (through jax[tpu]) lets the tests compile for TPU slices on a CPU host (lra_core.aot).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "jax[tpu]>=0.10"],
        "tf": ["tensorflow-cpu>=2.16"],
        "gpu": ["jax[cuda12]>=0.10"],
        "tpu": ["jax[tpu]>=0.10"],
    },
)
