#!/usr/bin/env bash
# The GPU check: everything s2hc wants to know from one CUDA GPU, in one run of under 8 minutes.
#
#   benchmarks/gpu_check.sh OUT_DIR             # on a machine with a CUDA GPU
#   benchmarks/gpu_check.sh --dry-run OUT_DIR   # the same steps on the CPU, every size shrunk (< 10 min, 2 cores)
#
# Steps, in order of importance; each has its own time limit (`timeout`), cut to what is left of the whole
# budget, and a step that fails or runs out of time is recorded and the next one runs:
#   peer     the hyper-connections package from .gpu-wheels/ into a temporary directory, when it is not importable
#   env      nvidia-smi, torch / triton / CUDA / package versions     -> env.txt, env.json
#   tests    pytest -m cuda tests/test_cuda.py (xdist and a per-test timeout where installed) -> tests.xml, tests.log
#   benches  `s2hc bench --json` at the gpt2-small and qwen3-0.6b shapes: n = 4 eager (residual, mhc, s2hc,
#            s2hc:kernels=triton, mhc-lite, kromhc, the hyper-connections:mhc peer), n = 4 compiled (residual,
#            mhc, s2hc; fewer layers), n = 8 eager (residual, mhc, s2hc)  -> bench-NAME.json, bench-NAME.log
#   summary  python benchmarks/gpu_check.py summarize OUT_DIR          -> summary.md, summary.json
# steps.jsonl records every step (status ok / failed / timeout / skipped, exit code, seconds, limit).
#
# s2hc runs from this tree (PYTHONPATH=src); nothing is installed into the Python environment.
# Settings (environment): PYTHON (default python3, or .venv/bin/python when python3 has no torch),
# GPU_CHECK_BUDGET (seconds for the whole run; 450 on a GPU, 570 dry), GPU_CHECK_WORKERS (pytest-xdist
# workers; 6 on a GPU, 2 dry). Exit status 0 when every step passed, 1 when one failed or timed out, 2 on
# bad usage. The exact device call and what comes back: benchmarks/README.md, "GPU check".
set -u -o pipefail

usage() {
    echo "usage: $0 [--dry-run] OUT_DIR" >&2
    exit 2
}
MODE=gpu
case "${1:-}" in
    --dry-run) MODE=dry-run; shift ;;
    -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) usage ;;
