"""Rank :func:`jaxcomp.autotune`'s candidates by whole training steps, and predict the rest.

Given the user's loss and a batch, each checked candidate is compiled into the step it would
run (gradients, the candidate's exchange with its error feedback, the optimizer, the update;
params and state donated) and timed for several steps. Timed alone, an exchange misleads: in
a step the collectives share the cores with the backward pass, overlap some of it or fuse
with the update, differently for each strategy (docs/autotune.md, "Whole steps", has the
measurements). The step is what the user runs, so the step is what is ranked
(:func:`select_step`); ties within the timing noise (:func:`tied_steps`) are timed again,
interleaved, and what is still tied goes to the least CPU per step, then the least codec
work (:func:`settle_tie`); and every candidate gets a predicted step
(:func:`calibrate_steps`): the compute fitted from the measured plain step, the exchange
from the link model, its codec passes and its feedback passes each scaled on the timed
steps (:func:`fit_step_scales`) of codecs of the same wire kind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import autotune as tuning
from jaxcomp._src.autotune import Candidate

#: Untimed warm-up steps before the timed ones (the first runs allocate the donated buffers).
WARMUP_STEPS = 2
#: Bounds of the fitted in-step scale of the codec passes (calibrate_steps): below 0 the
#: step hides more of the exchange than the passes cost alone (they overlap the backward).
PASS_RANGE = (-1.0, 10.0)
#: Bounds of the fitted in-step scale of the error-feedback passes (calibrate_steps).
FEEDBACK_RANGE = (0.0, 10.0)


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
    takes ``grad loss_fn(params, *its batch)``, then ``optax.chain(exchange, optimizer)``
    with the exchange :meth:`jaxcomp.AutotunePlan.transform` runs for ``row``
    (:func:`jaxcomp._src.autotune.plain_transform` for plain ``pmean``, else
    ``jc.compressed_allreduce(codec, axis_name, error_feedback=..., strategy=...,
    bucket_bytes=..., min_size=...)``); then ``optax.apply_updates``. A trace or compile
    error raises here, on this process alone, before any data moves.

    Returns:
      ``(compiled, tx)``: the program and the transform whose state it takes
      (:func:`jaxcomp.sharded_init` of ``tx``).
    """
    tx = optax.chain(tuning._exchange_tx(row, axis_name), optimizer)
    return step_lowered(params, batch, mesh, axis_name, tx, loss_fn).compile(), tx


def step_lowered(params, batch, mesh, axis_name, tx, loss_fn) -> Any:
    """The training step of ``tx`` (exchange and optimizer chained), lowered from abstract
    shapes: ``(params, state, *batch) -> (params, state)``, params and state donated
    (:func:`step_program` compiles it)."""
    state, specs = tuning.abstract_state(tx, params, mesh, axis_name)

    def step(p, s, *b):
        g = jax.grad(loss_fn)(jax.lax.pcast(p, axis_name, to="varying"), *b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    from jaxcomp._src.sharding import without_empty

    in_specs = (P(), specs, *[P(axis_name)] * len(batch))
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=_replicated(mesh)),
        params,
    )
    # Empty leaves go in as None (StepRunner drops them likewise): jaxlib 0.11.2's XLA:CPU
    # segfaults on a zero-element operand of a shard_map (docs/errors.md).
    fill, operands = without_empty(step, (abstract, state, *batch))
    fn = jax.shard_map(fill, mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    return jax.jit(fn, donate_argnums=(0, 1)).lower(*operands)


def _replicated(mesh: Any) -> NamedSharding:
    return NamedSharding(mesh, P())


class StepRunner:
    """A compiled step with its own params and state, fed back from step to step. Made, the
    params' copy and the state exist (blocked on): an allocation that fails raises here,
    before the step's collectives run."""

    def __init__(self, program: tuple, params: Any, batch: tuple, mesh, axis_name):
        from jaxcomp._src.sharding import init_state

        self.program, self.batch = program, batch
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=_replicated(mesh))
        self.params = copy(params)  # the step donates them: never the caller's arrays
        self.state = init_state(program[1], self.params, mesh, axis_name)
        jax.block_until_ready((self.params, self.state))
        self.times: list[float] = []  # wall seconds of each timed step
        self.cpu: list[float] = []  # this process's CPU seconds (every thread) of each

    def run(self, steps: int, timed: bool) -> None:
        from jaxcomp._src.sharding import drop_empty

        for _ in range(steps):
            args = drop_empty((self.params, self.state, *self.batch))
            t0, c0 = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(self.program[0](*args))
            self.params, self.state = out
            if timed:
                self.times.append(time.perf_counter() - t0)
                self.cpu.append(time.process_time() - c0)


