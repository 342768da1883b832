"""DiLoCo on the LM benchmark (``benchmarks/lm.py``): where its loss goes, sync by sync, and
the settings measured against AdamW data parallel.

Adds the rows of :data:`RECIPES` to ``benchmarks.lm.RECIPES`` (the same model, tokens, steps
and bytes accounting as every other LM recipe) and, with ``--diagnose``, records at every
sync of the recipes named:

* the held-out loss of the anchor (the last synced params), of the plain mean of the replicas
  and the mean of the replicas' own losses, taken just before the sync step (``H - 1`` inner
  steps after the last sync), and of the new anchor just after it; AdamW data parallel's
  held-out loss at the same step (the ``adamw`` run, recorded at the same steps);
* the pseudo-gradients ``D_i = x - theta_i`` (before the sync step): their mean norm, the norm
  of their mean, the mean cosine between replicas, and the norm of the outer step
  ``|x_new - x|``; AdamW data parallel's displacement over the same interval; the median over
  the coordinates of the replicas' AdamW denominator ``sqrt(nu)`` over data parallel's;
* SparseLoCo (all-gather): what its error feedback sent (:func:`feedback_record`: the
  payload's and the memory's norms over ``|D_i|``, the payload's cosine with ``D_i``), at
  ``--ef-decay`` (the recipe's decay), the pseudo-gradient read from a copy of the sync step
  run without its sync. ``--no-baseline``: no ``adamw`` run.

The rows: plain averaging (``local-H30``), the outer step (heavy ball, lr 1.5 and 2.0 without
momentum), the codec (float32; int2 at ``H = 15`` and 1-bit signs at ``H = 10``: the bytes of
int4 at ``H = 30`` spent on more syncs), data parallel for the first 30 steps
(``-dp30``: what the early drift costs), plain averaging at ``H = 10`` on 2 replicas, and
DeMo's peak lr and weight decay around its recipe (``demo-3e-3-decay0.9``). The sweep behind
``jc.diloco``'s default outer step and the rule for ``H``: the outer step at ``H = 10`` (8
replicas), ``H = 5`` on 8 and on 2 replicas, and 4 replicas of 2 devices (Nesterov against
plain averaging). SparseLoCo's defaults, one change at a time: the error feedback's decay
(0.95, 0.5, 0), float32 values (a diagnosis), an outer lr of 0.5, each payload clipped to its
pseudo-gradient's norm (``clip=True``), ``H = 10`` on 8 and on 2 replicas. The inner
schedule at ``H = 30`` (``-innerconst``: AdamW's lr held at its peak after the warm-up,
:func:`held_schedule`), with it the outer lr warmed up (``-outerwarmup3``) or annealed by
cosine (``-outercos``, :func:`outer_cosine`), Muon inside (``-muon``), and SparseLoCo's
``ef_decay=0.95`` with the held lr, on 8 and on 2 replicas. AdamW inside re-tuned at
``H = 30``: the outer step (``-outer1.0-0.6``, ``-outer0.5-0.6``, ``-outer0.7-0.3``), the inner
lr decayed at the end (``-innerwsd``: :func:`wsd_schedule`; ``-innerwsd10``, ``-innerwsd33``),
each replica's AdamW betas (``-b1_0.95``, ``-b2_0.95``), a growing ``H`` (``sync_every`` a
sequence of intervals: ``-H10to30`` on 8 replicas, ``-H5to30`` and ``-H5x6to30`` on 2),
``H = 20`` on 2 replicas, and SparseLoCo with WSD or ``averaging="all"``. The rule for
``H`` with the inner lr held: ``H = 10`` on 2 and on 8 replicas, ``H = 5`` and ``H = 8``
on 8, and ``H = 16`` on 2 (the shortest ``H`` that keeps 200x fewer bytes in 300 steps);
SparseLoCo with the inner lr held at ``H = 10``, 5, 4 and 3 on 8 replicas, 10 and 5 on 2;
on 2 replicas at ``H = 10`` and 5 one change at a time (the density 256 / 4096, ``ef_decay``
0.9, 0.95 and 1.0, an outer lr of 1.5), the density 256 / 4096 at ``H = 3`` on 2,
``ef_decay=0.95`` at ``H = 30`` on 2 and at ``H = 3`` on 8. SparseLoCo with Muon inside at
``H = 30`` and 3000x fewer bytes or more: on 2 replicas ``ef_decay=0.95`` and an outer lr of
1.5 and 2.0, on 8 replicas the density 16 / 4096 with every leaf compressed and an outer lr
of 1.5. With every leaf compressed on 2 replicas (3100-3152x): 152 of 4096 at 2 bits, 43 of
1024 at 2 bits, 47 of 1024 at 1 bit at the mean magnitude (``value_scale="mean"``); on 8
replicas 21 of 4096 at 1 bit at the mean and the two-phase exchange at 64 of 4096 (20 of 4096
at 2 bits defined, not run). From the 1-bit row on 2 replicas, one change at a time:
``ef_decay`` 0.3 and 0.8, an outer lr of 1.2 and 1.8, and the leaves under 1024 values as
1-bit signs (``small_codec=jc.sign()``).
``--fidelity ... --muon --fidelity-codecs 3000x``: the codecs of those rows on a pseudo-gradient
of Muon inside. A coordinate mask shared by every replica (``mask="random"`` / ``"previous"``,
1-bit values, two-phase) at 3000x on 8 and on 2 replicas; ``--fidelity-exchange START
--replicas M``: what SparseLoCo's exchanges at 3000x (per-replica top-k, shared masks) keep of
the mean of ``M`` replicas' pseudo-gradients (:func:`exchange_fidelity`); ``--block-energy
NPY``: how the mean's energy is spread over blocks (:func:`block_energy`).

::

    python -m benchmarks.lm_diloco --recipes diloco-f32-H30 --tag diloco
    python -m benchmarks.lm_diloco --diagnose diloco-int4-H30 local-H30 --tag sync_local
    python -m benchmarks.lm_diloco --diagnose sparseloco-H10-M2-innerconst --sync-every 10 \
        --no-baseline --tag S_sync_h10m2

Writes ``benchmarks/results/lm_TAG.json`` (and ``.png``); ``--diagnose``: the per-sync
records in ``lm_TAG.json`` under ``"syncs"``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from benchmarks import common, lm, lm_sparse


def _diloco(
    h: int,
    *,
    codec: str | None = "int4",
    outer: Callable[[], Any] | None = None,
    inner: Callable[[lm.Run], Any] | None = None,
    **kw: Any,
) -> Callable[[lm.Run, Any], Any]:
    """``jc.diloco`` of AdamW at the run's schedule (or ``inner(run)``), ``outer()`` as its
    outer step (None: the default), the pseudo-gradient through ``codec`` (None: float32)."""

    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        c = None if codec is None else common.make_codec(codec)
        o = None if outer is None else outer()
        tx = run.adamw() if inner is None else inner(run)
        return jc.diloco(tx, axis, h, codec=c, outer=o, **kw)

    return make


def _dp_first(h: int, start: int) -> lm.Recipe:
    """DiLoCo int4 (default outer step) that syncs every step before ``start`` (a diagnosis:
    what the drift of the first ``start`` steps costs)."""

    def make(run: lm.Run, axis: Any) -> Any:
        import optax

        from jaxcomp._src import periodic
        from jaxcomp._src.diloco import DiLoCoState

        return periodic.build(
            "diloco",
            DiLoCoState,
            run.adamw(),
            axis,
            h,
            codec=common.make_codec("int4"),
            error_feedback="auto",
            exchange={},
            outer=optax.sgd(0.7, momentum=0.6, nesterov=True),
            fragments=1,
            delay=0,
            mix=1.0,
            start_step=start,
        )

    return lm.Recipe(make, kind="replica", schedule={"sync_every": h, "start_step": start})


def _sgd(lr: float, momentum: float, nesterov: bool = True) -> Callable[[], Any]:
    def make():
        import optax

        return optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and bool(momentum))

    return make


def _row(h: int, m: int | None = None, note: str = "", **kw: Any) -> lm.Recipe:
    schedule = {"sync_every": h, **kw.pop("schedule", {})}
    return lm.Recipe(_diloco(h, **kw), kind="replica", replicas=m, schedule=schedule, note=note)


def _local(h: int, m: int | None = None) -> lm.Recipe:
    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.local_sgd(run.adamw(), axis, h)

    return lm.Recipe(make, kind="replica", replicas=m, schedule={"sync_every": h})


def _demo(peak: float, weight_decay: float = lm.WEIGHT_DECAY, **kw: Any) -> lm.Recipe:
    """``jc.demo`` at AdamW's schedule (peak ``peak``), momentum decay 0.9 unless ``kw``."""

    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        kw.setdefault("decay", 0.9)
        return jc.demo(run.schedule(peak), axis, weight_decay=weight_decay, **kw)

    return lm.Recipe(make)


def _sl_outer(h: int, lr: float, m: int | None = None, **kw: Any) -> lm.Recipe:
    """``jc.sparseloco`` of AdamW with ``outer=optax.sgd(lr)`` (an outer lr below 1)."""

    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.sparseloco(run.adamw(), axis, h, outer=_sgd(lr, 0.0)(), **kw)

    return lm.Recipe(make, kind="replica", replicas=m, schedule={"sync_every": h})


