#!/usr/bin/env bash
# One call on a lent GPU host (one GPU, 16 cores, jax with CUDA as `python3`), split by cores so
# the parts do not share them. Run as root from the repository root:
#
#     bash benchmarks/gpu_host.sh                    # hot path + step on the GPU, the suite
#     PARTS=link bash benchmarks/gpu_host.sh         # the shaped-link LM run alone
#     PARTS="gpu link" bash benchmarks/gpu_host.sh   # both halves of an earlier session's call
#
# PARTS (default "gpu suite") picks what runs:
# - gpu (cores 8-15, one after another): benchmarks.hot_path on the GPU (every row, the fused
#   ones too), then benchmarks.gpu_step (the compressed step on the GPU against its pmean step);
# - suite (cores 0-7, beside gpu): the test suite on the host's jax, CPU backend, 7 workers,
#   within SUITE_S seconds (default 240): the newest jax a lent host carries, where this host's
#   lock pins an older one;
# - link (cores 0-7, after suite): benchmarks/lm_link_host.sh, the time to AdamW's loss on a
#   shaped 100 Mbit/s link with 4 processes (it probes for tc and says so where the link cannot be
#   shaped; carry .iproute, from benchmarks/carry_iproute.sh, where the host has no iproute2).
# Result names carry the GPU's model and TAG (default s19): hot_path_gpu_h200_s19.json, say.
# Each part has its own time limit. Its JSON, PNG and logs go to /tmp/gpu_host/r, packed at the
# end into one results.tgz in $OUT (the device tool brings back at most 8 files).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .iproute/bin ] && export PATH="$PWD/.iproute/bin:$PATH"
PARTS=${PARTS:-gpu suite}
TAG=${TAG:-s19}
SUITE_S=${SUITE_S:-240}
R=/tmp/gpu_host/r
mkdir -p "$R"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  echo "cores: $(nproc); $(uptime)"
  python3 -c "import jax, jaxlib, optax, flax, chex; print('jax', jax.__version__, \
'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'flax', flax.__version__, \
'chex', chex.__version__); print(jax.devices())"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"
model=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -oiE 'h100|h200|a100|l40s?|b200' | head -1 | tr 'A-Z' 'a-z')
label="gpu_${model:-unknown}_$TAG"

cpu_half() {
  if has suite; then
    stamp "suite (CPU backend, host jax)"
    JAX_PLATFORMS=cpu taskset -c 0-7 timeout "$SUITE_S" python3 -m pytest -p no:cacheprovider \
      -q -n 7 -rfE tests/ > "$R/suite_$label.log" 2>&1
    stamp "suite exit $?"
  fi
  if has link; then
    stamp "lm_link_host.sh"
    JAXCOMP_BENCH_RESULTS="$R" OUT="$R" LABEL="host_$TAG" CPUS=0-7 \
      timeout "${LINK_S:-470}" bash benchmarks/lm_link_host.sh > "$R/lm_link_host.out" 2>&1
    stamp "lm_link_host.sh exit $?"
  fi
}
cpu_half > "$R/cpu_half.out" 2>&1 &
cpu=$!

if has gpu; then
  gpu() { JAXCOMP_BENCH_RESULTS="$R" taskset -c 8-15 timeout "$@"; }
  stamp "hot_path (GPU)"
  gpu 170 python3 -m benchmarks.hot_path --backend gpu --label "$label" --reps 15 \
    > "$R/hot_path.log" 2>&1
  stamp "hot_path exit $?"
  gpu 80 python3 -m benchmarks.gpu_step --pipeline 10 --out "$R/gpu_step_$label.json" \
    > "$R/gpu_step.log" 2>&1
  stamp "gpu_step exit $?"
fi
wait "$cpu"
cat "$R/cpu_half.out"
[ -f "$R/lm_link_host.out" ] && tail -n 30 "$R/lm_link_host.out"
[ -f "$R/suite_$label.log" ] && tail -n 25 "$R/suite_$label.log"
[ -f "$R/hot_path.log" ] && tail -n 12 "$R/hot_path.log" "$R/gpu_step.log"
(cd "$R" && tar czf "${OUT:-/tmp}/results.tgz" .)
ls -la "$R"
stamp "done"
