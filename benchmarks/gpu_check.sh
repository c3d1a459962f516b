#!/usr/bin/env bash
# The GPU check: everything s2hc wants to know from one CUDA GPU, in one run of under 5 minutes.
#
#   benchmarks/gpu_check.sh OUT_DIR             # on a machine with a CUDA GPU (budget 270 s)
#   benchmarks/gpu_check.sh --dry-run OUT_DIR   # the same steps on the CPU, every size shrunk (budget 1200 s)
#
# Steps, most informative first; each under `timeout` with its own limit, cut to what is left of the budget
# (GPU_CHECK_BUDGET); a step that fails or runs out of time is recorded and the next one runs; a step with
# less than MIN_STEP seconds left is skipped and recorded as skipped:
#   peer                  hyper-connections (+ torch-einops-utils) from .gpu-wheels/ into a temporary directory
#   env                   nvidia-smi, Python, torch / CUDA / triton / package versions
#   kernels               benchmarks/kernel_check.py: the Triton kernels against float64 (n = 4, 8, 16; K of s2hc
#                         and mhc; float32 and bf16), their time and GB/s against a device copy and the PyTorch path
#   gpt2-small-n4-bf16    `s2hc bench --json --jsonl` in bf16 autocast, as training runs (every bench below too)
#   gpt2-small-n4-fp32    the same in float32
#   tests                 pytest -m cuda tests/test_cuda.py tests/test_cuda_syncs.py
#   torchtitan            benchmarks/torchtitan_check.py: s2hc's decoder trained 10 steps by torchtitan's own trainer
#                         (torchtitan and what of it the image lacks from .gpu-wheels/torchtitan/); a cut at its time
#                         limit is recorded as such, not as a failure
#   gpt2-small-n4-bf16-compiled   torch.compile, 2 of the 12 layers
#   gpt2-small-n8-bf16    n = 8
#   kernel-tests          tests/test_triton_kernels.py on the GPU
#   qwen3-0.6b-n4-bf16    the Qwen3 architecture
#   aot                   benchmarks/aot_compile.py with the image's triton and ptxas, on a subset
# Output: at most 8 files in OUT_DIR, each rewritten or appended as steps finish, so a run cut anywhere still
# returns what finished: summary.md, summary.json (rebuilt after every step), steps.jsonl, console.log (all
# that is printed), raw.tar (every raw file of every finished step, appended: `tar -xf raw.tar`), and
# current/ (the files of the step in progress, at most 3, moved into raw.tar when it ends).
#
# s2hc runs from this tree (PYTHONPATH=src); nothing is installed into the Python environment.
# Settings (environment): PYTHON (default python3, or .venv/bin/python when python3 has no torch),
# GPU_CHECK_BUDGET (seconds for the whole run: 270 on a GPU, 1200 dry), GPU_CHECK_WORKERS (pytest-xdist
# workers: 8 on a GPU, 2 dry), GPU_CHECK_AOT_ARGS (arguments of benchmarks/aot_compile.py; default a subset:
# sm_90, n = 8 and 16, bf16 and fp32 on a GPU). Exit status 0 when every step passed or was skipped with its
# reason, 1 when one failed or timed out, 2 on bad usage. The device call: benchmarks/README.md, "GPU check".
set -u -o pipefail

usage() {
    echo "usage: $0 [--dry-run] OUT_DIR" >&2
    exit 2
}
MODE=gpu
case "${1:-}" in
    --dry-run) MODE=dry-run; shift ;;
    -h | --help) sed -n '2,/^set /{/^set /!p;}' "$0"; exit 0 ;;
    -*) usage ;;