def held_schedule(run: lm.Run) -> Any:
    """The run's 5% linear warm-up to its peak lr, then the peak held to the end (no decay)."""
    import optax

    return optax.warmup_constant_schedule(0.0, run.lr, max(1, run.steps // 20))


def outer_cosine(run: lm.Run, h: int, lr: float) -> Any:
    """An outer lr decaying by cosine from ``lr`` (the first outer step) to ``lr / 10`` (the
    last, ``run.steps // h - 1`` outer steps later): the annealing of the run's schedule
    moved from the inner steps to the outer step."""
    import optax

    return optax.cosine_decay_schedule(lr, max(1, run.steps // h - 1), 0.1)


def outer_rsqrt(first: float) -> Any:
    """An outer lr of ``first / sqrt(k)`` at the ``k``-th outer step (``k = 1, 2, ...``): the
    decay that SparseLoCo's per-sync line search at 3000x on 8 replicas reads (the best
    applied step shrinks from about 2.25 x the merged update at the first sync to about 0.75 x
    from the fifth on: the merged update grows against the replicas' mean pseudo-gradient as
    the error feedback fills and the replicas decorrelate)."""
    import jax.numpy as jnp

    return lambda count: first / jnp.sqrt(count + 1.0)


def outer_wsd(lr: float, syncs: int, tail: int = 2, final: float = 0.5) -> Any:
    """An outer lr held at ``lr`` and over the last ``tail`` of the ``syncs`` outer steps
    decayed linearly to ``final x lr`` (at ``syncs = 10``, ``tail = 2``: 1.125 and 0.75 for
    ``lr`` 1.5): the last syncs' best applied step of the 8-replica 3000x rows' line search
    (0.5-0.75 of the merged update on the benchmark, the held-out and the fifth pairs) with
    the earlier steps left at ``lr`` (:func:`outer_rsqrt` shortened those too and lost on the
    held-out pair)."""
    import jax.numpy as jnp

    def schedule(count):
        into = jnp.clip((count - (syncs - tail) + 1.0) / tail, 0.0, 1.0)
        return lr * (1.0 - (1.0 - final) * into)

    return schedule


def jnp_where(cond: Any, a: float, b: float) -> Any:
    """``jnp.where(cond, a, b)``, imported when called (the recipes' schedules run traced)."""
    import jax.numpy as jnp

    return jnp.where(cond, a, b)


def _inner_const(run: lm.Run) -> Any:
    """AdamW (weight decay 0.1) at :func:`held_schedule`."""
    import optax

    return optax.adamw(held_schedule(run), weight_decay=lm.WEIGHT_DECAY)


def wsd_schedule(run: lm.Run, decay: float = 0.2) -> Any:
    """Warm-up, stable, decay: the run's 5% linear warm-up to its peak lr, the peak held, and
    over the last ``decay`` of the steps a linear decay to 10% of the peak (data parallel's
    cosine ends there too)."""
    import optax

    warm, tail = max(1, run.steps // 20), max(1, round(decay * run.steps))
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, run.lr, warm),
            optax.constant_schedule(run.lr),
            optax.linear_schedule(run.lr, 0.1 * run.lr, tail),
        ],
        [warm, run.steps - tail],
    )


def _inner_wsd(run: lm.Run) -> Any:
    """AdamW (weight decay 0.1) at :func:`wsd_schedule`."""
    import optax

    return optax.adamw(wsd_schedule(run), weight_decay=lm.WEIGHT_DECAY)


def _wsd(decay: float) -> Callable[[lm.Run], Any]:
    """AdamW (weight decay 0.1) at :func:`wsd_schedule` decaying over the last ``decay``."""

    def make(run: lm.Run) -> Any:
        import optax

        return optax.adamw(wsd_schedule(run, decay), weight_decay=lm.WEIGHT_DECAY)

    return make


def _adam_betas(b1: float = 0.9, b2: float = 0.999) -> Callable[[lm.Run], Any]:
    """AdamW (weight decay 0.1) at :func:`held_schedule` with these betas (a replica's small
    batch: a longer first-moment average, or a faster second moment)."""

    def make(run: lm.Run) -> Any:
        import optax

        return optax.adamw(held_schedule(run), b1=b1, b2=b2, weight_decay=lm.WEIGHT_DECAY)

    return make


def _inner_held(peak: float) -> Callable[[lm.Run], Any]:
    """AdamW (weight decay 0.1) warmed up to ``peak`` over the run's 5%, then held."""

    def make(run: lm.Run) -> Any:
        import optax

        sched = optax.warmup_constant_schedule(0.0, peak, max(1, run.steps // 20))
        return optax.adamw(sched, weight_decay=lm.WEIGHT_DECAY)

    return make


def _warmed(h: int, steps: int = 3) -> Callable[[lm.Run], Any]:
    """The default outer step at M > 2 (Nesterov 0.7 / 0.6), its lr warmed up linearly from
    ``0.7 / steps`` over the first ``steps`` outer steps."""

    def make(run: lm.Run) -> Any:
        import optax

        return optax.sgd(optax.linear_schedule(0.7 / steps, 0.7, steps - 1), 0.6, nesterov=True)

    return make


def _outer_cos(h: int, lr: float = 0.7, momentum: float = 0.6) -> Callable[[lm.Run], Any]:
    """Nesterov SGD (plain SGD at ``momentum`` 0) at :func:`outer_cosine`."""

    def make(run: lm.Run) -> Any:
        import optax

        sched = outer_cosine(run, h, lr)
        return optax.sgd(sched, momentum or None, nesterov=bool(momentum))

    return make


def _muon(run: lm.Run, held: bool = False, wsd: bool = False) -> Any:
    """MuLoCo's inner step: Muon on the matrices, AdamW on the rest, both at the run's
    schedule (``held``: :func:`held_schedule`; ``wsd``: :func:`wsd_schedule`;
    ``consistent_rms=0.2``: Muon's update RMS matched to AdamW's, so one lr)."""
    import optax

    sched = held_schedule(run) if held else run.schedule()
    sched = wsd_schedule(run) if wsd else sched
    return optax.contrib.muon(
        sched,
        consistent_rms=0.2,
        adam_learning_rate=sched,
        weight_decay=lm.WEIGHT_DECAY,
        adam_weight_decay=lm.WEIGHT_DECAY,
    )


def _muon_held(run: lm.Run) -> Any:
    return _muon(run, held=True)


def _muon_wsd(run: lm.Run) -> Any:
    return _muon(run, wsd=True)


def _h(
    h: int,
    m: int | None = None,
    *,
    inner: Callable[[lm.Run], Any] | None = None,
    outer: Callable[[lm.Run], Any] | None = None,
    sparse: bool = False,
    **kw: Any,
) -> lm.Recipe:
    """DiLoCo int4 (or ``sparse``: SparseLoCo, at its defaults but ``kw``; its
    ``small_codec`` and ``value_codec``, if any, functions that make them) with
    ``inner(run)`` (None: the run's AdamW) and ``outer(run)`` (None: the default)."""

    def make(run: lm.Run, axis: Any) -> Any:
        import jaxcomp as jc

        tx = run.adamw() if inner is None else inner(run)
        o = None if outer is None else outer(run)
        if sparse:
            made = {k: kw[k]() for k in ("small_codec", "value_codec") if k in kw}
            return jc.sparseloco(tx, axis, h, outer=o, **{**kw, **made})
        return jc.diloco(tx, axis, h, codec=common.make_codec("int4"), outer=o, **kw)

    schedule = {"sync_every": h, **{k: kw[k] for k in ("fragments", "delay") if k in kw}}
    return lm.Recipe(make, kind="replica", replicas=m, schedule=schedule)


def _sign_mean() -> Any:
    import jaxcomp as jc

    return jc.sign("mean")


def _int1() -> Any:
    import jaxcomp as jc

    return jc.int_quant(1)


def _sparse_h30(
    m: int | None = None,
    outer_lr: Any = 1.5,
    momentum: float = 0.0,
    h: int | tuple[int, ...] = 30,
    **kw: Any,
) -> lm.Recipe:
    """SparseLoCo at ``H = 30`` (or the intervals ``h``) as tuned for 3000x: Muon inside at
    the held lr, outer SGD at lr ``outer_lr`` (a number or an optax schedule of the outer step
    count; Nesterov ``momentum``, default none), every leaf compressed (``min_size=0`` unless
    ``kw`` says otherwise); ``kw``: :func:`jaxcomp.sparseloco`'s codec and exchange
    arguments."""
    kw.setdefault("min_size", 0)
    outer = _sgd(outer_lr, momentum)
    return _h(h, m, inner=_muon_held, outer=lambda run: outer(), sparse=True, **kw)


def _sparse_wsd(
    density: float,
    h: int | tuple[int, ...] = 30,
    outer_lr: Any = 1.5,
    momentum: float = 0.0,
    **kw: Any,
) -> lm.Recipe:
    """The 8-replica 1-bit row at 3000x (``density`` of each 4096, every leaf, outer SGD 1.5)
    with Muon and its AdamW at :func:`wsd_schedule` instead of the held lr; ``h``,
    ``outer_lr``, ``momentum`` (outer Nesterov) and ``kw`` (:func:`jaxcomp.sparseloco`'s
    arguments) as :func:`_sparse_h30`'s, for the screens of slice L11."""
    outer = _sgd(outer_lr, momentum)
    kw = {"min_size": 0, "bits": 1, "value_scale": "mean", **kw}
    return _h(h, inner=_muon_wsd, outer=lambda run: outer(), sparse=True, density=density, **kw)


def growing(h: int, steps: int) -> tuple[int, ...]:
    """:func:`shrinking`'s intervals in reverse, from ``0.5 h`` to ``1.5 h`` (the same syncs,
    so the same bytes, as a constant ``h``): short windows while the loss falls fast and the
    8-replica rows' gap is made (their first 60 steps), long ones once the inner lr
    decays."""
    return shrinking(h, steps)[::-1]


def shrinking(h: int, steps: int) -> tuple[int, ...]:
    """``steps / h`` sync intervals that shrink linearly from ``1.5 h`` to ``0.5 h`` (their
    mean ``h``: the same syncs, so the same bytes, as a constant ``h``), rounded so that they
    add up to ``steps``: long intervals while the replicas' pseudo-gradients agree, short
    ones late, when they decorrelate within a window (the per-sync records of the 8-replica
    rows: the cosine between replicas falls from 0.35-0.49 to 0.10-0.19 over the run)."""
    n = steps // h
    ends = [round(h * (1.5 * (k + 1) - (k + 1) * k / (2 * (n - 1)))) for k in range(n)]
    return tuple(b - a for a, b in zip([0, *ends[:-1]], ends, strict=True))


#: The intervals of ``-H5to30`` (``sync_every``): short syncs while the loss falls fast
#: (13 syncs in 300 steps where ``H = 30`` makes 10); ``-H10to30``: one more sync (11), the
#: most that keeps 8 replicas at 200x fewer bytes than data parallel.
GROW_M2 = (5, 5, 10, 10, 30)
GROW_M8 = (10, 20, 30)
#: ``-H5x6to30``: every 5 steps for 30 steps, every 10 to step 60, then every 30 (17 syncs).
GROW_M2_DENSE = (5, 5, 5, 5, 5, 5, 10, 10, 10, 30)

RECIPES: dict[str, lm.Recipe] = {
    "diloco-int4-H30-innerconst": _h(30, inner=_inner_const),
    "diloco-int4-H30-innerconst-outercos": _h(30, inner=_inner_const, outer=_outer_cos(30)),
    "diloco-int4-H30-muon": _h(30, inner=_muon),
    "diloco-int4-H30-muon-innerconst": _h(30, inner=_muon_held),
    "diloco-int4-H30-M2-muon-innerconst": _h(30, 2, inner=_muon_held),
    "muon-innerconst": lm.Recipe(
        lambda run, axis: _muon_held(run), averages=False, note="Muon data parallel (pmean)"
    ),
    "sparseloco-H30-muon-innerconst": _h(30, inner=_muon_held, sparse=True),
    "sparseloco-H30-M2-muon-innerconst": _h(30, 2, inner=_muon_held, sparse=True),
    # SparseLoCo on 2 replicas with Muon inside and the decay measured best there with AdamW
    # inside (0.95); the density stays 64 / 4096 (3434x; 4x it is under 1000x).
    "sparseloco-H30-M2-muon-innerconst-ef0.95": _h(
        30, 2, inner=_muon_held, sparse=True, ef_decay=0.95
    ),
    # ... and at its defaults with a longer outer step (lr 1.5: 2.4 points at H = 10, AdamW).
    "sparseloco-H30-M2-muon-innerconst-outer1.5": _h(
        30, 2, inner=_muon_held, outer=lambda run: _sgd(1.5, 0.0)(), sparse=True
    ),
    "sparseloco-H30-M2-muon-innerconst-outer2.0": _h(
        30, 2, inner=_muon_held, outer=lambda run: _sgd(2.0, 0.0)(), sparse=True
    ),
    # 8 replicas at 3000x or more: a quarter of the density, every leaf compressed (3616x),
    # Muon inside and the outer lr of 1.5.
    "sparseloco-H30-muon-innerconst-d16-min0-outer1.5": _sparse_h30(density=16 / 4096),
    # 3000x at H = 30 with every leaf compressed (min_size=0): on 2 replicas the norms and
    # biases sent whole in float32 took 54% of the bytes; their share buys 152 / 4096 values
    # (3152x; 3085x on the held-out pair's model). On 8 replicas 20 / 4096 (3001x computed;
    # not yet run).
    "sparseloco-H30-M2-muon-innerconst-d152-min0-outer1.5": _sparse_h30(2, density=152 / 4096),
    "sparseloco-H30-muon-innerconst-d20-min0-outer1.5": _sparse_h30(density=20 / 4096),
    # ... in chunks of 1024 (10-bit indices): 43 of each 1024 (172 / 4096, 3105x; 3037x).
    "sparseloco-H30-M2-muon-innerconst-c1024-d172-min0-outer1.5": _sparse_h30(
        2, density=172 / 4096, chunk=1024
    ),
    # ... 1-bit values at their mean magnitude (value_scale="mean"), 47 of each 1024 (188 /
    # 4096, 3100x; 3029x): 29% of one replica's |D|^2 sent where 152 / 4096 at 2 bits send 22%.
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-min0-outer1.5": _sparse_h30(
        2, density=188 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    # The 2-replica 1-bit row (47 of 1024 at the mean), one change at a time (slice S3).
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-min0-outer1.5-ef0.8": _sparse_h30(
        2, density=188 / 4096, chunk=1024, bits=1, value_scale="mean", ef_decay=0.8
    ),
    # ... an outer lr of 1.2: the 1-bit mean payload is 0.54 of |D| long where 64 / 4096 at
    # 2 bits was 0.41, so lr 1.5 applies about what lr 2.0 (which overshot) did there.
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-min0-outer1.2": _sparse_h30(
        2, 1.2, density=188 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-min0-outer1.8": _sparse_h30(
        2, 1.8, density=188 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-min0-outer1.5-ef0.3": _sparse_h30(
        2, density=188 / 4096, chunk=1024, bits=1, value_scale="mean", ef_decay=0.3
    ),
    # ... the leaves under 1024 values (norms, biases) as 1-bit signs at their mean
    # magnitude with the same error feedback (small_codec=jc.sign()): every value's sign for
    # about the bytes of their top-k (measured: 3083x at seed 0, 3009x on the held-out pair).
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-smallsign-outer1.5": _sparse_h30(
        2,
        density=188 / 4096,
        chunk=1024,
        bits=1,
        value_scale="mean",
        min_size=1024,
        small_codec=_sign_mean,
    ),
    # ... twice its bytes (96 of each 1024, about 1550x): what the 3% bar on the held-out
    # pair needs, where the row (3000x) misses by 3.9 points (slice S2).
    # ... the top-k inside sub-chunks of 128 (sub_chunk=128: 7-bit indices, one scale per
    # 1024 still): 8 of each 128, 64 of each 1024 (256 / 4096) for about the row's bytes, what
    # jc.sparseloco_density(..., sub_chunk=128) gives (3128x; 3057x on the held-out pair's
    # model); sub-chunks of 256: 14 of each 256 (224 / 4096, 3173x; 3104x) (slice L13).
    "sparseloco-H30-M2-muon-innerconst-c1024-s128-d256-b1mean-min0-outer1.5": _sparse_h30(
        2, density=256 / 4096, chunk=1024, sub_chunk=128, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-s256-d224-b1mean-min0-outer1.5": _sparse_h30(
        2, density=224 / 4096, chunk=1024, sub_chunk=256, bits=1, value_scale="mean"
    ),
    # ... sub-chunks of 24 (5-bit indices) under one scale per 1536: 2 of each 24, 85 of
    # each 1024 (3184x; 3103x on the held-out pair's model).
    "sparseloco-H30-M2-muon-innerconst-c1536-s24-d341-b1mean-min0-outer1.5": _sparse_h30(
        2, density=2 / 24, chunk=1536, sub_chunk=24, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d384-b1mean-min0-outer1.5": _sparse_h30(
        2, density=384 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    # ... H = 60 at the same bytes (slice L11): 98 of each 1024, what jc.sparseloco_density
    # gives at H = 60 on the held-out pair's model (100 on the benchmark's), half the syncs.
    "sparseloco-H60-M2-muon-innerconst-c1024-d392-b1mean-min0-outer1.5": _sparse_h30(
        2, h=60, density=392 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    # ... 1.34, 2.6 and 5.2 times its bytes (64, 128 and 256 of each 1024).
    "sparseloco-H30-M2-muon-innerconst-c1024-d256-b1mean-min0-outer1.5": _sparse_h30(
        2, density=256 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d512-b1mean-min0-outer1.5": _sparse_h30(
        2, density=512 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d1024-b1mean-min0-outer1.5": _sparse_h30(
        2, density=1024 / 4096, chunk=1024, bits=1, value_scale="mean"
    ),
    # ... the sign-small row with an outer lr of 1.0, for the inner lr at data parallel's
    # tuned peak (--lr 6e-3 on the held-out pair): at 8 replicas cutting the outer lr to 1.0
    # at the inner 4.5e-3 took +17.49% to +13.09% (slice S2).
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-smallsign-outer1.0": _sparse_h30(
        2,
        1.0,
        density=188 / 4096,
        chunk=1024,
        bits=1,
        value_scale="mean",
        min_size=1024,
        small_codec=_sign_mean,
    ),
    "sparseloco-H30-M2-muon-innerconst-c1024-d188-b1mean-smallsign-outer0.7": _sparse_h30(
        2,
        0.7,
        density=188 / 4096,
        chunk=1024,
        bits=1,
        value_scale="mean",
        min_size=1024,
        small_codec=_sign_mean,
    ),
    # ... 1 bit at the mean magnitude, 21 of 4096 (3048x).
    "sparseloco-H30-muon-innerconst-d21-b1mean-min0-outer1.5": _sparse_h30(
        density=21 / 4096, bits=1, value_scale="mean"
    ),
    # ... 19 of 4096: what jc.sparseloco_density(params, 3000, 30, 8, chunk=4096, bits=1,
    # min_size=0, other_bytes=7) gives on the fourth pair's model (3 layers of d_model 96),
    # where 21 of 4096 (sized on the benchmark's model) reach 2845x (slice S3).
    "sparseloco-H30-muon-innerconst-d19-b1mean-min0-outer1.5": _sparse_h30(
        density=19 / 4096, bits=1, value_scale="mean"
    ),
    # ... an outer lr of 1.0, for the inner lr at data parallel's 4.5e-3 (--lr 4.5e-3): the
    # applied step about as long as 1.5 x the inner lr at 3e-3 (slice L2).
    "sparseloco-H30-muon-innerconst-d21-b1mean-min0-outer1.0": _sparse_h30(
        None, 1.0, density=21 / 4096, bits=1, value_scale="mean"
    ),
    # ... 17 of 4096: jc.sparseloco_density(params, 3000, 30, 8, bits=1, min_size=0,
    # other_bytes=7) on the held-out pair's model (3 layers of d_model 64: 3029x), where 21 of
    # 4096 reach 2662x (slice L8).
    "sparseloco-H30-muon-innerconst-d17-b1mean-min0-outer1.5": _sparse_h30(
        density=17 / 4096, bits=1, value_scale="mean"
    ),
    # ... the same 10 syncs at intervals shrinking from 45 to 15 steps (shrinking(30, 300):
    # the same bytes; slice L9).
    "sparseloco-H45to15-muon-innerconst-d21-b1mean-min0-outer1.5": _sparse_h30(
        h=shrinking(30, 300), density=21 / 4096, bits=1, value_scale="mean"
    ),
    "sparseloco-H45to15-muon-innerconst-d17-b1mean-min0-outer1.5": _sparse_h30(
        h=shrinking(30, 300), density=17 / 4096, bits=1, value_scale="mean"
    ),
    # ... the inner lr (Muon and its AdamW) decayed over the last 20% of the steps to 10%
    # (wsd_schedule): data parallel's annealing at the end, where the 8-replica rows lose
    # ground (slice L9).
    "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-outer1.5": _sparse_wsd(21 / 4096),
    "sparseloco-H30-muon-innerwsd-d17-b1mean-min0-outer1.5": _sparse_wsd(17 / 4096),
    "sparseloco-H30-muon-innerwsd-d19-b1mean-min0-outer1.5": _sparse_wsd(19 / 4096),
    # ... the top-k inside sub-chunks of 1024 under the chunk's one scale per 4096 (10-bit
    # indices for 12): 6 of each 1024, 24 of each 4096 where the row sends 21, what
    # jc.sparseloco_density(params, 3000, 30, 8, chunk=4096, sub_chunk=1024, bits=1,
    # min_size=0, other_bytes=7) gives on the benchmark's model (3154x); sub-chunks of 24 are
    # out of reach on 8 replicas (one of each 24 gives 874x) (slice L14).
    "sparseloco-H30-muon-innerwsd-c4096-s1024-d24-b1mean-min0-outer1.5": _sparse_wsd(
        6 / 1024, chunk=4096, sub_chunk=1024
    ),
    # ... sub-chunks of 512 under one scale per 2048 (9-bit indices): 3 of each 512, 24 of
    # each 4096 again (3074x).
    "sparseloco-H30-muon-innerwsd-c2048-s512-d24-b1mean-min0-outer1.5": _sparse_wsd(
        3 / 512, chunk=2048, sub_chunk=512
    ),
    # Slice L11's screens of the WSD row at the same bytes (3000x), one change each: H = 60
    # with the density jc.sparseloco_density gives there (46 of 4096 on the benchmark's
    # model, 42 on the held-out pair's, 43 on the fourth's: more than twice 30's, the chunks'
    # scales paid half as often); the 10 syncs at intervals growing from 15 to 45 steps;
    # outer Nesterov 0.6 at lr 0.6; the error feedback's decay at 0.3.
    "sparseloco-H60-muon-innerwsd-d46-b1mean-min0-outer1.5": _sparse_wsd(46 / 4096, 60),
    # ... and the other way, H = 20 at the 12 of 4096 it affords on the benchmark's model
    # (3207x; 13 would fall under 3000x): 15 syncs, each sparser.
    "sparseloco-H20-muon-innerwsd-d12-b1mean-min0-outer1.5": _sparse_wsd(12 / 4096, 20),
    "sparseloco-H60-muon-innerwsd-d42-b1mean-min0-outer1.5": _sparse_wsd(42 / 4096, 60),
    "sparseloco-H60-muon-innerwsd-d43-b1mean-min0-outer1.5": _sparse_wsd(43 / 4096, 60),
    "sparseloco-H15to45-muon-innerwsd-d21-b1mean-min0-outer1.5": _sparse_wsd(
        21 / 4096, growing(30, 300)
    ),
    "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-nesterov0.6-0.6": _sparse_wsd(
        21 / 4096, 30, 0.6, 0.6
    ),
    "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-outer1.5-ef0.3": _sparse_wsd(
        21 / 4096, ef_decay=0.3
    ),
    # ... the outer lr at 2.25 for the first two syncs, then 1.5 (the line searches' best
    # first steps: 1.5 x the merged update at the first sync on the benchmark, the first two
    # on the held-out and fifth pairs).
    "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-outer2.25first2": _sparse_wsd(
        21 / 4096, 30, lambda count: jnp_where(count < 2, 2.25, 1.5)
    ),
    # ... the mean over all 8 replicas (averaging="all") at an outer lr 8 x 1.5: a
    # coordinate one replica sent moves as with Templar's mean over its senders, one that k
    # replicas sent k times as far (the sum of the payloads x 1.5).
    "sparseloco-H30-muon-innerwsd-d21-b1mean-min0-all-outer12": _sparse_wsd(
        21 / 4096, 30, 12.0, averaging="all"
    ),
    # ... the outer lr decayed over the last two syncs to half (outer_wsd: 1.5, ..., 1.125,
    # 0.75), every density of the WSD row.
    **{
        f"sparseloco-H30-muon-innerwsd-d{k}-b1mean-min0-outer1.5wsd": _sparse_wsd(
            k / 4096, 30, outer_wsd(1.5, 10)
        )
        for k in (17, 19, 21)
    },
    **{
        f"sparseloco-H15to45-muon-innerwsd-d{k}-b1mean-min0-outer1.5": _sparse_wsd(
            k / 4096, growing(30, 300)
        )
        for k in (17, 19)
    },
    **{
        f"sparseloco-H30-muon-innerwsd-d{k}-b1mean-min0-nesterov0.6-0.6": _sparse_wsd(
            k / 4096, 30, 0.6, 0.6
        )
        for k in (17, 19)
    },
    **{
        f"sparseloco-H30-muon-innerwsd-d{k}-b1mean-min0-outer1.5-ef0.3": _sparse_wsd(
            k / 4096, ef_decay=0.3
        )
        for k in (17, 19)
    },
    # ... outer Nesterov momentum 0.6 at lr 0.6: the same step along a direction that persists
    # (lr / (1 - momentum) = 1.5) with the merged update's sync-to-sync noise averaged over
    # about 1 / (1 - momentum) = 2.5 syncs (slice L8).
    # ... the outer lr 2.25 / sqrt(k) at the k-th sync (outer_rsqrt), from the line search of
    # `--diagnose ... --line-search` (slice L8).
    "sparseloco-H30-muon-innerconst-d21-b1mean-min0-outer2.25rsqrt": _sparse_h30(
        None, outer_rsqrt(2.25), density=21 / 4096, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-muon-innerconst-d17-b1mean-min0-outer2.25rsqrt": _sparse_h30(
        None, outer_rsqrt(2.25), density=17 / 4096, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-muon-innerconst-d21-b1mean-min0-nesterov0.6-0.6": _sparse_h30(
        None, 0.6, 0.6, density=21 / 4096, bits=1, value_scale="mean"
    ),
    "sparseloco-H30-muon-innerconst-d17-b1mean-min0-nesterov0.6-0.6": _sparse_h30(
        None, 0.6, 0.6, density=17 / 4096, bits=1, value_scale="mean"
    ),
    # ... or the two-phase exchange, whose bytes do not grow with M: 64 / 4096 (3518x; 2776x
    # on the held-out pair's model, whose small leaves weigh more).
    "sparseloco-H30-muon-innerconst-2phase-min0-outer1.5": _sparse_h30(strategy="two_phase"),
    # A coordinate mask shared by every replica (slice S4): no indices, the kept values summed
    # (two-phase, about 2 (M - 1) / M of one payload instead of M - 1 payloads), here in 1
    # bit (jc.int_quant(1): the sign at the mean magnitude of each 256 values). 3000x at
    # H = 30 allows 1162 of 4096 on 8 replicas and 2038 on 2 (the arithmetic:
    # jaxcomp._src.shared_mask.wire_bytes); these keep a margin.
    "sparseloco-H30-muon-innerconst-random-d1150-int1-min0-outer1.5": _sparse_h30(
        mask="random", density=1150 / 4096, value_codec=_int1
    ),
    "sparseloco-H30-muon-innerconst-previous-d1150-int1-min0-outer1.5": _sparse_h30(
        mask="previous", density=1150 / 4096, value_codec=_int1
    ),
    "sparseloco-H30-M2-muon-innerconst-random-d2000-int1-min0-outer1.5": _sparse_h30(
        2, mask="random", density=2000 / 4096, value_codec=_int1
    ),
    "sparseloco-H30-M2-muon-innerconst-previous-d2000-int1-min0-outer1.5": _sparse_h30(
        2, mask="previous", density=2000 / 4096, value_codec=_int1
    ),
    "diloco-int4-H30-innerconst-outerwarmup3": _h(30, inner=_inner_const, outer=_warmed(30)),
    "sparseloco-H30-innerconst": _h(30, inner=_inner_const, sparse=True),
    "diloco-int4-H30-M2-innerconst": _h(30, 2, inner=_inner_const),
    "sparseloco-H30-innerconst-outercos": _h(
        30, inner=_inner_const, outer=_outer_cos(30, 1.0, 0.0), sparse=True
    ),
    "sparseloco-H30-M2-innerconst": _h(30, 2, inner=_inner_const, sparse=True),
    "sparseloco-H30-innerconst-ef0.95": _h(30, inner=_inner_const, sparse=True, ef_decay=0.95),
    "sparseloco-H30-M2-innerconst-ef0.95": _h(
        30, 2, inner=_inner_const, sparse=True, ef_decay=0.95
    ),
    # SparseLoCo on 2 replicas: the top-k density (diagnosis: 100% and 6.25% of each chunk),
    # and on 8 replicas a quarter of the density with every leaf compressed (bytes >= 3000x).
    "sparseloco-H30-M2-innerconst-dense": _h(30, 2, inner=_inner_const, sparse=True, density=1.0),
    "sparseloco-H30-M2-innerconst-d256": _h(
        30, 2, inner=_inner_const, sparse=True, density=256 / 4096
    ),
    "sparseloco-H30-innerconst-d16-min0": _h(
        30, inner=_inner_const, sparse=True, density=16 / 4096, min_size=0
    ),
    # The inner peak held at 6e-3 (AdamW data parallel's best lr) and at 2e-3, on 2 replicas.
    "diloco-int4-H30-M2-innerconst6e-3": _h(30, 2, inner=_inner_held(6e-3)),
    "diloco-int4-H30-M2-innerconst2e-3": _h(30, 2, inner=_inner_held(2e-3)),
    # Streaming DiLoCo: 3 fragments synced at staggered steps (the same bytes per step).
    "diloco-int4-H30-innerconst-F3": _h(30, inner=_inner_const, fragments=3),
    # The outer step re-tuned for AdamW inside at H = 30 (inner lr held): Nesterov at lr 1.0.
    "diloco-int4-H30-innerconst-outer1.0-0.6": _h(
        30, inner=_inner_const, outer=lambda run: _sgd(1.0, 0.6)()
    ),
    # A growing H: syncs after 5, 10, 20 and 30 steps, then every 30 (13 syncs, not 10).
    "diloco-int4-H5to30-M2-innerconst": _h(GROW_M2, 2, inner=_inner_const),
    # The inner lr held, then decayed linearly to 10% over the last 20% of the steps (WSD).
    "diloco-int4-H30-innerwsd": _h(30, inner=_inner_wsd),
    "diloco-int4-H30-M2-innerwsd": _h(30, 2, inner=_inner_wsd),
    "diloco-int4-H30-innerwsd10": _h(30, inner=_wsd(0.1)),
    "diloco-int4-H30-innerwsd33": _h(30, inner=_wsd(1 / 3)),
    "diloco-int4-H30-M2-innerwsd33": _h(30, 2, inner=_wsd(1 / 3)),
    "diloco-int4-H5to30-M2-innerwsd": _h(GROW_M2, 2, inner=_inner_wsd),
    "diloco-int4-H10to30-innerconst": _h(GROW_M8, inner=_inner_const),
    "diloco-int4-H10to30-innerwsd": _h(GROW_M8, inner=_inner_wsd),
    # Each replica's AdamW for its batch of 2 sequences: b1 0.95, or b2 0.95.
    "diloco-int4-H30-innerconst-b1_0.95": _h(30, inner=_adam_betas(b1=0.95)),
    "diloco-int4-H30-innerconst-b2_0.95": _h(30, inner=_adam_betas(b2=0.95)),
    "sparseloco-H30-innerwsd": _h(30, inner=_inner_wsd, sparse=True),
    "sparseloco-H30-M2-innerwsd": _h(30, 2, inner=_inner_wsd, sparse=True),
    # SparseLoCo's merge: the mean over every device (a coordinate sent by one is divided).
    "sparseloco-H30-M2-innerconst-all": _h(30, 2, inner=_inner_const, sparse=True, averaging="all"),
    # SparseLoCo on 2 replicas at H = 10 (and 5), one change at a time from its defaults: the
    # top-k density (4x: 256 of 4096), the error feedback's decay, the outer lr.
    "sparseloco-H10-M2-innerconst-d256": _h(
        10, 2, inner=_inner_const, sparse=True, density=256 / 4096
    ),
    "sparseloco-H10-M2-innerconst-ef0.95": _h(
        10, 2, inner=_inner_const, sparse=True, ef_decay=0.95
    ),
    "sparseloco-H10-M2-innerconst-ef1.0": _h(10, 2, inner=_inner_const, sparse=True, ef_decay=1.0),
    "sparseloco-H10-M2-innerconst-ef0.9": _h(10, 2, inner=_inner_const, sparse=True, ef_decay=0.9),
    "sparseloco-H10-M2-innerconst-outer1.5": _h(
        10, 2, inner=_inner_const, outer=lambda run: _sgd(1.5, 0.0)(), sparse=True
    ),
    "sparseloco-H10-M2-innerconst-d256-ef0.95": _h(
        10, 2, inner=_inner_const, sparse=True, density=256 / 4096, ef_decay=0.95
    ),
    "sparseloco-H5-M2-innerconst-ef0.95": _h(5, 2, inner=_inner_const, sparse=True, ef_decay=0.95),
    "sparseloco-H5-M2-innerconst-d256": _h(
        5, 2, inner=_inner_const, sparse=True, density=256 / 4096
    ),
    "sparseloco-H3-innerconst-ef0.95": _h(3, inner=_inner_const, sparse=True, ef_decay=0.95),
    "sparseloco-H3-M2-innerconst-d256": _h(
        3, 2, inner=_inner_const, sparse=True, density=256 / 4096
    ),
    # SparseLoCo with the inner lr held at smaller H (more syncs: bytes x 30 / H).
    "sparseloco-H10-innerconst": _h(10, inner=_inner_const, sparse=True),
    "sparseloco-H10-M2-innerconst": _h(10, 2, inner=_inner_const, sparse=True),
    "sparseloco-H5-innerconst": _h(5, inner=_inner_const, sparse=True),
    "sparseloco-H5-M2-innerconst": _h(5, 2, inner=_inner_const, sparse=True),
    "sparseloco-H4-innerconst": _h(4, inner=_inner_const, sparse=True),
    "sparseloco-H3-innerconst": _h(3, inner=_inner_const, sparse=True),
    "diloco-int4-H5x6to30-M2-innerconst": _h(GROW_M2_DENSE, 2, inner=_inner_const),
    "diloco-int4-H20-M2-innerconst": _h(20, 2, inner=_inner_const),
    # Shorter H with the inner lr held: 30 / H times the bytes of H = 30, for less loss.
    "diloco-int4-H10-M2-innerconst": _h(10, 2, inner=_inner_const),
    "diloco-int4-H10-innerconst": _h(10, inner=_inner_const),
    "diloco-int4-H5-innerconst": _h(5, inner=_inner_const),
    "diloco-int4-H8-innerconst": _h(8, inner=_inner_const),
    "diloco-int4-H8-innerwsd": _h(8, inner=_inner_wsd),
    # H = 16: the shortest H that keeps 2 replicas at 200x fewer bytes in 300 steps (18 syncs).
    "diloco-int4-H16-M2-innerconst": _h(16, 2, inner=_inner_const),
    "diloco-int4-H30-innerconst-outer0.5-0.6": _h(
        30, inner=_inner_const, outer=lambda run: _sgd(0.5, 0.6)()
    ),
    "diloco-int4-H30-innerconst-outer0.7-0.3": _h(
        30, inner=_inner_const, outer=lambda run: _sgd(0.7, 0.3)()
    ),
    "demo-2e-3-decay0.9": _demo(2e-3),
    "demo-4e-3-decay0.9": _demo(4e-3),
    "demo-5e-3-decay0.9": _demo(5e-3),
    "demo-3e-3-decay0.9-wd0": _demo(3e-3, weight_decay=0.0),
    "local-H30": _local(30),
    "diloco-f32-H30": _row(30, codec=None, note="pseudo-gradient in float32"),
    "diloco-int4-H30-heavyball0.7-0.6": _row(30, outer=_sgd(0.7, 0.6, nesterov=False)),
    "diloco-int4-H30-outer1.5-0": _row(30, outer=_sgd(1.5, 0.0)),
    "diloco-int4-H30-outer2.0-0": _row(30, outer=_sgd(2.0, 0.0)),
    "diloco-int2-H15": _row(15, codec="int2"),
    "diloco-sign-H10": _row(10, codec="sign"),
    "diloco-int4-H10-M2-outer1.0-0": _row(10, m=2, outer=_sgd(1.0, 0.0)),
    "diloco-sign-H10-M2": _row(10, m=2, codec="sign"),
    "diloco-int4-H30-dp30": _dp_first(30, 30),
    "diloco-int4-H10-outer1.0-0.5": _row(10, outer=_sgd(1.0, 0.5)),
    "diloco-int4-H10-outer0.7-0.7": _row(10, outer=_sgd(0.7, 0.7)),
    "diloco-int4-H10-outer1.0-0": _row(10, outer=_sgd(1.0, 0.0)),
    "diloco-int4-H10-outer0.5-0.6": _row(10, outer=_sgd(0.5, 0.6)),
    "diloco-int4-H5": _row(5),
    "diloco-int4-H10-M4": _row(10, m=4, note="default outer step: Nesterov 0.7 / 0.6 at M = 4"),
    "diloco-int4-H10-M4-outer1.0-0": _row(10, m=4, outer=_sgd(1.0, 0.0)),
    "diloco-int4-H5-M2-outer1.0-0": _row(5, m=2, outer=_sgd(1.0, 0.0)),
    "sparseloco-H30-senders-ef0.5": lm_sparse._sl(
        30, "error feedback decayed by 0.5", averaging="senders", ef_decay=0.5
    ),
    "sparseloco-H10-senders-ef0.5": lm_sparse._sl(
        10, "H = 10, error feedback decayed by 0.5", averaging="senders", ef_decay=0.5
    ),
    "sparseloco-H5-senders-ef0.5": lm_sparse._sl(
        5, "H = 5, error feedback decayed by 0.5", averaging="senders", ef_decay=0.5
    ),
    "sparseloco-H10-M2-senders-ef0.5": lm_sparse._sl(
        10,
        "2 replicas of 4, H = 10, error feedback decayed by 0.5",
        m=2,
        averaging="senders",
        ef_decay=0.5,
    ),
    "sparseloco-H30-senders-clip": lm_sparse._sl(
        30,
        "each payload clipped to its pseudo-gradient norm",
        averaging="senders",
        ef_decay=0.95,
        clip=True,
    ),
    "sparseloco-H30-senders-ef0.5-f32": lm_sparse._sl(
        30, "diagnosis: float32 values", averaging="senders", ef_decay=0.5, bits=None
    ),
    "sparseloco-H30-senders-ef0.5-outer0.5": _sl_outer(30, 0.5, averaging="senders", ef_decay=0.5),
    "sparseloco-H30-senders-ef0": lm_sparse._sl(
        30, "no error feedback", averaging="senders", ef_decay=0.0
    ),
    "sparseloco-H30-M2-senders-ef0.5": lm_sparse._sl(
        30, "2 replicas of 4, error feedback decayed by 0.5", m=2, averaging="senders", ef_decay=0.5
    ),
    # 2 replicas at H = 16 (214x): the outer step past plain averaging, Nesterov or longer.
    "diloco-int4-H16-M2-innerconst-outer1.0-0.3": _h(
        16, 2, inner=_inner_const, outer=lambda run: _sgd(1.0, 0.3)()
    ),
    "diloco-int4-H16-M2-innerconst-outer1.2-0": _h(
        16, 2, inner=_inner_const, outer=lambda run: _sgd(1.2, 0.0)()
    ),
    "diloco-int4-H16-M2-innerconst-outer1.4-0": _h(
        16, 2, inner=_inner_const, outer=lambda run: _sgd(1.4, 0.0)()
    ),
}


# --------------------------------------------------------------------------- per-sync records


def _flat(tree: Any) -> Any:
    import jax
    import numpy as np

    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(tree)])


