#!/usr/bin/env bash
# Time to AdamW's loss on a 100 Mbit/s link, 4 processes, on a host whose cores are not shared
# (benchmarks/lm_link.py; about 6-8 minutes on a 16-core host). Run as root from the
# repository root:
#
#     bash benchmarks/lm_link_host.sh            # PY=python3 by default; results under $OUT
#
# 1. A 5-second probe: can this host make a network namespace and shape its loopback with
#    tc tbf? If not, it says so and measures the unshaped step only (compute per step of
#    every row: with the exchange measured on another host, benchmarks.lm_link --split-from
#    gives the projection).
# 2. AdamW data parallel (300 steps) then DeMo (450) and DiLoCo int4 H = 30 with the inner
#    lr held (900) on the shaped link, and every row again for 60 steps unshaped (compute).
# Writes benchmarks/results/lm_link_host.json / lm_link_host_unshaped.json (and copies them,
# with the log, into $OUT when it is set).
set -u
PY=${PY:-python3}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=${JAXCOMP_BENCH_RESULTS:-benchmarks/results}
LOG=${OUT:-/tmp}/lm_link_host.log
ROWS=(demo-3e-3-sign-end1-decay0.95-k18-b4:450 diloco-int4-H30-innerconst:900)
start=$(date +%s)
{
  echo "host: $(nproc) cores, $(uptime)"
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
  probe=jaxcomp-probe-$$
  if timeout 5 sh -c "ip netns add $probe && ip netns exec $probe ip link set lo up && \
      ip netns exec $probe tc qdisc add dev lo root tbf rate 100mbit burst 256kb latency 10ms" \
      >/dev/null 2>&1; then
    shaped=1
    echo "probe: network namespace and tc tbf work"
  else
    shaped=0
    echo "probe: no network namespace or tc tbf here (needs root, iproute2 and CAP_NET_ADMIN):"
    echo "       measuring the unshaped step only (compute); no time to target on this host"
  fi
  ip netns del "$probe" >/dev/null 2>&1
  if [ "$shaped" = 1 ]; then
    timeout 420 "$PY" -m benchmarks.lm_link --label host --recipes "${ROWS[@]}" \
      --unshaped-steps 60 --timeout 400
  else
    timeout 300 "$PY" -m benchmarks.lm_link --label host_unshaped --rate none \
      --steps 60 --recipes "${ROWS[@]/%:*/:60}" --timeout 280
  fi
  echo "exit $? after $(( $(date +%s) - start )) s; $(uptime)"
} 2>&1 | tee "$LOG"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/lm_link_host*.json "$RESULTS"/lm_link_host*.png "$OUT"/ 2>/dev/null
fi
