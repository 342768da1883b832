"""PowerSGD: low-rank gradient all-reduce with warm starts and error feedback.

Every gradient matrix ``M`` (``n x m``) is replaced by a rank-``r`` approximation found by
one step of subspace (power) iteration, and only the two thin factors travel::

    P = M Q                 # n x r, all-reduced (round 1)
    P = orthogonalize(P)
    Q = M^T P               # m x r, all-reduced (round 2)
    M_hat = P Q^T / n_dev   # the mean gradient, projected on span(P)

Same-shaped matrices are batched, and the factors of *all* matrices travel together: a
steady-state step issues exactly two all-reduces, however many layers the model has (the
small leaves ride along with the first one). The reference is Vogels, Karimireddy and
Jaggi, 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (NeurIPS), https://arxiv.org/abs/1905.13727.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import collectives, feedback, shards, skeleton
from jaxcomp._src import layout as layouts
from jaxcomp._src.codecs.base import check_int, is_number, max_abs_over, safe_divide, scaled_norm

_HIGHEST = jax.lax.Precision.HIGHEST


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Fields mirror the gradient tree, None at leaves that are not sent low-rank; each low-rank
    leaf is seen as an ``n x m`` matrix (:func:`matrix_view`) of rank ``r``. Same-shaped
    matrices are stacked for the work (:attr:`Plan.groups`), never in the state.

    Attributes:
      error: per device, f32[1, *leaf.shape] per low-rank leaf: M_i - P P^T M_i; None if off
      q: the same on every device, f32[m, r] per low-rank leaf (n x m view); None if cold
      key: uint32[2], the same on every device; split every step
      count: int32[]: number of updates applied (plain pmean until start_step)
    """

    error: Any
    q: Any
    key: chex.PRNGKey
    count: jax.Array

    PER_DEVICE_FIELDS = ("error",)


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a leaf is seen as: all dimensions but the last flattened, ``(n, m)``.

    A dense kernel ``(in, out)`` stays as it is; a conv kernel ``(H, W, I, O)`` becomes
    ``(H*W*I, O)``; a ``(d, heads, head_dim)`` attention kernel becomes ``(d*heads, head_dim)``.
    """
    return int(np.prod(shape[:-1])), int(shape[-1])


def compression_rate(shape: tuple[int, ...], rank: int) -> float:
    """``n m / ((n + m) r)``: floats of the matrix over floats of its factors (``r`` clamped)."""
    if len(shape) < 2:
        return 1.0
    n, m = matrix_view(shape)
    r = min(rank, n, m)
    return n * m / ((n + m) * r) if r else 1.0


@dataclasses.dataclass(frozen=True)
class Group:
    """Low-rank leaves of one matrix shape, handled as one ``(B, n, m)`` batch."""

    n: int
    m: int
    rank: int  # min(rank, n, m)
    members: tuple[int, ...]  # positions among the layout's compressed leaves

    @property
    def batch(self) -> int:
        return len(self.members)

    @property
    def p_size(self) -> int:
        return self.batch * self.n * self.rank

    @property
    def q_size(self) -> int:
        return self.batch * self.m * self.rank


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static plan of one gradient tree: which leaves are low-rank, and their batches.

    ``layout`` groups leaves as :mod:`jaxcomp._src.layout` does; its ``compressed`` leaves are
    the low-rank ones, its ``plain`` leaves go through plain ``pmean``.
    """

    layout: layouts.Layout
    groups: tuple[Group, ...]

    @property
    def p_size(self) -> int:
        """Floats of all P factors: what round 1 sends besides the plain leaves."""
        return sum(g.p_size for g in self.groups)

    @property
    def q_size(self) -> int:
        """Floats of all Q factors: what round 2 sends."""
        return sum(g.q_size for g in self.groups)

    @property
    def plain_size(self) -> int:
        """Floats of the plain leaves."""
        return sum(self._plain_sizes)

    @property
    def _plain_sizes(self) -> list[int]:
        return [
            int(np.prod(s))
            for s, g in zip(self.layout.shapes, self.layout.groups, strict=True)
            if g == layouts.PLAIN
        ]


