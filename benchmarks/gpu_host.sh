#!/usr/bin/env bash
# One call on a lent GPU host (one GPU, 16 cores, jax with CUDA as `python3`), split by cores so
# the parts do not share them. Run as root from the repository root:
#
#     bash benchmarks/gpu_host.sh          # results packed into $OUT/results.tgz (or /tmp)
#
# - cores 0-7: benchmarks/lm_link_host.sh, the time to AdamW's loss on a shaped 100 Mbit/s
#   link with 4 processes (it probes for tc and says so where the link cannot be shaped);
# - cores 8-15, one after another: benchmarks.hot_path on the GPU (every row, the fused ones
#   too), then benchmarks.gpu_step (the compressed step on the GPU against its pmean step).
# The test suite is not run here: beside the shaped-link run it would take that run's memory
# bandwidth, and the suite on newer jax runs on a CPU host too (a Python 3.12 venv).
# Each part has its own time limit; the whole ends within about 480 s. Its JSON, PNG and logs
# go to /tmp/gpu_host/r, packed at the end into one results.tgz in $OUT (the device tool
# brings back at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
R=/tmp/gpu_host/r
mkdir -p "$R"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "cores: $(nproc); $(uptime)"
  python3 -c "import jax, jaxlib, optax, flax, chex; print('jax', jax.__version__, \
'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'flax', flax.__version__, \
'chex', chex.__version__); print(jax.devices())"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

(JAXCOMP_BENCH_RESULTS="$R" OUT="$R" taskset -c 0-7 timeout 470 bash benchmarks/lm_link_host.sh \
  > "$R/lm_link_host.out" 2>&1; stamp "lm_link_host.sh exit $?" >> "$R/lm_link_host.out") &
link=$!

gpu() { JAXCOMP_BENCH_RESULTS="$R" taskset -c 8-15 timeout "$@"; }
stamp "hot_path (GPU)"
gpu 170 python3 -m benchmarks.hot_path --backend gpu --label gpu_h100_s11 --reps 15 \
  > "$R/hot_path.log" 2>&1
stamp "hot_path exit $?"
gpu 80 python3 -m benchmarks.gpu_step --pipeline 10 --out "$R/gpu_step_gpu_h100_s11.json" \
  > "$R/gpu_step.log" 2>&1
stamp "gpu_step exit $?"
wait "$link"
tail -n 30 "$R/lm_link_host.out"
tail -n 12 "$R/hot_path.log" "$R/gpu_step.log"
(cd "$R" && tar czf "${OUT:-/tmp}/results.tgz" .)
ls -la "$R"
stamp "done"
