#!/usr/bin/env bash
# Time to AdamW's loss on a 100 Mbit/s link, 4 processes, on a host whose cores are not shared
# (benchmarks/lm_link.py; about 7-8 minutes on a 16-core host). Run as root from the
# repository root:
#
#     bash benchmarks/lm_link_host.sh       # PY=python3 by default; copies results into $OUT
#
# 1. A 5-second probe: can this host make a network namespace and shape its loopback with
#    tc tbf? If not, it says so and measures the unshaped step only.
# 2. (probe passed) AdamW data parallel, 300 steps, then DeMo (the best row on the 2-core
#    host), 450 steps, on the shaped link: lm_link_host.json.
# 3. Every row again for 30 steps on the unshaped loopback (compute and protocol):
#    lm_link_host_unshaped.json, skipped when under 60 s of the 8 minutes are left.
# 4. lm_link_host.json split with it (--split-from): each step as compute (unshaped) and
#    exchange (what the shaped link adds); the ratios of step 2 are the measured answer.
set -u
PY=${PY:-python3}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=${JAXCOMP_BENCH_RESULTS:-benchmarks/results}
LOG=${OUT:-/tmp}/lm_link_host.log
ROW=demo-3e-3-sign-end1-decay0.95-k18-b4
start=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - start) )); }
{
  echo "host: $(nproc) cores; $(uptime)"
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
  probe=jaxcomp-probe-$$
  if timeout 5 sh -c "ip netns add $probe && ip netns exec $probe ip link set lo up && \
      ip netns exec $probe tc qdisc add dev lo root tbf rate 100mbit burst 256kb latency 10ms" \
      >/dev/null 2>&1; then
    shaped=1
    echo "probe: network namespace and tc tbf work"
  else
    shaped=0
    echo "probe: no network namespace or tc tbf here (needs root, iproute2, CAP_NET_ADMIN):"
    echo "       the unshaped step only (compute); no time to target on this host"
  fi
  ip netns del "$probe" >/dev/null 2>&1
  if [ "$shaped" = 1 ]; then
    timeout 445 "$PY" -m benchmarks.lm_link --label host --recipes "$ROW:450" --timeout 430
    echo "shaped run: exit $? after $(( $(date +%s) - start )) s; $(uptime)"
  fi
  if [ "$(left)" -gt 60 ]; then
    timeout "$(left)" "$PY" -m benchmarks.lm_link --label host_unshaped --rate none \
      --steps 30 --recipes "$ROW:30" --timeout "$(( $(left) - 10 ))"
    echo "unshaped run: exit $? after $(( $(date +%s) - start )) s; $(uptime)"
    if [ "$shaped" = 1 ] && [ -f "$RESULTS/lm_link_host.json" ]; then
      "$PY" -m benchmarks.lm_link --label host --split-from host_unshaped
    fi
  fi
} 2>&1 | tee "$LOG"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/lm_link_host*.json "$RESULTS"/lm_link_host*.png "$OUT"/ 2>/dev/null
fi
