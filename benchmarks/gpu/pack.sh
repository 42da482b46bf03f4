#!/bin/bash
# Build .gpu/carry/, what a lent GPU machine needs beside the checkout
# (README.md here): Flower's and Ray's wheels unpacked for its Python 3.12 as
# one xz tarball (Ray trimmed and stripped to fit the device tool's 64 MiB),
# opacus, and CIFAR-10's JPEG archive. Run from the checkout's root:
#   bash benchmarks/gpu/pack.sh [DATA_DIR]   (DATA_DIR: where cifar10-jpeg.tar.gz is; ../shared/data)
set -euo pipefail
DATA=${1:-../shared/data}
PY312=${PY312:-$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
[ -x "$PY312" ] || { echo "need a python3.12 here (PY312=...)"; exit 2; }
EXCLUDE=$(git rev-parse --git-common-dir)/info/exclude
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo /.gpu/ >> "$EXCLUDE"
mkdir -p .gpu/whl .gpu/carry/data
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none"
for n in 17 24 27 28 31 34 35 38 39; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
# flwr[simulation] and flwr-datasets, less what the GPU image has (KINDS.md);
# the versions are uv.lock's
python3 -m pip download -q $P -d .gpu/whl \
    flwr==1.41.0 ray==2.55.1 flwr-datasets==0.6.1 datasets==4.8.5 dill==0.4.1 \
    multiprocess==0.70.19 grpcio==1.85.1 grpcio-health-checking==1.81.1 protobuf==6.33.6 \
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 iterators==0.0.2 \
    typer==0.20.1 rich==14.3.4 tomli==2.5.0 tomli-w==1.2.0 pathspec==1.1.1 \
    prompt-toolkit==3.0.53 wcwidth==0.9.4 packaging==25.0 sqlalchemy==2.1.9 greenlet==3.5.6 \
    alembic==1.20.1 mako==1.4.3 uvicorn==0.49.0 httptools==0.9.0 python-dotenv==1.2.4 \
    watchfiles==1.3.0 websockets==17.4 fastapi==0.138.2 starlette==1.3.1 pydantic==2.14.3 \
    pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 typing-extensions==4.16.0 fsspec==2026.2.0 click==8.5.1
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/carry opacus==1.6.0
rm -rf .gpu/site
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target .gpu/site .gpu/whl/*.whl
# Ray: no Java, no libraries pollen does not use, no dashboard web build
# (Flower starts Ray without the dashboard); its binaries without symbols
rm -rf .gpu/site/ray/jars .gpu/site/ray/rllib .gpu/site/ray/llm .gpu/site/ray/serve \
    .gpu/site/ray/dashboard/client/build .gpu/site/ray/data .gpu/site/ray/train .gpu/site/ray/tune
strip --strip-unneeded .gpu/site/ray/core/src/ray/raylet/raylet \
    .gpu/site/ray/core/src/ray/gcs/gcs_server .gpu/site/ray/_raylet.so
tar -C .gpu/site -cf - . | xz -T2 -9 > .gpu/carry/site.tar.xz
cp "$DATA/cifar10-jpeg.tar.gz" .gpu/carry/data/
# no .py files left under .gpu/: Flower's in-place FAB build would take them in
# (tests/test_fab.py compares it with the staged one)
rm -rf .gpu/site .gpu/whl
du -sh .gpu/carry .gpu/carry/*
