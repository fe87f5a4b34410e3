#!/usr/bin/env bash
# The GPU checks and benchmarks in one unattended command, on any CUDA host with JAX (and,
# for the PyTorch comparison, torch) installed. Offline: the packages Loomax needs beyond
# those come from a wheel folder made beforehand, where the network is, by
#   bench/gpu_wheels.sh            (writes .whl/; see bench/README.md "GPU")
# Usage: bench/gpu.sh [gpu.py options, e.g. --budget 450 --only attention,gpt2]
# Results: one table on stdout, gpu_results.json and gpu_log.txt in $OUT (else bench/results/).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${LOOMAX_WHEELS:-.whl}
SITE=${LOOMAX_SITE:-/tmp/loomax-site}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# one process at a time uses the GPU: let JAX take more than its default 75% of its memory
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
"$PYTHON" -c "import loomax, haliax, draccus, jmp" || {
  echo "bench/gpu.sh: Loomax's packages are missing: make the wheel folder with bench/gpu_wheels.sh ($WHEELS)" >&2
  exit 2
}
exec "$PYTHON" bench/gpu.py "$@"
