#!/usr/bin/env bash
# The GPU path's device checks (DESIGN §6: the hbm tier and its pools), as ONE script for the `device` tool's `run`:
#   carry: [".whl"]   command: bash bench/gpu/run_device_checks.sh   timeout_s: 540
# Runs tests_gpu/: the lines of kvstore/device_cuda.py (CudaOps), the only ones the CPU suite
# never runs (it runs the same code with CpuOps) - hbm put/get bit-exact, a pool handed out
# as CUDA IPC and read and written from a second process, each pool its own CUDA segment,
# cudaHostRegister of an arena and host->hbm bytes/s beside a plain pinned copy_, the server
# with --tiers hbm,host,ssd on CUDA (every arena pinned, tenants' own pools), layer-wise loads
# into CUDA KV on a side stream with one event per layer, from the pool and from the arena,
# and vLLM's GPU KV layout - and writes under $OUT: gpu_checks.json (per test outcome +
# figures), pytest.log, env.txt. Bounded to 7 minutes.
# Nothing is built or installed system-wide: the package is put on PYTHONPATH as a folder of
# links (kvstore/ copied, client/ tiers/ bench/ linked under it, as pyproject's package-dir
# maps them), so the machine's torch 2.11+cu130 is used as is (pyproject's torch pin is for
# the CPU wheel and must not be resolved there). Carried wheels (.whl/: lmdb, grpcio, protobuf; see
# bench/gpu/README.md) go to /tmp/site. PYTEST_ARGS=--collect-only checks imports and
# collection on a machine without a GPU.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/kvstore-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -m pip list 2>/dev/null | grep -i -E '^(grpcio|protobuf|numpy|xxhash|lmdb|prometheus|pytest|hypothesis) '
} > "$OUT/env.txt" 2>&1

SITE=/tmp/site
mkdir -p "$SITE"
if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$REPO"/.whl/*.whl \
    >> "$OUT/env.txt" 2>&1 || echo "carried wheels failed to install" >> "$OUT/env.txt"
fi
PKG=${PKG:-/tmp/kvpath}
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r "$REPO/kvstore" "$PKG/kvstore"
ln -s "$REPO/client" "$PKG/kvstore/client"
ln -s "$REPO/tiers" "$PKG/kvstore/tiers"
ln -s "$REPO/bench" "$PKG/kvstore/bench"
export PYTHONPATH="$PKG:$SITE${PYTHONPATH:+:$PYTHONPATH}"

cd /tmp  # not the repo root: its kvstore/ (without client/ and tiers/) must not shadow $PKG
"$PY" -c "import kvstore.tiers.pools, kvstore.device_cuda, kvstore.client; print('kvstore from', kvstore.__file__)" \
  >> "$OUT/env.txt" 2>&1
timeout 420 "$PY" -m pytest -q ${PYTEST_ARGS:-} -c "$REPO/tests_gpu/pytest.ini" --rootdir "$REPO/tests_gpu" "$REPO/tests_gpu" 2>&1 \
  | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "pytest exit status $rc" | tee -a "$OUT/pytest.log"
[ -f "$OUT/gpu_checks.json" ] && cat "$OUT/gpu_checks.json"
exit "$rc"