def step_stats(seconds: Sequence[float]) -> tuple[float, float]:
    """``(median ms, interquartile range ms)`` of step times in seconds."""
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    q25, q50, q75 = np.percentile(ms, [25, 50, 75])
    return float(q50), float(q75 - q25)


def tied_steps(rows: Sequence[Candidate]) -> list[Candidate]:
    """The timed rows whose step is within the timing noise of the fastest one.

    With ``m_r`` a row's median step, ``s_r`` the interquartile range of its timed steps
    (every step the max over processes, :meth:`_Timer.stats`, so every process computes the
    same rows) and ``b`` the fastest row, ``r`` ties ``b`` where::

        m_r - m_b <= max(TIE * m_b, s_r, s_b)

    The spread is the noise within one timing; :data:`jaxcomp._src.autotune.TIE` (5%) is the
    noise between timings that a few steps do not show (the same step timed twice in one
    run can swap places with another: docs/autotune.md, "How ties are broken", has the
    measurements). Failed rows never tie.

    Args:
      rows: candidates, ``step_ms`` NaN where no step was timed.

    Returns:
      The tied rows, the fastest first, then by median step ([] when fewer than two rows
      are timed or none ties the fastest). Pure: tested on tables alone.

    Example::

      tied_steps(plan.table)   # [] where the fastest step is clearly the fastest
    """
    timed = sorted((r for r in rows if _finite(r.step_ms) and not r.error), key=lambda r: r.step_ms)
    if len(timed) < 2:
        return []
    best = timed[0]

    def noise(r: Candidate) -> float:
        return max(tuning.TIE * best.step_ms, r.step_spread_ms, best.step_spread_ms)

    tied = [r for r in timed[1:] if r.step_ms - best.step_ms <= noise(r)]
    return [best, *tied] if tied else []


def tie_key(r: Candidate) -> tuple[float, float, float]:
    """The order of tied steps whose CPU time does not settle them (:func:`settle_tie`): the
    least codec work, then the fewest wire bytes, then the faster median.

    ``(codec_model_ms, bytes_per_device, step_ms)``: ``codec_model_ms`` is the encode,
    decode and error-feedback passes one exchange runs, as timed alone (plain ``pmean``: 0,
    so plain wins such a tie: compression that does not measurably pay is not taken). At 2
    devices the all-gather and the two phases send the same bytes and the all-gather runs
    the fewer passes (one encode and two decodes against 1.5 and 2: the owner re-encodes
    its sum), so it comes first.

    Args:
      r: a timed row.

    Returns:
      ``(codec_model_ms, bytes_per_device, step_ms)``, the smaller preferred.

    Example::

      min(tied_steps(plan.table), key=tie_key)
    """
    return (r.codec_model_ms, r.bytes_per_device, r.step_ms)