def plan_of(
    tree: Any,
    rank: int,
    *,
    min_size: int = 1024,
    min_compression_rate: float = 2.0,
    mask: Any = None,
    batch_same_shape: bool = True,
) -> Plan:
    """The :class:`Plan` of :func:`powersgd` for ``tree`` (arrays or ShapeDtypeStructs)."""
    allowed = layouts.resolve_mask(mask, tree)
    lowrank = jax.tree.map(
        lambda leaf, ok: (
            bool(ok)
            and np.ndim(leaf) >= 2
            and compression_rate(tuple(np.shape(leaf)), rank) >= min_compression_rate
        ),
        tree,
        allowed,
    )
    layout = layouts.layout_of(tree, min_size, lowrank)
    shapes = [
        s for s, g in zip(layout.shapes, layout.groups, strict=True) if g == layouts.COMPRESSED
    ]
    members: dict[Any, list[int]] = {}
    for i, shape in enumerate(shapes):
        members.setdefault(matrix_view(shape) if batch_same_shape else i, []).append(i)
    groups = []
    for idx in members.values():
        n, m = matrix_view(shapes[idx[0]])
        groups.append(Group(n, m, min(rank, n, m), tuple(idx)))
    return Plan(layout, tuple(groups))


def orthogonalize(p: jax.Array, epsilon: float = 1e-3) -> jax.Array:
    """Gram-Schmidt: orthonormal columns spanning the leading columns of ``p`` (``(..., n, r)``).

    In float32. Each column is first scaled to unit norm (by its largest entry first, so
    tiny or huge gradients neither underflow nor overflow), then the earlier columns are
    projected out twice ("twice is enough"). If what is left has norm ``<= epsilon``, the
    column is linearly dependent on the earlier ones (to working precision) and is zeroed
    instead of divided by (almost) zero: a zero matrix gives zeros and fp16/bf16 inputs
    never give NaN. The tolerance must stay well above float32 rounding (``~1e-7 sqrt(n)``):
    normalizing a residual that is only rounding noise gives a column that is not orthogonal
    to the others, and the error compounds column after column (seen on attention-layer
    gradients with ``1e-8``). A dropped column held at most ``epsilon**2`` of its energy,
    and error feedback keeps it. Rank 1 is plain normalization.

    Pure XLA ops (a loop over the ``r`` columns): no LAPACK call, whose batched CPU kernel
    can deadlock against the collectives of a multi-device CPU program.
    """
    p = p.astype(jnp.float32)

    def normalize(v, tol):  # (..., n)
        norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
        keep = norm > tol
        return v * jnp.where(keep, 1.0 / jnp.where(keep, norm, 1.0), 0.0)

    p = jnp.swapaxes(p, -1, -2)  # (..., r, n)
    biggest = jnp.max(jnp.abs(p), axis=-1, keepdims=True)
    # safe_divide: a plain divide by a largest entry above 2^126 multiplies by a subnormal
    # reciprocal, which XLA:CPU flushes to 0 (a column of such entries became zeros)
    p = normalize(safe_divide(p, biggest), 0.0)  # unit (or zero) rows
    if p.shape[-2] == 1:
        return jnp.swapaxes(p, -1, -2)

    def column(j, basis):  # basis: (..., r, n); rows j.. are still zero
        v = jax.lax.dynamic_index_in_dim(p, j, axis=-2, keepdims=False)
        for _ in range(2):
            coef = jnp.einsum("...rn,...n->...r", basis, v, precision=_HIGHEST)
            v = v - jnp.einsum("...rn,...r->...n", basis, coef, precision=_HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(basis, normalize(v, epsilon), j, axis=-2)

    basis = jax.lax.fori_loop(0, p.shape[-2], column, jnp.zeros_like(p))
    return jnp.swapaxes(basis, -1, -2)


def _flat(arrays: list[jax.Array]) -> jax.Array:
    parts = [a.reshape(-1) for a in arrays]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


def _split(vector: jax.Array, sizes: list[int]) -> list[jax.Array]:
    offsets = np.cumsum([0, *sizes]).tolist()
    return [vector[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _leaves_of(tree: Any, layout: layouts.Layout, kind: str) -> list[jax.Array]:
    return [leaf for leaf, g in zip(jax.tree.leaves(tree), layout.groups, strict=True) if g == kind]


def _stack(plan: Plan, leaves: list[jax.Array], shape_of) -> list[jax.Array]:
    """Per-leaf arrays (low-rank leaves, in order) as float32 batches, one per group."""
    return [
        jnp.stack([leaves[i].reshape(shape_of(g)).astype(jnp.float32) for i in g.members])
        for g in plan.groups
    ]


def _unstack(plan: Plan, batches: list[jax.Array]) -> list[jax.Array]:
    """Inverse of :func:`_stack`: per-leaf arrays (low-rank leaves, in order)."""
    out: list[Any] = [None] * sum(g.batch for g in plan.groups)
    for g, b in zip(plan.groups, batches, strict=True):
        for j, i in enumerate(g.members):
            out[i] = b[j]
    return out


def _random_q(plan: Plan, key: jax.Array) -> list[jax.Array]:
    """A random ``(m, r)`` start for every low-rank leaf (drawn per group)."""
    batches = [
        jax.random.normal(jax.random.fold_in(key, i), (g.batch, g.m, g.rank), jnp.float32)
        for i, g in enumerate(plan.groups)
    ]
    return _unstack(plan, batches)


def _orthogonalize_groups(plan: Plan, ps: list[jax.Array], epsilon: float) -> list[jax.Array]:
    """:func:`orthogonalize` every group's ``(B, n, r)`` batch: one call per ``(n, r)``."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for k, g in enumerate(plan.groups):
        by_shape.setdefault((g.n, g.rank), []).append(k)
    out: list[Any] = [None] * len(ps)
    for ks in by_shape.values():
        done = orthogonalize(
            jnp.concatenate([ps[k] for k in ks]) if len(ks) > 1 else ps[ks[0]], epsilon
        )
        offsets = np.cumsum([0] + [plan.groups[k].batch for k in ks]).tolist()
        for k, a, b in zip(ks, offsets[:-1], offsets[1:], strict=True):
            out[k] = done[a:b] if len(ks) > 1 else done
    return out


def _unit_columns(q: jax.Array, old: jax.Array) -> jax.Array:
    """``q``'s columns (``(B, m, r)``, over ``m``) at unit norm, to warm-start the next step.

    Only their directions matter (the scale cancels in :func:`orthogonalize`). The norm is
    taken after dividing by the column's largest entry, as :func:`orthogonalize` does: the
    plain ``sqrt(sum q^2)`` overflows to inf from entries of ~1.8e19 (one large finite
    gradient value), and ``q / inf`` is a zero column from which power iteration never
    recovers. A zero column keeps its old direction for the same reason. A finite column
    whose norm itself passes float32's range (entries near 3e38) is divided by its largest
    entry and then by the norm of that.
    """
    norm = scaled_norm(q, axis=1, keepdims=True)
    keep = norm > 0
    unit = safe_divide(q, max_abs_over(q, axis=1))
    over = jnp.isinf(norm) & jnp.all(jnp.isfinite(q), axis=1, keepdims=True)
    unit = safe_divide(unit, jnp.sqrt(jnp.sum(unit * unit, axis=1, keepdims=True)))
    return jnp.where(keep, jnp.where(over, unit, safe_divide(q, norm)), old)


def _two_rounds(plan, ms, plain, q, axis_name, n_dev, warm_start, epsilon):
    """PowerSGD on the ``(B, n, m)`` batches ``ms`` and plain pmean of the ``plain`` vector.

    Returns (mean batches ``P (Q / n)^T``, the factors ``(P, M_i^T P)`` of this device's share
    of them, plain mean, next q, bad). The error batches ``M_i - P (M_i^T P)^T`` are formed by
    the caller (:func:`_errors`).
    """
    # Round 1: P_i = M_i Q for every matrix, and the plain leaves, in one all-reduce.
    # Each device's part divided by n before the sums (exact for n a power of two): a mean
    # that fits float32 never overflows in them, and P's scale cancels in orthogonalize.
    ps = [jnp.einsum("bnm,bmr->bnr", a, b, precision=_HIGHEST) for a, b in zip(ms, q, strict=True)]
    round1 = jax.lax.psum(jnp.concatenate([plain, _flat(ps)]) / n_dev, axis_name)
    plain_mean, p_sum = round1[: plain.shape[0]], round1[plain.shape[0] :]
    ps = _split(p_sum, [g.p_size for g in plan.groups])
    ps = [a.reshape(g.batch, g.n, g.rank) for g, a in zip(plan.groups, ps, strict=True)]
    ps = _orthogonalize_groups(plan, ps, epsilon)

    # Round 2: Q_i = M_i^T P for every matrix, in one all-reduce.
    local = [
        jnp.einsum("bnm,bnr->bmr", a, b, precision=_HIGHEST) for a, b in zip(ms, ps, strict=True)
    ]
    q_sum = jax.lax.psum(_flat(local) / n_dev, axis_name)  # the mean Q, divided first
    qn = _split(q_sum, [g.q_size for g in plan.groups])
    qn = [a.reshape(g.batch, g.m, g.rank) for g, a in zip(plan.groups, qn, strict=True)]

    means = [_outer(a, b) for a, b in zip(ps, qn, strict=True)]
    bad = collectives.local_nonfinite((round1, q_sum))
    next_q = tuple(map(_unit_columns, qn, q)) if warm_start else ()
    return means, (ps, local), plain_mean, next_q, bad


def _errors(ms, shares) -> list[jax.Array]:
    """This device's error batches ``M_i - P (M_i^T P)^T`` from :func:`_two_rounds`'s factors."""
    return [m - _outer(a, b) for m, a, b in zip(ms, *shares, strict=True)]


def _outer(p: jax.Array, q: jax.Array) -> jax.Array:
    """``P Q^T`` of ``(B, n, r)`` and ``(B, m, r)`` batches: ``(B, n, m)``."""
    return jnp.einsum("bnr,bmr->bnm", p, q, precision=_HIGHEST)


def _dense_sums(plan, ms, plain, q_old, axis_name, n_dev):
    """The warm-up's exchange (:func:`_two_rounds`'s outputs, the matrices' sums in place of
    their means, zero factors): every matrix and the plain vector summed by one all-reduce of
    their tuple (no concatenated copy). The non-finite flag is that of the sums (a sum is
    finite exactly where ``sum / n`` is), read here: the branch's only gradient-sized
    output is the sums, so their partial sums (an eighth of each matrix) fit beside them."""
    sums = jax.lax.psum((plain, *ms), axis_name)
    shares = (
        [jnp.zeros((g.batch, g.n, g.rank), jnp.float32) for g in plan.groups],
        [
            skeleton.varying_like(jnp.zeros((g.batch, g.m, g.rank), jnp.float32), ms[0])
            for g in plan.groups
        ],
    )
    plain_mean = sums[0] / n_dev
    bad = collectives.local_nonfinite((plain_mean, sums[1:]))
    return list(sums[1:]), shares, plain_mean, tuple(q_old), bad


def _exchange(plan, ms, plain, q_old, warm, key, axis_name, n_dev, warm_start, epsilon):
    """The step's exchange: (mean batches, this device's error batches, plain mean, next
    ``q``, non-finite flag). :func:`_two_rounds`, or during the warm-up (``warm``, a traced
    bool; False: no warm-up branch) :func:`_dense_sums`, chosen by ``lax.cond``.

    The cond returns the means (the warm-up: the sums, divided by ``n`` after the cond; a
    division inside would write a second buffer beside the sum) and the small factors of
    this device's share ``P (M_i^T P)^T``. The new memory ``M_i - share`` (zero in the
    warm-up, but for a narrow leaf's output rounding) is formed after the cond, into the old
    memory's donated buffer: formed in the compressing branch, it was a second
    gradient-sized output beside the means and ``M_i`` (the cond's operand). A branch that
    returned its input (``M_i`` as the warm-up's share) would copy every matrix into the
    cond's output.
    """
    if not plan.groups:
        plain_mean = jax.lax.psum(plain / n_dev, axis_name)  # divided first: no overflow
        return [], [], plain_mean, q_old, collectives.local_nonfinite(plain_mean)

    def compress(_):
        q = q_old if warm_start else _stack(plan, _random_q(plan, key), lambda g: (g.m, g.rank))
        return _two_rounds(plan, ms, plain, q, axis_name, n_dev, warm_start, epsilon)

    if warm is False:
        means, shares, plain_mean, q, bad = compress(None)
        return means, _errors(ms, shares), plain_mean, q, bad
    dense = lambda _: _dense_sums(plan, ms, plain, q_old, axis_name, n_dev)
    means, shares, plain_mean, q, bad = jax.lax.cond(warm, dense, compress, None)
    means = [jnp.where(warm, m / n_dev, m) for m in means]
    errors = [jnp.where(warm, jnp.zeros((), e.dtype), e) for e in _errors(ms, shares)]
    return means, errors, plain_mean, q, bad


def powersgd(
    rank: int,
    axis_name: Any,
    *,
    start_step: int = 10,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    error_feedback: bool = True,
    orthogonalization_epsilon: float = 1e-3,
    batch_same_shape: bool = True,
    min_size: int = 1024,
    mask: Any = None,
    seed: int = 0,
    inner_axis_name: Any = None,
    param_specs: Any = None,
    shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""PowerSGD: average gradients over ``axis_name`` through rank-``r`` factors.

    Replaces the data-parallel ``pmean`` of the gradients: put it first in an optax chain,
    inside ``jax.shard_map`` (or ``jax.pmap``), and pass it the per-device gradients::

        tx = optax.chain(jc.powersgd(4, "data"), optax.sgd(0.1, momentum=0.9))

    Each leaf of rank >= 2 is seen as a matrix ``(prod(shape[:-1]), shape[-1])``. With
    error feedback, device ``i`` adds its memory, ``M_i = G_i + E_i``, and with ``Q`` the
    warm-start factor (``m x r``, the same on every device)

    .. math::

        P = \mathrm{orth}\Big(\sum_i M_i Q\Big), \qquad
        Q' = \sum_i M_i^\top P, \qquad
        \hat M = \frac{1}{n} P Q'^\top = P P^\top \frac{1}{n}\sum_i M_i, \qquad
        E_i \leftarrow M_i - P P^\top M_i .

    The output ``\hat M`` is the mean of the ``M_i`` projected on an ``r``-dimensional
    column space, identical on every device; a mean of rank ``<= r`` is reproduced exactly.
    ``P P^T M_i`` is device ``i``'s share of the output, so its memory keeps exactly what it
    could not send, and nothing is lost: ``sum_t out_t + mean_i E_i = sum_t mean_i G_i``,
    with ``out_t`` the output as returned: a bfloat16 or float16 leaf's output is
    ``cast(\hat M)``, and its rounding ``\hat M - cast(\hat M)`` (the same on every device)
    is added to every ``E_i``, in the warm-up too (a float32 leaf's memory stays zero there).
    (``torch``'s PowerSGD hook keeps ``M_i - \hat M`` instead. The outputs are the same,
    since every round sums over devices, but that memory also accumulates each device's
    deviation from the mean, a random walk that grows without bound.) ``Q'`` (its
    column directions) becomes the next step's ``Q``: one power-iteration step per training
    step, which tracks the gradient's top subspace over time.

    Each device sends ``(n + m) r`` floats per matrix instead of ``n m``: a compression rate of
    ``n m / ((n + m) r)`` (rank 4 on a 512 x 2048 MLP kernel: 102x). The factors of all
    matrices and all the small leaves travel in two all-reduces per step in total, whatever
    the number of layers. Work is in float32 (matmuls at ``Precision.HIGHEST``); each output
    leaf keeps its dtype; integer leaves pass through.

    When it pays: large dense matrices (transformers, MLPs, wide convs) over a slow link
    (Ethernet/DCN between hosts). It costs two dependent collectives instead of one and
    ``6 n m r`` flops per matrix, so on a fast interconnect (NVLink, ICI) or for small
    models plain ``pmean`` is often faster; measure with :func:`jaxcomp.comm_report` and a step
    timer. Rank 1-4 is the usual range for large CNNs and LSTMs trained with SGD and momentum
    (Vogels et al.); a small model trained for few steps needs more.

    What rank costs in loss (the character transformer of ``benchmarks/char_transformer.py``,
    run by ``benchmarks/powersgd_convergence.py``; measured: docs/convergence.md and
    docs/choosing-a-codec.md): with Adam or SGD, rank 4 ends a long run at the held-out loss
    of uncompressed training, but early on it is slower: each step moves a matrix along only
    ``r`` directions (error feedback delays the rest), and its *training* loss stays higher.
    A longer plain warm-up, a larger batch or another learning rate did not close the gap on
    short runs; a higher rank does. Raise the rank for short runs, or when the training loss
    matters. On a small GPT-style language model trained with AdamW (docs, "Language
    models over slow links: the measurements": PowerSGD with Adam, with the measured losses
    and bytes), rank ``d_model / 4`` chained before ``optax.adamw`` at data parallel's lr is the
    recommended setting; ``d_model / 8`` sends half the bytes and loses more.

    Warm-up: the first ``start_step`` steps send plain ``pmean`` (gradients change fast early
    and low-rank memory would lag). The switch is a ``jax.lax.cond`` on the step count, so
    the compiled program holds both branches and :func:`jaxcomp.comm_report` counts the
    warm-up's full all-reduce too: for the bytes of a steady-state step, report a step built
    with ``start_step=0`` (which compiles no warm-up branch).

    A non-finite gradient on any device makes the whole output NaN on every device and
    leaves the whole state unchanged, so ``optax.apply_if_finite`` can skip the step and lose
    nothing. No extra collective is needed to detect it: NaN/inf reach every device through
    the all-reduced factors.

    Args:
      rank: ``r``, the rank of the approximation (clamped to ``min(n, m)`` per matrix).
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      start_step: number of warm-up steps of plain ``pmean`` before compression starts.
      min_compression_rate: matrices whose ``n m / ((n + m) r)`` is below this go through
        plain ``pmean`` (they would save too little for the extra work). Default 2.
      warm_start: reuse last step's ``Q`` (default; far better approximations for the same
        rank). If False, a fresh random ``Q`` is drawn from the state's key every step.
      error_feedback: keep ``M_i - P P^T M_i`` per device and add it to the next gradient
        (default; without it PowerSGD is a biased compressor and training suffers).
      orthogonalization_epsilon: relative tolerance of the Gram-Schmidt step: a column of
        ``P`` that keeps at most this fraction of its norm once the earlier columns are
        projected out counts as linearly dependent and is zeroed instead of normalized
        (see :func:`orthogonalize`). Zero and fp16/bf16 gradients never give NaN. Keep it
        well above float32 rounding; 1e-3 drops directions holding < 1e-6 of a column's
        energy.
      batch_same_shape: stack same-shaped matrices into one batched matmul (default). The
        collectives are two per step either way.
      min_size: leaves with fewer elements go through plain ``pmean``.
      mask: None, a pytree of bools like the params, or a callable params -> such a tree;
        False leaves go through plain ``pmean``.
      seed: seeds the initial ``Q`` and the key in the state.
      param_specs: where params are sharded over other mesh axes than ``axis_name`` (a data
        x model mesh, ``jax.shard_map(..., axis_names={axis_name})``): a tree like the params
        of ``PartitionSpec`` (or ``NamedSharding``). Each device then compresses its own block
        of every leaf (per-block scales and selections) and keeps its memories sharded like
        the params: no gradient-sized traffic over the other axes. Build the state with
        ``jc.sharded_init(tx, params, mesh, axis_name, param_specs)``. The model axis must
        be ``AxisType.Auto``: an Explicit one is refused (the data-manual ``shard_map``
        would gather every model-sharded operand in float32); None beside an Auto axis warns.
      inner_axis_name: a fast mesh axis (devices of one host) averaged uncompressed first
        (float32 ``pmean``); PowerSGD then runs over ``axis_name`` between hosts, every device
        of a host sending the host's payload (``L`` copies per host on the outer axis; see
        :func:`jaxcomp._src.collectives.inner_mean`). The devices of a host hold the same state:
        ``jc.sharded_init(tx, params, mesh, axis_name)`` and
        ``jc.state_specs(state, axis_name)`` (per host, replicated over the inner axis).
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (HSDP: FSDP over ``"data"`` inside each group averaged over ``axis_name``), as
        :func:`jaxcomp.compressed_allreduce`'s: the non-finite flag is or-ed over it (one
        scalar ``psum``), so a non-finite shard poisons every shard's output and freezes every
        shard's state (error, ``Q``, key, count). Under ``check_vma=True`` jax's types tell
        (None works); under ``check_vma=False`` they do not, and with another manual axis
        bound beside ``axis_name`` / ``inner_axis_name`` the update warns where this is None.
        ``()``: the leaves are whole, no warning.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update returns the mean gradient.

    Raises:
      ValueError: at construction, ``rank``, ``start_step``, ``min_size``, ``seed``,
        ``min_compression_rate``, ``orthogonalization_epsilon``, ``axis_name`` or
        ``inner_axis_name`` outside its rule (the message names the argument; the rules:
        docs/errors.md).
      TypeError: at construction, ``rank``, ``start_step``, ``min_size``, ``seed``,
        ``min_compression_rate``, ``orthogonalization_epsilon``, ``warm_start``, ``error_feedback``,
        ``batch_same_shape``, ``axis_name``, ``inner_axis_name`` or ``shard_axis`` of the wrong
        kind.

    Example::

        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
        tx = optax.chain(jc.powersgd(4, "data"), optax.sgd(0.1, momentum=0.9))
        opt_state = jc.sharded_init(tx, params, mesh, "data")
        specs = jc.state_specs(opt_state, "data")  # the error memory is per device

        def step(params, opt_state, batch):
            # pcast: per-device gradients, without an implicit f32 all-reduce in grad.
            grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                     out_specs=(P(), specs)))

    :func:`plan_of` tells which leaves a tree sends low-rank and how many floats travel.

    References:
      Vogels, Karimireddy, Jaggi, 2019. PowerSGD: Practical Low-Rank Gradient Compression
      for Distributed Optimization. NeurIPS. https://arxiv.org/abs/1905.13727
    """
    collectives.check_axes(axis_name, inner_axis_name)
    shard_axis = shards.check_shard_axis(shard_axis)
    rank = check_int("rank", rank, 1)
    start_step = check_int("start_step", start_step, 0)
    min_size = check_int("min_size", min_size, 0)
    seed = check_int("seed", seed, 0)
    min_compression_rate = _check_nonnegative("min_compression_rate", min_compression_rate)
    epsilon = _check_nonnegative("orthogonalization_epsilon", orthogonalization_epsilon)
    if epsilon >= 1:
        raise ValueError(f"`orthogonalization_epsilon` must be < 1, got {epsilon}")
    for name, flag in (
        ("warm_start", warm_start),
        ("error_feedback", error_feedback),
        ("batch_same_shape", batch_same_shape),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be a bool, got {flag!r}")

    def plan(tree):
        return plan_of(
            tree,
            rank,
            min_size=min_size,
            min_compression_rate=min_compression_rate,
            mask=mask,
            batch_same_shape=batch_same_shape,
        )

    def fields(p: Plan, key: jax.Array) -> dict[str, Any]:
        layout = p.layout
        some = bool(p.groups)
        return {
            "error": skeleton.zeros_like_compressed(layout) if some and error_feedback else None,
            "q": layouts.like_compressed(layout, _random_q(p, key))
            if some and warm_start
            else None,
        }

    def init_fn(params):
        key, q_key = jax.random.split(jax.random.PRNGKey(seed))
        return PowerSGDState(key=key, count=jnp.zeros([], jnp.int32), **fields(plan(params), q_key))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n_dev = skeleton.begin("powersgd", updates, params, axis_name, inner_axis_name)
        updates = collectives.inner_mean(updates, inner_axis_name)
        p = plan(updates)
        skeleton.check_state(
            "powersgd",
            state,
            lambda: fields(p, jax.random.PRNGKey(0)),
            p.layout,
            False,
            axis_name,
            updates,
        )
        skeleton.check_per_host("powersgd", state, axis_name, inner_axis_name)
        key, step_key = jax.random.split(state.key)
        plain = _flat([a.astype(jnp.float32) for a in _leaves_of(updates, p.layout, layouts.PLAIN)])
        ms = _stack(p, _leaves_of(updates, p.layout, layouts.COMPRESSED), lambda g: (g.n, g.m))
        if error_feedback:
            # g + e in the memory's (batch, n, m) shape: XLA keeps M_i for the new memory formed
            # after the cond (g + e summed as (n, m) had it recompute M_i there from the
            # gradient, held through the exchange, into a copy of the memory).
            es = _stack(p, [e[0] for e in layouts.field_leaves(state.error)], lambda g: (g.n, g.m))
            ms = [m + e for m, e in zip(ms, es, strict=True)]
        q_old = (
            _stack(p, layouts.field_leaves(state.q), lambda g: (g.m, g.rank)) if warm_start else []
        )

        warm = state.count < start_step if start_step and p.groups else False
        means, errors, plain_mean, q, bad = _exchange(
            p, ms, plain, q_old, warm, step_key, axis_name, n_dev, warm_start, epsilon
        )
        bad = shards.any_block(bad)
        low_shapes = [
            s
            for s, g in zip(p.layout.shapes, p.layout.groups, strict=True)
            if g == layouts.COMPRESSED
        ]
        # A bfloat16 / float16 leaf's memory also keeps its output's rounding (the value
        # applied is cast(mean)); the freeze below restores it on a non-finite step.
        errors, means = _unstack(p, errors), _unstack(p, means)
        if error_feedback:
            errors = feedback.with_rounding(errors, means, feedback.compressed_dtypes(p.layout))
        new_state = PowerSGDState(
            error=layouts.like_compressed(
                p.layout, [e.reshape(1, *s) for e, s in zip(errors, low_shapes, strict=True)]
            )
            if error_feedback and p.groups
            else state.error,
            q=layouts.like_compressed(p.layout, _unstack(p, list(q)))
            if warm_start and p.groups
            else state.q,
            key=key,
            count=state.count + 1,
        )
        new_state = skeleton.freeze(bad, state, new_state)
        outs = [collectives.poison(m, bad).reshape(-1) for m in means]
        plains = _split(collectives.poison(plain_mean, bad), p._plain_sizes)
        return layouts.assemble(updates, p.layout, outs, plains), new_state

    every_axis = collectives.axis_names(axis_name, inner_axis_name)
    update_fn = shards.with_shard_axis(update_fn, "jc.powersgd", every_axis, shard_axis)
    return optax.GradientTransformationExtraArgs(
        init_fn, shards.over_shards(update_fn, param_specs, every_axis)
    )


def _check_nonnegative(name: str, value: Any) -> float:
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be >= 0 and finite, got {value}")
    return float(value)
