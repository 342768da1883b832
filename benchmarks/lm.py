"""Language models over slow links: a GPT-style decoder trained with every recipe of jaxcomp
against AdamW data parallel, the same tokens for every run.

The model is the pre-norm decoder of ``benchmarks/char_transformer.py`` (Flax NNX: causal
self-attention, a 4x GELU MLP, learned positions, bytes as the 256-token vocabulary). The text
ships offline: ``--data pydoc`` (default) is the English help() pages of CPython
(``pydoc_data.topics``, ~0.47 MB), ``--data PATH`` any UTF-8 text file (a held-out check on
other data); ``--d-model``, ``--layers``, ``--heads``, ``--context`` size another model.
The last 10% of the text is held out. Every run starts from the same initialization and draws
the same batches, so every recipe sees the same tokens in the same number of steps.

Configs: ``--config cpu`` (the default and the reference of the docs: 2 layers, d_model 128,
context 64, 2 sequences per device, 300 steps; 2-10 minutes per recipe on 8 CPU devices of a
loaded 2-core machine), ``--quick`` (a smoke run: the cpu config for 40 steps and three
recipes, a few minutes) and ``--config gpu`` (6 layers, d_model 512, context 256, 16
sequences per device, 3000 steps; sized for 8 accelerators).

Baseline: ``adamw`` (``optax.adamw``, 5% warm-up then cosine to 10%, weight decay 0.1, the
gradients averaged by ``pmean`` every step). Every recipe (the registry :data:`RECIPES`, to
which other modules add rows) is either data parallel (params replicated, the transform
returns the mean) or per replica (``jc.local_sgd``, ``jc.diloco``: params per replica,
``M`` replicas of ``n / M`` devices each on a replica x data mesh, the gradient averaged
inside a replica by ``pmean`` every step). Replica runs are evaluated on the mean replica
(after a sync it is every replica); ``nocomm`` (every device alone) on device 0's model.

Bytes per step: ring-model bytes per device of the step's collectives (read from the lowered
program, as ``jc.comm_report``'s ``logical``), averaged over the run: a step whose program
holds a ``lax.cond`` between exchanges is costed by the branch each step takes (1-bit / 0/1
Adam: ``CommReport.mean_bytes_per_device`` of the step, its branches weighted by how often
each runs; periodic recipes: the step lowered at each distinct sync pattern,
``jc.at_count``), weighted by how often it runs. ``slow_bytes_per_step`` counts
only the collectives across replicas (a replica's inner ``pmean`` runs on its fast link).

Writes ``benchmarks/results/lm.json`` (``lm_quick.json`` with ``--quick``; ``--tag T``
gives ``lm_T[_quick].json``), after every recipe (a bounded run keeps what finished; ``--resume``
goes on from it), and ``lm[_quick|_T].png`` (the loss curves)::

    python -m benchmarks.lm                                  # every recipe, cpu config
    python -m benchmarks.lm --recipes adamw diloco-int4-H30  # some (--resume: add to lm.json)
    python -m benchmarks.lm --quick                          # smoke run, a few minutes
    python -m benchmarks.lm --config gpu                     # 8 accelerators
    python -m benchmarks.lm --data other.txt --d-model 96 --tag heldout
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

from benchmarks import common

AXIS = "data"  # the data axis (inside a replica for replica recipes)
REPLICA = "replica"  # the replica axis of per-replica recipes (the slow link)
WEIGHT_DECAY = 0.1

CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": dict(d_model=128, layers=2, heads=4, context=64, batch_per_device=2, steps=300, lr=3e-3),
    "gpu": dict(
        d_model=512, layers=6, heads=8, context=256, batch_per_device=16, steps=3000, lr=1e-3
    ),
}
QUICK_STEPS, QUICK_RECIPES = 40, ["adamw", "int8-adamw", "diloco-int4-H10"]


@dataclasses.dataclass(frozen=True)
class Run:
    """What every recipe of one benchmark run shares (sizes, steps, the learning rate)."""

    steps: int
    lr: float
    devices: int
    baseline_lr: float | None = None  # the ``adamw`` baseline's peak (None: ``lr``)

    def schedule(self, peak: float | None = None) -> Any:
        """5% linear warm-up, cosine decay to 10% of ``peak`` (default ``lr``) at ``steps``."""
        import optax

        peak = self.lr if peak is None else peak
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, max(1, self.steps // 20), self.steps, end_value=0.1 * peak
        )

    def adamw(self, peak: float | None = None) -> Any:
        import optax

        return optax.adamw(self.schedule(peak), weight_decay=WEIGHT_DECAY)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One row of the benchmark.

    Attributes:
      make: ``make(run, axis_name) -> optax transform``. Data parallel: the whole optimizer,
        fed each device's gradient (it averages; ``averages=False``: fed the ``pmean``).
        Per replica: fed the replica's mean gradient, params per replica.
      kind: ``"dp"`` (params replicated) or ``"replica"`` (params per replica).
      averages: (``dp``) whether the transform itself averages over the axis.
      replicas: (``replica``) ``M``, replicas of ``n / M`` devices (None: one per device).
      schedule: (``replica``) the sync schedule (``sync_every``, ``fragments``, ``delay``,
        ``start_step``) of a transform built on ``jaxcomp._src.periodic``: its bytes are read
        per sync pattern.
      branches: (``dp``) the names of the branches of the step's one ``lax.cond`` /
        ``lax.switch`` between exchanges, in branch-index order; ``regime(run, t)`` names the
        one step ``t`` takes, and the bytes per step are the step's own branches weighted by
        how often each runs (``CommReport.mean_bytes_per_device``).
      regimes: (``dp``, without ``branches``) ``{name: make(run, axis) -> the exchange of that
        round}``, each round's bytes read from a step of its own. None (and no ``branches``):
        the step's bytes.
      evaluate: ``"mean"`` (the mean replica) or ``"first"`` (device 0's own model).
      note: what the row shows.
    """

    make: Callable[[Run, Any], Any]
    kind: str = "dp"
    averages: bool = True
    replicas: int | None = None
    schedule: dict[str, int] | None = None
    regimes: dict[str, Callable[[Run, Any], Any] | None] | None = None
    regime: Callable[[Run, int], str] | None = None
    branches: tuple[str, ...] | None = None
    evaluate: str = "mean"
    note: str = ""


def _mean_exchange(run: Run, axis: Any) -> Any:
    import jaxcomp as jc

    return jc.compressed_allreduce(jc.identity(), axis, error_feedback=None)


