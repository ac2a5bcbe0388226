#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command (the default test run skips them where
# there is none):
#   * the CUDA tests: the kernels against the CPU kernels on the device, full-size tensors
#     included (tests/thc/test_cuda_sim.py), and THC allreduce and the DDP hook on CUDA
#     tensors through the reference aggregator (tests/host/test_cuda_allreduce.py);
#   * the codec benchmark with its CUDA table (host.experiments.codec_bench speed);
#   * one worker's CPU per 16 MB THC call with the codec on the GPU, and on the CPU for
#     comparison (host.experiments.bench_worker_cpu --device cuda|cpu).
# Runs with the Python that has torch with CUDA (PYTHON, default python3), from the
# repository root; logs and JSON go to OUT_DIR.
#   tests/run_gpu_checks.sh [OUT_DIR]        (default build/gpu)
set -u
out=${1:-build/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  date -u
  uptime
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
             --format=csv,noheader
  "$py" -c 'import sys, numpy, numba, torch; print("python", sys.version.split()[0],
            "numpy", numpy.__version__, "numba", numba.__version__, "torch", torch.__version__,
            "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$out/machine.txt"

# Numba's CUDA target must compile a kernel here; a numba-cuda older than the numpy beside
# it fails at its first compile (seen: numpy 2.5 removed np.row_stack), deep inside the
# tests, so say it at once.
if ! "$py" - <<'PY'
import numpy as np
from numba import cuda


@cuda.jit
def one(a):
    a[0] = 1


out = cuda.device_array(1, np.int32)
one[1, 1](out)
assert out.copy_to_host()[0] == 1
PY
then
  echo "numba-cuda cannot compile and run a kernel here (error above): no GPU, or a numpy" \
       "its version does not support (numpy 2.5 with an older numba-cuda: install" \
       "'numpy<2.5')" >&2
  exit 2
fi

# the worker's native data path (without it the transport's Python path runs)
make -s native || echo "native data path not built: the Python path runs"

status=0
timeout 300 "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/thc/test_cuda_sim.py tests/host/test_cuda_allreduce.py 2>&1 | tee "$out/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 240 "$py" -m host.experiments.codec_bench speed --log2d 24 --reps 5 \
    --json "$out/codec_speed.json" 2>&1 | tee "$out/codec_speed.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for device in cuda cpu; do
  timeout 240 "$py" -m host.experiments.bench_worker_cpu --calls 10 --device $device \
      --json "$out/worker_cpu_$device.json" 2>&1 | tee "$out/worker_cpu_$device.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
