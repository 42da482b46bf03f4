#!/bin/bash
# pollen's GPU checks, in one command (docs/performance.md, "On an NVIDIA H100").
#   1. CUDA paths: device=cuda/auto pick the GPU; fractional GPUs in simulation
#      (client-resources-num-gpus=0.25); device=cuda with no GPU share; the
#      quick test suite with CUDA present.
#   2. benchmarks/throughput.py's cifar10-cnn: pollen against the floor on the GPU.
#   3. seed 001's FedDyn run (configs/feddyn-cifar10.toml) for the time left,
#      with checkpoint-every, stopped by SIGTERM (a resumable stop).
# Each step has its own timeout. Everything is tee'd into $OUT.
# On the CPU machine: LOCAL=1 BUDGET=... bash benchmarks/gpu/run.sh (small sizes; see README.md).
set -u
export PYTHONUNBUFFERED=1
REPO=$PWD
C=$REPO/.gpu/carry
OUTD=${OUT:-/tmp/gpu-out}
mkdir -p "$OUTD"
exec > >(tee -a "$OUTD/log.txt") 2>&1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
LOCAL=${LOCAL:-0}
GPUS=${GPUS:-0.25}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
step() { echo; echo "=== $* (t=$(($(date +%s) - T0))s, left $(left)s) ==="; }

if [ "$LOCAL" = 1 ]; then
    PY=$REPO/.venv/bin/python
    DATA=${DATA:-/tmp/gpu-data}
    mkdir -p "$DATA" && cp -n "$C/data/cifar10-jpeg.tar.gz" "$DATA/"
    SMALL="num-clients=4 local-epochs=1"
