"""Compressed vs plain all-reduce over a real, rate-limited network: N JAX processes, gloo.

The benchmark makes its own network namespace ``jaxcomp-bench-<pid>``, brings its loopback
up and shapes it with a token bucket::

    ip netns add jaxcomp-bench-<pid>
    ip netns exec jaxcomp-bench-<pid> ip link set lo up
    ip netns exec jaxcomp-bench-<pid> \
        tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 10ms

then starts ``-n`` JAX processes in it with ``python -m jaxcomp.launch`` (gloo CPU
collectives, one CPU device each). All their traffic — the collectives and the coordinator —
stays on that loopback. The namespace is deleted on exit, also on an error, Ctrl-C or
SIGTERM; every loop is bounded (the launcher has a timeout, repetitions are fixed). Needs
root and iproute2; otherwise it says so and exits 0 (skipped).

Per codec, in the same run as plain ``jax.lax.pmean`` (``pmean`` rows):

* ``allreduce``: one ``jc.pmean(g, "data", codec)`` (strategy ``auto``) of a ``--size``
  (25M) float32 gradient, median of ``--reps`` blocked calls;
* ``step``: one training step of an MLP of about that size (1024-4096-4096-1024, 25.2M
  params, batch 8 per process, MSE) with ``jc.compressed_allreduce(codec)`` + SGD, against
  the same step with ``pmean``;
* ``codec_ms``: encode + decode of the gradient on one device with no network (where the
  time goes when compression does not pay);
* ``link_ms``: the link limit: every process's bytes cross the one shaped loopback queue, so
  ``n * bytes_per_device * 8 / rate`` (bytes per device from the lowered program, ring
  model); ``efficiency = link_ms / allreduce_ms``.

Writes ``benchmarks/results/network.json`` and ``network.png``::

    sudo python benchmarks/network.py                        # 1gbit, 100mbit, 10gbit
    sudo python benchmarks/network.py --quick                # 1gbit, 4M floats, pmean + sign
    sudo python benchmarks/network.py --rates 1gbit --codecs sign int8 topk1% -n 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

AXIS = "data"
CODECS = ["sign", "int8", "topk1%", "int4", "fp16"]
RATES = ["1gbit", "100mbit", "10gbit"]
MLP = common.MLP
TBF = ("burst", "256kb", "latency", "10ms")


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units: kbit, mbit, gbit are powers of 1000)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"`rate` must look like 1gbit, 100mbit or 500kbit, got {rate!r}")


# --------------------------------------------------------------------------- worker side


def worker(args) -> None:
    """One of the N processes: time each codec, rank 0 writes ``args.out``."""
    from jaxcomp.launch import initialize

    initialize()
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src import accounting

    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sharded, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    d = args.size
    rng = np.random.RandomState(rank)
    local = rng.standard_normal((1, d)).astype(np.float32)
    grads = jax.make_array_from_callback((n, d), sharded, lambda idx: local)
    key = jax.random.PRNGKey(0)

    def timed(fn, *a, reps=args.reps):
        jax.block_until_ready(fn(*a))  # compile + warm-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts))

    def logical_bytes(fn, *a):
        text = fn.lower(*a).as_text()
        return sum(c.bytes_per_device for c in accounting.parse_stablehlo_collectives(text, n))

    # ---- the model (benchmarks/common.py): params replicated, batch sharded
    params0 = jax.jit(common.mlp_params, out_shardings=replicated)()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    xb = rng.standard_normal((args.batch, MLP[0])).astype(np.float32)
    yb = rng.standard_normal((args.batch, MLP[-1])).astype(np.float32)
    bx = jax.make_array_from_callback((n * args.batch, MLP[0]), sharded, lambda idx: xb)
    by = jax.make_array_from_callback((n * args.batch, MLP[-1]), sharded, lambda idx: yb)

    rows = []
    for name in ["pmean", *args.codecs]:
        t_start = time.perf_counter()
        codec = None if name == "pmean" else common.make_codec(name)
        if codec is None:
            body = lambda g: jax.lax.pmean(g[0], AXIS)  # noqa: E731
        else:
            body = lambda g, c=codec: jc.pmean(g[0], AXIS, c, key=key)  # noqa: E731
        allreduce = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
        row = {"codec": name, "size": d, "devices": n}
        row["bytes_per_device"] = logical_bytes(allreduce, grads)
        row["strategy"] = "-" if codec is None else jc.choose_strategy(codec, d, n)
        row["allreduce_ms"], row["allreduce_min_ms"] = timed(allreduce, grads)
        if codec is not None:
            one = jax.local_devices()[0]
            x1 = jax.device_put(local[0], one)
            enc = jax.jit(lambda v, c=codec: c.encode(v, key))
            dec = jax.jit(lambda pl, c=codec: c.decode(pl, d))
            payload = jax.block_until_ready(enc(x1))
            row["encode_ms"] = timed(enc, x1)[0]
            row["decode_ms"] = timed(dec, payload)[0]
        if not args.no_step:
            step, state = common.mlp_train_step(codec, params0, mesh, AXIS)
            row["step_bytes_per_device"] = logical_bytes(step, params0, state, bx, by)
            row["step_ms"], row["step_min_ms"] = timed(step, params0, state, bx, by)
        row["seconds"] = round(time.perf_counter() - t_start, 1)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"params": n_params, "rows": rows}, f)


# --------------------------------------------------------------------------- driver side


class Namespace:
    """A network namespace with a shaped loopback; deleted by :meth:`close` (idempotent)."""

    def __init__(self, name: str):
        self.name, self.alive = name, False

    def run(self, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=True, timeout=30)

    def open(self) -> Namespace:
        subprocess.run(["ip", "netns", "add", self.name], check=True, timeout=30)
        self.alive = True
        self.run("ip", "link", "set", "lo", "up")
        return self

    def shape(self, rate: str) -> None:
        self.run("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, *TBF)

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace: the launcher's workers run in sessions of
        their own, so killing the launcher's process group would leave them running."""
        found = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30
        )
        for pid in found.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.kill_all()
            subprocess.run(["ip", "netns", "del", self.name], timeout=30, check=False)


def skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"needs iproute2: {', '.join(missing)} not found"
    return None


def run_rate(ns: Namespace, rate: str, args, procs: list) -> dict:
    """Shape the loopback at ``rate`` and run the N workers in the namespace once."""
    ns.shape(rate)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        "ip", "netns", "exec", ns.name, sys.executable, "-m", "jaxcomp.launch",
        "-n", str(args.num_processes), "--timeout", str(args.timeout),
        os.path.abspath(__file__), "--worker", "--out", out, "--size", str(args.size),
        "--reps", str(args.reps_for(rate)), "--batch", str(args.batch),
        "--codecs", *args.codecs, *(["--no-step"] if args.no_step else []),
    ]  # fmt: skip
    print(f"\n== {rate}: {' '.join(cmd[4:])}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=common.ROOT)
    procs.append(proc)
    try:
        code = proc.wait(timeout=args.timeout + 60)
        if code != 0 or os.path.getsize(out) == 0:
            raise RuntimeError(f"workers at {rate} failed with status {code}")
        with open(out) as f:
            return json.load(f)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ns.kill_all()  # workers left behind by a killed launcher
        procs.remove(proc)
        os.unlink(out)


def summarize(rate: str, data: dict, n: int) -> list[dict]:
    bits = rate_bits(rate)
    rows = data["rows"]
    base = next(r for r in rows if r["codec"] == "pmean")
    for r in rows:
        r["rate"], r["mlp_params"] = rate, data["params"]
        r["link_ms"] = 1e3 * n * r["bytes_per_device"] * 8 / bits
        r["efficiency"] = r["link_ms"] / r["allreduce_ms"]
        r["allreduce_speedup"] = base["allreduce_ms"] / r["allreduce_ms"]
        r["bytes_saving"] = base["bytes_per_device"] / r["bytes_per_device"]
        if "step_ms" in r:
            r["step_speedup"] = base["step_ms"] / r["step_ms"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'rate':>8s} {'codec':8s}{'MB/dev':>8s}{'allreduce':>11s}{'speedup':>9s}"
        f"{'link ms':>9s}{'effic.':>8s}{'codec ms':>10s}{'step ms':>9s}{'speedup':>9s}"
    )
    for r in rows:
        codec_ms = r.get("encode_ms", 0) + r.get("decode_ms", 0)
        print(
            f"{r['rate']:>8s} {r['codec']:8s}{r['bytes_per_device'] / 1e6:>8.2f}"
            f"{r['allreduce_ms']:>9.0f}ms{r['allreduce_speedup']:>8.1f}x{r['link_ms']:>9.0f}"
            f"{r['efficiency']:>8.2f}{codec_ms:>10.0f}"
            + (f"{r['step_ms']:>9.0f}{r['step_speedup']:>8.1f}x" if "step_ms" in r else "")
        )


def draw(rows: list[dict], path) -> None:
    import numpy as np

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    names = list(dict.fromkeys(r["codec"] for r in rows))

    def one(ax):
        width = 0.8 / len(rates)
        for i, rate in enumerate(rates):
            vals = [
                next(
                    (r["allreduce_speedup"] for r in rows if r["rate"] == rate and r["codec"] == c),
                    0,
                )
                for c in names
            ]
            ax.bar(np.arange(len(names)) + i * width, vals, width, label=rate)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_yscale("log")
        ax.set_ylabel("all-reduce speedup over pmean (same run)")
        ax.legend()

    n, size = rows[0]["devices"], rows[0]["size"]
    common.plot(
        path, one, f"{n} JAX processes over gloo, shaped loopback, {size / 1e6:.0f}M floats"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1gbit, 4M floats, pmean + sign")
    ap.add_argument("--rates", nargs="+", default=None)
    ap.add_argument("--codecs", nargs="+", default=None, help=f"default {CODECS}")
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--size", type=int, default=None, help="gradient floats (default 25M)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default 5; 2 at <1gbit)")
    ap.add_argument("--batch", type=int, default=8, help="MLP batch per process")
    ap.add_argument("--no-step", action="store_true", help="only the all-reduce, no MLP step")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rate, bounded")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.codecs = args.codecs or (["sign"] if args.quick else CODECS)
    args.size = args.size or ((1 << 22) if args.quick else 25_000_000)
    args.no_step = args.no_step or args.quick
    rates = args.rates or (["1gbit"] if args.quick else RATES)
    for r in rates:
        rate_bits(r)
    args.reps_for = lambda r: args.reps or (5 if rate_bits(r) >= 1e9 else 2)
    reason = skip_reason()
    if reason:
        print(f"network.py: skipped: {reason}")
        return 0

    ns, procs = Namespace(f"jaxcomp-bench-{os.getpid()}"), []

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    start = time.perf_counter()
    rows = []
    try:
        try:
            ns.open()
        except subprocess.CalledProcessError as e:
            print(f"network.py: skipped: cannot create a network namespace ({e})")
            return 0
        for rate in rates:
            rows += summarize(rate, run_rate(ns, rate, args, procs), args.num_processes)
    finally:
        for p in list(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        ns.close()
        for s, h in old.items():
            signal.signal(s, h)
    print_table(rows)
    out = {
        "environment": common.environment(),
        "num_processes": args.num_processes,
        "tbf": " ".join(TBF),
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    common.write_json(common.result_path("network", args.quick), out)
    draw(rows, common.result_path("network", args.quick, "png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