esac
[[ $# -eq 1 && -n "$1" ]] || usage
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
rm -f "$OUT"/steps.jsonl "$OUT"/env.txt "$OUT"/env.json "$OUT"/tests.xml "$OUT"/tests.log "$OUT"/bench-*.json \
    "$OUT"/bench-*.log "$OUT"/summary.md "$OUT"/summary.json
: > "$OUT/steps.jsonl"

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

if [[ $MODE == gpu ]]; then
    BUDGET=${GPU_CHECK_BUDGET:-450}
    WORKERS=${GPU_CHECK_WORKERS:-6}
    PER_TEST=150
    TEST_LIMIT=240
    COMMON=(--device cuda --json --repeats 3 --steps 2)
    GPT2=(--preset gpt2-small --batch-size 8 --seq-len 1024)
    QWEN3=(--preset qwen3-0.6b --batch-size 4 --seq-len 512)
    COMPILED_LAYERS=(--layers 4) # whole-model torch.compile takes minutes at 12 and 28 layers
    LAYERS_NOTE="--layers 4: compiled at 4 layers (the presets have 12 and 28) to fit the time budget"
    EAGER_LIMIT=120 QWEN3_LIMIT=150 COMPILED_LIMIT=150 N8_LIMIT=100
else
    BUDGET=${GPU_CHECK_BUDGET:-570}
    WORKERS=${GPU_CHECK_WORKERS:-2}
    PER_TEST=300
    TEST_LIMIT=330
    # Every size shrunk; both shapes become the tiny preset at one layer (qwen3-0.6b's 151 936-token
    # vocabulary alone is 2.5 GB of AdamW state per model on the CPU).
    export S2HC_TEST_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    COMMON=(--device cpu --json --repeats 1 --steps 1 --threads 1)
    GPT2=(--preset tiny --layers 1 --batch-size 1 --seq-len 32)
    QWEN3=(--preset tiny --layers 1 --batch-size 1 --seq-len 32)
    COMPILED_LAYERS=()
    LAYERS_NOTE="dry run: tiny preset, 1 layer"
    EAGER_LIMIT=120 QWEN3_LIMIT=120 COMPILED_LIMIT=180 N8_LIMIT=90
fi
RESERVE=25 # the summary, and `timeout -k 10`'s grace
MIN_STEP=20
FAILED=0

json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}

# record NAME KIND STATUS RC SECONDS LIMIT ARGS NOTE
record() {
    printf '{"mode": "%s", "name": %s, "kind": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "args": %s, "note": %s}\n' \
        "$MODE" "$(json_str "$1")" "$2" "$3" "${4:-null}" "$5" "$6" "$(json_str "$7")" "$(json_str "$8")" \
        >> "$OUT/steps.jsonl"
}

# run_step NAME KIND LIMIT STDOUT STDERR ARGS NOTE -- COMMAND...: COMMAND under `timeout`, its limit cut to the
# budget left; STDOUT and STDERR may be the same file. Skipped when less than MIN_STEP seconds are left.
run_step() {
    local name=$1 kind=$2 want=$3 stdout=$4 stderr=$5 args=$6 note=$7
    shift 8
    local left=$((BUDGET - SECONDS - RESERVE))
    local limit=$((want < left ? want : left))
    if ((limit < MIN_STEP)); then
        echo "== $name: skipped (${left}s of the ${BUDGET}s budget left)"
        record "$name" "$kind" skipped null 0 0 "$args" "budget spent${note:+; $note}"
        return 0
    fi
    echo "== $name (limit ${limit}s)${note:+ [$note]}"
    echo "   $*"
    local start=$SECONDS rc
    if [[ $stdout == "$stderr" ]]; then
        timeout -k 10 "$limit" "$@" > "$stdout" 2>&1
        rc=$?
    else
        timeout -k 10 "$limit" "$@" > "$stdout" 2> "$stderr"
        rc=$?
    fi
    local took=$((SECONDS - start)) status=ok
    if ((rc == 124 || rc == 137)); then
        status=timeout
    elif ((rc != 0)); then
        status=failed
    fi
    [[ $status == ok ]] || FAILED=1
    echo "   $status (exit $rc, ${took}s)"
    if [[ $status != ok && $kind == bench ]]; then
        tail -n 15 "$stderr" | sed 's/^/   | /'
    fi
    record "$name" "$kind" "$status" "$rc" "$took" "$limit" "$args" "$note"
}

echo "GPU check ($MODE) into $OUT; budget ${BUDGET}s; python: $PYTHON"

# --------------------------------------------------------------------------------------------- peer
# The peer travels as wheels (.gpu-wheels/, carried to the device); installed into a temporary directory,
# never into the environment. The dry run always installs it this way, to try the path.
start=$SECONDS
peer_status=ok peer_note="" peer_rc=0
if [[ $MODE == gpu ]] && "$PYTHON" -c 'import hyper_connections' > /dev/null 2>&1; then
    peer_note="already importable"
elif ! ls .gpu-wheels/*.whl > /dev/null 2>&1; then
    peer_status=failed peer_rc=1
    peer_note="no .gpu-wheels/*.whl: the benches run without the peer"
else
    SITE="$WORK/site"
    if timeout 120 "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --find-links .gpu-wheels --target "$SITE" hyper-connections torch-einops-utils; then
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
[[ $peer_status == ok ]] || FAILED=1
record peer setup "$peer_status" "$peer_rc" $((SECONDS - start)) 120 "" "$peer_note"

# ---------------------------------------------------------------------------------------------- env
start=$SECONDS
{
    echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -srm), $(nproc) CPUs, mode $MODE"
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
        nvidia-smi 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    timeout 120 "$PYTHON" benchmarks/gpu_check.py env "$OUT" 2>&1
} | tee "$OUT/env.txt"
env_rc=${PIPESTATUS[0]}
"$PYTHON" -c 'import torch' > /dev/null 2>&1 || env_rc=1
if [[ $MODE == gpu ]] && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
    echo "warning: torch.cuda.is_available() is False: the tests skip and the benches fail"
    env_rc=1
fi
env_status=ok
((env_rc == 0)) || { env_status=failed; FAILED=1; }
record env setup "$env_status" "$env_rc" $((SECONDS - start)) 120 "" ""

# -------------------------------------------------------------------------------------------- tests
# -v: one line per finished test in tests.log, which the summary reads when a cut-short run left no XML.
PYTEST=("$PYTHON" -m pytest tests/test_cuda.py -m cuda -p no:cacheprovider -o addopts= -ra -v
    --junitxml="$OUT/tests.xml")
if ((WORKERS > 1)) && "$PYTHON" -c 'import xdist' > /dev/null 2>&1; then
    PYTEST+=(-n "$WORKERS")
fi
if "$PYTHON" -c 'import pytest_timeout' > /dev/null 2>&1; then
    PYTEST+=(--timeout "$PER_TEST")
fi
run_step tests tests "$TEST_LIMIT" "$OUT/tests.log" "$OUT/tests.log" "${PYTEST[*]:1}" "" -- "${PYTEST[@]}"
tail -n 25 "$OUT/tests.log" | sed 's/^/   | /'

# ------------------------------------------------------------------------------------------ benches
BENCH=("$PYTHON" -m s2hc bench "${COMMON[@]}")
N4=(--streams 4 --families mhc,s2hc,s2hc:kernels=triton,mhc-lite,kromhc) # + residual and the peer (auto)
COMPILED=(--streams 4 --families mhc,s2hc --compile --no-peer --no-coefficients ${COMPILED_LAYERS[@]+"${COMPILED_LAYERS[@]}"})
N8=(--streams 8 --families mhc,s2hc --no-peer --no-coefficients)

bench() { # bench NAME LIMIT NOTE ARGS...
    local name=$1 limit=$2 note=$3
    shift 3
    run_step "$name" bench "$limit" "$OUT/bench-$name.json" "$OUT/bench-$name.log" "$*" "$note" -- \
        "${BENCH[@]}" "$@"
}
bench gpt2-small-n4-eager "$EAGER_LIMIT" "" "${GPT2[@]}" "${N4[@]}"
bench qwen3-0.6b-n4-eager "$QWEN3_LIMIT" "" "${QWEN3[@]}" "${N4[@]}"
bench gpt2-small-n4-compiled "$COMPILED_LIMIT" "$LAYERS_NOTE" "${GPT2[@]}" "${COMPILED[@]}"
bench gpt2-small-n8-eager "$N8_LIMIT" "" "${GPT2[@]}" "${N8[@]}"
bench qwen3-0.6b-n8-eager "$N8_LIMIT" "" "${QWEN3[@]}" "${N8[@]}"
bench qwen3-0.6b-n4-compiled "$COMPILED_LIMIT" "$LAYERS_NOTE" "${QWEN3[@]}" "${COMPILED[@]}"

# ------------------------------------------------------------------------------------------ summary
echo "== summary (${SECONDS}s so far)"
if ! timeout 60 "$PYTHON" benchmarks/gpu_check.py summarize "$OUT"; then
    echo "summary: failed"
    FAILED=1
fi
[[ -f "$OUT/summary.md" ]] && cat "$OUT/summary.md"
echo "GPU check ($MODE) done in ${SECONDS}s: $([[ $FAILED == 0 ]] && echo 'every step passed' || echo 'some steps failed'); files in $OUT"
exit "$FAILED"
