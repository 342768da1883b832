#!/usr/bin/env bash
# Time to the tuned AdamW's loss on a 100 Mbit/s link, 4 processes, on a host whose cores are
# not shared (benchmarks/lm_link.py; at most BUDGET = 420 s: about 390 s on a 16-core host,
# where step 3 then does not fit). Run as root from the repository root:
#
#     bash benchmarks/lm_link_host.sh       # PY=python3 by default; copies results into $OUT
#
# 1. A 5-second probe: can this host make a network namespace and shape its loopback with
#    tc tbf? If not, it says so and measures the unshaped step only.
# 2. (probe passed) AdamW data parallel at its tuned peak lr (BASELINE_LR, 4.5e-3: the best
#    final held-out loss of 3e-3 / 4.5e-3 / 6e-3 at 4 processes, docs/lm.md) for its full
#    ADAMW_STEPS = 300 steps, then ROWS (NAME:STEPS, each run long enough to reach AdamW's
#    loss: DeMo at the width rule's decayed recipe, 330 steps, predicted the first there; DeMo
#    with its lr held, 360 steps, the row of the earlier 20.8x), on the shaped link:
#    lm_link_LABEL.json (LABEL = host_tuned; lm_link_host.json is the earlier run against
#    AdamW at 3e-3). Its JSON is written after each row: a row cut by the budget is lost alone.
# 3. Every row again for 30 steps on the unshaped loopback (compute and protocol):
#    lm_link_LABEL_unshaped.json, skipped when under 60 s of the budget are left; then
#    lm_link_LABEL.json split with it (--split-from): compute (unshaped) and exchange.
# Every process is pinned to CPUS (taskset -c 0-7: the other cores run other work); without
# taskset it says so and runs unpinned. Settings: environment variables of the names above.
set -u
PY=${PY:-python3}
BASELINE_LR=${BASELINE_LR:-4.5e-3}
ADAMW_STEPS=${ADAMW_STEPS:-300}
ROWS=${ROWS:-demo-3e-3-decay0.95-k20-b3-wsd20-warm2:330 demo-3e-3-sign-end1-decay0.95-k18-b4:360}
LABEL=${LABEL:-host_tuned}
BUDGET=${BUDGET:-420}
CPUS=${CPUS:-0-7}
UNSHAPED_STEPS=${UNSHAPED_STEPS:-30}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=${JAXCOMP_BENCH_RESULTS:-benchmarks/results}
LOG=${OUT:-/tmp}/lm_link_$LABEL.log
start=$(date +%s)
since=$(mktemp)  # result files newer than this one were written by this run
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
short_rows() { for r in $ROWS; do printf '%s:%s ' "${r%%:*}" "$UNSHAPED_STEPS"; done; }
{
  echo "host: $(nproc) cores; $(uptime)"
  echo "settings: BASELINE_LR=$BASELINE_LR ADAMW_STEPS=$ADAMW_STEPS ROWS='$ROWS' LABEL=$LABEL" \
    "BUDGET=$BUDGET CPUS=$CPUS"
  "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
  if command -v taskset >/dev/null 2>&1 && taskset -c "$CPUS" true 2>/dev/null; then
    pin=(taskset -c "$CPUS")
    echo "pinned: taskset -c $CPUS"
  else
    pin=()
    echo "not pinned: no taskset here, or CPUS=$CPUS not on this host"
  fi
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
    # shellcheck disable=SC2086  # ROWS: one word per row
    timeout "$(( $(left) - 5 ))" ${pin[@]+"${pin[@]}"} "$PY" -m benchmarks.lm_link --label "$LABEL" \
      --baseline-lr "$BASELINE_LR" --steps "$ADAMW_STEPS" --recipes $ROWS \
      --timeout "$(( $(left) - 25 ))"
    echo "shaped run: exit $? after $(( $(date +%s) - start )) s; $(uptime)"
  fi
  if [ "$(left)" -gt 60 ]; then
    # shellcheck disable=SC2046  # one word per row
    timeout "$(left)" ${pin[@]+"${pin[@]}"} "$PY" -m benchmarks.lm_link --label "${LABEL}_unshaped" \
      --rate none --baseline-lr "$BASELINE_LR" --steps "$UNSHAPED_STEPS" \
      --recipes $(short_rows) --timeout "$(( $(left) - 20 ))"
    echo "unshaped run: exit $? after $(( $(date +%s) - start )) s; $(uptime)"
    if [ "$shaped" = 1 ] && [ "$RESULTS/lm_link_$LABEL.json" -nt "$since" ] &&
      [ "$RESULTS/lm_link_${LABEL}_unshaped.json" -nt "$since" ]; then
      "$PY" -m benchmarks.lm_link --label "$LABEL" --split-from "${LABEL}_unshaped"
    elif [ "$shaped" = 1 ]; then
      echo "no split: this run wrote no lm_link_$LABEL.json or no lm_link_${LABEL}_unshaped.json"
    fi
  else
    echo "unshaped run: skipped, $(left) s of the $BUDGET s budget left"
  fi
  echo "done after $(( $(date +%s) - start )) s"
} 2>&1 | tee "$LOG"
rm -f "$since"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/lm_link_"$LABEL"*.json "$RESULTS"/lm_link_"$LABEL"*.png "$OUT"/ 2>/dev/null
fi
