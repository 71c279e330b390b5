#!/usr/bin/env bash
# The single-GPU check: ONE command for a one-GPU box with no network (see shared gpu_notes,
# "The single-GPU check box"). About 3 minutes on an H200 (189 s on 2026-12-04):
#   1. (--wheels DIR) install the wheels the box lacks, offline, then the project (no deps);
#   2. say what will be skipped and why (no vLLM, no TransformerEngine, ...);
#   3. pytest -m gpu: tests/gpu, tests/distributed/test_models_gpu.py, test_rollout_gpu.py;
#   4. benchmarks/gpu_step.py (one PPO step: speed, MFU, peak memory, log-prob parity);
#   5. one final line of JSON: the benchmark's figures + pytest's counts + the checks' figures.
#
#   bash benchmarks/gpu_check.sh --wheels .wheels     # on the GPU box
#   bash benchmarks/gpu_check.sh --dry-run [--wheels .wheels]
#                                                     # anywhere: the plan, no pytest/benchmark
#   bash benchmarks/gpu_check.sh --fetch-wheels .wheels
#                                                     # on a machine with PyPI: fill the wheels dir
# Environment: PYTHON (default python3), BOX_PY (the box's Python for --fetch-wheels, default 3.12),
# GPU_CHECK_OUT (where logs go, default a temp dir), GPU_STEP_ARGS (extra benchmark arguments),
# GPU_CHECK_ALLOW_CPU=1 (run the whole script without a GPU, to test its plumbing: the gpu tests
# then skip; pair it with GPU_STEP_ARGS=--quick).
#
# The box has torch, transformers, safetensors, pyarrow, pyyaml, tensorboard, pytest, numpy.
# The wheels dir must hold (--fetch-wheels gets them; ~3 MB in all):
#   megatron-core 0.16.1  (cp312; imported everywhere)
#   psutil                (megatron's checkpoint writer: WITHOUT it a save hangs forever: the
#                          writer process dies on the import and the parent waits on its queue)
#   pytest-timeout        (pytest.ini's per-test timeout; without it a hang has only the outer one)
#   einops                (megatron imports it optionally; not on megappo's path, kept for safety)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BOX_PY="${BOX_PY:-3.12}"
WHEELS=""
DRY=0
FETCH=""
PYTEST_TIMEOUT_S=330   # whole pytest run (the gpu module takes ~1-2 min on an H200)
BENCH_TIMEOUT_S=240
TEST_FILES=(tests/gpu tests/distributed/test_models_gpu.py tests/distributed/test_rollout_gpu.py)

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    --wheels=*) WHEELS="${1#*=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    --fetch-wheels) FETCH="${2:-.wheels}"; shift; [ $# -gt 0 ] && shift ;;
    --fetch-wheels=*) FETCH="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

