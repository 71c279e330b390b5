#!/usr/bin/env bash
# Create (or refresh) the separate virtual environment benchmarks/trl_ppo.py runs in: TRL 1.12.0
# (the last release with PPOTrainer, as trl.experimental.ppo) on the CPU build of torch.
#   bash benchmarks/setup_trl.sh              -> .venv-trl in the repository root
#   TRL_VENV=/path/to/venv bash benchmarks/setup_trl.sh
# (benchmarks/learning.py looks for the venv in $TRL_VENV too.) TRL is never a dependency of
# megappo itself: this venv is only for the comparison benchmark.
# Idempotent: it re-installs only when this script changed since the last successful run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TRL_VENV:-$ROOT/.venv-trl}"
PYTHON="${PYTHON:-python3}"

stamp="$VENV/.trl-setup-$(sha256sum "$0" | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi

# pip on some machines lists local mirror folders that do not exist: drop that noise only.
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade pip
# torch FIRST and pinned: the CPU wheel (2.13.0+cpu, the one megappo's CPU stack uses) lies on the
# build machines' disk; a bare `torch` requirement pulled in later would fetch a multi-GB CUDA build.
quiet "$VENV/bin/python" -m pip install -q "torch==2.13.0"
# Then TRL, repeating the torch pin so the resolver keeps that build. transformers in the range
# megappo uses (TRL 1.12 asks only >=4.56.2); it loads the tiny Qwen3 + word-tokenizer folders.
quiet "$VENV/bin/python" -m pip install -q "torch==2.13.0" "trl==1.12.0" "transformers>=5.16.1,<5.20.0" \
  accelerate datasets pyarrow pyyaml
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside the CPU torch they fail to
# import, and transformers imports torchvision when it is present.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2> >(grep -v "as it is not installed" >&2) || true

"$VENV/bin/python" -W ignore - <<'EOF'
import torch, transformers, trl
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401  (TRL 1.12's PPO lives here)
assert torch.__version__ == "2.13.0+cpu", f"setup_trl.sh: expected torch 2.13.0+cpu, got {torch.__version__}"
assert trl.__version__ == "1.12.0", f"setup_trl.sh: expected trl 1.12.0, got {trl.__version__}"
print("TRL env ready:", "torch", torch.__version__, "| transformers", transformers.__version__, "| trl", trl.__version__)
EOF
# The venv must load the tiny model folders megappo makes (Qwen3ForCausalLM + word tokenizer).
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH="$ROOT/src" TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 "$VENV/bin/python" -W ignore - "$tmp" <<'EOF'
import sys
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from megappo.data.tiny import make_tiny_setup
paths = make_tiny_setup(sys.argv[1], n_train=8, n_test=8, task="words")
tok = AutoTokenizer.from_pretrained(paths["model"])
AutoModelForCausalLM.from_pretrained(paths["model"])
AutoModelForSequenceClassification.from_pretrained(paths["model"], num_labels=1)
out = tok.apply_chat_template([{"role": "user", "content": "list: fruit cat saw"}], add_generation_prompt=True, tokenize=True)
ids = out["input_ids"] if hasattr(out, "keys") else out
assert len(ids) == 7 and tok.unk_token_id not in ids, ids
print("TRL env loads the tiny model folders:", type(tok).__name__)
EOF
rm -f "$VENV"/.trl-setup-*
touch "$stamp"
