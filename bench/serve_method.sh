#!/usr/bin/env bash
# One method's serving sweep on this machine: start bench/serve_random.py, wait until it answers, run bench/serve.py
# against it, then stop it. Run from anywhere (paths are the caller's):
#   bench/serve_method.sh METHOD RATE OUT.json [serve.py flags...]     (METHOD none, zack or palu; RATE ignored for none)
# SERVER_FLAGS passes flags to serve_random.py (e.g. SERVER_FLAGS="--cache-memory 20GiB"); PORT picks the port;
# LABEL names the method in the JSON (default "METHOD RATE", or "none").
set -euo pipefail
method=$1 rate=$2 out=$3
shift 3
port=${PORT:-8000}
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"  # where ``bench`` is a package
# shellcheck disable=SC2086  # SERVER_FLAGS is a list of flags
python3 -m bench.serve_random --method "$method" --rate "$rate" --port "$port" ${SERVER_FLAGS:-} &
server=$!
stop() { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop EXIT
trap 'stop; exit 143' TERM INT
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    kill -0 "$server" 2>/dev/null || { echo "serve_method.sh: the server exited before answering" >&2; exit 1; }
    sleep 2
done
label=$method
[ "$method" != none ] && label="$method $rate"
label=${LABEL:-$label}
# in the background so a TERM (e.g. from timeout) stops both at once instead of waiting for the load to end
python3 -m bench.serve --url "http://127.0.0.1:$port" --method "$label" --json "$out" "$@" &
load=$!
trap 'kill "$load" 2>/dev/null; stop; exit 143' TERM INT
wait "$load"
