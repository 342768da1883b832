"""Where a replica recipe loses ground against AdamW data parallel, read from runs already
recorded (no training): the gap of each row, window by window, on the same tokens.

Every run of ``benchmarks.lm`` records the training loss of every step (``curve``: for a
replica recipe the mean of the replicas' own losses, at their own params, on the same global
batch AdamW data parallel saw at that step) and the held-out loss every 50 steps
(``evals``: for a replica recipe the mean replica, which is the anchor only at a sync). For
each row named in :data:`ROWS` this module writes, against the ``adamw`` row of the same
file (AdamW at its tuned peak, cosine to 10%):

* ``wK``: the training-loss gap over the ``K``-th window of ``--window`` steps (30: one
  sync interval at ``H = 30``), ``100 (mean(curve) / mean(adamw curve) - 1)`` over the
  window, the same batches on both sides, so the batches' noise cancels;
* ``held-out 150`` and ``held-out 300``: the held-out gap at the two evaluations that fall on
  a sync of ``H = 30`` (and of ``H = 3``), in percent;
* ``late rise``: the last window's gap minus the smallest gap after the run's first third
  (in points): how much ground the row gives up once its start-up is over;
* ``inner / DP peak``: the inner lr held (the file's ``--lr``) over AdamW's tuned peak on
  that pair.

::

    python -m benchmarks.lm_gap_windows             # benchmarks/results/lm_gap_windows.json
    python -m benchmarks.lm_gap_windows --per-step --window 25 --tag gap_windows_per_step
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks import common

#: ``(pair, file, AdamW's tuned peak on the pair, the rows read)``: the 8-replica rows of
#: issue 24 (SparseLoCo at 3000x, DiLoCo with AdamW inside at ``H = 8`` and ``H = 30``,
#: MuLoCo, SparseLoCo at ``H = 3``) on each pair where they ran at seed 0 (and 1), and the
#: changes tried on the fifth pair's two misses (slice L9): the inner lr held at half of
#: AdamW's tuned peak, shrinking sync intervals, the inner lr decayed at the end (WSD).
SL3000 = "sparseloco-H30-muon-innerconst-d{}-b1mean-min0-outer1.5"
SL3000_WSD = SL3000.replace("innerconst", "innerwsd")
ROWS: tuple[tuple[str, str, float, tuple[str, ...]], ...] = (
    (
        "benchmark s0",
        "lm_S_sparseloco_m2.json",
        4.5e-3,
        (SL3000.format(21), SL3000.format(21) + "@inner4.5e-3"),
    ),
    (
        "benchmark s0",
        "lm_h30_adamw_inside.json",
        4.5e-3,
        ("diloco-int4-H8-innerconst", "diloco-int4-H30-innerconst"),
    ),
    ("benchmark s0", "lm_L2_sparseloco.json", 4.5e-3, ("sparseloco-H3-innerconst",)),
    ("held-out s0", "lm_S_sparseloco_m2_ho.json", 6e-3, (SL3000.format(17),)),
    (
        "held-out s0",
        "lm_h30_adamw_inside_heldout.json",
        6e-3,
        ("diloco-int4-H8-innerconst", "diloco-int4-H30-innerconst"),
    ),
    ("held-out s0", "lm_L2_sparseloco_ho.json", 6e-3, ("sparseloco-H3-innerconst",)),
    (
        "fourth s0",
        "lm_L16P4_loco.json",
        6e-3,
        (
            SL3000.format(19),
            "diloco-int4-H8-innerconst",
            "diloco-int4-H30-innerconst",
            "sparseloco-H3-innerconst",
        ),
    ),
    (
        "fourth s1",
        "lm_L16P4_s1_loco.json",
        6e-3,
        (SL3000.format(21), "diloco-int4-H8-innerconst", "diloco-int4-H30-innerconst"),
    ),
    (
        "fifth s0",
        "lm_fifth_loco.json",
        3e-3,
        (
            SL3000.format(21),
            "diloco-int4-H8-innerconst",
            "diloco-int4-H30-innerconst",
            "diloco-int4-H30-muon-innerconst",
            "sparseloco-H3-innerconst",
        ),
    ),
    ("fifth s1", "lm_fifth_s1_loco.json", 3e-3, ("diloco-int4-H8-innerconst",)),
    (
        "fifth s0",
        "lm_L9_fifth.json",
        3e-3,
        (
            SL3000.format(21) + "@inner1.5e-3",
            "diloco-int4-H8-innerconst@inner1.5e-3",
            "sparseloco-H45to15-muon-innerconst-d21-b1mean-min0-outer1.5",
            "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-outer1.5",
            "diloco-int4-H8-innerwsd",
        ),
    ),
    ("benchmark s0", "lm_h30_adamw_inside.json", 4.5e-3, ("diloco-int4-H8-innerwsd",)),
    # the 3000x row held and decayed (WSD) on the held-out and fourth pairs (slice L10)
    ("held-out s0", "lm_S_sparseloco_m2_ho.json", 6e-3, (SL3000_WSD.format(17),)),
    ("held-out s1", "lm_L10_ho_s1_loco.json", 6e-3, (SL3000.format(17), SL3000_WSD.format(17))),
    ("fourth s0", "lm_L16P4_loco.json", 6e-3, (SL3000_WSD.format(19),)),
    ("fourth s1", "lm_L16P4_s1_loco.json", 6e-3, (SL3000.format(19), SL3000_WSD.format(19))),
)

#: ``--per-step``: the per-step rows on the third pair (numpy's docstrings, 2 x ``d_model``
#: 96, AdamW's tuned 6e-3) at seeds 0-2 and at seed 2's initialization with another order of
#: batches (``--batch-seed 12``), where 1-bit Adam, 0/1 Adam and DeMo miss at seed 2 (slice
#: L12), without the ``inner / DP peak`` column.
OB, ZO, DEMO = (
    "onebit_adam",
    "zero_one_adam-var16-warmup50",
    "demo-4e-3-decay0.95-k20-b3-wsd20-warm2",
)
PER_STEP: tuple[tuple[str, str, float, tuple[str, ...]], ...] = (
    ("third s0", "lm_meanbound_third_s0.json", 6e-3, (OB, ZO)),
    ("third s0", "lm_third.json", 6e-3, ("int8-adamw", "powersgd24-adamw")),
    ("third s0", "lm_third_demo_blocks.json", 6e-3, (DEMO,)),
    ("third s1", "lm_meanbound_third_s1.json", 6e-3, (OB, ZO)),
    ("third s1", "lm_third_s1_perstep.json", 6e-3, ("int8-adamw", "powersgd24-adamw")),
    ("third s1", "lm_third_s1.json", 6e-3, (DEMO,)),
    ("third s2", "lm_meanbound_third_s2.json", 6e-3, (OB, ZO)),
    ("third s2", "lm_third_s2_perstep.json", 6e-3, ("int8-adamw", "powersgd24-adamw")),
    ("third s2", "lm_third_s2.json", 6e-3, (DEMO,)),
    ("third s2, batches 12", "lm_L12_third_s2_b12.json", 6e-3, (OB, ZO, DEMO)),
)


def window_gaps(curve: list[float], base: list[float], window: int) -> list[float]:
    """``100 (mean(curve[w]) / mean(base[w]) - 1)`` over consecutive windows of ``window``
    steps (the same steps, so the same batches, on both sides)."""
    out = []
    for start in range(0, len(base) - window + 1, window):
        mine = sum(curve[start : start + window]) / window
        theirs = sum(base[start : start + window]) / window
        out.append(100.0 * (mine / theirs - 1.0))
    return out


def held_out_gap(run: dict[str, Any], base: dict[str, Any], step: int) -> float | None:
    """The held-out gap in percent at evaluation ``step`` (None: not evaluated there)."""
    mine, theirs = dict(map(tuple, run["evals"])), dict(map(tuple, base["evals"]))
    if step not in mine or step not in theirs:
        return None
    return 100.0 * (mine[step] / theirs[step] - 1.0)


def row(pair: str, run: dict, base: dict, ratio: float | None, window: int) -> dict[str, Any]:
    """One record: the row's window gaps, its held-out gaps at steps 150 and 300, its late
    rise (the last window's gap over the smallest after the first third) and its inner lr
    over AdamW's tuned peak (``ratio``; None: no such column, a per-step row)."""
    gaps = window_gaps(run["curve"], base["curve"], window)
    late = gaps[len(gaps) // 3 :]
    record: dict[str, Any] = {"pair": pair, "recipe": run["recipe"]}
    if ratio is not None:
        record["inner / DP peak"] = round(ratio, 2)
    record.update({f"w{k + 1}": round(g, 1) for k, g in enumerate(gaps)})
    record["late rise"] = round(late[-1] - min(late), 1)
    for step in (150, 300):
        gap = held_out_gap(run, base, step)
        record[f"held-out {step}"] = None if gap is None else round(gap, 2)
    return record


def records(window: int, rows: tuple = ROWS) -> list[dict[str, Any]]:
    """Every row of ``rows`` (:data:`ROWS` or :data:`PER_STEP`), read from
    ``benchmarks/results``."""
    out = []
    for pair, name, peak, recipes in rows:
        data = json.loads((common.RESULTS / name).read_text())
        runs = {r["recipe"]: r for r in data["runs"]}
        for recipe in recipes:
            ratio = inner_lr(recipe, data["config"]["lr"]) / peak if rows is ROWS else None
            out.append(row(pair, runs[recipe], runs["adamw"], ratio, window))
    return out


def inner_lr(recipe: str, lr: float) -> float:
    """The inner lr a row held: its ``@innerX`` label's ``X`` (a run merged from another
    ``--lr``), else the file's ``lr``."""
    return float(recipe.rsplit("@inner", 1)[1]) if "@inner" in recipe else lr


def main(argv: list[str] | None = None) -> int:
    ap = common.arg_parser(__doc__, writes="lm_TAG.json", takes="about a second (no training)")
    ap.add_argument("--window", type=int, default=30, help="steps per window (H = 30's sync)")
    ap.add_argument("--tag", default="gap_windows", help="write benchmarks/results/lm_TAG.json")
    ap.add_argument(
        "--per-step", action="store_true", help="the rows of PER_STEP (the third pair's seeds)"
    )
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error(f"--window must be at least 1, got {args.window}")
    out = {"environment": common.environment(), "window": args.window}
    out["rows"] = records(args.window, PER_STEP if args.per_step else ROWS)
    common.write_json(common.result_path("lm_" + args.tag, False), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