def _replicas_flat(stacked: Any) -> Any:
    import jax
    import numpy as np

    leaves = jax.tree.leaves(stacked)
    m = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(m, -1) for x in leaves], axis=1)


def _anchor(state: Any) -> Any:
    import jax

    found = []

    def visit(node):
        if hasattr(type(node), "PER_DEVICE_FIELDS") and "anchor" in type(node)._fields:
            found.append(node.anchor)
        return node

    jax.tree.map(visit, state, is_leaf=lambda n: hasattr(type(n), "PER_DEVICE_FIELDS"))
    return jax.device_get(found[0])


def _second_moment(state: Any, replicas: bool = False) -> Any:
    """Adam's ``nu`` in ``state`` (the first ``ScaleByAdamState``), flat; ``replicas``: the
    mean over the replicas' (each leaf's leading axis)."""
    import jax
    import numpy as np

    found = []

    def visit(node):
        if hasattr(node, "nu") and hasattr(node, "mu") and not found:
            found.append(node.nu)
        return node

    jax.tree.map(visit, state, is_leaf=lambda n: hasattr(n, "nu") and hasattr(n, "mu"))
    leaves = jax.tree.leaves(jax.device_get(found[0]))
    if replicas:
        leaves = [np.asarray(x, np.float64).mean(0) for x in leaves]
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in leaves])


