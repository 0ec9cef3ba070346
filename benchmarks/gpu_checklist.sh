#!/usr/bin/env bash
# DESIGN.md's GPU checklist in one command, for a GPU machine's short lease:
# build once, run every GPU test, then the GPU benchmarks; logs go to $1 (default out/gpu).
#   bash benchmarks/gpu_checklist.sh [LOGDIR] [tests|bench|all]
# The GPU machine has no DGL: test files that import it skip themselves, and the cache
# benchmark reads WordNet's sampled ids from out/streams.npz when it is there (write it on
# a machine with DGL: bench_gpu_cache.py --twin --write-streams out/streams.npz, and carry
# it); without it that benchmark is not run and the script fails.
# Each benchmark writes its run into benchmarks/results/<script>.json; the script copies
# those files to $LOGDIR/results/ at the end, so they come back with the logs (copy them
# into the checkout's benchmarks/results/ and commit them).
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-out/gpu}; what=${2:-all}
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_checklist: no usable GPU here (nvidia-smi -L failed): run it on the GPU machine"
  exit 2
fi
mkdir -p "$log"
export PYTHONPATH=. PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=passive
nvidia-smi -L | tee "$log/device.txt"
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)" \
  | tee -a "$log/device.txt"
if ! DISTEMB_REQUIRE_CUDA=1 python3 setup.py build_ext --inplace >"$log/build.log" 2>&1; then
  tail -40 "$log/build.log"; exit 1
fi
echo "build: ok"
status=0
# pytest-xdist is on the GPU image: 8 workers share the one GPU (the tests take ~35 s, not minutes).
par=""; python3 -c "import xdist" 2>/dev/null && par="-n 8"
if [ "$what" != bench ]; then
  python3 -m pytest -q -rs $par --timeout 300 -p no:cacheprovider \
    tests/test_cuda_kernels.py tests/test_cuda_dispatch.py tests/test_cuda_segment_sum.py \
    tests/test_cuda_half.py tests/test_device_cache.py tests/test_cuda_emulated.py \
    tests/test_cuda_half_emulated.py tests/test_kernel_contract.py tests/test_dynamic_embedding.py \
    2>&1 | tee "$log/tests_gpu.log" | tail -25 || status=1
  python3 -m pytest -q $par --timeout 300 -p no:cacheprovider tests/test_kvclient_suite.py \
    tests/test_kvclient_jobs.py tests/test_keyed_suite.py tests/test_partition.py -k cuda \
    2>&1 | tee "$log/tests_client_suite.log" | tail -8 || status=1
fi
if [ "$what" != tests ]; then
  python3 benchmarks/bench_gpu_step.py --dtypes float32,bfloat16 2>&1 \
    | tee "$log/bench_gpu_step.log" || status=1
  python3 benchmarks/bench_gpu_step.py --optimizers adagrad,adam --ids zipf --profile \
    2>&1 | tee "$log/bench_gpu_step_profile.log" | tail -60 || status=1
  python3 benchmarks/bench_gpu_dynamic.py 2>&1 | tee "$log/bench_gpu_dynamic.log" || status=1
  python3 benchmarks/gpu_host_parts.py 2>&1 | tee "$log/gpu_host_parts.log" | tail -40 || status=1
  if [ -f out/streams.npz ]; then
    python3 benchmarks/bench_gpu_cache.py --streams sage,zipf --streams-file out/streams.npz \
      2>&1 | tee "$log/bench_gpu_cache.log" || status=1
  else
    echo "bench_gpu_cache: not run: out/streams.npz is missing (see the top of this script)"
    status=1
  fi
  mkdir -p "$log/results"
  cp benchmarks/results/bench_gpu_*.json benchmarks/results/gpu_host_parts.json "$log/results/"
fi
exit $status
