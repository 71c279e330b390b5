#!/usr/bin/env python
"""Write a HuggingFace model as an initial megappo (Megatron) checkpoint. See checkpoints_tools/README.md; the logic lives in megappo.convert."""
import os
import sys

# A CPU tool: one process, no accelerator (megatron then runs on its CPU adaptation).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
try:
    import megappo  # noqa: F401  (installed with pip install -e .)
except ImportError:  # a fresh clone run with a venv where megappo is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))

from megappo.convert.cli import convert_from_hf_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(convert_from_hf_main())