def denominator_ratio(nu: Any, base: Any) -> float | None:
    """The median over the coordinates of ``sqrt(nu) / sqrt(base)``: the replicas' Adam
    denominator over data parallel's. None where data parallel's was not recorded, or where
    the two hold other coordinates (Muon inside keeps an Adam ``nu`` only for the leaves that
    are not matrices, data parallel's AdamW for every leaf: nothing to compare)."""
    import numpy as np

    if base is None or np.shape(nu) != np.shape(base):
        return None
    return float(np.median(np.sqrt(nu) / np.maximum(np.sqrt(base), 1e-30)))


def pseudo_gradients(theta: Any, x: Any) -> dict:
    """The pseudo-gradients ``D_i = x - theta_i`` of replicas ``theta`` ``(m, d)`` from the
    anchor ``x`` ``(d,)``: their mean norm, the norm of their mean, and the mean cosine over
    the pairs ``i != j`` (1.0 for one replica)."""
    import numpy as np

    d = np.asarray(x, np.float64)[None, :] - np.asarray(theta, np.float64)
    norms = np.linalg.norm(d, axis=1)
    unit = d / np.maximum(norms[:, None], 1e-30)
    m = len(norms)
    cos = float(((unit @ unit.T).sum() - m) / (m * (m - 1))) if m > 1 else 1.0
    return {
        "delta_norm": float(norms.mean()),
        "mean_delta_norm": float(np.linalg.norm(d.mean(0))),
        "delta_cosine": cos,
    }


