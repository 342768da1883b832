r"""Where compression pays: an alpha-beta model of one data-parallel step, 8 to 1024 devices.

The step time of a data-parallel step with a ``d``-float gradient on ``n`` devices, links
of bandwidth ``B`` (bytes/s) and a per-message latency ``alpha``:

.. math::

    T = T_\text{compute} + T_\text{codec}(d, n) + \alpha \cdot m(n) + \text{bytes}(d, n) / B

* ``bytes(d, n)``: the ring-model bytes each device sends, ``jc.strategy_bytes`` for the
  strategy ``auto`` picks (``jc.choose_strategy``); plain pmean: ``2 (n-1)/n * 4d``.
* ``m(n)``: messages each device sends in sequence: a ring all-reduce ``2(n-1)``, a ring
  all-gather ``n-1``, two-phase (all-to-all then all-gather) ``2(n-1)``.
* ``T_codec``: measured, from ``benchmarks/results/codec_speed.json`` (seconds per float of
  encode and of decode at the largest size measured, on that run's device), times the work
  each strategy does: allreduce ``enc(d) + 2 dec(d)``; allgather ``enc(d) + (n+1) dec(d)``
  (every peer's payload plus one's own for error feedback); two-phase
  ``(1 + 1/n) enc(d) + (3 + 1/n) dec(d)``. ``--codec-scale`` rescales it (e.g. 0.02 for a
  GPU whose memory bandwidth is ~50x a CPU's: codec_speed.py measures it on one).
* the uncompressed step has ``T_codec = 0``.

The speedup is ``T_pmean / T_codec_step``; above 1 compression pays. Defaults: ``d`` = 25M
(the network benchmark's gradient), ``T_compute`` = 100 ms, ``alpha`` = 20 us (TCP/Ethernet;
~2-5 us on InfiniBand). It is a model: it ignores overlap of communication with backward,
congestion, hierarchy (NVLink inside a host) and gloo/NCCL protocol overheads — the network
benchmark measures those. Writes ``benchmarks/results/alpha_beta.json`` and
``alpha_beta.png``::

    python -m benchmarks.alpha_beta
    python -m benchmarks.alpha_beta --codec-scale 0.02 --name alpha_beta_gpu_scaled
"""

from __future__ import annotations

import json
import sys

from benchmarks import common

