#!/usr/bin/env bash
# The GPU check: what s2hc wants to know from one CUDA GPU, in one run of at most 8 minutes on a cold machine.
#
#   benchmarks/gpu_check.sh OUT_DIR             # on a machine with a CUDA GPU (budget 480 s)
#   benchmarks/gpu_check.sh --dry-run OUT_DIR   # the same steps on the CPU, every size shrunk
#   benchmarks/gpu_check.sh --plan [--dry-run]  # the plan as JSON lines (budget, steps, limits, commands)
#
# The plan is two tiers. The core steps, most valuable first, have limits that add up to the budget less a reserve
# for the last summary; each may use its own limit plus whatever the core steps before it left unspent, never the
# time of those after it. The extra steps then run on what is left, each cut to it. Every step runs under
# `timeout`; a step stopped at its limit is "cut" (for time): what it wrote is kept and summarised, and it is no
# failure, so the verdict does not depend on how fast or busy the machine is. A step with less than MIN_STEP seconds
# left is skipped, with that reason. Core steps:
#   peer                  hyper-connections (+ torch-einops-utils) from .gpu-wheels/ into a temporary directory
#   env                   nvidia-smi, Python, torch / CUDA / triton / package versions
#   connection            benchmarks/connection_time.py: one connection forward + backward at B·T = 16 384,
#                         C = 4 096, n = 4 (s2hc, mhc, the residual add; float32 and bf16 streams; eager, Triton,
#                         compiled) against the memory-traffic floor at the copy bandwidth measured in the same step
#   bench-gpt2-small-n4-compiled  `s2hc bench --compile` (each block compiled, as training does): all 12 layers,
#                         16 x 1024 tokens a step, bf16 autocast: residual, mhc, s2hc
#   bench-qwen3-0.6b-n4-compiled  the same at Qwen3-0.6B's shape (28 layers, 16 x 1024 tokens): residual, s2hc
#   tests                 pytest: tests/test_cuda.py, tests/test_cuda_syncs.py and the Triton kernel tests that
#                         matter on a GPU (every CUDA path against eager)
#   torchtitan            benchmarks/torchtitan_check.py: s2hc's decoder trained 10 steps by torchtitan's trainer
# Extra steps: kernels (benchmarks/kernel_check.py), eager benches (gpt2-small n = 4 bf16 with every family and the
# peer, n = 8, float32), the rest of the Triton kernel tests, aot (benchmarks/aot_compile.py on a subset).
# Output: at most 8 files in OUT_DIR, each rewritten or appended as steps finish, so a run cut anywhere still
# returns what finished: summary.md, summary.json (rebuilt after every step), steps.jsonl, console.log (all
# that is printed), raw.tar (every raw file of every finished step, appended: `tar -xf raw.tar`), and
# current/ (the files of the step in progress, at most 3, moved into raw.tar when it ends).
#
# s2hc runs from this tree (PYTHONPATH=src); nothing is installed into the Python environment.
# Settings (environment): PYTHON (default python3, or .venv/bin/python when python3 has no torch),
# GPU_CHECK_BUDGET (seconds for the whole run: 480 on a GPU; the dry run's is its steps' limits), GPU_CHECK_ONLY
# (a comma-separated list of step names: the others are skipped, with that reason; peer and env always run),
# GPU_CHECK_LIMITS (NAME=SECONDS,...: other limits for those steps; the default budget follows the core steps'),
# GPU_CHECK_MIN_STEP (the fewest seconds a step is started with: 15 on a GPU, 20 dry), GPU_CHECK_WORKERS
# (pytest-xdist workers: 8 on a GPU, 2 dry), GPU_CHECK_AOT_ARGS (arguments of benchmarks/aot_compile.py).
# Exit status 0 when every step passed, was skipped with its reason or was cut for time; 1 when a step failed (an
# error, a failed test or case, also one that finished inside a step cut for time); 2 on bad usage. The device
# call: benchmarks/README.md, "GPU check".
set -u -o pipefail

usage() {
    echo "usage: $0 [--dry-run] OUT_DIR | $0 --plan [--dry-run]" >&2
    exit 2
}
MODE=gpu PLAN_ONLY=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) MODE=dry-run; shift ;;
        --plan) PLAN_ONLY=1; shift ;;
        -h | --help) sed -n '2,/^set /{/^set /!p;}' "$0"; exit 0 ;;
        -*) usage ;;
        *) break ;;
    esac