def _sync_record(task: lm.Task, host: Any, anchor: Any) -> dict:
    """What the replicas are just before a sync step: losses and pseudo-gradients."""
    import jax
    import numpy as np

    import jaxcomp as jc

    m = jax.tree.leaves(host)[0].shape[0]
    own = [task.eval_loss(jax.tree.map(lambda a, i=i: a[i], host)) for i in range(m)]
    return {
        "eval_anchor": task.eval_loss(anchor),
        "eval_mean_params": task.eval_loss(jc.mean_replica(host)),
        "eval_replicas": float(np.mean(own)),
        **pseudo_gradients(_replicas_flat(host), _flat(anchor)),
    }


def feedback_memory(state: Any) -> list | None:
    """The error-feedback memory of SparseLoCo's all-gather exchange in ``state`` on the host:
    one entry per params leaf, ``(m, *shape)`` float64 or None (a leaf averaged exactly); None
    where ``state`` holds no such exchange."""
    import jax
    import numpy as np

    from jaxcomp._src.sparseloco import SparseFeedbackState

    found = []

    def visit(node):
        if isinstance(node, SparseFeedbackState) and not found:
            found.append(node.memory)
        return node

    jax.tree.map(visit, state, is_leaf=lambda n: isinstance(n, SparseFeedbackState))
    if not found:
        return None
    return [None if e is None else np.asarray(jax.device_get(e), np.float64) for e in found[0]]


def feedback_record(before: list, after: list, theta: list, anchor: list, beta: float) -> dict:
    r"""What SparseLoCo's error feedback did at one sync, over the compressed leaves (those
    with memory), per replica ``i`` and averaged over the replicas: with ``D_i = x -
    theta_i``, the target ``t_i = beta e_i + D_i`` (``e_i``: the memory ``before``) and the
    payload ``s_i = t_i - e'_i`` (``e'_i``: the memory ``after``)::

        sent_over_delta   = |s_i| / |D_i|        target_over_delta = |t_i| / |D_i|
        memory_over_delta = |e'_i| / |D_i|       sent_cosine       = cos(s_i, D_i)

    ``before`` / ``after``: :func:`feedback_memory`; ``theta``: the replicas' params leaves
    ``(m, *shape)``; ``anchor``: the anchor's leaves."""
    import numpy as np

    keep = [i for i, e in enumerate(after) if e is not None]
    m = theta[0].shape[0]

    def rows(leaves):
        return np.concatenate([np.asarray(leaves[i], np.float64).reshape(m, -1) for i in keep], 1)

    x = np.concatenate([np.asarray(anchor[i], np.float64).reshape(1, -1) for i in keep], 1)
    d, e_after = x - rows(theta), rows(after)
    target = beta * rows(before) + d
    sent = target - e_after
    norm_d = np.maximum(np.linalg.norm(d, axis=1), 1e-30)
    norm_s = np.maximum(np.linalg.norm(sent, axis=1), 1e-30)
    return {
        "sent_over_delta": float(np.mean(np.linalg.norm(sent, axis=1) / norm_d)),
        "target_over_delta": float(np.mean(np.linalg.norm(target, axis=1) / norm_d)),
        "memory_over_delta": float(np.mean(np.linalg.norm(e_after, axis=1) / norm_d)),
        "sent_cosine": float(np.mean((sent * d).sum(1) / (norm_s * norm_d))),
    }


NU: dict[int, Any] = {}  # adamw's second moment at the recorded steps

#: ``--line-search``: the applied outer step scaled by these (``x - c (x - x_new)``; 1: the
#: anchor the recipe made) and the replicas' exact mean pseudo-gradient by these
#: (``x - a mean_i D_i``: an uncompressed exchange at outer lr ``a``).
LINE_SCALES = (0.25, 0.5, 0.75, 1.0, 1.5)
MEAN_SCALES = (1.0, 1.5)


def _unflat(flat: Any, like: Any) -> Any:
    """The tree ``like`` with its leaves read in order from the flat vector ``flat``."""
    import jax
    import numpy as np

    leaves, out, at = jax.tree.leaves(like), [], 0
    for leaf in leaves:
        n = int(np.size(leaf))
        out.append(np.asarray(flat[at : at + n], np.float32).reshape(np.shape(leaf)))
        at += n
    return jax.tree.unflatten(jax.tree.structure(like), out)


def line_record(task: lm.Task, anchor: Any, x_old: Any, x_new: Any, theta: Any) -> dict:
    r"""At one sync: the held-out loss along the applied outer step and along the replicas'
    exact mean pseudo-gradient, and how the two point::

        line[c]       = loss(x - c (x - x_new))          c in LINE_SCALES
        mean_line[a]  = loss(x - a mean_i D_i)           a in MEAN_SCALES, D_i = x - theta_i
        step_cosine   = cos(x - x_new, mean_i D_i)
        step_nonzero  = share of the coordinates the step moves (8 replicas' disjoint top-k
                        of k per chunk: 8 k / chunk; less where replicas sent the same ones)

    ``anchor``: the old anchor's tree (the layout); ``x_old``, ``x_new``: flat anchors;
    ``theta``: the replicas' params before the sync, ``(m, d)`` flat."""
    import numpy as np

    step = x_old - x_new
    mean_d = x_old - theta.mean(0)
    denom = max(np.linalg.norm(step) * np.linalg.norm(mean_d), 1e-30)
    return {
        "line": {str(c): task.eval_loss(_unflat(x_old - c * step, anchor)) for c in LINE_SCALES},
        "mean_line": {
            str(a): task.eval_loss(_unflat(x_old - a * mean_d, anchor)) for a in MEAN_SCALES
        },
        "step_cosine": float(step @ mean_d / denom),
        "step_nonzero": float(np.mean(step != 0)),
    }


def diagnose(
    task: lm.Task,
    name: str,
    recipe: lm.Recipe,
    run: lm.Run,
    steps: list[int],
    ef_decay: float = 0.5,
    line: bool = False,
) -> dict:
    """Train ``recipe`` and record :func:`_sync_record` before, and the anchor's held-out loss
    after, each step index in ``steps`` (0-based; a sync step of the recipe); SparseLoCo
    (all-gather): also :func:`feedback_record` at its error feedback's decay ``ef_decay``,
    and with ``line`` :func:`line_record`. ``adamw``: its held-out loss and params at the
    same steps."""
    import jax
    import numpy as np

    fn, params, state, put = lm.build(task, recipe, run)
    # SparseLoCo: the same step without the sync (count fixed at 0), run on copies, gives the
    # replicas' params after the sync step's inner update: the pseudo-gradient exchanged.
    peek = lm.build(task, recipe, run, fixed=0)[0] if feedback_memory(state) else None
    task.reset()
    records, prev, curve = [], None, []
    for t in range(run.steps):
        at, batch = t in steps, put(task.batch())
        if at and recipe.kind == "replica":
            host, anchor = jax.device_get(params), _anchor(state)
            rec = {"step": t + 1, **_sync_record(task, host, anchor)}
            x_old, memory = _flat(anchor), feedback_memory(state)
            if peek is not None:
                copies = jax.tree.map(lambda a: a.copy(), (params, state))
                moved = jax.device_get(jax.block_until_ready(peek(*copies, batch))[0])
        params, state, loss = jax.block_until_ready(fn(params, state, batch))
        curve.append(float(loss))
        if not at:
            continue
        if recipe.kind == "replica":
            new = _anchor(state)
            if peek is not None:
                theta, x = jax.tree.leaves(moved), jax.tree.leaves(anchor)
                after = feedback_memory(state)
                rec.update(feedback_record(memory, after, theta, x, ef_decay))
                if line:
                    flat = (_flat(new), _replicas_flat(moved))
                    rec.update(line_record(task, anchor, x_old, *flat))
            rec["eval_after"] = task.eval_loss(new)
            rec["outer_step_norm"] = float(np.linalg.norm(_flat(new) - x_old))
            ratio = denominator_ratio(_second_moment(state, replicas=True), NU.get(t))
            if ratio is not None:
                rec["adam_denominator_ratio_median"] = ratio
        else:
            NU[t] = _second_moment(state)
            host = jax.device_get(params)
            flat = _flat(host)
            rec = {"step": t + 1, "eval_after": task.eval_loss(host)}
            rec["displacement"] = None if prev is None else float(np.linalg.norm(flat - prev))
            prev = flat
        records.append(rec)
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()})
    return {"recipe": name, "syncs": records, "curve": curve}


# --------------------------------------------------------------------------- codec fidelity

#: ``(name, codec factory)``: the pseudo-gradient codecs whose fidelity ``--fidelity`` reads.
FIDELITY_CODECS: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("int4 (DiLoCo)", lambda: common.make_codec("int4")),
    ("top-64/4096, 2 bits (SparseLoCo)", lambda: _chunked(64, 2)),
    ("top-64/4096, float32 values", lambda: _chunked(64, None)),
    ("top-16/4096, 2 bits", lambda: _chunked(16, 2)),
    ("top-256/4096, 2 bits", lambda: _chunked(256, 2)),
    ("top-1024/4096, 2 bits", lambda: _chunked(1024, 2)),
    ("top-4096/4096, 2 bits (dense)", lambda: _chunked(4096, 2)),
)


#: ``--fidelity-codecs 3000x``: codecs of SparseLoCo at 3000x fewer bytes at ``H = 30`` (2
#: replicas, every leaf compressed; 8 replicas: 16-20 of 4096) and the denser defaults.
FIDELITY_3000X: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("int4 (DiLoCo)", lambda: common.make_codec("int4")),
    ("top-64/4096, 2 bits (SparseLoCo)", lambda: _chunked(64, 2)),
    ("top-152/4096, 2 bits", lambda: _chunked(152, 2)),
    ("top-152/4096, float32 values", lambda: _chunked(152, None)),
    ("top-160/4096, 1 bit at the max", lambda: _chunked(160, 1)),
    ("top-168/4096, 1 bit at the mean", lambda: _chunked(168, 1, scale="mean")),
    ("top-43/1024, 2 bits", lambda: _chunked(43, 2, 1024)),
    ("top-47/1024, 1 bit at the mean", lambda: _chunked(47, 1, 1024, "mean")),
    ("top-24/512, 1 bit at the mean", lambda: _chunked(24, 1, 512, "mean")),
    ("top-16/4096, 2 bits", lambda: _chunked(16, 2)),
    ("top-20/4096, 2 bits", lambda: _chunked(20, 2)),
    ("top-20/4096, float32 values", lambda: _chunked(20, None)),
    ("top-22/4096, 1 bit at the mean", lambda: _chunked(22, 1, scale="mean")),
)

#: ``--fidelity-codecs subchunk``: the 2-replica 1-bit row's top-47 of each 1024 against the
#: top-k inside sub-chunks (one scale per 1024 still) at about its bytes (slice L13), and the
#: top-64 of each 1024 (the sub-chunks' count, more bytes).
FIDELITY_SUBCHUNK: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("top-47/1024, 1 bit at the mean", lambda: _chunked(47, 1, 1024, "mean")),
    ("top-64/1024, 1 bit at the mean", lambda: _chunked(64, 1, 1024, "mean")),
    ("top-26/512 of each 1024, 1 bit at the mean", lambda: _chunked(52, 1, 1024, "mean", 512)),
    ("top-14/256 of each 1024, 1 bit at the mean", lambda: _chunked(56, 1, 1024, "mean", 256)),
    ("top-8/128 of each 1024, 1 bit at the mean", lambda: _chunked(64, 1, 1024, "mean", 128)),
    ("top-4/64 of each 1024, 1 bit at the mean", lambda: _chunked(64, 1, 1024, "mean", 64)),
    ("top-8/128 of each 1024, float32 values", lambda: _chunked(64, None, 1024, sub=128)),
    ("top-2/24 of each 1536, 1 bit at the mean", lambda: _chunked(128, 1, 1536, "mean", 24)),
    ("top-6/96 of each 1536, 1 bit at the mean", lambda: _chunked(96, 1, 1536, "mean", 96)),
    ("top-64/1024, float32 values", lambda: _chunked(64, None, 1024)),
)


def _chunked(
    k: int, bits: int | None, chunk: int = 4096, scale: str = "max", sub: int | None = None
) -> Any:
    import jaxcomp as jc

    return jc.chunked_top_k(k, chunk, bits, scale, sub_chunk=sub)


