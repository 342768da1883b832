"""SparseLoCo and DeMo on the LM benchmark (``benchmarks/lm.py``), against AdamW data parallel.

Adds the rows of :data:`RECIPES` to ``benchmarks.lm.RECIPES`` and runs that benchmark (the
same model, tokens, steps and bytes accounting as every other LM recipe)::

    python -m benchmarks.lm_sparse                       # the cpu config, every row below
    python -m benchmarks.lm_sparse --recipes demo-1e-3   # (adamw is always run first)

Writes ``benchmarks/results/lm_sparse.json`` and ``lm_sparse.png`` (``--tag T``:
``lm_T.json``).

* ``sparseloco-H30``: ``jc.sparseloco(AdamW, H=30)`` at Templar's settings (64 of every
  4096 values, 2-bit values, error feedback decayed by 0.95, no outer momentum), the mean
  over every device; ``-senders``: Templar's mean over the devices that sent each
  coordinate (the library's defaults since: the mean over senders, ``ef_decay=0.5``, are
  the rows ``sparseloco-*-ef0.5`` of ``benchmarks.lm_diloco``).
* ``demo-LR-all``: ``jc.demo`` at its defaults (64 x 64 blocks, 16 components each, 8-bit
  values, momentum 0.999, every leaf through DeMo) with AdamW's schedule at peak ``LR`` and
  its weight decay (0.1); ``demo-LR``: the leaves under 1024 values sent whole
  (``min_size=1024``).
"""

from __future__ import annotations

from typing import Any

from benchmarks import common, lm


def _sparseloco(sync_every: int, inner_lr: float | None = None, **kw: Any):
    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.sparseloco(run.adamw(inner_lr), axis, sync_every, **kw)

    return make


def _sl(h: int, note: str, m: int | None = None, **kw: Any) -> lm.Recipe:
    return lm.Recipe(
        _sparseloco(h, **kw), kind="replica", replicas=m, schedule={"sync_every": h}, note=note
    )


def _demo(peak: float, **kw: Any):
    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.demo(run.schedule(peak), axis, weight_decay=lm.WEIGHT_DECAY, **kw)

    return make


RECIPES: dict[str, lm.Recipe] = {
    "nocomm": lm.RECIPES["nocomm"],
    "sparseloco-H30": lm.Recipe(
        _sparseloco(30, averaging="all", ef_decay=0.95),
        kind="replica",
        schedule={"sync_every": 30},
        note="mean over all",
    ),
    "sparseloco-H30-senders": lm.Recipe(
        _sparseloco(30, averaging="senders", ef_decay=0.95),
        kind="replica",
        schedule={"sync_every": 30},
        note="Templar: mean over senders",
    ),
    "sparseloco-H10": lm.Recipe(
        _sparseloco(10, averaging="all", ef_decay=0.95),
        kind="replica",
        schedule={"sync_every": 10},
        note="mean over all",
    ),
    "sparseloco-H30-two_phase": lm.Recipe(
        _sparseloco(30, strategy="two_phase", ef_decay=0.95),
        kind="replica",
        schedule={"sync_every": 30},
        note="reduce-scatter style exchange",
    ),
    "sparseloco-H30-M2-senders": _sl(
        30, "2 replicas of 4, senders", m=2, averaging="senders", ef_decay=0.95
    ),
    "demo-1e-3": lm.Recipe(_demo(1e-3, min_size=1024), note="peak lr 1e-3, small leaves whole"),
    "demo-3e-4": lm.Recipe(_demo(3e-4, min_size=1024), note="peak lr 3e-4, small leaves whole"),
    "demo-3e-3": lm.Recipe(_demo(3e-3, min_size=1024), note="peak lr 3e-3, small leaves whole"),
    "demo-1e-3-k32": lm.Recipe(_demo(1e-3, topk=32, min_size=1024), note="DeMo's topk 32"),
    "demo-1e-3-all": lm.Recipe(_demo(1e-3, min_size=0), note="every leaf compressed"),
    "demo-3e-3-all": lm.Recipe(_demo(3e-3, min_size=0), note="peak lr 3e-3, every leaf"),
    "demo-6e-3-all": lm.Recipe(_demo(6e-3, min_size=0), note="peak lr 6e-3, every leaf"),
    "demo-3e-3-decay0.99": lm.Recipe(_demo(3e-3, decay=0.99), note="momentum decay 0.99"),
    "demo-3e-3-decay0.9": lm.Recipe(_demo(3e-3, decay=0.9), note="momentum decay 0.9"),
    "demo-3e-3-decay0.7": lm.Recipe(_demo(3e-3, decay=0.7), note="momentum decay 0.7"),
    "demo-3e-3-decay0.8": lm.Recipe(_demo(3e-3, decay=0.8), note="momentum decay 0.8"),
    "demo-3e-3-decay0.95": lm.Recipe(_demo(3e-3, decay=0.95), note="momentum decay 0.95"),
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = common.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            "Writes benchmarks/results/lm_TAG.json and lm_TAG.png (adamw is run first unless "
            "--resume finds it there). Takes 3-20 minutes per recipe on 8 CPU devices of a "
            "loaded 2-core machine (the compile of a sync step is a good part of it)."
        ),
    )
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), help=f"of {list(RECIPES)}")
    ap.add_argument("--steps", type=int, default=None, help="steps (None: the cpu config's 300)")
    ap.add_argument("--resume", action="store_true", help="keep the recipes already run")
    ap.add_argument("--tag", default="sparse", help="write benchmarks/results/lm_TAG.json")
    args = ap.parse_args(argv)
    lm.RECIPES.update(RECIPES)
    extra = ["--resume"] if args.resume else []
    if args.steps is not None:
        extra += ["--steps", str(args.steps)]
    return lm.main(["--config", "cpu", "--tag", args.tag, "--recipes", *args.recipes, *extra])


if __name__ == "__main__":
    raise SystemExit(main())
