#!/usr/bin/env bash
# The runs behind docs/benchmarks.md, re-run with the current code. Sequential (they share the CPU); one
# torch thread each for stable ratios on a shared machine. Each writes its table to
# benchmarks/results/NAME.md; progress (the per-repetition times) goes to the terminal, prefixed [NAME].
#   bash benchmarks/run_all.sh [PATTERN]   # only the runs whose NAME matches the bash regex PATTERN
# Not re-run here: small-n4-eager-s2hc-paths-vs-mhc-broadcast-map.md (a code state that no longer exists)
# and gpt2-small-n4-compiled-s2hc-vs-mhc-repeats3.md (the same command as -repeats5 with --repeats 3).
set -u
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
pattern=${1-}
bench() {
    name=$1; shift
    [[ -z $pattern || $name =~ $pattern ]] || return 0
    .venv/bin/s2hc bench --device cpu --threads 1 "$@" > "$out/$name.md" 2> >(sed "s/^/[$name] /" >&2)
}
bench small-n4-eager-s2hc-paths-vs-mhc       --preset small --streams 4 --families s2hc,s2hc:fused=False,s2hc:recompute=True,mhc --repeats 5 --steps 1
bench small-n2-eager-s2hc-vs-mhc             --preset small --streams 2 --families s2hc,mhc --no-peer --repeats 3 --steps 1
bench small-n8-eager-s2hc-vs-mhc             --preset small --streams 8 --families s2hc,mhc --no-peer --repeats 3 --steps 1
bench gpt2-small-n4-eager-s2hc-recompute-vs-mhc --preset gpt2-small --streams 4 --families s2hc,s2hc:recompute=True,mhc --batch-size 2 --repeats 3 --steps 1
bench small-n4-compiled-s2hc-recompute-vs-mhc --preset small --streams 4 --families s2hc,s2hc:recompute=True,mhc --compile --repeats 5 --steps 1
bench gpt2-small-n4-compiled-s2hc-vs-mhc-repeats5 --preset gpt2-small --streams 4 --families s2hc,mhc --compile --batch-size 2 --repeats 5 --steps 1
bench gpt2-small-n4-compiled-s2hc-vs-residual --preset gpt2-small --streams 4 --families s2hc --no-peer --no-coefficients --compile --batch-size 2 --repeats 7 --steps 2
bench small-n2-compiled-s2hc-vs-mhc          --preset small --streams 2 --families s2hc,mhc --no-peer --compile --repeats 3 --steps 1
bench small-n8-compiled-s2hc-vs-mhc-repeats3 --preset small --streams 8 --families s2hc,mhc --no-peer --compile --repeats 3 --steps 1
bench small-n8-compiled-s2hc-vs-mhc-repeats5-steps2 --preset small --streams 8 --families s2hc,mhc --no-peer --no-coefficients --compile --repeats 5 --steps 2
bench small-n4-eager-all-families            --preset small --streams 4 --families hc,mhc,mhc-lite,kromhc,s2hc,orthogonal,isometric --no-peer --repeats 3 --steps 1
bench tiny-n4-eager-activation-checkpointing  --preset tiny --streams 4 --families mhc,s2hc --activation-checkpointing --no-peer --no-coefficients --repeats 9 --steps 2
bench tiny-n8-eager-activation-checkpointing  --preset tiny --streams 8 --families mhc,s2hc --activation-checkpointing --no-peer --no-coefficients --repeats 9 --steps 2
bench small-n4-eager-activation-checkpointing --preset small --streams 4 --families mhc,s2hc --activation-checkpointing --no-peer --no-coefficients --repeats 5 --steps 1
bench small-n8-eager-activation-checkpointing --preset small --streams 8 --families mhc,s2hc --activation-checkpointing --no-peer --no-coefficients --repeats 5 --steps 1
bench tiny-n4-compiled-activation-checkpointing --preset tiny --streams 4 --families s2hc --activation-checkpointing --no-peer --no-coefficients --compile --repeats 5 --steps 2
# every family at small, eager and compiled (each block compiled, as training does), beside the FLOP prediction
families=hc,mhc,mhc-lite,kromhc,s2hc,orthogonal,isometric,ihc,mhc-lagged,gated-residual,attn-res,attn-res:variant=full,wide-residual,vp-residual
bench small-n4-eager-every-family            --preset small --streams 4 --families $families --no-peer --repeats 3 --steps 2
bench small-n4-compiled-every-family         --preset small --streams 4 --families $families --no-peer --no-coefficients --compile --repeats 3 --steps 2
# how cost grows with the streams n and the width C (eager; the coefficient table splits off the per-token small ops)
for n in 2 4 8 16; do
    bench small-n$n-eager-growth             --preset small --streams $n --families hc,mhc,s2hc --no-peer --repeats 3 --steps 2
done
for c in 128 512 1024; do
    bench small-c$c-n4-eager-growth          --preset small --dim $c --streams 4 --families hc,mhc,s2hc --no-peer --repeats 3 --steps 2
done
