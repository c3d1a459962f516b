#!/usr/bin/env bash
# The runs behind docs/benchmarks.md. Sequential (they share the CPU); one thread each for stable
# ratios on a shared machine. Outputs: benchmarks/results/*.md (tables) and *.log (progress).
set -u
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
bench() { name=$1; shift; .venv/bin/s2hc bench --device cpu --threads 1 "$@" > "$out/$name.md" 2> "$out/$name.log"; }
bench small-n4-eager    --preset small --streams 4 --families s2hc,s2hc:fused=False,s2hc:recompute=True,mhc --repeats 5 --steps 1
bench small-n2-eager    --preset small --streams 2 --families s2hc,mhc --no-peer --repeats 3 --steps 1
bench small-n8-eager    --preset small --streams 8 --families s2hc,mhc --no-peer --repeats 3 --steps 1
bench gpt2-n4-eager     --preset gpt2-small --streams 4 --families s2hc,s2hc:recompute=True,mhc --batch-size 2 --repeats 3 --steps 1
bench small-n4-compiled --preset small --streams 4 --families s2hc,s2hc:recompute=True,mhc --compile --repeats 5 --steps 1
bench gpt2-n4-compiled-run2 --preset gpt2-small --streams 4 --families s2hc,mhc --compile --batch-size 2 --repeats 5 --steps 1
bench gpt2-n4-compiled-s2hc --preset gpt2-small --streams 4 --families s2hc --no-peer --no-coefficients --compile --batch-size 2 --repeats 7 --steps 2
bench small-n2-compiled  --preset small --streams 2 --families s2hc,mhc --no-peer --compile --repeats 3 --steps 1
bench small-n8-compiled  --preset small --streams 8 --families s2hc,mhc --no-peer --compile --repeats 3 --steps 1
bench small-n8-compiled-run2 --preset small --streams 8 --families s2hc,mhc --no-peer --no-coefficients --compile --repeats 5 --steps 2
bench small-n4-eager-families --preset small --streams 4 --families hc,mhc,mhc-lite,kromhc,s2hc,orthogonal,isometric --no-peer --repeats 3 --steps 1
