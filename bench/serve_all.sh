#!/usr/bin/env bash
# Several methods' serving sweeps in turn on this machine (bench/serve_method.sh for each), every one under the same
# server and load flags. Run from anywhere (paths are the caller's):
#   bench/serve_all.sh OUTDIR SECONDS "serve.py flags" METHOD...
# METHOD is none, zack:RATE, palu:RATE or palu:RATE:uniform (one width for every head), each optionally with
# +int4 or +int2 (quantized KV pages: serve_random.py --kv-bits), e.g. none+int4, zack:0.5+int4, or with /POLICY
# (each prompt evicted once prefilled: serve_random.py --evict), e.g. zack:0.5/kvcompress:4x. The whole run ends
# within SECONDS: each method gets the time left (start-up, compile and sweep). Each writes OUTDIR/serve-<method>.json
# (rewritten after every rate, so a sweep cut short keeps its finished rates) and OUTDIR/serve-<method>.log (the
# server's and the load's output).
# SERVER_FLAGS passes flags to every serve_random.py (e.g. "--cache-memory 20GiB --max-batch 64 --shape mistral-7b").
set -uo pipefail
outdir=$1 load=$3
deadline=$((SECONDS + $2))
shift 3
mkdir -p "$outdir"
for spec in "$@"; do
    bits="" evict=""
    [[ $spec == */* ]] && evict=${spec#*/} && spec=${spec%%/*}
    [[ $spec == *+int[0-9] ]] && bits=${spec##*+int} && spec=${spec%+int*}
    IFS=: read -r method rate plan <<<"$spec"
    name=$method${rate:+-$rate}${plan:+-$plan}${bits:+-int$bits}${evict:+-${evict/:/-}}
    flags="${SERVER_FLAGS:-}${plan:+ --plan $plan}${bits:+ --kv-bits $bits}${evict:+ --evict $evict}"
    left=$((deadline - SECONDS))
    [ "$left" -gt 10 ] || { echo "== $name: no time left"; continue; }
    echo "== $name ($(date +%T), ${left} s left)"
    # shellcheck disable=SC2086  # $load is a list of flags
    LABEL="$method${rate:+ $rate}${plan:+ $plan}${bits:+ int$bits}${evict:+ + $evict}" SERVER_FLAGS=$flags timeout "$left" \
        "$(dirname "$0")/serve_method.sh" "$method" "${rate:-0}" "$outdir/serve-$name.json" $load >"$outdir/serve-$name.log" 2>&1
    echo "   exit $? ($(date +%T))"
    grep -E "compiled|KV cache|^\|" "$outdir/serve-$name.log" || true
done
