"""``python -m jaxcomp.autotune``: measure the devices at hand and print the exchange table.

For a model of ``--params`` float32 parameters (``--leaves`` square matrices and their
biases), :func:`jaxcomp.autotune` times the link and each candidate codec on the devices
jax sees (``--devices N`` simulates N CPU devices) and prints every candidate's bytes,
predicted and measured time, marking the one chosen. ``--json PATH`` also writes the table.
Takes about a minute on 8 CPU devices at the default size.

``jc.autotune`` (the function) stays callable after this module is imported: the module
object forwards calls to it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types

_CLI_DOC = __doc__  # the module's own text, for --help (``__doc__`` becomes the function's)


def _tree(params: float, leaves: int) -> dict:
    import numpy as np

    h = max(8, int(math.sqrt(params / leaves)))
    tree = {}
    for i in range(leaves):
        tree[f"w{i}"] = np.zeros((h, h), np.float32)
        tree[f"b{i}"] = np.zeros((h,), np.float32)
    return tree


def _parser() -> argparse.ArgumentParser:
    from jaxcomp._src.cli import bounded
    from jaxcomp._src.codecs.registry import CODECS
    from jaxcomp._src.cost import STRATEGIES

    p = argparse.ArgumentParser(
        prog="python -m jaxcomp.autotune",
        description=_CLI_DOC.split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--params",
        type=bounded(float, 1),
        default=4e6,
        help="float32 parameters of the model",
    )
    p.add_argument(
        "--leaves", type=bounded(int, 1), default=8, help="weight matrices (each with a bias)"
    )
    p.add_argument(
        "--devices",
        type=bounded(int, 0),
        default=0,
        help="simulate this many CPU devices (0: the devices jax finds)",
    )
    p.add_argument(
        "--codecs",
        nargs="+",
        default=["none", "bf16", "fp16", "int8"],
        choices=["none", *CODECS],
        metavar="CODEC",
        help="candidates: 'none' (plain pmean) or jc.CODECS names, e.g. sign topk1%%",
    )
    p.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        choices=[s for s in STRATEGIES if s != "auto"],
        metavar="STRATEGY",
        help="strategies to try (None: allreduce, allgather, two_phase where a codec can carry "
        "them)",
    )
    p.add_argument(
        "--check",
        type=bounded(int, 1),
        default=4,
        help="candidates timed for real (best of each codec first)",
    )
    p.add_argument(
        "--budget",
        type=bounded(float, 0, open_low=True),
        default=120.0,
        help="seconds for the timed checks",
    )
    p.add_argument("--json", default=None, help="also write the table to this JSON file")
    return p


def _check_strategies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error where no strategy of ``--strategies`` can carry a codec of ``--codecs``
    (:func:`jaxcomp._src.autotune.check_carried`, the function's own check): the autotuner
    would leave its rows out of the table without a word."""
    from jaxcomp._src.autotune import check_carried
    from jaxcomp._src.codecs.registry import get_codec

    if not args.strategies:
        return
    try:
        check_carried([None if n == "none" else get_codec(n) for n in args.codecs], args.strategies)
    except ValueError as e:
        parser.error(f"argument --strategies: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_strategies(parser, args)
    if args.devices:
        from jaxcomp.cpu import use_cpu_devices

        use_cpu_devices(args.devices)
    import jax

    import jaxcomp as jc
    from jaxcomp._src import autotune as tuning

    if len(jax.devices()) < 2:  # every compressed row failed with ZeroDivisionError
        print(
            f"python -m jaxcomp.autotune: {len(jax.devices())} device: nothing to exchange; "
            "simulate CPU devices with --devices 8",
            file=sys.stderr,
        )
        return 2
    codecs = [None if c == "none" else jc.get_codec(c) for c in args.codecs]
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    plan = tuning.autotune(
        _tree(args.params, args.leaves),
        mesh,
        "data",
        codecs=codecs,
        strategies=args.strategies,
        check=args.check,
        budget_s=args.budget,
    )
    print(
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{args.params:.3g} params in {args.leaves} leaves"
    )
    print(plan.format())
    chosen = (
        "no compression (plain pmean)"
        if plan.codec is None
        else (
            f"{tuning.codec_label(plan.codec)} {plan.exchange()}"
            f" error_feedback={plan.error_feedback!r}"
        )
    )
    print(f"chosen: {chosen}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "table": [dict(r._asdict(), codec=r.name) for r in plan.table],
                    "link": {k: v._asdict() for k, v in plan.link.items()},
                },
                f,
                indent=1,
            )
    return 0


class _CallableModule(types.ModuleType):
    """Importing ``jaxcomp.autotune`` rebinds the package attribute ``autotune`` to this
    module; calls still reach the function."""

    def __call__(self, *args, **kwargs):
        from jaxcomp._src.autotune import autotune

        return autotune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

# ``jc.autotune`` is this module once it is imported (the package attribute is rebound): its
# help, ``inspect.signature`` and ``inspect.getdoc`` still give the function's.
from jaxcomp._src.autotune import autotune as __wrapped__  # noqa: E402

__doc__ = __wrapped__.__doc__

if __name__ == "__main__":
    sys.exit(main())
