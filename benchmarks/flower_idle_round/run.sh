#!/usr/bin/env bash
# A round of Flower 1.41 with no work, on one machine, insecure (loopback):
# a SuperLink, two SuperNodes with Flower's own SuperExec, and a run of
# idle_app.py. Prints each round's seconds. Needs only `pip install flwr==1.41.0`.
#
#   bash benchmarks/flower_idle_round/run.sh [ROUNDS]
#
# Set FLWR_SUPEREXEC_TASK_POLL_INTERVAL (Flower's default: 1 s) to see the
# SuperExec's share; the SuperNode's 3 s idle sleep and the ClientApp's 1 s
# first object-pull backoff are constants in Flower's code.
set -euo pipefail
app=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
export FLWR_HOME=$work/home FLWR_DISABLE_UPDATE_CHECK=1
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
flower-superlink --insecure --isolation subprocess --port 9390 \
    --database "$work/link.db" --disable-runtime-dependency-installation \
    >"$work/link.log" 2>&1 & pids+=($!)
sleep 3
for k in 0 1; do
    FLWR_HOME=$work/node-$k flower-supernode --insecure --superlink 127.0.0.1:9390 \
        --port $((9490 + k)) >"$work/node-$k.log" 2>&1 & pids+=($!)
done
mkdir -p "$FLWR_HOME"
printf '[superlink]\ndefault = "here"\n\n[superlink.here]\naddress = "127.0.0.1:9390"\ninsecure = true\n' \
    >"$FLWR_HOME/config.toml"
flwr run "$app" here --stream --run-config "rounds=${1:-6}" 2>&1 | grep --line-buffered "^round"
