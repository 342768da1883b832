"""Rank :func:`jaxcomp.autotune`'s candidates by whole training steps, and predict the rest.

Given the user's loss and a batch, each checked candidate is compiled into the step it would
run (gradients, the candidate's exchange with its error feedback, the optimizer, the update;
params and state donated) and timed for several steps. Timed alone, an exchange misleads: in
a step the collectives share the cores with the backward pass, overlap some of it or fuse
with the update, differently for each strategy (docs/autotune.md, "Whole steps", has the
measurements). The step is what the user runs, so the step is what is ranked
(:func:`select_step`), ties within the timing noise are settled by more repeats
(:func:`tied_steps`), and every candidate gets a predicted step (:func:`calibrate_steps`):
the compute fitted from the measured plain step, the exchange from the link model, the codec
passes scaled on the timed steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import autotune as tuning
from jaxcomp._src import skeleton
from jaxcomp._src.autotune import Candidate

#: Untimed warm-up steps before the timed ones (the first runs allocate the donated buffers).
WARMUP_STEPS = 2
#: Bounds of the fitted codec-pass scale ``kappa`` (calibrate_steps).
KAPPA_RANGE = (0.0, 10.0)


def _finite(x: float) -> bool:
    return not math.isnan(x)


def check_step_args(loss_fn: Any, batch: Any, optimizer: Any) -> tuple:
    """``(batch as a tuple, optimizer)`` after checking :func:`jaxcomp.autotune`'s step
    arguments (all None: the exchange is timed alone)."""
    if loss_fn is None:
        if batch is not None or optimizer is not None:
            raise ValueError(
                "`batch` and `optimizer` time whole steps and need `loss_fn=` "
                "(loss_fn(params, *batch) -> scalar) beside them"
            )
        return (), None
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be a function loss_fn(params, *batch), got {loss_fn!r}")
    if batch is None:
        raise ValueError(
            "`batch` is needed with `loss_fn`: a tuple of arrays whose leading dimension is "
            "split over `axis_name` (the global batch of one step)"
        )
    batch = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
    optimizer = optax.sgd(1e-3) if optimizer is None else optimizer
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"`optimizer` must be an optax GradientTransformation, got {optimizer!r}")
    return batch, optimizer


def place_batch(batch: tuple, mesh: Any, axis_name: Any) -> tuple:
    """``batch`` laid out as :func:`step_program` takes it: every leaf's leading dimension
    split over ``axis_name`` (``NamedSharding(mesh, P(axis_name))``; a leaf already laid out
    so is not copied). Host arrays (NumPy) are accepted: on several processes each passes
    the same global values.

    Args:
      batch: the arrays (or trees of arrays) of one step's global batch.
      mesh: the mesh the steps run on.
      axis_name: the data-parallel axis (or axes) of ``mesh`` the batch is split over.

    Returns:
      ``batch`` with every leaf a ``jax.Array`` laid out ``P(axis_name)``.

    Example::

      batch = place_batch((x, y), mesh, "data")   # x, y: [global batch, ...]

    Raises:
      ValueError: naming ``batch``, where a leaf has no leading dimension divisible by the
        ``n`` devices of ``axis_name``.
    """
    n = math.prod(mesh.shape[a] for a in tuning._names(axis_name))
    for leaf in jax.tree.leaves(batch):
        shape = np.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"`batch` must hold arrays whose leading dimension is split over `axis_name` "
                f"{axis_name!r} ({n} devices), a multiple of {n}; got a leaf of shape {shape}"
            )
    return jax.device_put(batch, NamedSharding(mesh, P(axis_name)))


def step_program(params, batch, mesh, axis_name, row: Candidate, loss_fn, optimizer) -> Any:
    """``row``'s training step, compiled ahead of time from abstract shapes.

    ``(params, state, *batch) -> (params, state)``, params and state donated: each device
    takes ``grad loss_fn(params, *its batch)``, then plain ``pmean`` (the float32 mean of
    every leaf) and ``optimizer`` for the plain row, else
    ``optax.chain(jc.compressed_allreduce(codec, axis_name, error_feedback=..., strategy=...,
    bucket_bytes=..., min_size=...), optimizer)``; then ``optax.apply_updates``. A trace or
    compile error raises here, on this process alone, before any data moves.

    Returns:
      ``(compiled, tx)``: the program and the transform whose state it takes
      (:func:`jaxcomp.sharded_init` of ``tx``).
    """
    from jaxcomp._src.sharding import abstract_init, state_specs

    exchange = None if row.codec is None else tuning._exchange_tx(row, axis_name)
    tx = optimizer if exchange is None else optax.chain(exchange, optimizer)
    specs = state_specs(abstract_init(tx, params, mesh, axis_name), axis_name)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        jax.eval_shape(init, params),
        specs,
    )

    def step(p, s, *b):
        g = jax.grad(loss_fn)(jax.lax.pcast(p, axis_name, to="varying"), *b)
        if exchange is None:
            g = skeleton.tree_pmean(g, axis_name)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    in_specs = (P(), specs, *[P(axis_name)] * len(batch))
    fn = jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=_replicated(mesh)),
        params,
    )
    return jax.jit(fn, donate_argnums=(0, 1)).lower(abstract, state, *batch).compile(), tx


def _replicated(mesh: Any) -> NamedSharding:
    return NamedSharding(mesh, P())


class StepRunner:
    """A compiled step with its own params and state, fed back from step to step."""

    def __init__(self, compiled: Callable, tx: Any, params: Any, batch: tuple, mesh, axis_name):
        from jaxcomp._src.sharding import sharded_init

        self.compiled, self.batch = compiled, batch
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=_replicated(mesh))
        self.params = copy(params)  # the step donates them: never the caller's arrays
        self.state = sharded_init(tx, self.params, mesh, axis_name)
        self.times: list[float] = []

    def run(self, steps: int, timed: bool) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.compiled(self.params, self.state, *self.batch))
            self.params, self.state = out
            if timed:
                self.times.append(time.perf_counter() - t0)


def step_stats(seconds: Sequence[float]) -> tuple[float, float]:
    """``(median ms, interquartile range ms)`` of step times in seconds."""
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    q25, q50, q75 = np.percentile(ms, [25, 50, 75])
    return float(q50), float(q75 - q25)


def tied_steps(rows: Sequence[Candidate]) -> list[Candidate]:
    """The timed rows whose step is within the timing noise of the fastest one.

    With ``m_r`` a row's median step and ``s_r`` its interquartile range, ``r`` ties the
    fastest ``b`` where ``m_r - m_b <= max(s_r, s_b)``. Returns them, the fastest first ([]
    when fewer than two rows are timed or none ties); pure, tested on tables alone.
    """
    timed = sorted((r for r in rows if _finite(r.step_ms)), key=lambda r: r.step_ms)
    if len(timed) < 2:
        return []
    best = timed[0]
    tied = [
        r
        for r in timed[1:]
        if r.step_ms - best.step_ms <= max(r.step_spread_ms, best.step_spread_ms)
    ]
    return [best, *tied] if tied else []


def select_step(rows: Sequence[Candidate]) -> Candidate:
    """The row whose measured step is fastest (median over its timed steps).

    Plain ``pmean`` has no preference: it is one timed row among the others, so the plan
    never runs a step slower than plain ``pmean``'s as measured. Rows tied within the noise
    (:func:`tied_steps`) are timed again by :func:`jaxcomp.autotune` before this choice, and
    the faster median after the repeats wins; an exact tie goes to the least codec work.

    Raises:
      ValueError: no row has a measured step.
    """
    timed = [r for r in rows if _finite(r.step_ms) and not r.error]
    if not timed:
        raise ValueError("`rows` must hold at least one row with a measured step (step_ms)")
    return min(timed, key=lambda r: (r.step_ms, r.codec_model_ms))


def fit_kappa(points: Sequence[tuple[float, float]]) -> float:
    """The codec passes' scale ``kappa`` minimizing ``sum (y - kappa * c)^2`` over the points
    ``(c, y)``, clipped to :data:`KAPPA_RANGE`; 1 (the standalone passes) without points.

    Example::

      fit_kappa([(500.0, 40.0), (250.0, 15.0)])   # 0.0733...
    """
    return tuning.fit_scale(points, *KAPPA_RANGE)


def calibrate_steps(rows: Sequence[Candidate]) -> list[Candidate]:
    """``predicted_step_ms`` and ``predicted_ms`` of every row from the timed steps.

    With ``S_0`` plain ``pmean``'s measured step, ``w_r = model_ms - codec_model_ms`` a row's
    wire time in the link model (:func:`jaxcomp._src.autotune.predict_seconds`) and
    ``c_r = codec_model_ms`` its codec passes timed alone::

        compute      = S_0 - w_0                    (the plain step less its modelled exchange)
        exchange_r   = w_r + kappa * c_r
        predicted_r  = compute + exchange_r

    ``kappa`` (what the codec passes cost inside a step against alone: they fuse with the
    sum, the update and each other, and a cast may run slower fused than alone) is least
    squares ``S_t - S_0 - (w_t - w_0) = kappa c_t`` over the other timed steps of the same
    codec where there are some, else over every other timed compressed step. A timed row's
    own step never enters its ``kappa`` (leave-one-out), so its predicted against measured
    step is a fair test; plain ``pmean`` is the anchor (predicted = measured). Without a measured
    plain step the rows are returned unchanged. The wire is taken from the link model as
    fitted: scaling it too (a second factor) fits two noisy steps exactly and extrapolates
    to negative compute.

    Args:
      rows: the candidates, ``step_ms`` NaN where no step was timed.

    Returns:
      The rows in the same order, ``predicted_step_ms`` and ``predicted_ms`` (the exchange's
      share of the step) set.

    Example::

      rows = jaxcomp._src.autotune_steps.calibrate_steps(plan.table)

    Reference: the alpha-beta model of Hockney, Parallel Computing 1994, with the codec's
    passes added as in Agarwal et al., "On the Utility of Gradient Compression in Distributed
    Training Systems", MLSys 2022 (a step is compute plus an exchange that does not overlap).
    """
    plain = next((r for r in rows if r.codec is None and _finite(r.step_ms)), None)
    if plain is None:
        return list(rows)
    w0 = plain.model_ms - plain.codec_model_ms
    timed = [r for r in rows if r.codec is not None and _finite(r.step_ms) and not r.error]
    out = []
    for r in rows:
        if r is plain or r.error or not _finite(r.model_ms):
            out.append(
                r._replace(predicted_step_ms=r.step_ms, predicted_ms=w0) if r is plain else r
            )
            continue
        others = [t for t in timed if t is not r]
        same = [t for t in others if t.codec == r.codec]  # the codec's own scale where known
        k = fit_kappa(
            [
                (t.codec_model_ms, t.step_ms - plain.step_ms - (t.model_ms - t.codec_model_ms - w0))
                for t in same or others
            ]
        )
        exchange = r.model_ms - r.codec_model_ms + k * r.codec_model_ms
        out.append(
            r._replace(predicted_ms=exchange, predicted_step_ms=plain.step_ms - w0 + exchange)
        )
    return out


def _key(r: Candidate) -> tuple:
    return r.name, r.strategy, r.bucket_bytes, r.min_size, r.error_feedback


class _Timer:
    """Times candidates' steps for :func:`stepped_plan`; every decision is agreed over
    processes. Each candidate's params and state live only while its steps run (one
    candidate's at a time, a tie's while it is timed again): the compiled programs and the
    step times are kept, so timing ``check`` candidates holds one extra copy of the params
    and the optimizer and feedback state, not ``check``."""

    def __init__(self, params, batch, mesh, axis_name, loss_fn, optimizer, reps):
        self.args = params, batch, mesh, axis_name
        self.loss_fn, self.optimizer, self.reps = loss_fn, optimizer, reps
        self.programs: dict[tuple, tuple] = {}  # (compiled step, tx) per timed row
        self.times: dict[tuple, list[float]] = {}  # seconds of each timed step

    def time(self, row: Candidate) -> Candidate:
        """``row`` with its step timed (``WARMUP_STEPS`` then ``reps``), or its error."""
        params, batch, mesh, axis_name = self.args
        compiled, err = tuning._guarded(
            lambda: step_program(params, batch, mesh, axis_name, row, self.loss_fn, self.optimizer)
        )
        if not err:
            runner, err = tuning._guarded(lambda: self._start(compiled))
        if err:
            return row._replace(error=err, step_ms=math.nan)
        self.programs[_key(row)], self.times[_key(row)] = compiled, runner.times
        return self.stats(row)  # the runner, its params and state, freed here

    def _start(self, program: tuple) -> StepRunner:
        """A runner of ``program`` from the params, warmed up, then ``reps`` steps timed."""
        params, batch, mesh, axis_name = self.args
        runner = StepRunner(*program, params, batch, mesh, axis_name)
        runner.run(WARMUP_STEPS, timed=False)
        runner.run(self.reps, timed=True)
        return runner

    def again(self, rows: Sequence[Candidate]) -> None:
        """``reps`` more steps of each of ``rows``, interleaved (drift hits all alike), each
        from fresh params and state after ``WARMUP_STEPS``; their times join the first ones."""
        params, batch, mesh, axis_name = self.args
        runners = []
        for r in rows:
            runners.append(StepRunner(*self.programs[_key(r)], params, batch, mesh, axis_name))
            runners[-1].run(WARMUP_STEPS, timed=False)
        for _ in range(self.reps):
            for runner in runners:
                runner.run(1, timed=True)
        for r, runner in zip(rows, runners, strict=True):
            self.times[_key(r)] = self.times[_key(r)] + runner.times

    def stats(self, row: Candidate) -> Candidate:
        times = tuning._reduce_over_processes(np.asarray(self.times[_key(row)]))
        median, spread = step_stats(times)
        return row._replace(step_ms=median, step_spread_ms=spread, step_reps=len(times))


def _next_row(rows: list[Candidate], timed: set) -> Candidate | None:
    """The untimed row to time next: a codec and strategy not timed yet before another bucket
    size or ``min_size`` of a timed one (those differ by little), then the best predicted step
    (calibrate_steps on the steps timed so far), the model's time where there is none."""
    left = [r for r in rows if r.codec is not None and not r.error and _key(r) not in timed]
    if not left:
        return None
    pairs = {k[:2] for k in timed}
    return min(
        left,
        key=lambda r: (
            _key(r)[:2] in pairs,
            np.nan_to_num(r.predicted_step_ms, nan=np.inf),
            r.model_ms,
        ),
    )