# -- fill the wheels dir (a machine with PyPI; not the box) ---------------------------------------
if [ -n "$FETCH" ]; then
  mkdir -p "$FETCH"
  dl() { python3 -m pip download --no-deps --only-binary=:all: --python-version "$BOX_PY" "$@" -d "$FETCH" \
           2> >(grep -v "is neither a file nor a directory" >&2); }
  dl --platform manylinux_2_28_x86_64 megatron-core==0.16.1 || exit 1
  # psutil's wheel is tagged manylinux2010/2_12 (+2_28): either platform finds it.
  dl --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 psutil || exit 1
  dl einops pytest-timeout || exit 1
  ls -l "$FETCH"/*.whl
  bytes=$(cat "$FETCH"/*.whl | wc -c)
  echo "wheels: $(ls "$FETCH"/*.whl | wc -l) files, $((bytes / 1024)) KiB (the box receives at most 64 MiB with the working tree)"
  [ "$bytes" -lt $((32 << 20)) ] || { echo "gpu_check.sh: the wheels take over 32 MiB: too much to carry" >&2; exit 1; }
  echo "{\"mode\": \"fetch-wheels\", \"wheels\": $(ls "$FETCH"/*.whl | wc -l), \"wheels_kib\": $((bytes / 1024))}"
  exit 0
fi

OUT="${GPU_CHECK_OUT:-$(mktemp -d /tmp/megappo-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
SITE="$OUT/site"          # fallback install target when pip cannot write to the interpreter
rm -f "$OUT"/figures.jsonl "$OUT"/pytest.xml "$OUT"/bench.out "$OUT"/pytest_rc "$OUT"/bench_rc  # no stale figures
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"   # the working tree's megappo, installed or not
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
T0=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*"; }

# -- 1. offline installs ------------------------------------------------------------------------
INSTALL_NOTE="none (no --wheels)"
if [ -n "$WHEELS" ]; then
  shopt -s nullglob
  whl=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#whl[@]} -eq 0 ]; then
    echo "gpu_check.sh: no *.whl in $WHEELS (fill it with: bash benchmarks/gpu_check.sh --fetch-wheels $WHEELS)" >&2
    exit 2
  fi
  say "wheels in $WHEELS: $(for w in "${whl[@]}"; do printf '%s ' "$(basename "$w")"; done)"
  if [ "$DRY" = 1 ]; then
    say "would run: $PY -m pip install --no-index --no-deps ${whl[*]}"
    say "would run: $PY -m pip install --no-deps --no-build-isolation -e ."
    INSTALL_NOTE="dry run"
  else
    if "$PY" -m pip install -q --no-index --no-deps "${whl[@]}"; then
      INSTALL_NOTE="pip"
    elif "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${whl[@]}"; then
      INSTALL_NOTE="pip --target $SITE"   # e.g. an externally managed (PEP 668) or read-only Python
      export PYTHONPATH="$SITE:$PYTHONPATH"
    else
      mkdir -p "$SITE"                     # no usable pip: a wheel is a zip of the installed files
      for w in "${whl[@]}"; do
        "$PY" -m zipfile -e "$w" "$SITE" || { echo '{"mode": "error", "error": "cannot install the wheels"}'; exit 2; }
      done
      INSTALL_NOTE="unzipped into $SITE"
      export PYTHONPATH="$SITE:$PYTHONPATH"
    fi
    say "wheels installed ($INSTALL_NOTE)"
    if "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip-e.log" 2>&1; then
      say "project installed (pip install -e .)"
    else
      say "pip install -e . failed (see $OUT/pip-e.log; e.g. no setuptools): using PYTHONPATH=$ROOT/src"
    fi
  fi
fi

# -- 2. what is there, what will be skipped --------------------------------------------------------
MODULES="torch transformers megatron.core psutil pytest pytest_timeout einops vllm transformer_engine"
# One interpreter start for all of them: "name 1|0" per module, then "cuda 1|0".
PROBE="$("$PY" - $MODULES 2>/dev/null <<'EOF'
import importlib, sys, warnings
warnings.filterwarnings("ignore")
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
        print(m, 1)
    except Exception:
        print(m, 0)
try:
    import torch
    print("cuda", int(torch.cuda.is_available()))
except Exception:
    print("cuda", 0)
EOF
)"
has() { grep -qx "$1 1" <<<"$PROBE"; }
CUDA=0
has cuda && CUDA=1
# A dry run installs nothing: count a module the wheels dir provides as present (would be installed).
in_wheels() {
  [ -n "$WHEELS" ] && compgen -G "$WHEELS/${1//./_}-*.whl" >/dev/null   # megatron.core -> megatron_core-*.whl
}
declare -A HAVE
declare -A HOW
for m in $MODULES; do
  if has "$m"; then HAVE[$m]=1; HOW[$m]=present
  elif [ "$DRY" = 1 ] && in_wheels "$m"; then HAVE[$m]=1; HOW[$m]="missing, in the wheels dir (would be installed)"
  else HAVE[$m]=0; HOW[$m]=MISSING; fi
done
say "interpreter: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
say "CUDA: $([ $CUDA = 1 ] && "$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__)' 2>/dev/null || echo no)"
for m in $MODULES; do
  printf '  %-20s %s\n' "$m" "${HOW[$m]}"
done
SKIPS=()
FILES=("${TEST_FILES[@]}")
if [ "${HAVE[vllm]}" = 0 ]; then
  # test_rollout_gpu.py skips itself without vLLM (pytest.importorskip).
  SKIPS+=("tests/distributed/test_rollout_gpu.py: no vLLM (the CUDA engine, sleep/wake and in-place sync are not checked)")
fi
if [ "${HAVE[transformer_engine]}" = 0 ]; then
  SKIPS+=("tests/gpu/test_gpu_path.py [te] cases: no TransformerEngine (only megatron's local layer spec is checked)")
fi
[ "${HAVE[pytest_timeout]}" = 0 ] && SKIPS+=("no pytest-timeout: no per-test timeout, only the outer ${PYTEST_TIMEOUT_S}s one")
SKIPS+=("never checked on one GPU: NCCL between GPUs (TP/PP/DP > 1; NCCL refuses two ranks on one GPU)")
say "will skip:"
for s in "${SKIPS[@]}"; do echo "  - $s"; done
NONEMPTY=()
for f in "${FILES[@]}"; do [ -n "$f" ] && NONEMPTY+=("$f"); done
FILES=("${NONEMPTY[@]}")
PYTEST=("$PY" -m pytest -m gpu "${FILES[@]}" -q -p no:cacheprovider -rs --junitxml="$OUT/pytest.xml")
[ "${HAVE[pytest_timeout]}" = 1 ] && PYTEST+=(-o timeout=240)
say "pytest: ${PYTEST[*]}"
BENCH=("$PY" benchmarks/gpu_step.py ${GPU_STEP_ARGS:-})
say "benchmark: ${BENCH[*]}"

missing=()
for m in torch transformers megatron.core psutil pytest; do [ "${HAVE[$m]}" = 0 ] && missing+=("$m"); done

summary() {  # the one final JSON line: $1 = mode
  "$PY" - "$1" "$OUT" "$INSTALL_NOTE" "${#SKIPS[@]}" "${SKIPS[@]}" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
mode, out, install, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
skips = sys.argv[5:5 + n]
res = {}
bench = os.path.join(out, "bench.out")
if os.path.exists(bench):
    lines = [l for l in open(bench).read().splitlines() if l.startswith("{")]
    if lines:
        try:
            res.update(json.loads(lines[-1]))
        except ValueError:
            pass
res["mode"] = mode
xmlp = os.path.join(out, "pytest.xml")
if os.path.exists(xmlp):
    root = ET.parse(xmlp).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    res.update(pytest_passed=c["tests"] - c["failures"] - c["errors"] - c["skipped"], pytest_failed=c["failures"],
               pytest_errors=c["errors"], pytest_skipped=c["skipped"])
    res["pytest_failed_tests"] = [f"{t.get('classname')}::{t.get('name')}" for t in root.iter("testcase")
                                  if t.find("failure") is not None or t.find("error") is not None][:20]
figs = os.path.join(out, "figures.jsonl")
if os.path.exists(figs):
    for line in open(figs):
        r = json.loads(line)
        tag = r.pop("check")
        tag += "_" + r.pop("spec", "")
        if "critic_distributed_optimizer" in r:
            tag += "_distopt" if r.pop("critic_distributed_optimizer") else "_plainopt"
        r.pop("dtype", None)
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                res[f"{tag}_{k}"] = v
for k in ("pytest_rc", "bench_rc"):
    p = os.path.join(out, k)
    if os.path.exists(p):
        res[k] = int(open(p).read().strip() or -1)
res["install"] = install
res["skips"] = skips
res["logs"] = out
print(json.dumps(res))
EOF
}

if [ "$DRY" = 1 ]; then
  [ ${#missing[@]} -gt 0 ] && say "a real run here would stop: missing ${missing[*]} (bring them with --wheels)"
  [ $CUDA = 0 ] && say "a real run here would stop: no CUDA device (the gpu tests skip without one)"
  say "benchmark plan:"
  "${BENCH[@]}" --dry-run >"$OUT/bench.out" 2>&1
  grep -v '^{' "$OUT/bench.out" | sed 's/^/  /'
  summary dry-run
  exit 0
fi

if [ ${#missing[@]} -gt 0 ]; then
  say "cannot run: missing ${missing[*]} (pass --wheels DIR; psutil: a checkpoint save would hang without it)"
  echo "{\"mode\": \"error\", \"error\": \"missing ${missing[*]}\"}"
  exit 2
fi
if [ $CUDA = 0 ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
  say "cannot run: no CUDA device (use --dry-run on a machine without a GPU)"
  echo '{"mode": "error", "error": "no CUDA device"}'
  exit 2
fi

# -- 3. the gpu tests -----------------------------------------------------------------------------
say "running the gpu tests (limit ${PYTEST_TIMEOUT_S}s)"
MEGAPPO_GPU_FIGURES="$OUT/figures.jsonl" timeout -k 15 "$PYTEST_TIMEOUT_S" "${PYTEST[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -40
echo "${PIPESTATUS[0]}" >"$OUT/pytest_rc"
say "pytest exit code $(cat "$OUT/pytest_rc")"

# -- 4. the benchmark -----------------------------------------------------------------------------
say "running benchmarks/gpu_step.py (limit ${BENCH_TIMEOUT_S}s)"
timeout -k 15 "$BENCH_TIMEOUT_S" "${BENCH[@]}" >"$OUT/bench.out" 2>"$OUT/bench.err"
echo "$?" >"$OUT/bench_rc"
grep -v '^{' "$OUT/bench.out" | tail -25
[ "$(cat "$OUT/bench_rc")" = 0 ] || { say "benchmark failed:"; tail -30 "$OUT/bench.err"; }
say "done in $(( $(date +%s) - T0 ))s; logs in $OUT"

# -- 5. one JSON line -----------------------------------------------------------------------------
summary run
rc=$(cat "$OUT/pytest_rc")
[ "$rc" = 0 ] && rc=$(cat "$OUT/bench_rc")
exit "$rc"