esac
[[ $# -eq 1 && -n "$1" ]] || usage
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
CUR="$OUT/current"
rm -rf "$CUR" "$OUT"/summary.md "$OUT"/summary.json "$OUT"/steps.jsonl "$OUT"/console.log "$OUT"/raw.tar
mkdir -p "$CUR" || exit 2
: > "$OUT/steps.jsonl"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")

# Everything printed from here on also goes to console.log, as it is printed.
exec > >(tee -a "$OUT/console.log") 2>&1
TEE_PID=$!
cleanup() {
    rm -rf "$WORK"
    exec >&- 2>&-
    wait "$TEE_PID" 2> /dev/null
}
trap cleanup EXIT

if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    if ! "$PYTHON" -c 'import torch' > /dev/null 2>&1 && [[ -x .venv/bin/python ]]; then
        PYTHON=.venv/bin/python
    fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}" # deterministic cuBLAS (the resume test)
export S2HC_CACHE_DIR="${S2HC_CACHE_DIR:-$WORK/cache}"

BENCH_FAMILIES_N4=mhc,s2hc,s2hc:kernels=triton,mhc-lite,kromhc # + residual, + the peer when importable
if [[ $MODE == gpu ]]; then
    BUDGET=${GPU_CHECK_BUDGET:-270}
    WORKERS=${GPU_CHECK_WORKERS:-8}
    PER_TEST=80
    KERNELS=() # kernel_check.py's own sizes on CUDA: T = 8192 tokens, C = 768
    COMMON=(--device cuda --json --repeats 3 --steps 2)
    GPT2=(--preset gpt2-small --batch-size 8 --seq-len 1024)
    QWEN3=(--preset qwen3-0.6b --batch-size 4 --seq-len 512)
    COMPILED_LAYERS=(--layers 2) # whole-model torch.compile of 12 layers takes minutes
    LAYERS_NOTE="--layers 2: compiled at 2 of the preset's 12 layers to fit the budget"
    # the limits of the steps, in seconds, before the cut to what is left of the budget
    L_PEER=30 L_ENV=30 L_KERNELS=75 L_BF16=60 L_FP32=45 L_TESTS=90 L_COMPILED=70 L_N8=40 L_KTESTS=60 L_AOT=30
    L_QWEN3=60 L_TITAN=60
    DRY=()
    AOT_DEFAULT="--arch 90 --streams 8,16 --dtypes bf16,fp32"
    RESERVE=10 MIN_STEP=15
else
    BUDGET=${GPU_CHECK_BUDGET:-1200}
    WORKERS=${GPU_CHECK_WORKERS:-2}
    PER_TEST=300
    # Every size shrunk; both shapes become the tiny preset at one layer (qwen3-0.6b's 151 936-token
    # vocabulary alone is 2.5 GB of AdamW state per model on the CPU).
    export S2HC_TEST_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    KERNELS=(--tokens 3 --dim 40)
    COMMON=(--device cpu --json --repeats 1 --steps 1 --threads 1)
    GPT2=(--preset tiny --layers 1 --batch-size 1 --seq-len 32)
    QWEN3=(--preset tiny --layers 1 --batch-size 1 --seq-len 32)
    COMPILED_LAYERS=()
    LAYERS_NOTE="dry run: tiny preset, 1 layer"
    L_PEER=60 L_ENV=60 L_KERNELS=150 L_BF16=120 L_FP32=90 L_TESTS=600 L_COMPILED=240 L_N8=90 L_KTESTS=240
    L_AOT=120 L_QWEN3=90 L_TITAN=240
    DRY=(--dry-run)
    AOT_DEFAULT="--arch 90 --streams 8 --dtypes fp32"
    RESERVE=20 MIN_STEP=20
fi
FAILED=0

json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}

# record NAME KIND STATUS RC SECONDS LIMIT ARGS NOTE: one line of steps.jsonl
record() {
    printf '{"mode": "%s", "name": %s, "kind": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "args": %s, "note": %s}\n' \
        "$MODE" "$(json_str "$1")" "$2" "$3" "${4:-null}" "$5" "$6" "$(json_str "$7")" "$(json_str "$8")" \
        >> "$OUT/steps.jsonl"
}

# finish_step: the step's files from current/ appended to raw.tar, the summary rebuilt
finish_step() {
    timeout 30 "$PYTHON" benchmarks/gpu_check.py finish-step "$OUT" | sed 's/^/   /'
}

# left: the seconds of the budget not spent, less the reserve for the last summary
left() {
    echo $((BUDGET - SECONDS - RESERVE))
}