else
    step setup
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "cpus $(nproc); $(free -g | awk '/Mem/ {print $2}') GiB; /dev/shm $(df -h /dev/shm | awk 'NR==2 {print $2}')"
    mkdir -p /tmp/site
    tar -C /tmp/site -xJf "$C/site.tar.xz" || python3 -c "import tarfile; tarfile.open('$C/site.tar.xz').extractall('/tmp/site')" || exit 3
    PY=$(python3 -c 'import sys; print(sys.executable)')
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$C"/opacus-*.whl || echo "opacus: not installed"
    for f in /tmp/site/bin/*; do sed -i "1s|^#!.*python.*$|#!$PY|" "$f"; done
    BIN=$(dirname "$PY")
    if ! touch "$BIN/.pollen-w" 2>/dev/null; then  # the image's venv is read-only: a venv of our own
        base=$PY
        "$PY" -m venv --without-pip /tmp/pv || exit 3
        PURE=$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        PY=/tmp/pv/bin/python3; BIN=/tmp/pv/bin
        export PYTHONPATH_EXTRA=$PURE
    fi
    rm -f "$BIN/.pollen-w"
    printf '#!%s\nimport sys\nfrom pollen.cli import main\nsys.exit(main())\n' "$PY" > "$BIN/pollen"
    chmod +x "$BIN/pollen"
    export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH_EXTRA:+:$PYTHONPATH_EXTRA}
    export PATH=$BIN:/tmp/site/bin:$PATH
    DATA=$C/data
    SMALL="num-clients=10"
fi
POLLEN=$(dirname "$PY")/pollen
RUNS=/tmp/gpu-runs
mkdir -p "$RUNS"
"$PY" -c "
import sys, torch, numpy, flwr, ray, pollen
print('python', sys.version.split()[0], sys.executable)
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
print('numpy', numpy.__version__, 'flwr', flwr.__version__, 'ray', ray.__version__, 'pollen', pollen.__file__)
import flwr_datasets, datasets, pyarrow; print('flwr-datasets', flwr_datasets.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)
" || { echo "IMPORTS FAILED"; [ "$LOCAL" = 1 ] || exit 4; }

# GPU monitor: elapsed s, GPU memory used, utilisation, processes on the GPU
if command -v nvidia-smi >/dev/null; then
    (while :; do
        t=$(($(date +%s) - T0))
        g=$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits | tr -d ' ')
        a=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | tr -d ' ' | tr '\n' ';')
        echo "$t $g $a"
        sleep 1
    done > "$OUTD/gpu-monitor.txt" 2>&1) &
    MONITOR=$!
fi

step "decode CIFAR-10 once (pollen's loader, into the disk cache)"
timeout 120 "$PY" -c "
import time; t = time.time()
from pollen.task.data import check_readable
check_readable('cifar10', '$DATA', False)
print(f'decoded in {time.time() - t:.1f} s')
"

if [ "${SKIP1:-0}" != 1 ]; then
step "1a. pick_device and the local device check"
timeout 60 "$PY" -c "
from pollen.task.train import pick_device
from pollen.deployment.run_config import check_local_device
for name in ('auto', 'cuda', 'cpu'):
    try:
        print(name, '->', pick_device(name)); check_local_device(name)
    except Exception as err:
        print(name, '->', type(err).__name__, err)
"

# one short simulation: cnn on CIFAR-10, 2 rounds; prints where the clients trained
cuda_run() {  # name, timeout, -c value, federation values...
    local name=$1 secs=$2 extra=$3; shift 3
    local fed=()
    for v in "$@"; do fed+=(--federation-config "$v"); done
    local started=$(($(date +%s) - T0))
    timeout -k 20 "$secs" "$POLLEN" run . -c "data-set='cifar10' model='cnn' $SMALL rounds=2 data-root='$DATA' output-dir='$RUNS' run-name='$name' $extra" "${fed[@]}"
    echo "exit $? ($name, started at t=${started}s)"
    "$PY" -c "
import json, pathlib
d = pathlib.Path('$RUNS/$name')
s = json.loads((d / 'summary.json').read_text()) if (d / 'summary.json').exists() else {}
h = json.loads((d / 'history.json').read_text()) if (d / 'history.json').exists() else []
print('summary:', {k: s.get(k) for k in ('status', 'error', 'rounds', 'final-accuracy', 'total-seconds')} if s else 'none')
print('rounds s:', [round(r['seconds'], 2) for r in h], 'accuracy:', [r.get('accuracy') for r in h])
" 2>&1 | tail -3
    [ -f "$RUNS/$name/flower.log" ] && grep -iE "cuda|out of memory|error|Traceback" "$RUNS/$name/flower.log" | head -8
}

step "1b. device='cuda', client-resources-num-gpus=$GPUS"
cuda_run cuda-frac 90 "device='cuda'" "client-resources-num-gpus=$GPUS"
step "1c. device='auto', client-resources-num-gpus=$GPUS"
cuda_run auto-frac 90 "device='auto'" "client-resources-num-gpus=$GPUS"
step "1e. the quick test suite with CUDA present (-m 'not integration')"
timeout -k 10 ${PYTEST_SECS:-80} "$PY" -m pytest -p no:cacheprovider --basetemp=/tmp/gpu-pytest \
    -m "not integration" -q -rfEs -n ${PYTEST_WORKERS:-16} ${PYTEST_TIMEOUT---timeout=60} \
    -W ignore::DeprecationWarning ${PYTEST_ARGS:-tests} 2>&1 | grep -vE "^\.|^s+$" | tail -60
echo "pytest exit ${PIPESTATUS[0]}"
step "1d. device='cuda' without a GPU share (Ray hides the GPU from the actors)"
cuda_run cuda-noshare 60 "device='cuda'"

fi

if [ "${SKIP2:-0}" != 1 ]; then
step "2. throughput: cifar10-cnn, pollen (num-gpus=$GPUS) and pollen-serial (num-gpus=1) against the floor"
timeout -k 20 ${THROUGHPUT_SECS:-170} "$PY" benchmarks/gpu/gpu_throughput.py --data-root "$DATA" \
    --workload ${THROUGHPUT_WORKLOAD:-cifar10-cnn} \
    --rounds ${THROUGHPUT_ROUNDS:-3} --gpus "$GPUS"
echo "throughput exit $?"
fi

FEDDYN_SECS=$(($(left) - 75))
step "3. FedDyn, configs/feddyn-cifar10.toml, for ${FEDDYN_SECS}s then SIGTERM"
NAME=feddyn-cifar10-gpu
if [ "$FEDDYN_SECS" -gt 40 ]; then
    # SIGTERM to the pollen command alone (as `kill PID` would), then up to 50 s to stop
    "$POLLEN" run . -c configs/feddyn-cifar10.toml \
        -c "data-root='$DATA' output-dir='$RUNS' run-name='$NAME' checkpoint-every=${CHECKPOINT_EVERY:-2} ${FEDDYN_EXTRA:-}" \
        --federation-config "client-resources-num-gpus=$GPUS" &
    P=$!
    (sleep "$FEDDYN_SECS"; echo "t=$(($(date +%s) - T0))s: SIGTERM to pollen ($P)"; kill -TERM $P 2>/dev/null
     sleep 50; kill -KILL $P 2>/dev/null) &
    W=$!
    wait $P
    rc=$?
    kill $W 2>/dev/null
    echo "feddyn exit $rc at t=$(($(date +%s) - T0))s"
    "$PY" -c "
import json, pathlib
d = pathlib.Path('$RUNS/$NAME')
h = json.loads((d / 'history.json').read_text()) if (d / 'history.json').exists() else []
for r in h: print('round', r.get('round'), 's', round(r['seconds'], 2), 'acc', r.get('accuracy'), 'lr', r.get('lr'))
s = d / 'summary.json'
print(s.read_text()[:1500] if s.exists() else 'no summary')
"
    du -sh "$RUNS/$NAME" "$RUNS/$NAME"/* 2>/dev/null
    ls "$RUNS/$NAME/checkpoints" 2>/dev/null
else
    echo "no time left for it"
fi

step "pack results"
[ -n "${MONITOR:-}" ] && kill "$MONITOR"
tar -C "$RUNS" -czf "$OUTD/cuda-runs.tgz" --exclude=checkpoints --exclude=client-state \
    cuda-frac auto-frac cuda-noshare 2>/dev/null
if [ -d "$RUNS/$NAME" ]; then
    # the run less client-state (FedDyn's h_k, one model's size per client trained:
    # too big to bring back); the newest checkpoint only
    keep=$(ls -d "$RUNS/$NAME"/checkpoints/round-* 2>/dev/null | sort | tail -1)
    excl=()
    for d in "$RUNS/$NAME"/checkpoints/round-*; do
        [ -e "$d" ] && [ "$d" != "$keep" ] && excl+=(--exclude="$NAME/checkpoints/$(basename "$d")")
    done
    tar -C "$RUNS" -czf /tmp/feddyn-run.tgz --exclude="$NAME/client-state" "${excl[@]}" "$NAME"
    ls -la /tmp/feddyn-run.tgz
    split -b 15m -d -a 1 /tmp/feddyn-run.tgz "$OUTD/feddyn-run.tgz.part"
fi
ls -la "$OUTD"
echo "done at t=$(($(date +%s) - T0))s"