def settle_tie(tied: Sequence[Candidate]) -> Candidate:
    """The row a tie of measured steps goes to: the least CPU time per step, then
    :func:`tie_key`.

    With ``c_r`` a row's median CPU time per step (``step_cpu_ms``: every thread of the
    process, so the codec passes, the copies of the collectives and the compute; the max
    over processes) and ``q_r`` its interquartile range::

        least  = argmin_{r in tied} c_r
        kept   = {r in tied : c_r - c_least <= max(TIE * c_least, q_r, q_least)}
        chosen = argmin_{r in kept} tie_key(r)

    (the same noise as :func:`tied_steps`' on the wall clock: a few steps' spread, at least
    :data:`jaxcomp._src.autotune.TIE` of the least).

    Two steps whose wall times the timing cannot tell apart may still load the host
    differently, and on a host whose cores run both the step and its exchange the one that
    costs less CPU is the faster one once the wall clock is quiet (CPU time counts this
    process's own work, not the time it waits for the cores or the link): int8 with its
    residual in two phases runs a re-encode and a second memory that its all-gather does
    not (``benchmarks/exchange_cpu.py`` measures both; docs/autotune.md, "How ties are
    broken", has the figures). Rows within the CPU noise, and rows without a CPU time
    (exchanges timed alone, recorded tables), are settled by :func:`tie_key` alone.

    Args:
      tied: the tied rows (:func:`tied_steps`), at least one.

    Returns:
      The chosen row; the same on every process (the times are reduced first).

    Example::

      settle_tie(tied_steps(plan.table))
    """
    tied = list(tied)
    if all(_finite(r.step_cpu_ms) for r in tied):
        least = min(tied, key=lambda r: r.step_cpu_ms)
        floor = tuning.TIE * least.step_cpu_ms
        noise = np.nan_to_num([[r.step_cpu_spread_ms, least.step_cpu_spread_ms] for r in tied])
        tied = [
            r for r, q in zip(tied, noise.max(axis=1), strict=True)
            if r.step_cpu_ms - least.step_cpu_ms <= max(q, floor)
        ]  # fmt: skip
    return min(tied, key=tie_key)


def select_step(rows: Sequence[Candidate]) -> Candidate:
    """The row whose measured step is fastest, a tie going to the least work.

    With ``b`` the row of the fastest median step and ``T`` the rows tied with it within the
    timing noise (:func:`tied_steps`)::

        chosen = b               if T is empty
                 settle_tie(T)   otherwise

    :func:`jaxcomp.autotune` times the tied rows again, interleaved (one step of each in
    turn, from fresh params and state, so drift on the host hits all alike), before this
    choice; rows still within the noise are a coin flip on wall time alone, and
    :func:`settle_tie` (the least CPU time per step, then the least codec work) settles them
    the same way on every process.
    Plain ``pmean`` is a timed row like the others: the plan is never a step measured slower
    than plain ``pmean``'s beyond the noise.

    Args:
      rows: candidates, ``step_ms`` NaN where no step was timed.

    Returns:
      The chosen row.

    Raises:
      ValueError: no row has a measured step.

    Example::

      best = select_step(plan.table)   # plan.table[0]

    Reference: on timings biased by their setup beyond their spread, Mytkowicz et al.,
    "Producing Wrong Data Without Doing Anything Obviously Wrong!", ASPLOS 2009.
    """
    timed = [r for r in rows if _finite(r.step_ms) and not r.error]
    if not timed:
        raise ValueError("`rows` must hold at least one row with a measured step (step_ms)")
    tied = tied_steps(timed)
    return settle_tie(tied) if tied else min(timed, key=lambda r: r.step_ms)


