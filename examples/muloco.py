"""MuLoCo: DiLoCo with Muon as the inner optimizer and 2-bit outer gradients with error
feedback, on 8 CPU devices, against Muon with a per-step pmean.

MuLoCo (arXiv 2505.23725) is ``jc.diloco`` with ``optax.contrib.muon`` inside: nothing new
in the library, a configuration. Its settings: H = 30 inner Muon steps, the pseudo-gradient
quantized to 2 bits with residual error feedback (``jc.int_quant(2)``, error feedback
``"auto"`` = residual for a biased codec), outer Nesterov SGD with lr 0.7 and momentum 0.6::

    tx = jc.diloco(
        optax.contrib.muon(0.02), "data", sync_every=30,
        outer=optax.sgd(0.7, momentum=0.6, nesterov=True),
        codec=jc.int_quant(2),
    )

Muon runs at the same ``--lr`` in both: the inner optimizer at data parallel's own lr, the
rule measured on the LM benchmark (docs/lm-diloco.md, MuLoCo, "The inner lr").

A small MLP on scikit-learn's digits (ships offline); the same batches for both runs. Bytes
are read from the compiled steps (``jc.comm_report``; the sync step's, times the run's syncs,
over its steps).

    python examples/muloco.py
    python examples/muloco.py --steps 600 --sync-every 30
"""

from __future__ import annotations

import argparse
import sys

from _flags import WithDefaults, bounded  # examples/_flags.py

import jaxcomp as jc
from jaxcomp.cpu import use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

import jax  # noqa: E402
import optax  # noqa: E402
import sparseloco_demo as shared  # noqa: E402  (the data, model and step of the sibling)

AXIS = "data"


def muloco(lr: float, sync_every: int) -> optax.GradientTransformation:
    """MuLoCo's configuration of ``jc.diloco`` (outer lr 0.7, momentum 0.6, 2-bit + EF)."""
    return jc.diloco(
        optax.contrib.muon(lr),
        AXIS,
        sync_every,
        outer=optax.sgd(0.7, momentum=0.6, nesterov=True),
        codec=jc.int_quant(2),
    )


def train(method: str, args) -> tuple[float, float]:
    """(test accuracy, bytes per step per device averaged over the run)."""
    tx = muloco(args.lr, args.sync_every) if method == "muloco" else optax.contrib.muon(args.lr)
    kind = "replica" if method == "muloco" else "pmean"
    return shared.run(tx, kind, args.steps, args.sync_every)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=WithDefaults)
    ap.add_argument("--steps", type=bounded(int, 1), default=300, help="training steps")
    ap.add_argument("--sync-every", type=bounded(int, 1), default=30, help="H: inner Muon steps")
    ap.add_argument(
        "--lr",
        type=bounded(float, 0, open_low=True),
        default=0.02,
        help="Muon's learning rate",
    )
    args = ap.parse_args(argv)
    if args.steps < args.sync_every:
        ap.error(
            f"argument --steps: {args.steps} ends before the first sync "
            f"(--sync-every {args.sync_every})"
        )
    rows = [(m, *train(m, args)) for m in ("muon", "muloco")]
    base = rows[0][2]
    print(f"{'method':8s} {'accuracy':>9s} {'bytes/step/device':>18s} {'x fewer':>8s}")
    for method, acc, per_step in rows:
        print(f"{method:8s} {acc:>9.4f} {per_step:>18.0f} {base / per_step:>7.1f}x")
    print(f"devices: {jax.device_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