def _train_step(task: lm.Task, tx: Any) -> Callable:
    """One jitted step of ``tx`` on ``task``'s loss: ``(params, state, tokens) -> (params,
    state)``, the replica's own (no exchange)."""
    import jax
    import optax

    @jax.jit
    def step(p, s, tokens):
        g = jax.grad(task.loss)(p, tokens)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def replica_deltas(
    task: lm.Task,
    run: lm.Run,
    replicas: int,
    starts: list[int],
    h: int,
    inner: Callable[[lm.Run], Any] | None = None,
    min_size: int = 1024,
) -> list:
    """One replica's pseudo-gradients ``D = theta_s - theta_{s + h}`` for each ``s`` in
    ``starts`` (each a list of its leaves of at least ``min_size`` values, flat): AdamW at
    :func:`held_schedule` (or ``inner(run)``) on the replica's rows of every global batch
    (``n / replicas`` devices' worth), from the shared initialization, never synced."""
    import jax
    import numpy as np

    tx = (inner or _inner_const)(run)
    rows = task.n // replicas * task.per_device
    step = _train_step(task, tx)

    p, snapshots = task.params, {}
    s = tx.init(p)
    task.reset()
    for t in range(max(starts) + h + 1):
        if t in starts or t - h in starts:
            snapshots[t] = [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(p))]
        if t < max(starts) + h:
            p, s = jax.block_until_ready(step(p, s, task.batch()[:rows]))
    pairs = [zip(snapshots[t], snapshots[t + h], strict=True) for t in starts]
    return [[(a - b).reshape(-1) for a, b in pair if a.size >= min_size] for pair in pairs]


def fidelity(codec: Any, leaves: list) -> dict:
    """What ``codec`` keeps of the vectors ``leaves`` (each encoded on its own): the cosine
    between ``C(D)`` and ``D``, ``|C(D)| / |D|``, the share of ``|D|^2`` left out
    (``|D - C(D)|^2 / |D|^2``) and float32's bytes over the payload's."""
    import jax.numpy as jnp
    import numpy as np

    dot = norm_d = norm_c = err = 0.0
    sent = dense = 0
    for x in leaves:
        c = np.asarray(codec.decode(codec.encode(jnp.asarray(x)), x.size), np.float64)
        x = x.astype(np.float64)
        dot, norm_d = dot + float(c @ x), norm_d + float(x @ x)
        norm_c, err = norm_c + float(c @ c), err + float((x - c) @ (x - c))
        sent, dense = sent + codec.payload_bytes(x.size), dense + 4 * x.size
    return {
        "cosine": dot / np.sqrt(norm_d * norm_c),
        "norm_ratio": float(np.sqrt(norm_c / norm_d)),
        "left_out": err / norm_d,
        "x_fewer": dense / sent,
    }


def short_chunks(codec: Any, leaves: list) -> dict:
    """Where the chunked top-k ``codec`` keeps exact zeros of ``leaves`` (each encoded on its
    own): its chunks holding fewer than ``k`` nonzero values (``short``; ``empty`` where none),
    the zeros kept in them (``k`` minus the nonzeros; the padding of a short last chunk
    counted too, though its slots lie past the leaf and were always dropped: an upper
    bound), the zero values and all values. Until the fix each kept zero travelled as a
    level of its chunk's scale (``s/3`` at 2 bits, ``-s`` at 1) and counted as a sender; an
    empty chunk's scale is 0, so it decoded to 0 but still counted. With no short chunk the
    old and the new wire decode to the same bits."""
    import numpy as np

    out = dict.fromkeys(("chunks", "short", "empty", "kept_zeros", "zeros", "values"), 0)
    out["short_leaf_sizes"] = []
    for x in leaves:
        c, kc, rows = codec.layout(x.size)
        nonzero = (np.pad(x, (0, rows * c - x.size)).reshape(rows, c) != 0).sum(axis=1)
        short = nonzero < kc
        out["chunks"] += rows
        out["short"] += int(np.sum(short & (nonzero > 0)))
        out["empty"] += int(np.sum(nonzero == 0))
        out["kept_zeros"] += int(np.sum(np.maximum(kc - nonzero, 0)))
        out["zeros"] += int(np.sum(x == 0))
        out["values"] += int(x.size)
        if np.any(short):
            out["short_leaf_sizes"].append(int(x.size))
    return out