# run_step NAME KIND WANT STDOUT STDERR ARGS NOTE -- COMMAND...: COMMAND under `timeout`, its limit WANT cut to
# the budget left; STDOUT and STDERR are file names in current/ (the same name: one file). Skipped when less
# than MIN_STEP seconds are left. Then recorded, archived and summarised. With SOFT_TIMEOUT set (in the call's
# environment) a cut at the limit is recorded as a timeout with that said, and does not fail the check.
run_step() {
    local name=$1 kind=$2 want=$3 stdout=$CUR/$4 stderr=$CUR/$5 args=$6 note=$7
    shift 8
    local rest
    rest=$(left)
    local limit=$((want < rest ? want : rest))
    if ((limit < MIN_STEP)); then
        echo "== $name: skipped (${rest}s of the ${BUDGET}s budget left)"
        record "$name" "$kind" skipped null 0 0 "$args" "budget spent${note:+; $note}"
        finish_step
        return 0
    fi
    echo "== $name (limit ${limit}s, ${SECONDS}s so far)${note:+ [$note]}"
    echo "   $*"
    local start=$SECONDS rc
    if [[ $stdout == "$stderr" ]]; then
        timeout -k 5 "$limit" "$@" > "$stdout" 2>&1
        rc=$?
    else
        timeout -k 5 "$limit" "$@" > "$stdout" 2> "$stderr"
        rc=$?
    fi
    local took=$((SECONDS - start)) status=ok
    if ((rc == 124 || rc == 137)); then
        status=timeout
    elif ((rc != 0)); then
        status=failed
    fi
    if [[ $status == timeout && -n ${SOFT_TIMEOUT:-} ]]; then
        note="${note:+$note; }cut at its ${limit}s limit: what it logged is kept, not a failure"
    elif [[ $status != ok ]]; then
        FAILED=1
    fi
    echo "   $status (exit $rc, ${took}s)"
    if [[ $status != ok || $kind == kernels || $kind == tests ]]; then
        tail -n 12 "$stderr" | sed 's/^/   | /'
    fi
    record "$name" "$kind" "$status" "$rc" "$took" "$limit" "$args" "$note"
    finish_step
}

echo "GPU check ($MODE) into $OUT; budget ${BUDGET}s; python: $PYTHON; $(date -u '+%Y-%m-%d %H:%M:%S UTC')"