def fit_step_scales(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """The in-step scales ``(k_pass, k_fb)`` minimizing ``sum (y - k_pass p - k_fb f)^2`` over
    the points ``(p, f, y)``, clipped to :data:`PASS_RANGE` and :data:`FEEDBACK_RANGE` (where
    one is clipped the other is refitted with it fixed).

    ``p``: a timed step's codec passes timed alone (encode, decode), ``f``: its error-feedback
    passes timed alone, ``y``: its step less the fitted compute and its modelled wire. Where
    no point has feedback ``k_fb = 1`` (no step informs it: the standalone passes) and
    ``k_pass`` is fitted alone; where the two columns are collinear (one point, or every
    point with the same mix) one scale ``k = sum (p+f) y / sum (p+f)^2`` serves both;
    without points ``(1, 1)``.

    Args:
      points: ``(p, f, y)`` in ms per timed compressed step (:func:`calibrate_steps`).

    Returns:
      ``(k_pass, k_fb)``.

    Example::

      fit_step_scales([(300.0, 0.0, -180.0), (200.0, 170.0, 50.0)])   # (-0.6, 1.0)

    Reference: ordinary least squares (Gauss), here over the steps, as the alpha-beta fit of
    :func:`jaxcomp._src.autotune.measure_link` is over the collectives.
    """
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    p, f, y = pts.T
    pp, ff, pf = p @ p, f @ f, p @ f
    if not pp + ff:
        return 1.0, 1.0
    if not ff:
        return float(np.clip(p @ y / pp, *PASS_RANGE)), 1.0
    if pp * ff - pf * pf <= 1e-9 * pp * ff:  # collinear: one scale for both
        kp = kf = (p + f) @ y / ((p + f) @ (p + f))
    else:
        kp, kf = np.linalg.solve([[pp, pf], [pf, ff]], [p @ y, f @ y])
    if not PASS_RANGE[0] <= kp <= PASS_RANGE[1]:
        kp = float(np.clip(kp, *PASS_RANGE))
        kf = f @ (y - kp * p) / ff
    if not FEEDBACK_RANGE[0] <= kf <= FEEDBACK_RANGE[1]:
        kf = float(np.clip(kf, *FEEDBACK_RANGE))
        kp = float(np.clip(p @ (y - kf * f) / pp, *PASS_RANGE)) if pp else kp
    return float(kp), float(kf)


def _parts(r: Candidate) -> tuple[float, float, float]:
    """``(wire, codec passes, feedback passes)`` of ``r``'s model, ms."""
    fb = r.feedback_model_ms
    return r.model_ms - r.codec_model_ms, r.codec_model_ms - fb, fb


def _widened(r: Candidate) -> bool:
    """Whether the backend moves ``r``'s payload wider than its own type (bf16 on XLA:CPU)."""
    return r.widen > 1.0


def _fitted_on(timed: Sequence[Candidate], r: Candidate) -> list[Candidate]:
    """The timed steps whose scales predict ``r`` (:func:`calibrate_steps`): every other one,
    but for a codec the backend moves at its own width only the others of that kind (all the
    others where there are none)."""
    others = [t for t in timed if t is not r]
    own = [t for t in others if not _widened(t)]
    return others if _widened(r) or not own else own


def calibrate_steps(rows: Sequence[Candidate]) -> list[Candidate]:
    """``predicted_step_ms`` and ``predicted_ms`` of every row from the timed steps.

    With ``S_0`` plain ``pmean``'s measured step, and for a row ``r`` its modelled wire
    ``w_r = model_ms - codec_model_ms`` (the link model,
    :func:`jaxcomp._src.autotune.predict_seconds`), its codec passes ``p_r`` (encode,
    decode) and error-feedback passes ``f_r = feedback_model_ms``, as timed alone::

        compute      = max(0, S_0 - w_0)               (plain step less its modelled wire)
        exchange_r   = max(0, w_r + k_pass p_r + k_fb f_r)
        predicted_r  = compute + exchange_r

    ``(k_pass, k_fb)`` (:func:`fit_step_scales`) are least squares
    ``S_t - compute - w_t = k_pass p_t + k_fb f_t`` over the other timed steps of the same
    wire kind as ``r`` (a link model whose plain wire exceeds the plain step, as on small
    trees, leaves a compute of 0, so no step is predicted below 0). In a step the passes do
    not cost what they cost alone: a cast's encode and decode fuse with the backward pass and
    the update, and part of the exchange runs while the backward pass computes, so ``k_pass``
    comes out near 0 or negative; the residual memory's read and write of the whole gradient
    does not hide (``k_fb`` near 1). One scale for both would let the feedback rows pull the
    casts' scale up. A codec the backend moves at its own width (fp16, int8) is fitted on the
    other such steps alone: a codec whose payload the backend widens (``widen > 1``,
    :func:`jaxcomp._src.autotune.wire_widths`: bf16 on XLA:CPU, converted to float32 on each
    side of every collective) runs converts that do not fuse into the step the same way, and
    its steps' scale swings from run to run, pulling the others' fit with it. A widened
    codec's step is predicted from every other timed step (docs/autotune.md, "How the steps
    are predicted", has the fitted scales and the measured errors, with and without the
    split). A timed row's own step never enters its scales (leave-one-out), so its
    predicted against measured step is a fair test; plain ``pmean`` is the anchor
    (predicted = measured). Without a measured plain step the rows are returned unchanged.

    Args:
      rows: the candidates, ``step_ms`` NaN where no step was timed.

    Returns:
      The rows in the same order, ``predicted_step_ms`` and ``predicted_ms`` (the exchange's
      share of the step) set.

    Example::

      rows = jaxcomp._src.autotune_steps.calibrate_steps(plan.table)

    Reference: the alpha-beta model of Hockney, Parallel Computing 1994, with the codec's
    passes added as in Agarwal et al., "On the Utility of Gradient Compression in Distributed
    Training Systems", MLSys 2022, their in-step cost fitted on the timed steps.
    """
    plain = next((r for r in rows if r.codec is None and _finite(r.step_ms)), None)
    if plain is None:
        return list(rows)
    compute = max(0.0, plain.step_ms - _parts(plain)[0])
    timed = [r for r in rows if r.codec is not None and _finite(r.step_ms) and not r.error]
    out = []
    for r in rows:
        if r is plain or r.error or not _finite(r.model_ms):
            out.append(
                r._replace(predicted_step_ms=r.step_ms, predicted_ms=r.step_ms - compute)
                if r is plain
                else r
            )
            continue
        points = [
            (p, f, t.step_ms - compute - w)
            for t, (w, p, f) in ((t, _parts(t)) for t in _fitted_on(timed, r))
        ]
        k_pass, k_fb = fit_step_scales(points)
        w, p, f = _parts(r)
        exchange = max(0.0, w + k_pass * p + k_fb * f)
        out.append(r._replace(predicted_ms=exchange, predicted_step_ms=compute + exchange))
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
        self.cpu: dict[tuple, list[float]] = {}  # CPU seconds of each (StepRunner.cpu)

    def time(self, row: Candidate) -> Candidate:
        """``row`` with its step timed (``WARMUP_STEPS`` then ``reps``), or its error. Three
        stages, every process agreeing after each before the next
        (:func:`jaxcomp._src.autotune._agreed`): compile, make the params' copy and the
        state, run; so a candidate that fails to build on one process is skipped by all and
        none waits in its collectives."""
        params, batch, mesh, axis_name = self.args
        runner, err = tuning._agreed(
            lambda _: step_program(params, batch, mesh, axis_name, row, self.loss_fn,
                                   self.optimizer),
            lambda program: StepRunner(program, params, batch, mesh, axis_name),
            self._warm_and_time,
        )  # fmt: skip
        if err:
            return row._replace(error=err, step_ms=math.nan)
        self.programs[_key(row)], self.times[_key(row)] = runner.program, runner.times
        self.cpu[_key(row)] = runner.cpu
        return self.stats(row)  # the runner, its params and state, freed here

    def _warm_and_time(self, runner: StepRunner) -> StepRunner:
        """``runner`` after ``WARMUP_STEPS`` untimed steps and ``reps`` timed ones."""
        runner.run(WARMUP_STEPS, timed=False)
        runner.run(self.reps, timed=True)
        return runner

    def again(self, rows: Sequence[Candidate]) -> str:
        """``reps`` more steps of each of ``rows``, interleaved (drift hits all alike), each
        from fresh params and state after ``WARMUP_STEPS``; their times join the first ones.
        The runners are made first and agreed on over processes, then run. Returns "" or
        the failure (the first times are kept)."""

        def run(runners: list[StepRunner]) -> list[StepRunner]:
            for runner in runners:
                runner.run(WARMUP_STEPS, timed=False)
            for _ in range(self.reps):
                for runner in runners:
                    runner.run(1, timed=True)
            return runners

        runners, err = tuning._agreed(
            lambda _: [StepRunner(self.programs[_key(r)], *self.args) for r in rows], run
        )
        for r, runner in zip(rows, runners or (), strict=False):
            self.times[_key(r)] = self.times[_key(r)] + runner.times
            self.cpu[_key(r)] = self.cpu[_key(r)] + runner.cpu
        return err

    def stats(self, row: Candidate) -> Candidate:
        """``row`` with the median and interquartile range of its timed steps' wall and CPU
        times, each step's the max over processes (every process gets the same row)."""
        both = np.stack([self.times[_key(row)], self.cpu[_key(row)]])
        times, cpu = tuning._reduce_over_processes(both)
        (median, spread), (cpu_ms, cpu_spread) = step_stats(times), step_stats(cpu)
        return row._replace(
            step_ms=median, step_spread_ms=spread, step_reps=len(times), step_cpu_ms=cpu_ms,
            step_cpu_spread_ms=cpu_spread,
        )  # fmt: skip


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
    return tuning.elapsed_over_processes(t0)


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
        err = timer.again(tied)  # on failure: the first timings
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