done
if [[ -n $PLAN_ONLY ]]; then
    [[ $# -eq 0 ]] || usage
else
    [[ $# -eq 1 && -n "$1" ]] || usage
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

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

# The Triton kernel tests that matter on a GPU (the tests step): the linked call a connection makes, the shapes that
# take other code (several C blocks, 16 streams and more, K beyond one tile, every family's K), bf16 streams and the
# whole connection and model on the kernels. The rest of the file (hypothesis-drawn single kernels, float64
# gradchecks, error messages) is an extra step. -k also matches the module: "test_cuda" keeps both test_cuda files.
KERNEL_TESTS_K="linked_call or several_c_blocks or from_16_streams or families_k or bfloat16_streams"
KERNEL_TESTS_K+=" or with_triton_kernels"
if [[ $MODE == gpu ]]; then
    WORKERS=${GPU_CHECK_WORKERS:-8}
    COMMON=(--device cuda --json --repeats 3 --steps 2)
    # 16 384 tokens a step at both shapes, as the connection is timed at
    GPT2=(--preset gpt2-small --batch-size 16 --seq-len 1024)
    QWEN3=(--preset qwen3-0.6b --batch-size 16 --seq-len 1024)
    GPT2_EAGER=(--preset gpt2-small --batch-size 8 --seq-len 1024)
    GPT2_COMPILED_FAMILIES=mhc,s2hc # + residual; Qwen3-0.6B: s2hc alone (a compile is most of a bench's time)
    CONNECTION=(--tokens 16384 --dim 4096 --streams 4)
    KERNELS=() # kernel_check.py's own sizes on CUDA: T = 8192 tokens, C = 768
    TESTS_K="test_cuda or $KERNEL_TESTS_K"
    KTESTS_K="not ($KERNEL_TESTS_K)"
    AOT_DEFAULT="--arch 90 --streams 8,16 --dtypes bf16,fp32"
    # Limits in seconds. Core: 10 + 15 + 135 + 95 + 80 + 75 + 60 = 470, the budget (480) less the reserve (10).
    # The compiled benches' limits are mostly compile time on a cold cache (one graph per family and mode; the
    # bench's `built` events say how long each took); the connection's compiles its four graphs last.
    L_PEER=10 L_ENV=15 L_CONNECTION=135 L_GPT2_COMPILED=95 L_QWEN3_COMPILED=80 L_TESTS=75 L_TITAN=60
    L_KERNELS=60 L_BF16=45 L_N8=40 L_KTESTS=60 L_FP32=40 L_AOT=30 # extras: on what the core steps leave
    RESERVE=10 MIN_STEP=15
    TITAN_NOTE="s2hc's decoder in torchtitan's trainer: s2hc_debugmodel, 10 steps"
    DRY=()
else
    WORKERS=${GPU_CHECK_WORKERS:-2}
    # Every size shrunk; both shapes become the tiny preset at one layer (qwen3-0.6b's 151 936-token vocabulary
    # alone is 2.5 GB of AdamW state per model on the CPU). The compiled benches compile with inductor for real,
    # residual and s2hc (mhc's 20 Sinkhorn rounds take over a minute to compile on a CPU); the connection's
    # compiled path traces with aot_eager (no code generation: a CPU compile takes most of a minute). The tests
    # are one of each kind, the slow compiled ones left to the benches.
    export S2HC_TEST_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    COMMON=(--device cpu --json --repeats 1 --steps 1 --threads 1)
    GPT2=(--preset tiny --layers 1 --batch-size 1 --seq-len 32)
    QWEN3=("${GPT2[@]}")
    GPT2_EAGER=("${GPT2[@]}")
    GPT2_COMPILED_FAMILIES=s2hc
    CONNECTION=(--tokens 32 --dim 32 --streams 4 --repeats 2 --warmup 1 --compile-backend aot_eager)
    KERNELS=(--tokens 3 --dim 40 --streams 4 --dtypes float32,bfloat16)
    TESTS_K="(test_cuda and s2hc and not bfloat16 and not compiled and not eight)"
    TESTS_K+=" or test_model_with_triton_kernels_matches or test_linked_call_equals_reference"
    KTESTS_K="test_read_equals_reference or test_kernels_option_errors"
    AOT_DEFAULT="--arch 90 --streams 8 --dtypes fp32"
    L_PEER=60 L_ENV=60 L_CONNECTION=150 L_GPT2_COMPILED=240 L_QWEN3_COMPILED=180 L_TESTS=240 L_TITAN=180
    L_KERNELS=180 L_BF16=90 L_N8=90 L_KTESTS=120 L_FP32=90 L_AOT=180
    RESERVE=20 MIN_STEP=20
    TITAN_NOTE="s2hc's decoder in torchtitan's trainer: s2hc_tiny, 3 steps"
    DRY=(--dry-run)
fi

json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}

PEER_WHEELS=(hyper-connections==0.4.11 torch-einops-utils==0.2.0)
TITAN_WHEELS=(torchtitan==0.3.0 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    spmd-types==0.2.3 torch-checkpointing==0.1.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
TITAN_DIR=.gpu-wheels/torchtitan

# ---------------------------------------------------------------------------------------- the run's folders
if [[ -z $PLAN_ONLY ]]; then
    mkdir -p "$1" || exit 2
    OUT=$(cd "$1" && pwd)
    CUR="$OUT/current"
    rm -rf "$CUR" "$OUT"/summary.md "$OUT"/summary.json "$OUT"/steps.jsonl "$OUT"/console.log "$OUT"/raw.tar
    mkdir -p "$CUR" || exit 2
    : > "$OUT/steps.jsonl"
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
    export S2HC_CACHE_DIR="${S2HC_CACHE_DIR:-$WORK/cache}"

    # Everything printed from here on also goes to console.log, as it is printed.
    exec > >(tee -a "$OUT/console.log") 2>&1
    TEE_PID=$!
    cleanup() {
        rm -rf "$WORK"
        exec >&- 2>&-
        wait "$TEE_PID" 2> /dev/null
    }
    trap cleanup EXIT
    FAILED=0

    # The dry run fetches what the device cannot (this machine reaches the package registry; the device does not): the
    # peer's two wheels, and torchtitan's for Python 3.12 (the image's) and for its own Python (multiprocess is tagged
    # by version). Before the budget starts; without them those steps are skipped with their reason.
    if [[ $MODE == dry-run ]] && ! ls .gpu-wheels/*.whl > /dev/null 2>&1; then
        if timeout 120 "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
            -d .gpu-wheels "${PEER_WHEELS[@]}" > "$WORK/peer-download.log" 2>&1; then
            echo "   fetched ${PEER_WHEELS[*]} into .gpu-wheels/"
        else
            rm -rf .gpu-wheels/*.whl.part 2> /dev/null
            echo "   could not fetch the peer's wheels: $(tail -n 1 "$WORK/peer-download.log")"
        fi
    fi
    if [[ $MODE == dry-run ]] && ! ls "$TITAN_DIR"/*.whl > /dev/null 2>&1; then
        mkdir -p "$TITAN_DIR"
        own=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        fetch=("$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all:
            -d "$TITAN_DIR")
        log="$WORK/titan-download.log"
        if timeout 120 "${fetch[@]}" --python-version 3.12 "${TITAN_WHEELS[@]}" > "$log" 2>&1 &&
            timeout 120 "${fetch[@]}" --python-version "$own" multiprocess==0.70.18 >> "$log" 2>&1; then
            echo "   fetched ${TITAN_WHEELS[*]} into $TITAN_DIR/"
        else
            rm -f "$TITAN_DIR"/*.whl "$TITAN_DIR"/*.whl.part 2> /dev/null
            echo "   could not fetch torchtitan's wheels: $(tail -n 1 "$log")"
        fi
    fi
fi

# ------------------------------------------------------------------------------------------------ the plan
# plan NAME KIND TIER LIMIT STDOUT STDERR ARGS NOTE SKIP -- COMMAND...: a step. STDOUT and STDERR are file names in
# current/ (the same name: one file); ARGS is what steps.jsonl records of its arguments (the summary reads the
# benches' settings from it); SKIP, when not empty, is why it will not run. COMMAND is kept quoted and run with eval,
# @CUR@ and @WORK@ in it replaced by the run's folders (the plan is made before they exist).
P_NAME=() P_KIND=() P_TIER=() P_LIMIT=() P_OUT=() P_ERR=() P_ARGS=() P_NOTE=() P_SKIP=() P_CMD=()
plan() {
    P_NAME+=("$1") P_KIND+=("$2") P_TIER+=("$3") P_LIMIT+=("$4") P_OUT+=("$5") P_ERR+=("$6") P_ARGS+=("$7")
    P_NOTE+=("$8") P_SKIP+=("$9")
    shift 10
    local quoted
    printf -v quoted '%q ' "$@"
    P_CMD+=("$quoted")
}

bench() { # bench NAME TIER LIMIT NOTE ARGS...: bench-NAME.json (stdout), .log (progress), .jsonl (events)
    local name=bench-$1 tier=$2 limit=$3 note=$4
    shift 4
    plan "$name" bench "$tier" "$limit" "$name.json" "$name.log" "$*" "$note" "" -- \
        "$PYTHON" -m s2hc bench "${COMMON[@]}" --jsonl "@CUR@/$name.jsonl" "$@"
}

pytest_step() { # pytest_step NAME TIER LIMIT NOTE PYTEST-ARGS...: NAME.xml (JUnit), NAME.log (-v: a line per test)
    local name=$1 tier=$2 limit=$3 note=$4
    shift 4
    # No per-test timeout: a test stopped by one would fail for the machine's load; the step's limit cuts instead,
    # and the verbose log says what finished.
    local cmd=("$PYTHON" -m pytest "$@" -p no:cacheprovider -o addopts= -ra -v --junitxml="@CUR@/$name.xml")
    if ((WORKERS > 1)) && "$PYTHON" -c 'import xdist' > /dev/null 2>&1; then
        cmd+=(-n "$WORKERS")
    fi
    plan "$name" tests "$tier" "$limit" "$name.log" "$name.log" "${cmd[*]:1}" "$note" "" -- "${cmd[@]}"
}

CUDA_TESTS=(tests/test_cuda.py)
[[ -f tests/test_cuda_syncs.py ]] && CUDA_TESTS+=(tests/test_cuda_syncs.py)
COMPILED=(--dtype bfloat16 --streams 4 --compile --no-peer --no-coefficients)
# shellcheck disable=SC2206 # GPU_CHECK_AOT_ARGS is a list of words
AOT=(${GPU_CHECK_AOT_ARGS:-$AOT_DEFAULT}) # the ahead-of-time compile tool, with the image's triton and ptxas

# the core steps, most valuable first
plan peer setup core "$L_PEER" "" "" "" "the peer's wheels" "" -- builtin
plan env setup core "$L_ENV" env.txt env.txt "" "" "" -- builtin
plan connection connection core "$L_CONNECTION" connection.log connection.log "${CONNECTION[*]}" \
    "one connection fwd+bwd against the memory-traffic floor" "" -- \
    "$PYTHON" benchmarks/connection_time.py "${CONNECTION[@]}" --jsonl "@CUR@/connection.jsonl"
bench gpt2-small-n4-compiled core "$L_GPT2_COMPILED" "compiled per block, as training runs" "${GPT2[@]}" \
    "${COMPILED[@]}" --families "$GPT2_COMPILED_FAMILIES"
bench qwen3-0.6b-n4-compiled core "$L_QWEN3_COMPILED" "compiled per block, as training runs" "${QWEN3[@]}" \
    "${COMPILED[@]}" --families s2hc
pytest_step tests core "$L_TESTS" "every CUDA path against eager" "${CUDA_TESTS[@]}" tests/test_triton_kernels.py \
    -k "$TESTS_K"
titan_skip=""
if ! ls "$TITAN_DIR"/*.whl > /dev/null 2>&1 && ! "$PYTHON" -c 'import torchtitan.trainer' > /dev/null 2>&1; then
    titan_skip="no $TITAN_DIR/*.whl and torchtitan not importable (fetch: pip download ${TITAN_WHEELS[*]} --no-deps"
    titan_skip+=" --only-binary=:all: --python-version 3.12 -d $TITAN_DIR)"
fi
plan torchtitan tool core "$L_TITAN" torchtitan.log torchtitan.log "${DRY[*]-}" "$TITAN_NOTE" "$titan_skip" -- \
    "$PYTHON" benchmarks/torchtitan_check.py ${DRY[@]+"${DRY[@]}"} "$TITAN_DIR" "@WORK@/torchtitan"
# the extra steps, on what the core steps left
plan kernels kernels extra "$L_KERNELS" kernels.log kernels.log "${KERNELS[*]-}" "the Triton kernels alone" "" -- \
    "$PYTHON" benchmarks/kernel_check.py --jsonl "@CUR@/kernels.jsonl" ${KERNELS[@]+"${KERNELS[@]}"}
bench gpt2-small-n4-bf16 extra "$L_BF16" "eager, every family and the peer" "${GPT2_EAGER[@]}" --dtype bfloat16 \
    --streams 4 --families mhc,s2hc,s2hc:kernels=triton,mhc-lite,kromhc
bench gpt2-small-n8-bf16 extra "$L_N8" "eager, n = 8" "${GPT2_EAGER[@]}" --dtype bfloat16 --streams 8 \
    --families mhc,s2hc,s2hc:kernels=triton --no-peer --no-coefficients
pytest_step kernel-tests extra "$L_KTESTS" "the rest of tests/test_triton_kernels.py" tests/test_triton_kernels.py \
    -k "$KTESTS_K"
bench gpt2-small-n4-fp32 extra "$L_FP32" "eager, float32 (TF32 off)" "${GPT2_EAGER[@]}" --dtype float32 --streams 4 \
    --families mhc,s2hc,s2hc:kernels=triton --no-peer --no-coefficients
plan aot tool extra "$L_AOT" aot.log aot.log "${AOT[*]}" "ahead-of-time compile tool, a subset" "" -- \
    "$PYTHON" benchmarks/aot_compile.py "${AOT[@]}" --json "@CUR@/aot.json" --markdown "@CUR@/aot.md"

# GPU_CHECK_LIMITS=NAME=SECONDS,...: other limits for the steps named (a second try that gives one step more time)
for pair in ${GPU_CHECK_LIMITS:+${GPU_CHECK_LIMITS//,/ }}; do
    found=""
    for i in "${!P_NAME[@]}"; do
        if [[ ${P_NAME[$i]} == "${pair%%=*}" && ${pair#*=} =~ ^[0-9]+$ ]]; then
            P_LIMIT[i]=${pair#*=} found=1
        fi
    done
    [[ -n $found ]] || { echo "$0: GPU_CHECK_LIMITS: $pair is not NAME=SECONDS for a step of the plan" >&2; exit 2; }
done
for only in ${GPU_CHECK_ONLY:+${GPU_CHECK_ONLY//,/ }}; do # a misspelt name would skip every step
    [[ " ${P_NAME[*]} " == *" $only "* ]] || { echo "$0: GPU_CHECK_ONLY: $only is no step of the plan" >&2; exit 2; }
done
MIN_STEP=${GPU_CHECK_MIN_STEP:-$MIN_STEP}

# The budget: on a GPU the core steps' limits and the reserve (480 s); in the dry run every step's, so that every
# step runs to its end and is tried.
CORE=0 EXTRA=0 CUMULATIVE=()
for i in "${!P_NAME[@]}"; do
    if [[ ${P_TIER[$i]} == core ]]; then
        CORE=$((CORE + P_LIMIT[i]))
    else
        EXTRA=$((EXTRA + P_LIMIT[i]))
    fi
    CUMULATIVE+=("$CORE")
done
if [[ $MODE == gpu ]]; then
    BUDGET=${GPU_CHECK_BUDGET:-$((CORE + RESERVE))}
else
    BUDGET=${GPU_CHECK_BUDGET:-$((CORE + EXTRA + RESERVE))}
fi

if [[ -n $PLAN_ONLY ]]; then
    printf '{"kind": "settings", "mode": "%s", "budget_s": %s, "reserve_s": %s, "core_s": %s, "extra_s": %s, "min_step_s": %s}\n' \
        "$MODE" "$BUDGET" "$RESERVE" "$CORE" "$EXTRA" "$MIN_STEP"
    for i in "${!P_NAME[@]}"; do
        printf '{"kind": "step", "index": %s, "name": %s, "step_kind": "%s", "tier": "%s", "limit_s": %s, "args": %s, "note": %s, "skip": %s, "command": %s}\n' \
            "$i" "$(json_str "${P_NAME[$i]}")" "${P_KIND[$i]}" "${P_TIER[$i]}" "${P_LIMIT[$i]}" \
            "$(json_str "${P_ARGS[$i]}")" "$(json_str "${P_NOTE[$i]}")" "$(json_str "${P_SKIP[$i]}")" \
            "$(json_str "${P_CMD[$i]}")"
    done
    exit 0
fi

# record NAME KIND TIER STATUS RC SECONDS LIMIT ARGS NOTE: one line of steps.jsonl
record() {
    printf '{"mode": "%s", "name": %s, "kind": "%s", "tier": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "args": %s, "note": %s}\n' \
        "$MODE" "$(json_str "$1")" "$2" "$3" "$4" "${5:-null}" "$6" "$7" "$(json_str "$8")" "$(json_str "$9")" \
        >> "$OUT/steps.jsonl"
}

# finish_step: the step's files from current/ appended to raw.tar, the summary rebuilt
finish_step() {
    timeout 30 "$PYTHON" benchmarks/gpu_check.py finish-step "$OUT" | sed 's/^/   /'
}

# step_limit I: the seconds step I may run. A core step: its own limit plus what the core steps before it left
# unspent (their limits' sum up to it, less the time spent); an extra step: its limit, cut to what is left.
step_limit() {
    local i=$1 rest=$((BUDGET - RESERVE - SECONDS))
    if [[ ${P_TIER[$i]} == core ]]; then
        local own=$((CUMULATIVE[i] - SECONDS))
        echo $((own < rest ? own : rest))
    else
        echo $((P_LIMIT[i] < rest ? P_LIMIT[i] : rest))
    fi
}

# ------------------------------------------------------------------------- the two built-in setup steps
# The peer travels as wheels (.gpu-wheels/, carried to the device); installed into a temporary directory,
# never into the environment. The dry run always installs it this way, to try the path.
# Without the wheels the step is skipped with its reason: the peer is a comparison, not s2hc, so its absence is no
# failure of the check (the benches run without it).
run_peer() { # run_peer LIMIT: sets STATUS, RC, NOTE
    STATUS=ok NOTE="" RC=0
    if [[ $MODE == gpu ]] && "$PYTHON" -c 'import hyper_connections' > /dev/null 2>&1; then
        NOTE="already importable"
        return
    elif ! ls .gpu-wheels/*.whl > /dev/null 2>&1; then
        STATUS=skipped RC=null
        NOTE="no .gpu-wheels/*.whl (fetch: pip download ${PEER_WHEELS[*]} --no-deps -d .gpu-wheels): the benches run without the peer"
        return
    fi
    SITE="$WORK/site"
    timeout -k 5 "$1" "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --no-compile --find-links .gpu-wheels --target "$SITE" hyper-connections torch-einops-utils
    RC=$?
    if ((RC == 0)); then
        NOTE="pip install --target from .gpu-wheels"
    elif ((RC == 124 || RC == 137)); then
        STATUS=cut NOTE="cut for time at its ${1}s limit: the benches run without the peer"
        return
    else # no pip: a wheel is a zip file
        "$PYTHON" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$SITE" .gpu-wheels/*.whl
        NOTE="unzipped from .gpu-wheels (pip failed)" RC=0
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
    if ! "$PYTHON" -c 'import hyper_connections' 2>&1; then
        STATUS=failed RC=1 NOTE="$NOTE; still not importable"
    fi
}

run_env() { # run_env LIMIT: env.txt and env.json into current/; sets STATUS, RC, NOTE
    STATUS=ok NOTE="" RC=0
    {
        echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -srm), $(nproc) CPUs, mode $MODE"
        if command -v nvidia-smi > /dev/null 2>&1; then
            timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
                --format=csv 2>&1
            timeout 10 nvidia-smi 2>&1
        else
            echo "nvidia-smi: not found"
        fi
        timeout -k 5 "$1" "$PYTHON" benchmarks/gpu_check.py env "$CUR" 2>&1
    } > "$CUR/env.txt"
    RC=$?
    cat "$CUR/env.txt"
    if ((RC == 124 || RC == 137)); then
        STATUS=cut NOTE="cut for time at its ${1}s limit"
        return
    fi
    "$PYTHON" -c 'import torch' > /dev/null 2>&1 || RC=1
    if [[ $MODE == gpu ]] && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2> /dev/null; then
        echo "warning: torch.cuda.is_available() is False: the tests skip and the benches fail"
        RC=1 NOTE="torch sees no CUDA device"
    fi
    ((RC == 0)) || STATUS=failed
}

echo "GPU check ($MODE) into $OUT; budget ${BUDGET}s (core steps ${CORE}s, reserve ${RESERVE}s); python: $PYTHON;" \
    "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
SECONDS=0 # the budget starts here

# ------------------------------------------------------------------------------------------------ the steps
for i in "${!P_NAME[@]}"; do
    name=${P_NAME[$i]} kind=${P_KIND[$i]} tier=${P_TIER[$i]} args=${P_ARGS[$i]//@CUR@/$CUR} note=${P_NOTE[$i]}
    limit=$(step_limit "$i")
    skip=${P_SKIP[$i]}
    if [[ -z $skip && -n ${GPU_CHECK_ONLY:-} && $kind != setup && ",$GPU_CHECK_ONLY," != *",$name,"* ]]; then
        skip="not in GPU_CHECK_ONLY ($GPU_CHECK_ONLY)"
    fi
    if [[ -z $skip ]] && ((limit < MIN_STEP)); then
        skip="budget spent: ${limit}s left for it at ${SECONDS}s of ${BUDGET}s"
    fi
    if [[ -n $skip ]]; then
        echo "== $name: skipped ($skip)"
        record "$name" "$kind" "$tier" skipped null 0 0 "$args" "$skip"
        finish_step
        continue
    fi
    echo "== $name ($tier, limit ${limit}s, ${SECONDS}s so far)${note:+ [$note]}"
    start=$SECONDS
    if [[ $name == peer ]]; then
        run_peer "$limit"
    elif [[ $name == env ]]; then
        run_env "$limit"
    else
        eval "cmd=(${P_CMD[$i]})"
        cmd=("${cmd[@]//@CUR@/$CUR}")
        cmd=("${cmd[@]//@WORK@/$WORK}")
        echo "   ${cmd[*]}"
        stdout=$CUR/${P_OUT[$i]} stderr=$CUR/${P_ERR[$i]}
        if [[ $stdout == "$stderr" ]]; then
            timeout -k 5 "$limit" "${cmd[@]}" > "$stdout" 2>&1
        else
            timeout -k 5 "$limit" "${cmd[@]}" > "$stdout" 2> "$stderr"
        fi
        RC=$? STATUS=ok NOTE=$note
        # Stopped by `timeout` (124; 137 after its KILL at the limit, not a kill before it, such as the OOM
        # killer's): its limit, not its result.
        if ((RC == 124 || (RC == 137 && SECONDS - start >= limit))); then
            STATUS=cut NOTE="${note:+$note; }cut for time at its ${limit}s limit: what it wrote is kept"
        elif ((RC != 0)); then
            STATUS=failed
        fi
    fi
    took=$((SECONDS - start))
    [[ $STATUS == failed ]] && FAILED=1
    echo "   $STATUS (exit $RC, ${took}s)${NOTE:+: $NOTE}"
    if [[ $kind != setup ]] && [[ $STATUS != ok || $kind =~ ^(kernels|tests|connection)$ ]]; then
        tail -n 12 "$stderr" | sed 's/^/   | /'
    fi
    record "$name" "$kind" "$tier" "$STATUS" "$RC" "$took" "$limit" "$args" "$NOTE"
    finish_step
done

# ------------------------------------------------------------------------------------------------ summary
echo "== summary (${SECONDS}s so far)"
if ! timeout 60 "$PYTHON" benchmarks/gpu_check.py finish-step "$OUT"; then
    echo "summary: failed"
    FAILED=1
fi
[[ -f "$OUT/summary.md" ]] && cat "$OUT/summary.md"
# The verdict reads every step's results, also those of a step cut for time (a test that failed before the cut).
timeout 60 "$PYTHON" benchmarks/gpu_check.py verdict "$OUT"
verdict=$?
((verdict == 0 || verdict == 1)) || verdict=1
((FAILED)) && verdict=1
if ((verdict == 0)); then
    said="every step ok, skipped with its reason or cut for time"
else
    said="a step failed"
fi
echo "GPU check ($MODE) done in ${SECONDS}s: $said; files in $OUT"
exit "$verdict"