def run_fidelity(
    largs: Any,
    replicas: int,
    starts: list[int],
    h: int,
    tag: str,
    muon: bool = False,
    codecs: tuple = FIDELITY_CODECS,
    zeros: bool = False,
) -> int:
    """``--fidelity``: each codec's :func:`fidelity` on one replica's pseudo-gradient over
    ``[start, start + h)`` for each ``start`` (``muon``: Muon inside, :func:`_muon_held`);
    with ``zeros`` instead :func:`short_chunks` of its chunked top-k codecs over every leaf
    (``min_size=0``); writes ``lm_TAG.json``."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(largs.devices)
    import jax

    task = lm.Task(largs, jax.device_count())
    run = lm.Run(largs.steps, largs.lr, jax.device_count())
    records = []
    inner = _muon_held if muon else None
    deltas = replica_deltas(task, run, replicas, starts, h, inner, 0 if zeros else 1024)
    for start, leaves in zip(starts, deltas, strict=True):
        for name, make in codecs:
            if zeros and not hasattr(make(), "layout"):
                continue  # not a chunked top-k
            rec = {"steps": f"{start}-{start + h}", "replicas": replicas, "codec": name}
            rec.update(short_chunks(make(), leaves) if zeros else fidelity(make(), leaves))
            records.append(rec)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()})
    path = common.result_path("lm_" + tag, False)
    out = {"environment": common.environment(), "config": lm.run_config(largs)}
    common.write_json(path, {**out, "records": records})
    return 0


# ----------------------------------------------------------- exchange fidelity at M replicas


def forked_deltas(
    task: lm.Task,
    run: lm.Run,
    replicas: int,
    starts: list[int],
    h: int,
    inner: Callable[[lm.Run], Any] | None = None,
) -> list[list[list]]:
    """For each ``s`` in ``starts``: the pseudo-gradients ``D_i = theta_s - theta_{s+h}^i`` of
    ``replicas`` replicas forked at step ``s`` from one trajectory (Muon at the held lr,
    :func:`_muon_held`, or ``inner(run)``, on every row of the global batch: data parallel)
    and run ``h`` steps each on its own rows (``n / replicas`` devices' worth) with a copy of
    the trajectory's optimizer state. Returns ``[start][replica][leaf]`` flat float32
    arrays, every leaf."""
    import jax
    import numpy as np

    tx = (inner or _muon_held)(run)
    rows = task.n // replicas * task.per_device
    step = _train_step(task, tx)

    def flat(p):
        return [np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(jax.device_get(p))]

    p, s = task.params, tx.init(task.params)
    task.reset()
    out, t = [], 0
    for start in sorted(starts):
        while t < start:
            p, s = jax.block_until_ready(step(p, s, task.batch()))
            t += 1
        batches = [task.batch() for _ in range(h)]  # the next h global batches
        base = flat(p)
        per = []
        for r in range(replicas):
            q, qs = p, s
            for b in batches:
                q, qs = jax.block_until_ready(step(q, qs, b[r * rows : (r + 1) * rows]))
            per.append([a - b for a, b in zip(base, flat(q), strict=True)])
        out.append(per)
        for b in batches:  # the trajectory goes on with the same batches, data parallel
            p, s = jax.block_until_ready(step(p, s, b))
            t += 1
    return out


def _exchange_variant(kind: str, replicas: int, **kw: Any) -> Any:
    """The feedback transform of one SparseLoCo exchange over axis ``"r"``: ``"topk"``
    (:func:`jaxcomp._src.sparseloco.sparse_feedback`, Templar's merge) or a shared mask."""
    import jaxcomp as jc
    from jaxcomp._src import shared_mask, sparseloco

    if kind == "topk":
        codec = jc.chunked_top_k(kw["k"], kw["chunk"], 1, "mean")
        return sparseloco.sparse_feedback(codec, "r", ef_decay=0.5, min_size=0, averaging="senders")
    return shared_mask.shared_mask_feedback(
        jc.int_quant(kw["bits"], kw.get("block", 256)),
        "r",
        mask=kind,
        density=kw["density"],
        ef_decay=0.5,
        min_size=0,
        strategy="two_phase",
        explore=kw.get("explore", 0.0),
    )


def _largest_density(bits: int, sizes: list[int], n: int, budget: float, block: int = 256) -> float:
    """The largest density (in steps of 1/4096) whose two-phase int``bits`` exchange (a scale
    per ``block`` values) costs at most ``budget`` bytes per device
    (:func:`jaxcomp._src.shared_mask.wire_bytes`)."""
    import jaxcomp as jc
    from jaxcomp._src import shared_mask

    codec = jc.int_quant(bits, block)
    lo = 1
    for j in range(1, 4097):
        if shared_mask.wire_bytes(sizes, codec, n, j / 4096, 0) > budget:
            break
        lo = j
    return lo / 4096


def exchange_fidelity(variant: Any, deltas: list[list[list]], replicas: int) -> dict:
    """Run ``variant`` (a feedback transform over ``"r"``) on every window of ``deltas`` in
    turn (its memory carried, as at successive syncs) on a mesh of ``replicas`` devices; of
    the last window: the share of ``|mean_i D_i|^2`` its output leaves out, the cosine and
    norm ratio of the output to ``mean_i D_i``, the same against the mean of the targets
    ``beta e_i + D_i``, and the compiled bytes per device (``jc.comm_report``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = jax.make_mesh(
        (replicas,),
        ("r",),
        axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:replicas],
    )
    sizes = [x.size for x in deltas[0][0]]
    state = variant.init([jnp.zeros(d, jnp.float32) for d in sizes])
    per_dev = [f for f in type(state)._fields if f in type(state).PER_DEVICE_FIELDS]

    def spec_of(field):
        return P("r") if field in per_dev else P()

    specs = type(state)(
        *[jax.tree.map(lambda _, f=f: spec_of(f), getattr(state, f)) for f in type(state)._fields]
    )
    state = type(state)(
        *[
            jax.tree.map(lambda x: jnp.concatenate([x] * replicas), getattr(state, f))
            if f in per_dev
            else getattr(state, f)
            for f in type(state)._fields
        ]
    )
    state = jax.device_put(state, jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs))

    def body(d, st):
        out, st = variant.update([x[0] for x in d], st)
        return out, st

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("r"), specs), out_specs=(P(), specs)))
    beta = 0.5
    for window in deltas:
        d = [np.stack([window[r][j] for r in range(replicas)]) for j in range(len(sizes))]
        d = jax.device_put(d, NamedSharding(mesh, P("r")))
        memory = [np.asarray(m) if m is not None else None for m in state.memory]
        args = (d, state)
        out, state = jax.block_until_ready(fn(*args))
    report = jc.comm_report(fn, *args)
    mean_d = np.concatenate(
        [np.mean([window[r][j] for r in range(replicas)], 0) for j in range(len(sizes))]
    ).astype(np.float64)
    target = np.concatenate(
        [
            np.mean(
                [
                    window[r][j] + (0 if memory[j] is None else beta * memory[j][r])
                    for r in range(replicas)
                ],
                0,
            )
            for j in range(len(sizes))
        ]
    ).astype(np.float64)
    o = np.concatenate([np.asarray(x).reshape(-1) for x in out]).astype(np.float64)

    def compare(ref):
        return (
            float(np.sum((ref - o) ** 2) / np.sum(ref**2)),
            float(o @ ref / np.sqrt((o @ o) * (ref @ ref))),
            float(np.sqrt((o @ o) / (ref @ ref))),
        )

    left, cos, ratio = compare(mean_d)
    left_t, cos_t, _ = compare(target)
    return {
        "left_out": left,
        "cosine": cos,
        "norm_ratio": ratio,
        "left_out_of_target": left_t,
        "cosine_target": cos_t,
        "bytes_per_sync": float(report.bytes_per_device),
    }


def run_exchange_fidelity(largs: Any, replicas: int, start: int, h: int, tag: str) -> int:
    """``--fidelity-exchange START``: the exchanges of SparseLoCo at 3000x at ``H = h`` on
    ``replicas`` replicas (per-replica top-k, 1 bit at the mean, all-gathered; shared masks,
    int-quantized values, two-phase, at the top-k's bytes or under), each run at the syncs
    ``start - h`` and ``start`` (:func:`forked_deltas`, Muon inside), every leaf coded;
    writes ``lm_TAG.json``."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(largs.devices)
    import jax

    task = lm.Task(largs, jax.device_count())
    run = lm.Run(largs.steps, largs.lr, jax.device_count())
    t0 = time.perf_counter()
    deltas = forked_deltas(task, run, replicas, [start - h, start], h)
    print(f"deltas: {time.perf_counter() - t0:.0f} s", flush=True)
    if os.environ.get("LM_SAVE_DELTAS"):  # for offline analysis: [window, replica, value]
        import numpy as np

        flat = [[np.concatenate(r) for r in w] for w in deltas]
        np.save(os.environ["LM_SAVE_DELTAS"], np.asarray(flat, np.float32))
    sizes = [x.size for x in deltas[0][0]]
    ref = {"k": 21, "chunk": 4096} if replicas == 8 else {"k": 47, "chunk": 1024}
    variants = [("topk", f"top-{ref['k']}/{ref['chunk']}, 1 bit at the mean (all-gather)", ref)]
    records = []
    budget = None
    for kind, name, kw in variants:
        rec = exchange_fidelity(_exchange_variant(kind, replicas, **kw), deltas, replicas)
        budget = rec["bytes_per_sync"]
        records.append(
            {"replicas": replicas, "steps": f"{start}-{start + h}", "exchange": name, **kw, **rec}
        )
        print(records[-1], flush=True)
    shared = []
    for bits in (1, 2, 3, 4, 8):
        dens = _largest_density(bits, sizes, replicas, budget)
        name = f"shared random {dens * 100:.2f}%, int{bits} (two-phase)"
        shared.append(("random", name, {"bits": bits, "density": dens}))
    dens1 = _largest_density(1, sizes, replicas, budget, block=1024)
    name = f"shared random {dens1 * 100:.2f}%, int1 per 1024 (two-phase)"
    shared.append(("random", name, {"bits": 1, "density": dens1, "block": 1024}))
    for bits in (1, 4):
        dens = _largest_density(bits, sizes, replicas, budget)
        for explore in (0.0, 0.25, 0.5):
            name = f"previous update's top {dens * 100:.2f}%, explore {explore}, int{bits}"
            shared.append(("previous", name, {"bits": bits, "density": dens, "explore": explore}))
    for kind, name, kw in shared:
        rec = exchange_fidelity(_exchange_variant(kind, replicas, **kw), deltas, replicas)
        records.append(
            {"replicas": replicas, "steps": f"{start}-{start + h}", "exchange": name, **kw, **rec}
        )
        print(records[-1], flush=True)
    path = common.result_path("lm_" + tag, False)
    out = {"environment": common.environment(), "config": lm.run_config(largs)}
    common.write_json(path, {**out, "records": records})
    return 0


# ------------------------------------------------- low-rank factors against the top-k at 3000x


def svd_kept(x: Any, ranks: tuple[int, ...]) -> dict[int, float]:
    """The share of ``|x|^2`` in the best rank-``r`` approximation of the matrix ``x``
    (Eckart-Young: the top ``r`` squared singular values over their sum), for each ``r``."""
    import numpy as np

    s2 = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False) ** 2
    return {r: float(s2[:r].sum() / s2.sum()) for r in ranks}


def gaussian_kept(shape: tuple[int, int], ranks: tuple[int, ...], draws: int = 3) -> dict:
    """:func:`svd_kept` of a matrix of independent normal entries of ``shape`` (the mean over
    ``draws`` draws, seed 0): the share a rank-``r`` approximation keeps of noise."""
    import numpy as np

    rng = np.random.default_rng(0)
    kept = [svd_kept(rng.standard_normal(shape), ranks) for _ in range(draws)]
    return {r: float(np.mean([k[r] for k in kept])) for r in ranks}


def topk_kept(x: Any, k: int, chunk: int) -> float:
    """The share of ``|x|^2`` in the ``k`` largest magnitudes of each ``chunk`` values of
    ``x`` (flat, zero-padded to whole chunks), the values sent exactly."""
    import numpy as np

    v = np.asarray(x, np.float64).reshape(-1)
    v = np.pad(v, (0, -v.size % chunk)).reshape(-1, chunk) ** 2
    return float(np.sort(v, axis=1)[:, -k:].sum() / v.sum())


def powersgd_exchange(rank: int, deltas: list[list[list]], shapes: list, replicas: int) -> tuple:
    """``jc.powersgd(rank)`` (warm-started ``Q``, error feedback, no warm-up) run as the
    exchange of every window of ``deltas`` in turn on ``replicas`` devices, its state carried
    as from sync to sync (the leaves under 1024 values through its plain float32 ``pmean``).
    Returns the last window's output (flat leaves) and the compiled exchange's bytes per
    device (``jc.comm_report``)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = jax.make_mesh(
        (replicas,),
        ("r",),
        axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:replicas],
    )
    tx = jc.powersgd(rank, "r", start_step=0)
    zeros = [np.zeros(s, np.float32) for s in shapes]
    state = jc.sharded_init(tx, zeros, mesh, "r")
    specs = jc.state_specs(state, "r")

    def body(d, st):
        return tx.update([x[0] for x in d], st)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("r"), specs), out_specs=(P(), specs)))
    for window in deltas:
        d = [
            np.stack([window[r][j].reshape(s) for r in range(replicas)])
            for j, s in enumerate(shapes)
        ]
        args = (jax.device_put(d, NamedSharding(mesh, P("r"))), state)
        out, state = jax.block_until_ready(fn(*args))
    report = jc.comm_report(fn, *args)
    return [np.asarray(x, np.float64).reshape(-1) for x in out], float(report.bytes_per_device)


def _cosine(a: Any, b: Any) -> float:
    import numpy as np

    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def lowrank_records(
    deltas: list[list[list]], shapes: list, replicas: int, ranks: tuple, k: int, chunk: int
) -> tuple[list, list]:
    """What low-rank factors keep of the last window's pseudo-gradients against the top-k at
    ``k`` of ``chunk`` (the 3000x density): per matrix leaf and over all matrices, the share
    of ``|D|^2`` kept by the top-k (values exact) and by the best rank ``r`` (SVD), of one
    replica's ``D`` and of ``mean_i D_i`` (and of normal noise of each shape,
    :func:`gaussian_kept`); and of ``mean_i D_i`` by :func:`powersgd_exchange`
    (one power iteration per sync, ``Q`` warm from the sync before, its memory carried): the
    share at the best scale (``cosine^2``), the share left out as applied, the length ratio,
    and the compiled bytes. Returns ``(per-leaf rows, summary rows)``."""
    import numpy as np

    last = deltas[-1]
    mats = [j for j, s in enumerate(shapes) if len(s) == 2]
    one = [np.asarray(last[0][j], np.float64) for j in range(len(shapes))]
    mean = [
        np.mean([last[r][j] for r in range(replicas)], 0).astype(np.float64)
        for j in range(len(shapes))
    ]
    leaves, energy = [], {"one replica": 0.0, f"mean of {replicas}": 0.0}
    energy["normal noise of each shape"] = sum(float(one[j] @ one[j]) for j in mats)
    sums: dict[tuple, float] = {}
    for j in mats:
        row = {"leaf": j, "shape": list(shapes[j])}
        noise = gaussian_kept(shapes[j], ranks)
        row["gaussian"] = {f"rank {r} (SVD)": v for r, v in noise.items()}
        for of, x in (("one replica", one[j]), (f"mean of {replicas}", mean[j])):
            e = float(x @ x)
            energy[of] += e
            kept = {f"top-{k}/{chunk}": topk_kept(x, k, chunk)}
            kept.update(
                {f"rank {r} (SVD)": v for r, v in svd_kept(x.reshape(shapes[j]), ranks).items()}
            )
            row[of] = kept
            for name, v in kept.items():
                sums[(of, name)] = sums.get((of, name), 0.0) + v * e
            s = np.linalg.svd(x.reshape(shapes[j]), compute_uv=False)
            row[of]["sigma1 / sigma2"] = float(s[0] / s[1])
        for r, v in noise.items():  # weighted by the leaf's share of one replica's |D|^2
            key = ("normal noise of each shape", f"rank {r} (SVD)")
            sums[key] = sums.get(key, 0.0) + v * float(one[j] @ one[j])
        leaves.append(row)
    summary = [
        {"of": of, "method": name, "kept": v / energy[of], "replicas": replicas}
        for (of, name), v in sums.items()
    ]
    ref = np.concatenate([mean[j] for j in mats])
    for r in ranks:
        out, nbytes = powersgd_exchange(r, deltas, shapes, replicas)
        out = [out[j] for j in mats]
        o = np.concatenate(out)
        cos = _cosine(o, ref)
        for row, x in zip(leaves, out, strict=True):
            row[f"mean of {replicas}"][f"powersgd rank {r}, cosine"] = _cosine(x, mean[row["leaf"]])
        summary.append(
            {
                "of": f"mean of {replicas}",
                "method": f"jc.powersgd rank {r}: one power step, Q warm, memory carried",
                "kept": cos**2,
                "cosine": cos,
                "norm_ratio": float(np.sqrt((o @ o) / (ref @ ref))),
                "left_out_as_applied": float((ref - o) @ (ref - o) / (ref @ ref)),
                "bytes_per_sync": nbytes,
                "replicas": replicas,
            }
        )
    return leaves, summary


def run_lowrank_fidelity(
    largs: Any, replicas: int, start: int, h: int, tag: str, adamw: bool = False
) -> int:
    """``--fidelity-lowrank START``: low-rank factors against the top-k at 3000x on the
    pseudo-gradients of :func:`forked_deltas` (Muon inside, or ``adamw``: AdamW at the held
    lr, :func:`_inner_const`; syncs ``START - H`` and ``START``), the matrices of the model
    (:func:`lowrank_records`), with the bytes per device and sync that 3000x allows, the
    top-k exchange's (:func:`exchange_fidelity`) and rank ``r`` factors' in float32 and 16
    bits (all-reduced: ``2 (M - 1) / M`` of them); writes ``lm_TAG.json``.
    ``LM_LOAD_DELTAS=NPY``: the pseudo-gradients that ``--fidelity-exchange`` saved
    (``LM_SAVE_DELTAS``, the same trajectory) instead."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(largs.devices)
    import jax
    import numpy as np

    task = lm.Task(largs, jax.device_count())
    run = lm.Run(largs.steps, largs.lr, jax.device_count())
    shapes = [tuple(x.shape) for x in jax.tree.leaves(task.params)]
    t0 = time.perf_counter()
    if os.environ.get("LM_LOAD_DELTAS"):  # what --fidelity-exchange saved (LM_SAVE_DELTAS)
        saved = np.load(os.environ["LM_LOAD_DELTAS"])
        cuts = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        deltas = [
            [[r[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)] for r in w] for w in saved
        ]
    else:
        inner = _inner_const if adamw else None
        deltas = forked_deltas(task, run, replicas, [start - h, start], h, inner)
    print(f"deltas: {time.perf_counter() - t0:.0f} s", flush=True)
    k, chunk = (21, 4096) if replicas == 8 else (47, 1024)
    leaves, summary = lowrank_records(deltas, shapes, replicas, (1, 2, 4, 8), k, chunk)
    ref = {"k": k, "chunk": chunk}
    topk = exchange_fidelity(_exchange_variant("topk", replicas, **ref), deltas, replicas)
    summary.append(
        {
            "of": f"mean of {replicas}",
            "method": f"top-{k}/{chunk}, 1 bit at the mean, all-gathered (every leaf)",
            "kept": topk["cosine"] ** 2,
            "cosine": topk["cosine"],
            "norm_ratio": topk["norm_ratio"],
            "left_out_as_applied": topk["left_out"],
            "bytes_per_sync": topk["bytes_per_sync"],
            "replicas": replicas,
        }
    )
    d = sum(int(np.prod(s)) for s in shapes)
    ring = 2 * (replicas - 1) / replicas
    factor_floats = sum(s[0] + s[1] for s in shapes if len(s) == 2)
    budget = {
        "pmean_bytes_per_step": ring * 4 * d,
        "bytes_per_sync_at_3000x": ring * 4 * d * h / 3000,
        "factor_floats_per_rank": factor_floats,
        "rank_r_bytes_per_sync_float32": ring * 4 * factor_floats,
        "rank_r_bytes_per_sync_16bit": ring * 2 * factor_floats,
        "small_leaf_values": sum(int(np.prod(s)) for s in shapes if len(s) < 2),
    }
    for r in summary:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print(budget, flush=True)
    path = common.result_path("lm_" + tag, False)
    out = {"environment": common.environment(), "config": lm.run_config(largs)}
    if os.environ.get("LM_LOAD_DELTAS"):
        out["deltas_from"] = os.environ["LM_LOAD_DELTAS"]
    out["inner"] = "adamw" if adamw else "muon"
    common.write_json(path, {**out, "budget": budget, "records": summary, "leaves": leaves})
    return 0


# ----------------------------------------- where the 2-replica top-k's bytes could go further


def block_topk(x: Any, block: int, k: int, scale_block: int, exact: bool = False) -> tuple:
    """The top ``k`` magnitudes of each ``block`` values of ``x`` (indices of ``log2 block``
    bits), sent as one bit at the mean magnitude of the kept values of each ``scale_block``
    values (a float32 scale each) or, ``exact``, as float32 values. A leaf shorter than the
    block keeps the same share of itself. Returns ``(|x - C(x)|^2, payload bytes)``, the
    streams rounded up to whole uint32 words as :func:`jaxcomp.chunked_top_k` packs them."""
    import numpy as np

    d = x.size
    b = min(block, d)
    kb = k if b == block else max(1, math.ceil(k * b / block - 1e-9))
    per = max(1, min(scale_block, d) // b)  # blocks per scale
    rows = math.ceil(d / (b * per)) * per
    v = np.pad(np.asarray(x, np.float64), (0, rows * b - d)).reshape(rows, b)
    idx = np.argsort(-np.abs(v), axis=1)[:, :kb]
    kept = np.take_along_axis(v, idx, 1)
    if not exact:
        groups = kept.reshape(-1, per * kb)
        scale = np.abs(groups).mean(1, keepdims=True)
        kept = (scale * np.sign(groups)).reshape(kept.shape)
    out = np.zeros_like(v)
    np.put_along_axis(out, idx, kept, 1)
    n = rows * kb
    index = 4 * math.ceil(n * max(1, math.ceil(math.log2(b))) / 32)
    values = 4 * n if exact else 4 * math.ceil(n / 32) + 4 * (rows // per)
    return float(np.sum((out.reshape(-1)[:d] - x) ** 2)), index + values


def waterfilled(leaves: list, chunk: int, budget: int) -> tuple:
    """Top-``k`` in chunks of ``chunk``, one bit at the mean per chunk, with ``k`` chosen per
    leaf (the same in each of its chunks) greedily by the energy it adds per byte, within
    ``budget`` bytes (a step that keeps less, as more values at one mean magnitude can, is
    never taken). Returns ``(|x - C(x)|^2 summed, bytes)``."""
    import numpy as np

    curves = []
    for x in leaves:
        c = min(chunk, x.size)
        rows = math.ceil(x.size / c)
        a = -np.sort(-np.abs(np.pad(x, (0, rows * c - x.size)).reshape(rows, c)), axis=1)
        ks = np.arange(1, c + 1)
        kept = ((np.cumsum(a, axis=1) ** 2) / ks).sum(0)  # (sum of the top k |v|)^2 / k
        bits = max(1, math.ceil(math.log2(c)))
        cost = np.array(
            [4 * math.ceil(rows * k * bits / 32) + 4 * math.ceil(rows * k / 32) for k in ks]
        )
        curves.append((kept, cost + 4 * rows))
    ks = [1] * len(curves)
    spent = sum(cost[0] for _, cost in curves)
    while True:
        best = None
        for j, (kept, cost) in enumerate(curves):
            for step in (1, 2, 4, 8):  # past the plateaus of whole words
                k = ks[j] + step
                if k > kept.size or spent + cost[k - 1] - cost[ks[j] - 1] > budget:
                    continue
                gain = (kept[k - 1] - kept[ks[j] - 1]) / max(cost[k - 1] - cost[ks[j] - 1], 1)
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, j, k)
        if best is None:
            break
        _, j, k = best
        spent += curves[j][1][k - 1] - curves[j][1][ks[j] - 1]
        ks[j] = k
    err = sum(
        float(x @ x) - kept[k - 1] for x, (kept, _), k in zip(leaves, curves, ks, strict=True)
    )
    return err, int(spent)


#: ``(name, block, k, scale_block, exact)`` of :func:`block_topk` screened against the
#: 2-replica row (47 of each 1024 in one bit at the mean).
INDEX_SCREEN: tuple[tuple[str, int, int, int, bool], ...] = (
    ("top-47/1024, 1 bit at the mean (the row)", 1024, 47, 1024, False),
    ("top-47/1024, float32 values", 1024, 47, 1024, True),
    ("top-24/512, 1 bit at the mean", 512, 24, 512, False),
    ("top-8 of each 128 (7-bit indices), 1 bit at the mean per 1024", 128, 8, 1024, False),
    ("top-4 of each 64 (6-bit indices), 1 bit at the mean per 1024", 64, 4, 1024, False),
    ("top-2 of each 32 (5-bit indices), 1 bit at the mean per 1024", 32, 2, 1024, False),
    ("top-64/1024, 1 bit at the mean", 1024, 64, 1024, False),
    ("top-96/1024, 1 bit at the mean", 1024, 96, 1024, False),
    ("top-128/1024, 1 bit at the mean", 1024, 128, 1024, False),
)


def run_index_screen(largs: Any, start: int, h: int, tag: str) -> int:
    """``--fidelity-index START``: one replica's pseudo-gradient of 2 (Muon inside,
    :func:`replica_deltas`, every leaf) through :data:`INDEX_SCREEN` and
    :func:`waterfilled` at the row's bytes: the share of ``|D|^2`` left out and the payload's
    bytes over the row's; writes ``lm_TAG.json``."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(largs.devices)
    import jax
    import numpy as np

    task = lm.Task(largs, jax.device_count())
    run = lm.Run(largs.steps, largs.lr, jax.device_count())
    leaves = replica_deltas(task, run, 2, [start], h, _muon_held, 0)[0]
    leaves = [np.asarray(x, np.float64) for x in leaves]
    energy = sum(float(x @ x) for x in leaves)
    records, row = [], None
    for name, block, k, scale_block, exact in INDEX_SCREEN:
        err = nbytes = 0
        for x in leaves:
            e, b = block_topk(x, block, k, scale_block, exact)
            err, nbytes = err + e, nbytes + b
        row = row or nbytes
        records.append({"codec": name, "left_out": err / energy, "bytes": nbytes})
    err, nbytes = waterfilled(leaves, 1024, row)
    records.append(
        {
            "codec": "k per leaf water-filled, 1 bit at the mean",
            "left_out": err / energy,
            "bytes": nbytes,
        }
    )
    for r in records:
        r.update(steps=f"{start}-{start + h}", replicas=2, bytes_over_row=r["bytes"] / row)
        print(r, flush=True)
    path = common.result_path("lm_" + tag, False)
    out = {"environment": common.environment(), "config": lm.run_config(largs)}
    common.write_json(path, {**out, "records": records})
    return 0


def block_energy(path: str, tag: str) -> int:
    """``--block-energy NPY``: on the pseudo-gradients that ``--fidelity-exchange`` saved with
    ``LM_SAVE_DELTAS=NPY`` (``[window, replica, value]``), the share of ``|mean_i D_i|^2`` of the
    last window in the top ``p`` of its coordinates (known to no replica), and in the top
    ``p`` of its blocks of 256 and 1024 values chosen by the block energy of the mean itself
    (an oracle), by ``sum_i |D_i|^2`` per block (what one all-reduce of a float per block
    gives every replica), by the previous window's mean, or at random (``p``, in
    expectation); writes ``lm_TAG.json``."""
    import numpy as np

    deltas = np.load(path).astype(np.float64)
    window, mean = deltas[-1], deltas[-1].mean(0)
    total = float(np.sum(mean**2))
    records = []
    for p in (0.0757, 0.28):
        top = np.sort(mean**2)[::-1][: int(p * mean.size)].sum() / total
        records.append({"share": p, "block": 1, "oracle": float(top)})
        for b in (256, 1024):
            nb = mean.size // b

            def per_block(x, nb=nb, b=b):
                return (x[..., : nb * b].reshape(*x.shape[:-1], nb, b) ** 2).sum(-1)

            energy, kb = per_block(mean), int(p * nb)

            def kept(score, energy=energy, kb=kb):
                return float(energy[np.argsort(-score)[:kb]].sum() / total)

            records.append(
                {
                    "share": p,
                    "block": b,
                    "oracle": kept(energy),
                    "sum_of_replica_energies": kept(per_block(window).sum(0)),
                    "previous_mean": kept(per_block(deltas[-2].mean(0))),
                    "random": p,
                }
            )
            print(records[-1], flush=True)
    path_out = common.result_path("lm_" + tag, False)
    common.write_json(path_out, {"environment": common.environment(), "records": records})
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = common.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Writes benchmarks/results/lm_TAG.json (adamw is run first unless --resume "
        "finds it there; other options go to benchmarks.lm). Takes 1-5 minutes per recipe on "
        "8 CPU devices of a loaded 2-core machine (--diagnose: twice that).",
    )
    ap.add_argument("--recipes", nargs="+", default=None, help=f"of {list(RECIPES)} or lm's")
    ap.add_argument("--diagnose", nargs="+", default=None, help="per-sync records of these")
    ap.add_argument("--sync-every", type=int, default=30, help="--diagnose: record every H")
    ap.add_argument("--tag", default="diloco", help="write benchmarks/results/lm_TAG.json")
    ap.add_argument(
        "--fidelity",
        nargs="+",
        type=int,
        default=None,
        help="what each codec of FIDELITY_CODECS keeps of one replica's pseudo-gradient over "
        "the H steps from each of these steps (--replicas, --sync-every)",
    )
    ap.add_argument("--replicas", type=int, default=2, help="--fidelity: M")
    ap.add_argument(
        "--fidelity-exchange",
        type=int,
        default=None,
        help="what SparseLoCo's exchanges at 3000x (per-replica top-k, shared masks) keep of "
        "the mean of --replicas replicas' pseudo-gradients at the sync ending START + H",
    )
    ap.add_argument(
        "--fidelity-lowrank",
        type=int,
        default=None,
        help="what low-rank factors (SVD, jc.powersgd) keep of one replica's and the mean "
        "pseudo-gradient at the sync ending START + H, against the top-k at 3000x",
    )
    ap.add_argument(
        "--fidelity-index",
        type=int,
        default=None,
        help="where the 2-replica top-k's bytes could go further (INDEX_SCREEN) on one "
        "replica's pseudo-gradient over the H steps from START",
    )
    ap.add_argument(
        "--line-search",
        action="store_true",
        help="--diagnose (SparseLoCo): the held-out loss along the applied outer step and along "
        "the exact mean pseudo-gradient at each sync (line_record)",
    )
    ap.add_argument("--muon", action="store_true", help="--fidelity: Muon inside (held lr)")
    ap.add_argument(
        "--adamw", action="store_true", help="--fidelity-lowrank: AdamW inside (held lr)"
    )
    ap.add_argument(
        "--zeros",
        action="store_true",
        help="--fidelity: count the chunks holding fewer than k nonzero values (short_chunks) "
        "over every leaf instead",
    )
    ap.add_argument(
        "--fidelity-codecs",
        choices=("default", "3000x", "subchunk"),
        default="default",
        help="--fidelity: FIDELITY_CODECS, FIDELITY_3000X or FIDELITY_SUBCHUNK",
    )
    ap.add_argument(
        "--ef-decay",
        type=float,
        default=0.5,
        help="--diagnose: the error feedback's decay of the SparseLoCo recipes diagnosed",
    )
    ap.add_argument(
        "--block-energy",
        default=None,
        help="the share of the mean pseudo-gradient's energy in the top blocks, from the NPY "
        "that --fidelity-exchange saved (LM_SAVE_DELTAS=NPY)",
    )
    args, rest = ap.parse_known_args(argv)
    if args.block_energy:
        return block_energy(args.block_energy, args.tag)
    if args.fidelity_index is not None:
        largs = lm.parse(["--tag", args.tag, *rest])
        return run_index_screen(largs, args.fidelity_index, args.sync_every, args.tag)
    if args.fidelity_lowrank is not None:
        largs = lm.parse(["--tag", args.tag, *rest])
        return run_lowrank_fidelity(
            largs, args.replicas, args.fidelity_lowrank, args.sync_every, args.tag, args.adamw
        )
    if args.fidelity_exchange is not None:
        largs = lm.parse(["--tag", args.tag, *rest])
        return run_exchange_fidelity(
            largs, args.replicas, args.fidelity_exchange, args.sync_every, args.tag
        )
    if args.fidelity:
        largs = lm.parse(["--tag", args.tag, *rest])
        codecs = {"3000x": FIDELITY_3000X, "subchunk": FIDELITY_SUBCHUNK}.get(
            args.fidelity_codecs, FIDELITY_CODECS
        )
        return run_fidelity(
            largs,
            args.replicas,
            args.fidelity,
            args.sync_every,
            args.tag,
            args.muon,
            codecs,
            args.zeros,
        )
    lm.RECIPES.update(lm_sparse.RECIPES)
    lm.RECIPES.update(RECIPES)
    if not args.diagnose:
        return lm.main(["--tag", args.tag, "--recipes", *(args.recipes or list(RECIPES)), *rest])
    return run_diagnose(args, rest)


def run_diagnose(args: Any, rest: list[str]) -> int:
    largs = lm.parse(["--tag", args.tag, *rest])
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(largs.devices)
    import jax

    task = lm.Task(largs, jax.device_count())
    run = lm.Run(largs.steps, largs.lr, jax.device_count(), largs.baseline_lr)
    h = args.sync_every
    steps = [t for t in range(run.steps) if (t + 1) % h == 0]
    out = []
    for name in args.diagnose if largs.no_baseline else ["adamw", *args.diagnose]:
        t0 = time.perf_counter()
        out.append(
            diagnose(task, name, lm.RECIPES[name], run, steps, args.ef_decay, args.line_search)
        )
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    config = lm.run_config(largs)
    path = common.result_path("lm_" + args.tag, False)
    common.write_json(path, {"environment": common.environment(), "config": config, "syncs": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