# --------------------------------------------------------------------------------------------- peer
# The peer travels as wheels (.gpu-wheels/, carried to the device); installed into a temporary directory,
# never into the environment. The dry run always installs it this way, to try the path.
# Without the wheels the dry run fetches them (this machine reaches the package registry; the device does not);
# when they still are not there the step is skipped with its reason: the peer is a comparison, not s2hc, so its
# absence is no failure of the check (the benches run without it).
PEER_WHEELS=(hyper-connections==0.4.11 torch-einops-utils==0.2.0)
start=$SECONDS
peer_status=ok peer_note="" peer_rc=0
if [[ $MODE == dry-run ]] && ! ls .gpu-wheels/*.whl > /dev/null 2>&1; then
    if timeout "$L_PEER" "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        -d .gpu-wheels "${PEER_WHEELS[@]}" > "$WORK/peer-download.log" 2>&1; then
        echo "   fetched ${PEER_WHEELS[*]} into .gpu-wheels/"
    else
        rm -rf .gpu-wheels/*.whl.part 2> /dev/null
        echo "   could not fetch the peer's wheels: $(tail -n 1 "$WORK/peer-download.log")"
    fi
fi
if [[ $MODE == gpu ]] && "$PYTHON" -c 'import hyper_connections' > /dev/null 2>&1; then
    peer_note="already importable"
elif ! ls .gpu-wheels/*.whl > /dev/null 2>&1; then
    peer_status=skipped peer_rc=null
    peer_note="no .gpu-wheels/*.whl (fetch: pip download ${PEER_WHEELS[*]} --no-deps -d .gpu-wheels): the benches run without the peer"
else
    SITE="$WORK/site"
    if timeout "$L_PEER" "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --no-compile --find-links .gpu-wheels --target "$SITE" hyper-connections torch-einops-utils; then
        peer_note="pip install --target from .gpu-wheels"
    else # no pip: a wheel is a zip file
        "$PYTHON" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$SITE" .gpu-wheels/*.whl
        peer_note="unzipped from .gpu-wheels (pip failed)"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    if ! "$PYTHON" -c 'import hyper_connections' 2>&1; then
        peer_status=failed peer_rc=1
        peer_note="$peer_note; still not importable"
    fi
fi
echo "== peer: $peer_status ($peer_note)"
[[ $peer_status == failed ]] && FAILED=1
record peer setup "$peer_status" "$peer_rc" $((SECONDS - start)) "$L_PEER" "" "$peer_note"

# ---------------------------------------------------------------------------------------------- env
start=$SECONDS
{
    echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -srm), $(nproc) CPUs, mode $MODE"
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
            --format=csv 2>&1
        nvidia-smi 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    timeout "$L_ENV" "$PYTHON" benchmarks/gpu_check.py env "$CUR" 2>&1
} > "$CUR/env.txt"
env_rc=$?
cat "$CUR/env.txt"
"$PYTHON" -c 'import torch' > /dev/null 2>&1 || env_rc=1
if [[ $MODE == gpu ]] && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
    echo "warning: torch.cuda.is_available() is False: the tests skip and the benches fail"
    env_rc=1
fi
env_status=ok
((env_rc == 0)) || { env_status=failed; FAILED=1; }
record env setup "$env_status" "$env_rc" $((SECONDS - start)) "$L_ENV" "" ""
finish_step

# ---------------------------------------------------------------------------------- step commands
BENCH=("$PYTHON" -m s2hc bench "${COMMON[@]}")
bench() { # bench NAME LIMIT NOTE ARGS...: bench-NAME.json (stdout), .log (progress), .jsonl (events)
    local name=bench-$1 limit=$2 note=$3
    shift 3
    run_step "$name" bench "$limit" "$name.json" "$name.log" "$*" "$note" -- \
        "${BENCH[@]}" --jsonl "$CUR/$name.jsonl" "$@"
}

pytest_step() { # pytest_step NAME LIMIT NOTE PYTEST-ARGS...: NAME.xml (JUnit), NAME.log (-v: a line per test)
    local name=$1 limit=$2 note=$3
    shift 3
    local cmd=("$PYTHON" -m pytest "$@" -p no:cacheprovider -o addopts= -ra -v --junitxml="$CUR/$name.xml")
    if ((WORKERS > 1)) && "$PYTHON" -c 'import xdist' > /dev/null 2>&1; then
        cmd+=(-n "$WORKERS")
    fi
    if "$PYTHON" -c 'import pytest_timeout' > /dev/null 2>&1; then
        cmd+=(--timeout "$PER_TEST")
    fi
    run_step "$name" tests "$limit" "$name.log" "$name.log" "${cmd[*]:1}" "$note" -- "${cmd[@]}"
}

CUDA_TESTS=(tests/test_cuda.py)
[[ -f tests/test_cuda_syncs.py ]] && CUDA_TESTS+=(tests/test_cuda_syncs.py)
COMPILED=(--compile --no-peer --no-coefficients ${COMPILED_LAYERS[@]+"${COMPILED_LAYERS[@]}"})

# -------------------------------------------------------------------- the steps, most informative first
run_step kernels kernels "$L_KERNELS" kernels.log kernels.log "${KERNELS[*]}" "" -- \
    "$PYTHON" benchmarks/kernel_check.py --jsonl "$CUR/kernels.jsonl" ${KERNELS[@]+"${KERNELS[@]}"}
bench gpt2-small-n4-bf16 "$L_BF16" "" "${GPT2[@]}" --dtype bfloat16 --streams 4 --families "$BENCH_FAMILIES_N4"
bench gpt2-small-n4-fp32 "$L_FP32" "" "${GPT2[@]}" --dtype float32 --streams 4 \
    --families mhc,s2hc,s2hc:kernels=triton --no-coefficients
pytest_step tests "$L_TESTS" "" "${CUDA_TESTS[@]}" -m cuda
# torchtitan: its wheels travel in .gpu-wheels/torchtitan/ (2.8 MB, pure Python; carried with .gpu-wheels); the
# dry run fetches them when absent, for Python 3.12 (the image's) and for its own Python (multiprocess is tagged by
# version). Without them and without an importable torchtitan the step is skipped with that reason.
TITAN_WHEELS=(torchtitan==0.3.0 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    spmd-types==0.2.3 torch-checkpointing==0.1.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
TITAN_DIR=.gpu-wheels/torchtitan
if [[ $MODE == dry-run ]] && ! ls "$TITAN_DIR"/*.whl > /dev/null 2>&1; then
    mkdir -p "$TITAN_DIR"
    own=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    fetch=("$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$TITAN_DIR")
    if timeout "$L_PEER" "${fetch[@]}" --python-version 3.12 "${TITAN_WHEELS[@]}" > "$WORK/titan-download.log" 2>&1 &&
        timeout "$L_PEER" "${fetch[@]}" --python-version "$own" multiprocess==0.70.18 >> "$WORK/titan-download.log" 2>&1; then
        echo "   fetched ${TITAN_WHEELS[*]} into $TITAN_DIR/"
    else
        rm -f "$TITAN_DIR"/*.whl "$TITAN_DIR"/*.whl.part 2> /dev/null
        echo "   could not fetch torchtitan's wheels: $(tail -n 1 "$WORK/titan-download.log")"
    fi
fi
if ls "$TITAN_DIR"/*.whl > /dev/null 2>&1 || "$PYTHON" -c 'import torchtitan.trainer' > /dev/null 2>&1; then
    SOFT_TIMEOUT=1 run_step torchtitan tool "$L_TITAN" torchtitan.log torchtitan.log "${DRY[*]-}" \
        "s2hc's decoder in torchtitan's trainer: $([[ $MODE == gpu ]] && echo s2hc_debugmodel, 10 steps || echo s2hc_tiny, 3 steps)" -- \
        "$PYTHON" benchmarks/torchtitan_check.py ${DRY[@]+"${DRY[@]}"} "$TITAN_DIR" "$WORK/torchtitan"
else
    echo "== torchtitan: skipped (no $TITAN_DIR/*.whl and torchtitan not importable)"
    record torchtitan tool skipped null 0 0 "" \
        "no $TITAN_DIR/*.whl (fetch: pip download ${TITAN_WHEELS[*]} --no-deps --only-binary=:all: --python-version 3.12 -d $TITAN_DIR)"
    finish_step
fi
bench gpt2-small-n4-bf16-compiled "$L_COMPILED" "$LAYERS_NOTE" "${GPT2[@]}" --dtype bfloat16 --streams 4 \
    --families s2hc "${COMPILED[@]}"
bench gpt2-small-n8-bf16 "$L_N8" "" "${GPT2[@]}" --dtype bfloat16 --streams 8 \
    --families mhc,s2hc,s2hc:kernels=triton --no-peer --no-coefficients
pytest_step kernel-tests "$L_KTESTS" "the kernels' own tests (test_triton_kernels.py)" tests/test_triton_kernels.py
bench qwen3-0.6b-n4-bf16 "$L_QWEN3" "" "${QWEN3[@]}" --dtype bfloat16 --streams 4 \
    --families mhc,s2hc,s2hc:kernels=triton --no-coefficients
# shellcheck disable=SC2206 # GPU_CHECK_AOT_ARGS is a list of words
AOT=(${GPU_CHECK_AOT_ARGS:-$AOT_DEFAULT}) # the ahead-of-time compile tool, with the image's triton and ptxas
run_step aot tool "$L_AOT" aot.log aot.log "${AOT[*]}" "ahead-of-time compile tool, a subset" -- \
    "$PYTHON" benchmarks/aot_compile.py "${AOT[@]}" --json "$CUR/aot.json" --markdown "$CUR/aot.md"

# ------------------------------------------------------------------------------------------ summary
echo "== summary (${SECONDS}s so far)"
if ! timeout 60 "$PYTHON" benchmarks/gpu_check.py finish-step "$OUT"; then
    echo "summary: failed"
    FAILED=1
fi
[[ -f "$OUT/summary.md" ]] && cat "$OUT/summary.md"
echo "GPU check ($MODE) done in ${SECONDS}s: $([[ $FAILED == 0 ]] && echo 'every step ok or skipped with its reason' || echo 'some steps failed'); files in $OUT"
exit "$FAILED"