BANDWIDTHS = {"1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8, "100 Gbit/s": 100e9 / 8}
DEVICES = [8, 16, 32, 64, 128, 256, 512, 1024]
CODECS = ["fp16", "int8", "int4", "sign", "topk1%"]
MESSAGES = {"pmean": 2, "allreduce": 2, "two_phase": 2, "allgather": 1}  # times (n - 1)


def codec_costs(path=None) -> tuple[dict[str, tuple[float, float]], str]:
    """Seconds per float (encode, decode) per codec from the largest size in codec_speed."""
    for p in (
        [path]
        if path
        else [common.RESULTS / f for f in ("codec_speed.json", "codec_speed_quick.json")]
    ):
        if p is not None and p.exists():
            data = json.loads(p.read_text())
            best: dict[str, dict] = {}
            for r in data["rows"]:
                if r["codec"] not in best or r["size"] > best[r["codec"]]["size"]:
                    best[r["codec"]] = r
            costs = {
                name: (1e-3 * r["encode_ms"] / r["size"], 1e-3 * r["decode_ms"] / r["size"])
                for name, r in best.items()
            }
            env = data["environment"]
            return costs, f"{p.name} ({env['backend']}, {env['device']})"
    raise FileNotFoundError("run python -m benchmarks.codec_speed first (no codec_speed JSON)")


def codec_seconds(strategy: str, enc: float, dec: float, d: float, n: int) -> float:
    if strategy == "allreduce":
        return d * (enc + 2 * dec)
    if strategy == "allgather":
        return d * (enc + (n + 1) * dec)
    return d * ((1 + 1 / n) * enc + (3 + 1 / n) * dec)


def step_time(name, d, n, bandwidth, alpha, compute, costs, scale) -> dict:
    import jaxcomp as jc

    if name == "pmean":
        strategy, wire, codec_s = "pmean", 2 * (n - 1) / n * 4 * d, 0.0
    else:
        codec = common.make_codec(name)
        strategy = jc.choose_strategy(codec, int(d), n)
        wire = jc.strategy_bytes(codec, int(d), n)[strategy]
        enc, dec = costs[name]
        codec_s = scale * codec_seconds(strategy, enc, dec, d, n)
    latency = alpha * MESSAGES[strategy] * (n - 1)
    total = compute + codec_s + latency + wire / bandwidth
    return {
        "strategy": strategy,
        "bytes_per_device": wire,
        "codec_s": codec_s,
        "latency_s": latency,
        "wire_s": wire / bandwidth,
        "step_s": total,
    }


def model(d, compute, alpha, costs, scale, codecs) -> list[dict]:
    rows = []
    for bw_name, bw in BANDWIDTHS.items():
        for n in DEVICES:
            base = step_time("pmean", d, n, bw, alpha, compute, costs, scale)
            for name in ["pmean", *codecs]:
                r = step_time(name, d, n, bw, alpha, compute, costs, scale)
                r.update(bandwidth=bw_name, devices=n, codec=name)
                r["speedup"] = base["step_s"] / r["step_s"]
                rows.append(r)
    return rows


def draw(rows, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws = list(BANDWIDTHS)
    fig, axes = plt.subplots(1, len(bws), figsize=(14, 4.5), sharey=True)
    for ax, bw in zip(axes, bws, strict=True):
        for name in dict.fromkeys(r["codec"] for r in rows if r["codec"] != "pmean"):
            pts = [
                (r["devices"], r["speedup"])
                for r in rows
                if r["bandwidth"] == bw and r["codec"] == name
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(bw)
        ax.set_xlabel("devices n")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("step speedup over pmean (>1: compression pays)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {common.show_path(path)}")


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="alpha_beta.json and .png (`--name`: another stem; `--quick`: alpha_beta_quick.*)",
        takes="a few seconds (a model in Python; it reads codec_speed.json)",
    )
    ap.add_argument("--quick", action="store_true", help="same model, written as *_quick")
    ap.add_argument("--params", type=float, default=25e6, help="gradient floats d")
    ap.add_argument("--compute-ms", type=float, default=100.0, help="compute time of one step (ms)")
    ap.add_argument("--alpha-us", type=float, default=20.0, help="latency per message")
    ap.add_argument("--codec-scale", type=float, default=1.0, help="multiplies measured codec cost")
    ap.add_argument("--codecs", nargs="+", default=CODECS, help="codecs modelled")
    ap.add_argument("--name", default="alpha_beta", help="output file stem (keep variants apart)")
    args = ap.parse_args(argv)
    costs, source = codec_costs()
    codecs = [c for c in args.codecs if c in costs]
    missing = sorted(set(args.codecs) - set(codecs))
    if missing:
        print(f"no measured cost for {missing} in {source}: left out")
    rows = model(
        args.params, 1e-3 * args.compute_ms, 1e-6 * args.alpha_us, costs, args.codec_scale, codecs
    )
    print(f"codec cost from {source}, x{args.codec_scale:g}; d = {args.params:.3g}")
    print(f"{'bandwidth':>11s}{'n':>6s}  " + "".join(f"{c:>9s}" for c in codecs))
    for bw in BANDWIDTHS:
        for n in DEVICES:
            sp = {
                r["codec"]: r["speedup"] for r in rows if r["bandwidth"] == bw and r["devices"] == n
            }
            print(f"{bw:>11s}{n:>6d}  " + "".join(f"{sp[c]:>8.2f}x" for c in codecs))
    out = {
        "environment": common.environment(),
        "codec_cost_source": source,
        "codec_cost_seconds_per_float": {c: costs[c] for c in codecs},
        "params": args.params,
        "compute_s": 1e-3 * args.compute_ms,
        "alpha_s": 1e-6 * args.alpha_us,
        "codec_scale": args.codec_scale,
        "rows": rows,
    }
    common.write_json(common.result_path(args.name, args.quick), out)
    title = (
        f"alpha-beta model: d={args.params:.3g} floats, compute {args.compute_ms:g} ms, "
        f"alpha {args.alpha_us:g} us, codec cost {source} x{args.codec_scale:g}"
    )
    draw(rows, common.result_path(args.name, args.quick, "png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