def _elapsed(t0: float) -> float:
    return float(tuning._reduce_over_processes(np.array([time.perf_counter() - t0]))[0])


def stepped_plan(rows, check, budget_s, timer: _Timer, link) -> tuning.AutotunePlan:
    """Time plain ``pmean``'s step and ``check`` candidates' (the best predicted of each codec,
    then the best predicted steps), time the ties again, choose (:func:`select_step`)."""
    t0, rows = time.perf_counter(), list(rows)
    order = tuning._to_check(rows, check)
    firsts = [r for i, r in enumerate(order) if all(q.codec != r.codec for q in order[:i])]
    timed: set = set()

    def time_row(r: Candidate) -> None:
        timed.add(_key(r))
        rows[rows.index(r)] = timer.time(r)

    for r in firsts:  # plain first, so the budget never skips it
        if r.codec is None or _elapsed(t0) <= budget_s:
            time_row(r)
    while len(timed) <= check and _elapsed(t0) <= budget_s:
        rows = calibrate_steps(rows)
        r = _next_row(rows, timed)
        if r is None:
            break
        time_row(r)
    tied = tied_steps(rows)
    if tied and _elapsed(t0) <= budget_s:
        _, err = tuning._guarded(lambda: timer.again(tied))  # on failure: the first timings
        rows = [timer.stats(r) if not err and any(r is t for t in tied) else r for r in rows]
    return _plan(calibrate_steps(rows), link)


def _plan(rows: list[Candidate], link) -> tuning.AutotunePlan:
    """The plan of :func:`select_step`'s row; the table: chosen, timed steps fastest first,
    untimed by predicted step, failed last."""
    if not any(_finite(r.step_ms) for r in rows):
        reasons = "; ".join(f"{r.name} {r.strategy}: {r.error}" for r in rows if r.error)
        raise RuntimeError(f"jc.autotune: every timed candidate failed ({reasons})")
    best = select_step(rows)
    rest = sorted(
        (r for r in rows if r is not best),
        key=lambda r: (bool(r.error), not _finite(r.step_ms), np.nan_to_num(r.step_ms, nan=0.0),
                       np.nan_to_num(r.predicted_step_ms, nan=np.inf)),
    )  # fmt: skip
    strategy = "auto" if best.codec is None else best.strategy
    return tuning.AutotunePlan(
        best.codec, strategy, best.bucket_bytes, best.min_size, (best, *rest), link,
        error_feedback=best.error_feedback,
    )  # fmt: skip