def _sign_exchange(run: Run, axis: Any) -> Any:
    import jaxcomp as jc

    return jc.compressed_allreduce(jc.sign(), axis)


def onebit_freeze(run: Run) -> int:
    return max(1, run.steps // 6)


# local_step_scaler: the library's default (skipped rounds from step 1000 on; at 100 they began
# at step 200 of 300 and cost +0.8%: docs/lm-onebit-adam.md)
ZERO_ONE = {"var_update_scaler": 8, "local_step_scaler": 1000, "local_step_clipper": 16}


def zero_one_freeze(run: Run) -> int:
    return max(1, run.steps // 3)


def zero_one_settings(run: Run, kw: dict) -> dict:
    """0/1 Adam's settings here: :data:`ZERO_ONE`, a warm-up of a quarter of the freeze (the
    library's default until 2026-11-26, which the recorded ``zero_one_adam*`` rows ran with;
    ``warmup_steps=None``: the library's default now), then ``kw``."""
    return {**ZERO_ONE, "warmup_steps": zero_one_freeze(run) // 4, **kw}


# lax.switch(round kind): three branches, a fourth with variance_rounds="coded"
ZERO_ONE_BRANCHES = ("full", "compressed", "skipped", "variance")


@functools.cache
def _zero_one_kinds(run: Run, gaps: tuple, warmup_steps: int | None, coded: bool) -> tuple:
    from jaxcomp._src.zero_one_adam import default_warmup, round_kinds

    warmup = default_warmup(zero_one_freeze(run), warmup_steps)
    return tuple(round_kinds(run.steps, zero_one_freeze(run), *gaps, warmup, coded))


@functools.cache
def _zero_one_kinds_at(steps: int, freeze: int, gaps: tuple, warmup_steps: int | None) -> tuple:
    """:func:`_zero_one_kinds` with the variance frozen at ``freeze`` (computed once: each
    step's kind is a few eager jax ops)."""
    from jaxcomp._src.zero_one_adam import default_warmup, round_kinds

    warmup = default_warmup(freeze, warmup_steps)
    return tuple(round_kinds(steps, freeze, *gaps, warmup))


def _zero_one_regime(run: Run, t: int, **kw: Any) -> str:
    """The round ``jc.zero_one_adam`` at the benchmark's settings (``kw`` overriding them)
    takes at step ``t``."""
    z = zero_one_settings(run, kw)
    gaps = (z["var_update_scaler"], z["local_step_scaler"], z["local_step_clipper"])
    coded = z.get("variance_rounds") == "coded"
    return ZERO_ONE_BRANCHES[_zero_one_kinds(run, gaps, z["warmup_steps"], coded)[t]]


def _chain(codec_factory: Callable[[], Any]) -> Callable[[Run, Any], Any]:
    def make(run: Run, axis: Any) -> Any:
        import optax

        import jaxcomp as jc

        return optax.chain(jc.compressed_allreduce(codec_factory(), axis), run.adamw())

    return make


def _powersgd(rank: int, **kw: Any) -> Callable[[Run, Any], Any]:
    def make(run: Run, axis: Any) -> Any:
        import optax

        import jaxcomp as jc

        return optax.chain(jc.powersgd(rank, axis, **kw), run.adamw())

    return make


POWERSGD_START = 10  # jc.powersgd's default warm-up of plain pmean steps


def _psgd(rank: int, start: int = POWERSGD_START) -> Recipe:
    """PowerSGD rank ``rank`` then AdamW, plain pmean for the first ``start`` steps; bytes:
    plain pmean for the warm-up (its ``lax.cond``), then the compressed exchange (lowered
    with ``start_step=0``)."""

    def compressed(run: Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.powersgd(rank, axis, start_step=0)

    return Recipe(
        _powersgd(rank, start_step=start),
        regimes={"warmup": _mean_exchange, "compressed": compressed},
        regime=lambda run, t: "warmup" if t < start else "compressed",
    )


def reset_every(inner: Any, period: int) -> Any:
    """``inner`` whose float state (Adam's moments) is zeroed before every ``period``-th
    update after the first, its integer state (step counts: the schedule, bias correction)
    kept: DiLoCo with the inner optimizer's moments reset at every sync."""
    import jax
    import jax.numpy as jnp
    import optax

    def init_fn(params):
        return (inner.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        s, count = state
        fresh = (count > 0) & (count % period == 0)

        def zero(x):
            floating = jnp.issubdtype(jnp.result_type(x), jnp.floating)
            return jnp.where(fresh, jnp.zeros_like(x), x) if floating else x

        u, s = inner.update(updates, jax.tree.map(zero, s), params)
        return u, (s, count + 1)

    return optax.GradientTransformation(init_fn, update_fn)


def _diloco(
    sync_every: int,
    codec: str | None = "int4",
    outer: tuple[float, float] | None = None,
    *,
    inner_lr: float | None = None,
    outer_warmup: int = 0,
    reset: bool = False,
    **kw,
) -> Callable[[Run, Any], Any]:
    """``jc.diloco`` of AdamW (peak ``inner_lr``, None: the run's); ``outer=(lr, momentum)``:
    Nesterov SGD (None: the defaults), its lr warmed up linearly over the first
    ``outer_warmup`` outer steps (from ``lr / outer_warmup``); ``reset``: the inner moments
    zeroed at every sync (:func:`reset_every`)."""

    def make(run: Run, axis: Any) -> Any:
        import optax

        import jaxcomp as jc

        c = None if codec is None else common.make_codec(codec)
        o = None
        if outer is not None or outer_warmup:
            lr, momentum = outer or (0.7, 0.6)
            if outer_warmup:
                lr = optax.linear_schedule(lr / outer_warmup, lr, outer_warmup - 1)
            o = optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum))
        inner = run.adamw(inner_lr)
        if reset:
            inner = reset_every(inner, sync_every)
        return jc.diloco(inner, axis, sync_every, codec=c, outer=o, **kw)

    return make


def _dl(h: int, outer: tuple[float, float] | None = None, m: int | None = None, **kw) -> Recipe:
    return Recipe(
        _diloco(h, outer=outer, **kw), kind="replica", replicas=m, schedule={"sync_every": h}
    )


def _local(sync_every: int) -> Callable[[Run, Any], Any]:
    def make(run: Run, axis: Any) -> Any:
        import jaxcomp as jc

        return jc.local_sgd(run.adamw(), axis, sync_every)

    return make


def _q(name: str) -> Callable[[], Any]:
    return lambda: common.make_codec(name)


def _onebit(run: Run, axis: Any, freeze: int | None = None, **kw: Any) -> Any:
    import jaxcomp as jc

    freeze = freeze or onebit_freeze(run)
    return jc.onebit_adam(run.schedule(), axis, freeze_step=freeze, weight_decay=WEIGHT_DECAY, **kw)


def _zero_one(run: Run, axis: Any, **kw: Any) -> Any:
    import jaxcomp as jc

    return jc.zero_one_adam(
        run.schedule(),
        axis,
        var_freeze_step=zero_one_freeze(run),
        weight_decay=WEIGHT_DECAY,
        **zero_one_settings(run, kw),
    )


def _f32(make: Callable[..., Any]) -> Callable[[Run, Any], Any]:
    """``make`` with the momentum exchanged exactly (``jc.identity()``): what freezing the
    variance (and skipping rounds) costs without the 1-bit codec."""

    def f32(run: Run, axis: Any) -> Any:
        import jaxcomp as jc

        return make(run, axis, codec=jc.identity())

    return f32


def _ob(divisor: int = 6, note: str = "", **kw: Any) -> Recipe:
    """``jc.onebit_adam`` frozen at ``steps // divisor`` with ``kw`` (``codec``: a factory)."""

    def make(run: Run, axis: Any) -> Any:
        extra = {k: (v() if callable(v) else v) for k, v in kw.items()}
        return _onebit(run, axis, freeze=max(1, run.steps // divisor), **extra)

    return Recipe(
        make,
        branches=("compressed", "warmup"),
        regime=lambda run, t: "warmup" if t < max(1, run.steps // divisor) else "compressed",
        note=note,
    )


def _zo(note: str = "", **kw: Any) -> Recipe:
    """``jc.zero_one_adam`` at the benchmark's settings with ``kw``."""

    def make(run: Run, axis: Any) -> Any:
        return _zero_one(run, axis, **{k: (v() if callable(v) else v) for k, v in kw.items()})

    gaps = {k: v for k, v in kw.items() if k in (*ZERO_ONE, "warmup_steps", "variance_rounds")}
    coded = kw.get("variance_rounds") == "coded"
    return Recipe(
        make,
        branches=ZERO_ONE_BRANCHES[: 4 if coded else 3],
        regime=lambda run, t: _zero_one_regime(run, t, **gaps),
        note=note,
    )


def _zo_freeze(divisor: int, note: str = "", **kw: Any) -> Recipe:
    """``jc.zero_one_adam`` with the variance frozen at ``steps // divisor`` (the benchmark's
    other settings, ``kw`` overriding them): with ``warmup_steps`` equal to it, no variance
    round after the 1-bit rounds start (1-bit Adam's rounds, 0/1 Adam's variance)."""

    def freeze(run: Run) -> int:
        return max(1, run.steps // divisor)

    def make(run: Run, axis: Any) -> Any:
        import jaxcomp as jc

        z = {**ZERO_ONE, "warmup_steps": freeze(run) // 4, **kw}
        return jc.zero_one_adam(
            run.schedule(), axis, var_freeze_step=freeze(run), weight_decay=WEIGHT_DECAY, **z
        )

    def regime(run: Run, t: int) -> str:
        z = {**ZERO_ONE, "warmup_steps": freeze(run) // 4, **kw}
        gaps = (z["var_update_scaler"], z["local_step_scaler"], z["local_step_clipper"])
        kinds = _zero_one_kinds_at(run.steps, freeze(run), gaps, z["warmup_steps"])
        return ZERO_ONE_BRANCHES[kinds[t]]

    return Recipe(make, branches=ZERO_ONE_BRANCHES[:3], regime=regime, note=note)


def _codec(name: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        import jaxcomp as jc

        return getattr(jc, name)(**kw)

    return make


RECIPES: dict[str, Recipe] = {
    "adamw": Recipe(
        lambda run, axis: run.adamw(run.baseline_lr), averages=False, note="baseline: pmean"
    ),
    "int8-adamw": Recipe(_chain(_q("int8")), note="int8 then AdamW"),
    # jc.onebit_adam's defaults: exact zeros, steps within Adam's bound (adam_bound=True
    # since 2026-11-26; the rows of result files written before ran adam_bound=False, today's
    # onebit_adam-unbounded). Until 2026-11-27 the bound clipped each device's step, since a
    # floor on the variance and a clip of the mean step: the rows written before (lm_A_*,
    # lm_Z_*) ran the per-device clip, lm_meanbound_* the bound of today.
    "onebit_adam": Recipe(
        _onebit,
        branches=("compressed", "warmup"),  # lax.cond(count < freeze_step, warm-up, ...)
        regime=lambda run, t: "warmup" if t < onebit_freeze(run) else "compressed",
    ),
    "onebit_adam-unbounded": _ob(
        adam_bound=False, note="adam_bound=False: steps not clipped (the default before 11-26)"
    ),
    "zero_one_adam": Recipe(
        _zero_one,
        branches=ZERO_ONE_BRANCHES[:3],
        regime=_zero_one_regime,
    ),
    # The 1-bit Adam variants below ran (and run) adam_bound=False, the default when their
    # results were written: variants of onebit_adam-unbounded.
    "onebit_adam-f32": Recipe(
        _f32(functools.partial(_onebit, adam_bound=False)),
        branches=("compressed", "warmup"),
        regime=lambda run, t: "warmup" if t < onebit_freeze(run) else "compressed",
        note="diagnosis: the momentum exchanged in float32",
    ),
    "zero_one_adam-f32": Recipe(
        _f32(_zero_one),
        branches=ZERO_ONE_BRANCHES[:3],
        regime=_zero_one_regime,
        note="diagnosis: 0/1 Adam's rounds, the momentum exchanged in float32",
    ),
    "onebit_adam-freeze100": Recipe(
        lambda run, axis: _onebit(run, axis, freeze=max(1, run.steps // 3), adam_bound=False),
        regimes={"warmup": _mean_exchange, "compressed": _sign_exchange},
        regime=lambda run, t: "warmup" if t < max(1, run.steps // 3) else "compressed",
        note="freeze at a third of the steps",
    ),
    "onebit_adam-frozen": _ob(
        rescale_variance=False, adam_bound=False, note="the paper's variance: frozen as is"
    ),
    "zero_one_adam-frozen": _zo(rescale_variance=False, note="variance not rescaled"),
    "zero_one_adam-clip1": _zo(local_step_clipper=1, note="no skipped rounds"),
    "zero_one_adam-nowarmup": _zo(
        warmup_steps=0, note="compressed rounds from step 9 (no full-precision warm-up)"
    ),
    "zero_one_adam-coded": _zo(
        variance_rounds="coded", note="variance rounds: the momentum through the codec"
    ),
    "zero_one_adam-coded-exactzeros": _zo(
        variance_rounds="coded",
        codec=_codec("sign", scale="rms", exact_zeros=True),
        note="variance rounds coded; all-zero sign words decode to 0",
    ),
    # The default codecs send exact zeros (jc.sign(scale="rms", exact_zeros=True)); both
    # recipes clip each momentum step at Adam's bound (adam_bound=True; 1-bit Adam's default
    # since 2026-11-26: onebit_adam-bound is today's onebit_adam, kept for its results).
    "onebit_adam-signs": _ob(
        adam_bound=False,
        codec=_codec("sign", scale="rms"),
        note="jc.sign(scale='rms'): a zero word moves; adam_bound=False",
    ),
    "onebit_adam-bound-signs": _ob(
        adam_bound=True,
        codec=_codec("sign", scale="rms"),
        note="steps clipped at Adam's bound; jc.sign(scale='rms')",
    ),
    "onebit_adam-bound": _ob(
        adam_bound=True, note="steps clipped at Adam's bound (today's onebit_adam)"
    ),
    "zero_one_adam-signs": _zo(
        codec=_codec("sign", scale="rms"), note="jc.sign(scale='rms'): a zero word moves"
    ),
    "zero_one_adam-unbounded-signs": _zo(
        adam_bound=False,
        codec=_codec("sign", scale="rms"),
        note="steps not clipped at Adam's bound; jc.sign(scale='rms')",
    ),
    "zero_one_adam-var16": _zo(var_update_scaler=16, note="variance gaps doubling every 16 rounds"),
    "zero_one_adam-defaults": _zo(
        var_update_scaler=16,
        warmup_steps=None,
        note="the library's defaults (warm-up var_freeze_step // 2 since 2026-11-26)",
    ),
    "zero_one_adam-var16-warmup50": _zo(
        var_update_scaler=16, warmup_steps=50, note="var_update_scaler=16, warm-up of 50 steps"
    ),
    # Diagnoses of the defaults' seed-2 gap on the third pair (Z15): the same rounds with the
    # momentum exchanged in float32, and with the momentum coded at the variance rounds too.
    "zero_one_adam-var16-warmup50-f32": _zo(
        var_update_scaler=16,
        warmup_steps=50,
        codec=_codec("identity"),
        note="diagnosis: the defaults' rounds, the momentum exchanged in float32",
    ),
    "zero_one_adam-var16-warmup50-coded": _zo(
        var_update_scaler=16,
        warmup_steps=50,
        variance_rounds="coded",
        note="the defaults' rounds; variance rounds: the momentum through the codec",
    ),
    "zero_one_adam-var16-warmup100": _zo(
        var_update_scaler=16,
        warmup_steps=100,
        note="diagnosis: a warm-up to the freeze (100): the 1-bit rounds from step 100",
    ),
    "zero_one_adam-var16-freeze50-warmup50": _zo_freeze(
        6,
        var_update_scaler=16,
        warmup_steps=50,
        note="diagnosis: frozen at 50, 50 warm-up steps: no variance round after a 1-bit one",
    ),
    # The third pair's seed-2 miss (L12): the signs' root mean square per block of 256 values
    # (one float32 each, 1/8 bit per value more) in place of one per chunk.
    "onebit_adam-rms256": _ob(
        codec=_codec("sign", scale="rms", block_size=256, exact_zeros=True),
        note="jc.sign(scale='rms', block_size=256, exact_zeros=True)",
    ),
    "onebit_adam-freeze60": _ob(5, note="freeze at a fifth of the steps (60 of 300)"),
    "zero_one_adam-var16-warmup50-rms256": _zo(
        var_update_scaler=16,
        warmup_steps=50,
        codec=_codec("sign", scale="rms", block_size=256, exact_zeros=True),
        note="the defaults' rounds; jc.sign(scale='rms', block_size=256, exact_zeros=True)",
    ),
    "zero_one_adam-scaler100": _zo(
        local_step_scaler=100, note="skipped rounds from step 200 (every other step)"
    ),
    "zero_one_adam-f32-clip1": _zo(
        codec=_codec("identity"), local_step_clipper=1, note="no skipped rounds, float32"
    ),
    "onebit_adam-f32-freeze100": _ob(
        3, adam_bound=False, codec=_codec("identity"), note="float32, freeze at 100"
    ),
    "onebit_adam-meansign": _ob(
        adam_bound=False, codec=_codec("sign"), note="jc.sign(): mean-|x| scale"
    ),
    "zero_one_adam-meansign": _zo(codec=_codec("sign"), note="jc.sign(): mean-|x| scale"),
    "onebit_adam-freeze25": _ob(
        12, adam_bound=False, note="freeze at a twelfth of the steps; adam_bound=False"
    ),
    "onebit_adam-bound-freeze25": _ob(
        12, adam_bound=True, note="steps clipped at Adam's bound, freeze at a twelfth of the steps"
    ),
    "powersgd4-adamw": _psgd(4),
    "powersgd8-adamw": _psgd(8),
    "powersgd16-adamw": _psgd(16),
    "powersgd24-adamw": _psgd(24),  # d_model / 4 on the third pair's d_model 96
    **{f"powersgd{r}-adamw-start{t}": _psgd(r, t) for r in (8, 16, 32) for t in (30, 60)},
    "powersgd32-adamw": _psgd(32),
    "powersgd40-adamw": _psgd(40),  # d_model / 4 on the fifth pair's d_model 160
    "sign-adamw": Recipe(_chain(_q("sign")), note="known bad: sign before Adam"),
    "topk1%-adamw": Recipe(_chain(_q("topk1%")), note="known bad: top-k before Adam"),
    "nocomm": Recipe(
        _local(10**9), kind="replica", schedule={"sync_every": 10**9}, evaluate="first"
    ),
    "local-H10": Recipe(_local(10), kind="replica", schedule={"sync_every": 10}),
    "diloco-int4-H10": _dl(10),
    "diloco-int4-H30": _dl(30),
    "local-H10-M2": Recipe(_local(10), kind="replica", replicas=2, schedule={"sync_every": 10}),
    "diloco-int4-H30-M2": _dl(30, (0.7, 0.6), m=2),  # Nesterov: the default at M > 2
    "diloco-int4-H10-M2": _dl(10, (0.7, 0.6), m=2),
    # The outer step, (lr, Nesterov momentum): the paper's 0.7 / 0.9 and the sweep.
    "diloco-int4-H30-outer0.7-0.9": _dl(30, (0.7, 0.9)),
    "diloco-int4-H10-outer0.7-0.9": _dl(10, (0.7, 0.9)),
    "diloco-int4-H30-outer1.0-0": _dl(30, (1.0, 0.0)),
    "diloco-int4-H30-outer0.7-0.6": _dl(30, (0.7, 0.6)),
    "diloco-int4-H30-outer1.0-0.5": _dl(30, (1.0, 0.5)),
    "diloco-int4-H30-outer1.5-0": _dl(30, (1.5, 0.0)),
    "diloco-int4-H30-M2-outer0.7-0.9": _dl(30, (0.7, 0.9), m=2),
    "diloco-int4-H30-M2-outer1.0-0": _dl(30, (1.0, 0.0), m=2),
    "diloco-int4-H30-M2-outer0.7-0.6": _dl(30, (0.7, 0.6), m=2),
    # The inner peak lr (1e-3: AdamW's 3e-3 scaled by sqrt(replica batch / global batch)), an
    # outer warm-up over 3 outer steps, the inner moments reset at every sync.
    "diloco-int4-H30-inner1e-3": _dl(30, inner_lr=1e-3),
    "diloco-int4-H30-inner6e-3": _dl(30, inner_lr=6e-3),
    "diloco-int4-H30-M2-outer1.5-0": _dl(30, (1.5, 0.0), m=2),
    "diloco-int4-H30-outerwarmup3": _dl(30, outer_warmup=3),
    "diloco-int4-H30-reset": _dl(30, reset=True),
}


# --------------------------------------------------------------------------- data and model


def load_text(data: str = "pydoc") -> Any:
    """The text as one uint8 array: ``"pydoc"`` (CPython's help() pages) or a file's bytes."""
    import numpy as np

    if data == "pydoc":
        from benchmarks import char_transformer

        return char_transformer.load_text()
    path = pathlib.Path(data)
    if not path.is_file():
        raise ValueError(f"`--data` must be 'pydoc' or a text file, got {data!r}")
    return np.frombuffer(path.read_bytes(), np.uint8)


class Task:
    """The text split, the model (params and loss) and the batches every recipe shares."""

    def __init__(self, args: argparse.Namespace, devices: int):
        import jax
        import numpy as np
        from flax import nnx

        from benchmarks import char_transformer as ct

        text = load_text(args.data)
        cut = int(0.9 * len(text))
        self.train_text, self.eval_text = text[:cut], text[cut:]
        self.context, self.per_device, self.n = args.context, args.batch_per_device, devices
        # The batches' seed: --batch-seed where given (another order of the same text for
        # the same initialization), else --seed.
        self.seed = args.seed if getattr(args, "batch_seed", None) is None else args.batch_seed

        def make_model():
            return ct.CharTransformer(
                context=args.context,
                d=args.d_model,
                layers=args.layers,
                heads=args.heads,
                rngs=nnx.Rngs(args.seed),
            )

        self.graphdef = nnx.graphdef(nnx.eval_shape(make_model))
        self.params = jax.device_get(jax.jit(lambda: nnx.state(make_model()))())
        self.eval_tokens = self.sample(np.random.default_rng(12345), self.eval_text, 256)
        self._eval = jax.jit(self.loss)
        self.reset()

    def reset(self) -> None:
        import numpy as np

        self.rng = np.random.default_rng(self.seed)

    def sample(self, rng, source, size):
        import numpy as np

        starts = rng.integers(0, len(source) - self.context - 1, size)
        return np.stack([source[s : s + self.context + 1] for s in starts]).astype(np.int32)

    def batch(self):
        """The next global batch (every recipe draws the same sequence of batches)."""
        return self.sample(self.rng, self.train_text, self.n * self.per_device)

    def loss(self, p, tokens):
        import optax
        from flax import nnx

        logits = nnx.merge(self.graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def eval_loss(self, p) -> float:
        import jax.numpy as jnp

        return float(self._eval(p, jnp.asarray(self.eval_tokens)))


# --------------------------------------------------------------------------- one run


def build(task: Task, recipe: Recipe, run: Run, fixed: int | None = None):
    """``(step, params, state, put)``: the jitted ``shard_map`` step of ``recipe``; with
    ``fixed`` the periodic state's step count is that constant (one sync pattern compiled)."""
    import jax
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    n = task.n
    if recipe.kind == "dp":
        mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
        tx = recipe.make(run, AXIS)
        state = jc.sharded_init(tx, task.params, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)
        params = jax.device_put(task.params, NamedSharding(mesh, P()))

        def step(p, s, tokens):
            loss, g = jax.value_and_grad(task.loss)(jax.lax.pcast(p, AXIS, to="varying"), tokens)
            if not recipe.averages:
                g = jax.lax.pmean(g, AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, jax.lax.pmean(loss, AXIS)

        pspec, batch_spec = P(), P(AXIS)
    else:
        m = recipe.replicas or n
        if n % m:
            raise ValueError(f"{m} replicas do not divide {n} devices")
        mesh = jax.make_mesh((m, n // m), (REPLICA, AXIS), axis_types=(AxisType.Explicit,) * 2)
        tx = recipe.make(run, REPLICA)
        state = jc.sharded_init(tx, task.params, mesh, REPLICA)
        specs = jc.state_specs(state, REPLICA)
        params = jc.replica_params(task.params, mesh, REPLICA)

        def step(r, s, tokens):
            if fixed is not None:
                s = jc.at_count(s, fixed)
            # Varying over the data axis too: no implicit all-reduce by grad.
            p = jc.own(r)
            local = jax.lax.pcast(p, AXIS, to="varying")
            loss, g = jax.value_and_grad(task.loss)(local, tokens)
            g = jax.lax.pmean(g, AXIS)  # plain data parallel inside the replica
            u, s = tx.update(g, s, p)
            return jc.slot(optax.apply_updates(p, u)), s, jax.lax.pmean(loss, (REPLICA, AXIS))

        pspec, batch_spec = P(REPLICA), P((REPLICA, AXIS))
    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(pspec, specs, batch_spec), out_specs=(pspec, specs, P())
        ),
        donate_argnums=(0, 1),
    )
    sharding = NamedSharding(mesh, batch_spec)
    return fn, params, state, lambda b: jax.device_put(b, sharding)


def lowered(fn, *args) -> list:
    """The collectives of ``fn``'s lowered program, ring-model bytes per device (as
    ``jc.comm_report``'s ``logical``), read without compiling it."""
    import jax

    from jaxcomp._src.accounting import parse_stablehlo_collectives

    return parse_stablehlo_collectives(fn.lower(*args).as_text(), jax.device_count())


def branch_bytes(recipe: Recipe, run: Run, fn, params, state, sample) -> dict:
    """Bytes per step of a step with one ``lax.cond`` / ``lax.switch`` between exchanges: each
    branch's bytes from the step's own lowered program, weighted by how often it runs.

    0/1 Adam with ``variance_rounds="coded"`` takes its variance rounds' float32 mean gradient
    in a ``lax.cond`` of its own beside the switch (branches: the other rounds, the variance
    rounds): weighted by the variance rounds' share, its bytes count in the "variance" regime.
    """
    import jaxcomp as jc

    report = jc.comm_report(fn, params, state, sample)
    counts = [0] * len(recipe.branches)
    for t in range(run.steps):
        counts[recipe.branches.index(recipe.regime(run, t))] += 1
    conditionals = report.logical_conditionals
    main = next((c.index for c in conditionals if c.num_branches == len(counts)), 0)
    others = [c for c in conditionals if c.index != main]
    if others and ("variance" not in recipe.branches or any(c.num_branches != 2 for c in others)):
        raise ValueError(
            f"the step has conditionals of {[c.num_branches for c in others]} branches"
            " beside the regime switch, and only 0/1 Adam's variance cond (2 branches, a "
            "'variance' regime) is known here: give its branches' weights in branch_bytes"
        )
    others = [c.index for c in others]
    variance = counts[recipe.branches.index("variance")] if others else 0
    weights = {main: counts, **{k: [run.steps - variance, variance] for k in others}}
    b = report.mean_bytes_per_device(weights, logical=True)
    each = report.branch_bytes(logical=True)
    regime = {name: each[main, i] for i, name in enumerate(recipe.branches)}
    for k in others:
        regime["variance"] += each[k, 1]
    return {
        "bytes_per_step": b,
        "slow_bytes_per_step": b,
        "regime_bytes": regime,
        "regime_steps": dict(zip(recipe.branches, counts, strict=True)),
    }


def step_bytes(task: Task, recipe: Recipe, run: Run, fn, params, state, sample) -> dict:
    """Bytes per step averaged over the run (see the module docstring)."""
    import optax

    from jaxcomp._src.periodic import schedule as exchanges

    if recipe.kind == "replica":
        inner = task.n // (recipe.replicas or task.n)
        patterns: dict[tuple, int] = {}
        for c in range(run.steps):
            key = exchanges(c, **{"sync_every": 1, **(recipe.schedule or {})})
            patterns[key] = patterns.get(key, 0) + 1
        total = slow = 0.0
        by_pattern = {}
        for key, count in patterns.items():
            c0 = next(c for c in range(run.steps) if exchanges(c, **recipe.schedule) == key)
            f, p, s, _ = build(task, recipe, run, fixed=c0)
            ops = lowered(f, p, s, sample)
            every = sum(c.bytes_per_device for c in ops)
            # Collectives inside one replica (group of `inner` devices) run on its fast link.
            across = sum(c.bytes_per_device for c in ops if inner == 1 or c.group_size != inner)
            by_pattern[str(key)] = {"bytes": every, "slow": across}
            total += every * count
            slow += across * count
        return {
            "bytes_per_step": total / run.steps,
            "slow_bytes_per_step": slow / run.steps,
            "bytes_by_pattern": by_pattern,
        }
    if recipe.branches:
        return branch_bytes(recipe, run, fn, params, state, sample)
    if recipe.regimes:
        regime_bytes = {}
        for name, make in recipe.regimes.items():
            if make is None:
                regime_bytes[name] = 0.0
                continue
            one = Recipe(lambda r, a, make=make: optax.chain(make(r, a), optax.sgd(0.0)))
            f, p, s, _ = build(task, one, run)
            regime_bytes[name] = sum(c.bytes_per_device for c in lowered(f, p, s, sample))
        taken: dict[str, int] = {}
        for t in range(run.steps):
            k = recipe.regime(run, t)
            taken[k] = taken.get(k, 0) + 1
        b = sum(regime_bytes[k] * c for k, c in taken.items()) / run.steps
        return {
            "bytes_per_step": b,
            "slow_bytes_per_step": b,
            "regime_bytes": regime_bytes,
            "regime_steps": taken,
        }
    b = sum(c.bytes_per_device for c in lowered(fn, params, state, sample))
    return {"bytes_per_step": b, "slow_bytes_per_step": b}


def train(task: Task, name: str, recipe: Recipe, run: Run, eval_every: int) -> dict:
    import jax
    import numpy as np

    import jaxcomp as jc

    t0 = time.perf_counter()
    fn, params, state, put = build(task, recipe, run)
    task.reset()
    sample = put(task.batch())
    task.reset()
    wire = step_bytes(task, recipe, run, fn, params, state, sample)
    setup = time.perf_counter() - t0

    def model(p):
        host = jax.device_get(p)
        if recipe.kind == "dp":
            return host
        if recipe.evaluate == "first":
            return jax.tree.map(lambda x: x[0], host)
        return jc.mean_replica(host)

    curve, evals, step_seconds = [], [], []
    start = time.perf_counter()
    for t in range(run.steps):
        t1 = time.perf_counter()
        params, state, loss = jax.block_until_ready(fn(params, state, put(task.batch())))
        step_seconds.append(time.perf_counter() - t1)
        curve.append(float(loss))
        if (t + 1) % eval_every == 0 or t + 1 == run.steps:
            evals.append((t + 1, task.eval_loss(model(params))))
    seconds = time.perf_counter() - start
    final = jax.device_get(params)
    spread = 0.0
    if recipe.kind == "replica":
        spread = max(float(np.abs(a - a.mean(0)).max()) for a in jax.tree.leaves(final))
    return {
        "recipe": name,
        "kind": recipe.kind,
        "replicas": (recipe.replicas or task.n) if recipe.kind == "replica" else 1,
        "note": recipe.note,
        "eval_loss": evals[-1][1],
        "evals": evals,
        "final_train_loss": float(np.mean(curve[-20:])),
        "curve": curve,
        "replica_spread": spread,
        "train_seconds": seconds,
        "step_seconds": step_seconds,
        "setup_seconds": setup,
        **wire,
    }


# --------------------------------------------------------------------------- modelled time

LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}  # bits per second of the modelled slow link


def step_compute(r: dict) -> float:
    """A run's measured wall seconds per step: the median of ``step_seconds`` (older results:
    ``train_seconds / steps``)."""
    import statistics

    times = r.get("step_seconds")
    return statistics.median(times) if times else r["train_seconds"] / len(r["curve"])


def steps_to_loss(curve: list[float], target: float, window: int = 20) -> int | None:
    """The first step count whose ``window``-step mean training loss is at most ``target``
    (None: never in the run); the same mean as a run's ``final_train_loss``."""
    for t in range(window, len(curve) + 1):
        if sum(curve[t - window : t]) / window <= target:
            return t
    return None


def modelled_seconds(
    r: dict, target: float, bits_per_second: float, compute: float | None = None
) -> float | None:
    """MODELLED (not measured) wall seconds until run ``r`` reaches training loss ``target``
    on a link of ``bits_per_second``: ``steps * (compute + 8 bytes / bandwidth)``.

    ``steps`` from the measured loss curve (:func:`steps_to_loss`), ``bytes`` the measured
    ``slow_bytes_per_step`` (ring model, averaged over the run), ``compute`` seconds per step
    (None: the run's own :func:`step_compute`). No overlap of compute and communication, no
    latency: a model for comparing recipes, not a measurement of a network.
    """
    steps = steps_to_loss(r["curve"], target)
    if steps is None:
        return None
    compute = step_compute(r) if compute is None else compute
    return steps * (compute + 8.0 * r["slow_bytes_per_step"] / bits_per_second)


# --------------------------------------------------------------------------- output


def finish(runs: list[dict]) -> None:
    """Gaps and byte ratios against the ``adamw`` run."""
    base = next((r for r in runs if r["recipe"] == "adamw"), None)
    if base is None:
        return
    for r in runs:
        r["gap"] = r["eval_loss"] / base["eval_loss"] - 1.0
        r["bytes_ratio"] = base["bytes_per_step"] / max(r["slow_bytes_per_step"], 1e-9)


def print_table(runs: list[dict]) -> None:
    print(f"{'recipe':28s}{'eval':>8s}{'gap':>8s}{'B/step':>12s}{'fewer':>9s}{'s':>6s}")
    for r in runs:
        print(
            f"{r['recipe']:28s}{r['eval_loss']:8.4f}{100 * r.get('gap', math.nan):7.1f}%"
            f"{r['slow_bytes_per_step']:12.0f}{r.get('bytes_ratio', math.nan):8.1f}x"
            f"{r['train_seconds']:6.0f}"
        )


def draw(runs: list[dict], path: pathlib.Path) -> None:
    import numpy as np

    def one(ax):
        for r in runs:
            c = np.asarray(r["curve"])
            k = max(1, len(c) // 30)
            smooth = np.convolve(c, np.ones(k) / k, mode="valid")
            ax.plot(
                np.arange(len(smooth)) + k, smooth, label=f"{r['recipe']} ({r['eval_loss']:.3f})"
            )
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats per byte)")
        ax.legend(fontsize=7)

    common.plot(path, one, "LM benchmark: train loss (held-out loss in the legend)")


def resumed_environment(before: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    """``now`` (this run's environment), its ``command`` kept as the file's first command and
    ``commands`` listing every command that wrote the file, the first first (a ``--resume``
    adds one; ``before``: the file's environment, None for a new file)."""
    if not before:
        return {**now, "commands": [now["command"]]}
    earlier = before.get("commands") or [before["command"]]
    commands = [*earlier, now["command"]]
    return {**now, "command": earlier[0], "commands": commands}


def result_file(before: dict, environment: dict, config: dict, runs: list[dict]) -> dict:
    """The result file a run writes: ``before`` (the file it resumes, ``{}`` for a new one)
    keeps its ``merged`` list, the commands whose runs were joined into it (an ``adamw``
    row added with ``--baseline-from``), so a ``--resume`` does not drop where they came
    from."""
    out = {"environment": environment, "config": config, "runs": runs}
    if before.get("merged"):
        out["merged"] = list(before["merged"])
    return out


def run_config(args: argparse.Namespace) -> dict:
    """The config written with the results (``baseline_lr`` only where it differs)."""
    config = {k: getattr(args, k) for k in (*CONFIGS["cpu"], "data", "seed")}
    if getattr(args, "batch_seed", None) is not None:
        config["batch_seed"] = args.batch_seed
    if args.baseline_lr is not None and args.baseline_lr != args.lr:
        config["baseline_lr"] = args.baseline_lr
    return config


def same_run(config: dict) -> dict:
    """What makes the recipes' runs of two result files comparable (the baseline's lr
    aside: merged runs are measured against the baseline of the file merged into)."""
    return {k: v for k, v in config.items() if k != "baseline_lr"}


def adamw_config(config: dict) -> dict:
    """The config ``adamw`` ran with in a result file: its lr ``baseline_lr``, else ``lr``."""
    rest = {k: v for k, v in config.items() if k not in ("lr", "baseline_lr")}
    return {**rest, "lr": config.get("baseline_lr", config["lr"])}


def tuned_baseline(data: dict, other: pathlib.Path) -> dict:
    """The ``adamw`` run of ``other``, a result file whose AdamW ran with the config ``data``'s
    would run it with (:func:`adamw_config`): the baseline of recipes run with
    ``--no-baseline`` (``--baseline-from``), e.g. at AdamW's tuned lr (``--lr``) against a
    file whose recipes ran at another (``--baseline-lr``)."""
    import json

    extra = json.loads(other.read_text())
    if adamw_config(extra["config"]) != adamw_config(data["config"]):
        raise ValueError(
            f"{other}'s AdamW ran another config: {adamw_config(extra['config'])} != "
            f"{adamw_config(data['config'])} (the lr: baseline_lr, else lr)"
        )
    data.setdefault("merged", []).append(f"{extra['environment']['command']} (its adamw run)")
    return next(r for r in extra["runs"] if r["recipe"] == "adamw")


def merge(
    path: pathlib.Path,
    runs: list[dict],
    others: list[pathlib.Path],
    label: str | None = None,
    baseline: pathlib.Path | None = None,
) -> int:
    """Add the runs of ``others`` (result files of the same config, e.g. run in parallel
    processes) to ``path``'s, a recipe already there kept, and redraw. ``label``: the
    merged runs are named ``recipe@label`` and may differ from ``path``'s config in ``lr``
    (e.g. the baseline's lr sweep: ``--merge lm_lr6e-3.json --label lr6e-3``). ``baseline``:
    a file whose ``adamw`` run (at this file's ``lr``) becomes the first row where there is
    none (:func:`tuned_baseline`)."""
    import json

    data = json.loads(path.read_text()) if path.exists() else None
    for other in others:
        extra = json.loads(other.read_text())
        data = data or extra
        mine, theirs = same_run(data["config"]), same_run(extra["config"])
        if label:
            mine, theirs = {**mine, "lr": None}, {**theirs, "lr": None}
        if mine != theirs:
            raise ValueError(f"{other} ran another config: {extra['config']} != {data['config']}")
        new = [{**r, "recipe": f"{r['recipe']}@{label}"} if label else r for r in extra["runs"]]
        runs += [r for r in new if all(r["recipe"] != q["recipe"] for q in runs)]
        data.setdefault("merged", []).append(extra["environment"]["command"])
    if baseline is not None and all(r["recipe"] != "adamw" for r in runs):
        runs.insert(0, tuned_baseline(data, baseline))
    finish(runs)
    data["runs"] = runs
    print_table(runs)
    common.write_json(path, data)
    draw(runs, path.with_suffix(".png"))
    return 0


def rebytes(path: pathlib.Path, runs: list[dict], task: Task, run: Run, names: list[str]) -> int:
    """Recompute the bytes per step of the runs of ``names`` in ``path`` (no training)."""
    import json

    for r in runs:
        if r["recipe"] in names:
            recipe = RECIPES[r["recipe"]]
            fn, params, state, put = build(task, recipe, run)
            task.reset()
            r.update(step_bytes(task, recipe, run, fn, params, state, put(task.batch())))
    finish(runs)
    data = json.loads(path.read_text())
    data["runs"] = runs
    print_table(runs)
    common.write_json(path, data)
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = common.arg_parser(
        __doc__,
        writes="lm.json and lm.png (lm_quick.* with --quick, lm_TAG.* with --tag)",
        takes=(
            "2-10 min per recipe with the cpu config on 8 CPU devices of a loaded 2-core "
            "machine (hours for every recipe); --quick a few minutes"
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: the cpu config for {QUICK_STEPS} steps, recipes {QUICK_RECIPES} "
        "unless --recipes; writes lm_quick.*",
    )
    parser.add_argument(
        "--config", choices=tuple(CONFIGS), default=None, help="model and run size (None: cpu)"
    )
    parser.add_argument(
        "--recipes", nargs="+", default=None, help="names in RECIPES (None: every one)"
    )
    parser.add_argument("--data", default="pydoc", help="'pydoc' or a UTF-8 text file")
    for k in ("d_model", "layers", "heads", "context", "batch_per_device", "steps"):
        parser.add_argument(
            "--" + k.replace("_", "-"), type=int, default=None, help="None: the config's"
        )
    parser.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate")
    parser.add_argument(
        "--baseline-lr",
        type=float,
        default=None,
        help="the adamw baseline's peak lr (None: --lr; the recipes keep --lr)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialization and batches")
    parser.add_argument(
        "--batch-seed",
        type=int,
        default=None,
        help="the batches' seed where it differs from --seed (None: --seed)",
    )
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    parser.add_argument("--tag", default=None, help="write lm_TAG.json instead")
    parser.add_argument("--resume", action="store_true", help="keep the recipes already run")
    parser.add_argument(
        "--label",
        default=None,
        help="with --merge: name the merged runs RECIPE@LABEL (their lr may differ)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="run only --recipes, without the adamw baseline (for parallel processes whose "
        "files are joined with --merge into one that has it)",
    )
    parser.add_argument(
        "--bytes-only",
        action="store_true",
        help="recompute the bytes of --recipes in the output file (lowering only) and exit",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="add the runs of these result files (same config) to the output and exit",
    )
    parser.add_argument(
        "--baseline-from",
        default=None,
        help="add the adamw run of this result file (its AdamW run with the output's AdamW "
        "config: --baseline-lr, else --lr) to the output where it has none, and exit",
    )
    args = parser.parse_args(argv)
    config = dict(CONFIGS[args.config or "cpu"])
    if args.quick:
        config["steps"] = QUICK_STEPS
        args.recipes = args.recipes or QUICK_RECIPES
    for k, v in config.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    unknown = [r for r in args.recipes or () if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; known: {list(RECIPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)  # only where there is no accelerator
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)  # XLA:CPU collectives
    name = "lm" + (f"_{args.tag}" if args.tag else "")
    path = common.result_path(name, args.quick)
    runs: list[dict] = []
    before: dict[str, Any] = {}
    if (args.resume or args.merge or args.baseline_from or args.bytes_only) and path.exists():
        import json

        before = json.loads(path.read_text())
        runs = before["runs"]
    if args.merge or args.baseline_from:
        others = [pathlib.Path(m) for m in args.merge or ()]
        baseline = args.baseline_from and pathlib.Path(args.baseline_from)
        return merge(path, runs, others, args.label, baseline)
    task = Task(args, jax.device_count())
    run = Run(args.steps, args.lr, jax.device_count(), args.baseline_lr)
    if args.bytes_only:
        return rebytes(path, runs, task, run, args.recipes or [])
    names = args.recipes or list(RECIPES)
    has_baseline = "adamw" in names or any(r["recipe"] == "adamw" for r in runs)
    if not (has_baseline or args.no_baseline):
        names = ["adamw", *names]
    out = None  # stays None when every recipe asked for is in the file already
    for recipe_name in names:
        if any(r["recipe"] == recipe_name for r in runs):
            continue
        t0 = time.perf_counter()
        r = train(task, recipe_name, RECIPES[recipe_name], run, args.eval_every)
        runs.append(r)
        finish(runs)
        print(
            f"{recipe_name}: held-out {r['eval_loss']:.4f}  gap {100 * r.get('gap', 0):+.1f}%  "
            f"{r['slow_bytes_per_step']:.0f} B/step  {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        environment = resumed_environment(before.get("environment"), common.environment())
        out = result_file(before, environment, run_config(args), runs)
        common.write_json(path, out, quiet=True)
    print_table(runs)
    if out is not None:
        common.write_json(path, out)
        draw(runs, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
