#!/usr/bin/env bash
# The GPU checks in one run, well inside 10 minutes on one GPU: the CUDA paths' tests (`pytest -m gpu`: the model
# against the CPU reference in fp32 and bf16, the streamed loader through pinned staging buffers, the adapter
# tiers) and the load benchmark into GPU memory (bench/load.py --device cuda). Never part of `make test`.
#
#   scripts/gpu_check.sh [OUT_DIR]     OUT_DIR (default bench/results) gets gpu-tests.txt and load-cuda.json
#
# PYTHON chooses the interpreter (default .venv/bin/python where it exists, else python3); it needs a CUDA build of
# torch and the project's dependencies. Exit status: 2 without a CUDA device, else the tests' (the benchmark's
# failure is printed, not fatal: its figures are information).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device (interpreter: $py)" >&2
  exit 2
fi
"$py" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
echo "== gpu tests: ${files[*]}"
timeout 300 "$py" -m pytest -m gpu -p no:cacheprovider -q "${files[@]}" 2>&1 | tee "$out/gpu-tests.txt"
rc=${PIPESTATUS[0]}

echo "== load benchmark into GPU memory"
if ! timeout 240 "$py" bench/load.py --device cuda --only synthetic --runs 3 --out "$out/load-cuda.json" \
  --work "${TMPDIR:-/tmp}/loraplex-load-cuda"; then
  echo "gpu_check: the load benchmark failed (see above)" >&2
fi
exit "$rc"
