"""The contract every jaxcomp transform keeps: one table of transforms, the same checks for each.

As optax's ``contrib/_common_test.py`` runs one suite over every optimizer, this file runs one
suite over every jaxcomp transform in :data:`ROWS`; a new transform (or codec, or strategy) is
tested by adding one :class:`Row`. The contract (DESIGN.md, "Rules that make it real"):

1. error feedback conserves the gradient: ``sum_t out_t + held back == sum_t fed_t`` (``fed_t``
   is ``mean_i g_i`` or, with momentum, what the transform's docstring says enters the memory);
2. a NaN or inf on one device makes every compressed output non-finite on every device and
   leaves the state bit-identical, so ``optax.apply_if_finite`` skips the step;
3. ``jc.sharded_init`` / ``jc.state_specs`` shard per-device fields over the data axis, a
   jitted ``shard_map`` step keeps them, and a zero gradient gives exactly zero;
4. the state checkpoints with orbax and a restored run continues bit-identically;
5. ``jax.pmap`` gives the numbers of ``shard_map``;
6. the compiled step sends fewer bytes per device than ``jax.lax.pmean``;
7. bad arguments raise errors naming the argument, at construction or at trace time.

Each row is built and compiled once (module cache) on one tree whose ``w`` (8,192 values)
and ``v`` (2,048) are compressed and ``b`` is small; items share a 4-step trajectory of it.
``w`` is the large leaf of the non-finite checks (XLA:CPU's float max over 4,096 values or
more: below), ``v`` the small one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest
from helpers import (
    OUTLIERS,
    Blocking,
    N,
    assert_state_survives_outlier,
    assert_trees_equal,
    held_back,
    jaxcomp_nodes,
    jaxcomp_state,
    per_leaf,
    replicated_per_leaf,
    server_per_leaf,
    sharded_like,
    skip_unless,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SHAPES = {"w": (128, 64), "b": (48,), "v": (2048,)}
STEPS = 4
BETA = 0.9  # worker momentum of the Signum-style row
DGC_MOMENTUM = 0.9  # jc.dgc's default


# --------------------------------------------------------------------------- reading states
#
# The readers of per-device fields (per_leaf, server_per_leaf, held_back, ...) live in
# tests/helpers.py, shared with the per-transform tests.


def fed_mean(state: Any, g: dict, previous: dict, params: dict) -> dict:
    """Residual feedback: what enters the memory each step is the mean gradient."""
    return {k: a.mean(0) for k, a in g.items()}


def fed_worker_momentum(state: Any, g: dict, previous: dict, params: dict) -> dict:
    """Worker momentum m_i <- b m_i + (1 - b) g_i is linear, so mean_i m_i is the momentum of
    the mean gradient; the compressed leaves (those with a memory) send it, the rest the mean."""
    memory = per_leaf(jaxcomp_state(state, "momentum").momentum, params)
    return {
        k: a.mean(0) if memory[k] is None else BETA * previous[k] + (1 - BETA) * a.mean(0)
        for k, a in g.items()
    }


def fed_dgc(state: Any, g: dict, previous: dict, params: dict) -> dict:
    """DGC (its docstring): ``u_i <- m u_i + g_i`` enters ``v_i`` (the accumulation), with the
    velocity ``u_i`` of the state before the step (after momentum factor masking); small and
    1-D leaves get ``trace <- m trace + mean_i g_i`` and send it."""
    velocity = per_leaf(jaxcomp_state(state).velocity, params)
    return {
        k: a.mean(0) + DGC_MOMENTUM * (previous[k] if velocity[k] is None else velocity[k].mean(0))
        for k, a in g.items()
    }


# --------------------------------------------------------------------------- the table


# Arguments each factory must refuse at construction, naming them: (argument, bad value).
ALLREDUCE_ERRORS = (
    ("min_size", -1),
    ("strategy", "ring"),
    ("error_feedback", "momentum"),
    ("granularity", "bucket"),
    ("seed", -1),
    ("server_feedback", "yes"),
    ("worker_momentum", 1.0),
    ("memory_dtype", "int8"),
)
DGC_ERRORS = (
    ("ratio", 0.0),
    ("ratio", 1.5),
    ("axis_name", None),
    ("momentum", 1.0),
    ("nesterov", 1),
    ("momentum_masking", 1),
    ("clip_norm", 0.0),
    ("warmup_steps", -1),
    ("sample_ratio", 1.5),
    ("min_size", -1),
    ("strategy", "allreduce"),
    ("strategy", "ring"),
    ("seed", -1),
)
SGD_ERRORS = (
    ("momentum", 1.0),
    ("momentum", "0.9"),
    ("worker_momentum", 0.5),
    ("strategy", "ring"),
    ("min_size", -1),
    ("error_feedback", "momentum"),
)
ONEBIT_ERRORS = (
    ("freeze_step", 0),
    ("freeze_step", 2.5),
    ("b1", 1.0),
    ("b2", -0.1),
    ("eps", -1.0),
    ("worker_momentum", 0.5),
    ("strategy", "ring"),
)
ZERO_ONE_ERRORS = (
    ("var_freeze_step", 0),
    ("var_update_scaler", 0),
    ("local_step_scaler", 1.5),
    ("local_step_clipper", 0),
    ("b1", 1.0),
    ("worker_momentum", 0.5),
)
POWERSGD_ERRORS = (
    ("rank", 0),
    ("rank", 2.0),
    ("start_step", -1),
    ("min_size", -1),
    ("min_compression_rate", float("nan")),
    ("orthogonalization_epsilon", -1e-8),
    ("orthogonalization_epsilon", 1.0),
    ("warm_start", 1),
    ("error_feedback", 1),
    ("seed", -1),
)
DEMO_ERRORS = (
    ("chunk", 0),
    ("topk", 0),
    ("decay", 1.5),
    ("weight_decay", -1.0),
    ("sign", "yes"),
    ("bits", 9),
    ("min_size", -1),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One transform under test.

    ``make(axis_name=..., **overrides)`` builds it; ``memory`` names the per-device fields that
    hold back what was not sent (the server residual is read when present); ``law`` is the
    conservation law: ``"sum"`` (``sum_t out_t + held == sum_t fed_t``, ``fed`` as given),
    ``"ef21"`` (the output is the global estimate; the devices' estimates average to it plus
    the server residual) or a sentence saying why there is none. ``bad`` lists (argument,
    value) pairs ``make`` must refuse; ``skip`` (item, reason) pairs where an item does not
    apply. A new transform is one more Row in :data:`ROWS`.
    """

    id: str
    make: Callable[..., optax.GradientTransformation]
    memory: tuple[str, ...] = ("memory",)
    law: str = "sum"
    fed: Callable[..., dict] = fed_mean
    compressed: tuple[str, ...] = ("w", "v")  # output leaves that a bad step must poison
    atol: float = 2e-5
    bad: tuple[tuple[str, Any], ...] = ALLREDUCE_ERRORS
    inner_axis: str | None = None  # hierarchical: a 2 x 4 mesh ("data", inner_axis)
    out_scale: float = 1.0  # a recipe's output is out_scale times the mean it sent
    skip: tuple[tuple[str, str], ...] = ()  # (contract item, why it does not apply)

    def build(self, **overrides) -> optax.GradientTransformation:
        overrides.setdefault("axis_name", "data")
        if self.inner_axis is not None:
            overrides.setdefault("inner_axis_name", self.inner_axis)
        return self.make(**overrides)

    @property
    def hosts(self) -> int:
        """Devices on the (slow) data axis: N, or 2 of a hierarchical 2 x 4 mesh."""
        return N if self.inner_axis is None else 2

    def skip_reason(self, item: str) -> str | None:
        return dict(self.skip).get(item)


def allreduce(codec, **kw):
    return functools.partial(jc.compressed_allreduce, codec=codec, **kw)


ROWS = [
    Row("sign-allgather", allreduce(jc.sign(), strategy="allgather")),
    Row("sign-two_phase", allreduce(jc.sign(), strategy="two_phase")),
    Row("sign-auto", allreduce(jc.sign(), strategy="auto")),
    Row(
        "signsgd-majority_vote",
        allreduce(jc.sign(None), strategy="majority_vote"),
        memory=(),
        law="majority vote keeps no error feedback: the vote is not a mean of what was sent",
        bad=(("error_feedback", "ef21"), ("min_size", -1), ("worker_momentum", -0.5)),
    ),
    Row("int8-auto", allreduce(jc.int_quant(8), strategy="auto")),
    Row(
        "fp16-allreduce",
        allreduce(jc.cast("fp16", scaled=False), strategy="allreduce", error_feedback="residual"),
        # A summable fp16 payload is also *added* in fp16 inside the psum: that rounding
        # (~2^-11 of the running sum) happens in the network, where no memory can see it.
        atol=5e-3,
    ),
    Row(
        # The default fp16 cast is scaled (one power-of-two scale per vector): "auto" sends it
        # two_phase (the owner re-encodes with the rows' largest scale) and keeps no memory.
        "fp16scaled-auto",
        allreduce(jc.cast("fp16")),
        memory=(),
        law="a rounding-only codec keeps no memory (error_feedback='auto', rounding_only)",
    ),
    Row(
        # ... with a residual asked for: the memory and the two-phase server residual hold
        # the scaled cast's rounding (conservation), and a bad step leaves them as they were.
        "fp16scaled-residual",
        allreduce(jc.cast("fp16"), error_feedback="residual"),
    ),
    Row("topk-allgather", allreduce(jc.top_k(0.01), strategy="allgather")),
    Row("topk-two_phase", allreduce(jc.top_k(0.01), strategy="two_phase")),
    Row(
        # Memories in bfloat16 (memory and the two-phase server residual): each step rounds
        # them (relative 2^-9 of an int8 residual of ~1e-2), so conservation holds to ~1e-4.
        "int8-auto-bf16memory",
        allreduce(jc.int_quant(8), strategy="auto", memory_dtype="bfloat16"),
        atol=2e-4,
        skip=(("pmap", "the memory's type changes no collective: int8-auto's pmap items"),),
    ),
    Row(
        "int8-ef21",
        allreduce(jc.int_quant(8), error_feedback="ef21"),
        law="ef21",
    ),
    Row(
        "sign-worker_momentum",
        allreduce(jc.sign(), worker_momentum=BETA),
        fed=fed_worker_momentum,
    ),
    Row(
        # jc.sgd at lr 0.1, momentum 0.9, heavy ball: the update is -0.1 / (1 - 0.9) = -1 times
        # the mean of the sent momenta; every leaf's momentum (the small one's too) is fed.
        "sgd-sign",
        functools.partial(jc.sgd, 0.1, jc.sign(), momentum=BETA, nesterov=False),
        memory=("memory",),
        fed=fed_worker_momentum,
        out_scale=-1.0,
        bad=SGD_ERRORS,
    ),
    Row(
        "sgd-topk-nesterov",
        functools.partial(jc.sgd, 0.1, jc.top_k(0.01), momentum=BETA, nesterov=True),
        law="Nesterov sends beta m_i + (1 - beta) g_i, not the momentum: tests/test_recipes.py",
        out_scale=-1.0,
        bad=SGD_ERRORS,
    ),
    Row(
        "onebit_adam",
        functools.partial(jc.onebit_adam, 1e-3, freeze_step=2),
        law="the output is Adam's direction; its momentum exchange: tests/test_recipes.py",
        bad=ONEBIT_ERRORS,
        skip=(
            (
                "bytes",
                "the compiled step holds the warm-up's full all-reduce too (a lax.cond): "
                "comm_report counts both branches",
            ),
        ),
    ),
    Row(
        # Steps 0..3: a full-precision variance round, a 1-bit round, a variance round, a
        # 1-bit round after the freeze (skipped rounds: tests/test_recipes.py).
        "zero_one_adam",
        functools.partial(
            jc.zero_one_adam,
            1e-3,
            var_freeze_step=3,
            var_update_scaler=1,
            local_step_scaler=1,
        ),
        law="the output is Adam's direction; its rounds: tests/test_recipes.py",
        bad=ZERO_ONE_ERRORS,
        skip=(
            (
                "bytes",
                "the compiled step holds the variance rounds' full all-reduce too (a "
                "lax.switch): comm_report counts every branch",
            ),
        ),
    ),
    Row(
        "sign-hierarchical",
        allreduce(jc.sign(), strategy="two_phase"),
        inner_axis="local",
        skip=(("pmap", "the transform needs two axes, and jax.pmap does not nest"),),
    ),
    Row(
        "dgc-allgather",
        # warmup_steps=0: the density warm-up's stages are tests/test_warmup.py's.
        functools.partial(jc.dgc, ratio=0.01, warmup_steps=0),
        memory=("accumulation",),
        fed=fed_dgc,
        compressed=("w",),
        bad=DGC_ERRORS,
    ),
    Row(
        "dgc-two_phase",
        functools.partial(jc.dgc, ratio=0.01, strategy="two_phase", warmup_steps=0),
        memory=("accumulation",),
        fed=fed_dgc,
        compressed=("w",),
        bad=DGC_ERRORS,
    ),
    Row(
        # DeMo with decay 1 and no sign: each device's momentum accumulates its gradients,
        # the sent DCT components leave it, and -0.1 times their mean is the output.
        "demo-accumulate",
        functools.partial(jc.demo, 0.1, decay=1.0, sign=False),
        memory=("momentum",),
        out_scale=-0.1,
        bad=DEMO_ERRORS,
    ),
    Row(
        "powersgd-start0",
        functools.partial(jc.powersgd, rank=4, start_step=0),
        memory=("error",),
        compressed=("w",),
        bad=POWERSGD_ERRORS,
    ),
    Row(
        "powersgd-start2",
        functools.partial(jc.powersgd, rank=4, start_step=2),
        memory=("error",),
        compressed=("w",),
        bad=POWERSGD_ERRORS,
        skip=(
            (
                "bytes",
                "the compiled step holds the warm-up's full all-reduce too (a lax.cond): "
                "comm_report counts both branches",
            ),
        ),
    ),
]


# --------------------------------------------------------------------------- building a row


def mesh_of(row: Row) -> tuple[jax.sharding.Mesh, Any]:
    """The mesh and the axes the per-device state is sharded over."""
    if row.inner_axis is None:
        m = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
        return m, "data"
    m = jax.make_mesh(
        (row.hosts, N // row.hosts), ("data", row.inner_axis), axis_types=(AxisType.Explicit,) * 2
    )
    return m, ("data", row.inner_axis)


def params(shapes: dict = SHAPES) -> dict:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def grads(t: int, shapes: dict = SHAPES) -> dict:
    """Per-device gradients, stacked on a leading device axis (an offset: signs agree a bit)."""
    rng = np.random.default_rng(100 + t)
    return {k: (rng.standard_normal((N, *s)) + 0.3).astype(np.float32) for k, s in shapes.items()}


def follower() -> optax.GradientTransformation:
    """The optimizer after the transform, skipping non-finite steps."""
    return optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)


class Built:
    """A row's transform chained before :func:`follower`, its sharded state and jitted step.

    ``step(grads, state) -> (out, update, state)``: ``out`` is the transform's output as each
    device sees it (stacked, ``(n, *shape)``), ``update`` the follower's (replicated).
    """

    def __init__(
        self, row: Row, tx: optax.GradientTransformation | None = None, shapes: dict = SHAPES
    ):
        self.row = row
        self.tx = row.build() if tx is None else tx
        self.chain = optax.chain(self.tx, follower())
        self.mesh, self.axes = mesh_of(row)
        self.params = jax.device_put(params(shapes), NamedSharding(self.mesh, P()))
        self.state0 = jc.sharded_init(self.chain, self.params, self.mesh, self.axes)
        self.specs = jc.state_specs(self.state0, self.axes)
        self.jitted = self.make_step(self.tx, self.specs)
        self.step_fn = Blocking(self.jitted)

    def make_step(self, tx, specs):
        follow = follower()
        axes = self.axes

        def step(g, s, p):
            g = jax.tree.map(lambda a: a[0], g)
            u, s_tx = tx.update(g, s[0], p)
            v, s_follow = follow.update(u, s[1], p)
            seen = jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying")[None], u)
            return seen, v, (s_tx, s_follow)

        return jax.jit(
            jax.shard_map(
                step,
                mesh=self.mesh,
                in_specs=(P(self.axes), specs, P()),
                out_specs=(P(self.axes), P(), specs),
            )
        )

    def put(self, g: dict) -> dict:
        return jax.device_put(g, NamedSharding(self.mesh, P(self.axes)))

    def step(self, g: dict, state: Any):
        return self.step_fn(self.put(g), state, self.params)


@functools.cache
def built(row_id: str) -> Built:
    return Built(ROW_BY_ID[row_id])


@functools.cache
def trajectory(row_id: str) -> tuple[list, list]:
    """(outputs of steps 0..STEPS-1 as numpy, states 0..STEPS): the run items share."""
    b = built(row_id)
    states, outs = [b.state0], []
    for t in range(STEPS):
        out, _, state = b.step(grads(t), states[-1])
        outs.append(jax.tree.map(np.asarray, out))
        states.append(state)
    return outs, states


ROW_BY_ID = {r.id: r for r in ROWS}
assert len(ROW_BY_ID) == len(ROWS), "row ids must be unique"


@pytest.fixture(scope="module", params=[r.id for r in ROWS])
def row(request) -> Row:
    return ROW_BY_ID[request.param]


def same_on_every_device(out: dict) -> None:
    for k, a in out.items():
        np.testing.assert_array_equal(a, np.broadcast_to(a[0], a.shape), err_msg=k)


# --------------------------------------------------------------------------- 1. conservation


def test_error_feedback_conserves_the_gradient(row):
    skip_unless(row, "conservation")
    outs, states = trajectory(row.id)
    p = params()
    if row.law == "ef21":
        # EF21: each device's estimate h_i += C(g_i - h_i); the output is the global estimate
        # h += mean_i C(g_i - h_i), so h == mean_i h_i, less what the chunk owners' second
        # encoding (two_phase) held back in their server residual; h moves towards mean_i g_i.
        ours = jaxcomp_state(states[-1], "memory")
        devices = per_leaf(ours.memory, p)
        estimate = replicated_per_leaf(ours.estimate, p)
        server = getattr(ours, "server_residual", None)
        server = {} if server is None else server_per_leaf(server, p, row.hosts)
        for k in row.compressed:
            np.testing.assert_allclose(outs[-1][k][0], estimate[k], rtol=1e-6, atol=1e-7)
            held = estimate[k] + (0.0 if server.get(k) is None else server[k])
            np.testing.assert_allclose(devices[k].mean(0), held, atol=row.atol, err_msg=k)
        first = {k: np.abs(outs[0][k][0] - grads(0)[k].mean(0)).max() for k in row.compressed}
        assert all(v < 1.0 for v in first.values()), first
        return
    if row.law != "sum":
        pytest.skip(row.law)
    fed_total = {k: np.zeros(s) for k, s in SHAPES.items()}
    fed = {k: np.zeros(s) for k, s in SHAPES.items()}
    applied = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(STEPS):
        same_on_every_device(outs[t])
        fed = row.fed(
            states[t], {k: np.asarray(a, np.float64) for k, a in grads(t).items()}, fed, p
        )
        for k in SHAPES:
            fed_total[k] += fed[k]
            applied[k] += outs[t][k][0] / row.out_scale
    held = held_back(states[-1], p, row.memory, row.hosts)
    for k in SHAPES:
        np.testing.assert_allclose(applied[k] + held[k], fed_total[k], atol=row.atol, err_msg=k)
    # ... and compression did hold something back (the law is not met by sending everything).
    assert max(float(np.abs(held[k]).max()) for k in row.compressed) > 1e-5


# --------------------------------------------------------------------------- 2. poison and freeze


def nan_at(row: Row) -> tuple[str, tuple[int, ...]]:
    """Where the nan items put their NaN: device 3 of a leaf the row compresses, ``v``
    (2,048 values, under the 4,096 of XLA:CPU's NaN-dropping reduce), else ``w`` (DGC and
    PowerSGD compress matrices only: their ``v`` goes by plain ``pmean``, as ``b`` does)."""
    return ("v", (3, 1031)) if "v" in row.compressed else ("w", (3, 5, 7))


@pytest.mark.parametrize("where", ["nan-compressed", "inf-b"])
def test_nonfinite_gradient_poisons_output_and_freezes_state(row, where):
    b = built(row.id)
    _, states = trajectory(row.id)
    # After one step (a warm-up step of powersgd-start2) and after two.
    t = 1 if where == "nan-compressed" else 2
    before, g = states[t], grads(t)
    if where == "nan-compressed":
        leaf, at = nan_at(row)
        g[leaf][at] = np.nan  # one device, a compressed leaf
    else:
        g["b"][5, 0] = np.inf  # another device, a small leaf sent by plain pmean
    out, update, after = b.step(g, before)
    for k in row.compressed:
        assert not np.isfinite(np.asarray(out[k], np.float32)).any(), k
    assert_trees_equal(after[0], before[0])  # the whole transform state, bit for bit
    # apply_if_finite after it skips the step: a zero update, its own state counting one.
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(update))
    assert int(after[1].notfinite_count) == 1 and int(after[1].total_notfinite) == 1
    assert_trees_equal(after[1].inner_state, before[1].inner_state)


# A leaf of 8,192 values: XLA:CPU compiles a float max / min reduce over 4,096 values or more
# (and a maximum / minimum fused into a reduce) to a YNNPACK fusion that drops NaN, so a NaN
# step flagged in the small leaf ``v`` can pass unflagged in ``w`` (docs/errors.md). Bad
# values at the first, a middle (inside a block or chunk) and the last value of device 3's
# ``w``. Until 2026-11-27 a second tree (``w`` and ``v`` of 8,192 values) was compiled for
# these items, each row twice; ``w`` is now that large leaf in the one tree.
LARGE_POSITIONS = (0, 4133, 8191)


# ... and, on the large tree only, the codecs whose scale or norm is a max over a block
# (qsgd, terngrad, the int8 values of a sparse payload), adaptive compression (its state sums
# squared outputs) and clipping before a recipe.
LARGE_ROWS = [
    *ROWS,
    Row("qsgd-residual", allreduce(jc.qsgd(16), error_feedback="residual")),
    Row("terngrad-residual", allreduce(jc.terngrad(), error_feedback="residual")),
    Row("topk-int8values", allreduce(jc.top_k(0.01, approx="blocked", values="int8"))),
    Row(
        "sgd-accordion",
        functools.partial(
            jc.sgd, 0.1, jc.top_k(0.01), adaptive=jc.accordion(jc.int_quant(8), interval=2)
        ),
    ),
    Row(
        "clip-sgd-sign",
        lambda axis_name: optax.chain(
            jc.clip_by_global_norm(1.0, axis_name), jc.sgd(0.1, jc.sign(), axis_name)
        ),
    ),
]
LARGE_ROW_BY_ID = {r.id: r for r in LARGE_ROWS}


@functools.cache
def built_large(row_id: str) -> Built:
    """A row of :data:`ROWS`: its one build; a row only these items run: built here."""
    return built(row_id) if row_id in ROW_BY_ID else Built(LARGE_ROW_BY_ID[row_id])


@functools.cache
def large_states(row_id: str) -> tuple:
    """States 0..3 of the row's clean run (its nan and inf items share it): of
    :func:`trajectory` for a row of :data:`ROWS`."""
    if row_id in ROW_BY_ID:
        return tuple(trajectory(row_id)[1][:4])
    b = built_large(row_id)
    states = [b.state0]
    for t in range(3):
        states.append(b.step(grads(t), states[-1])[2])
    return tuple(states)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("row_id", list(LARGE_ROW_BY_ID))
def test_nonfinite_in_a_large_leaf_poisons_output_and_freezes_state(row_id, value):
    row = LARGE_ROW_BY_ID[row_id]
    b = built_large(row_id)
    for t in (2, 3):  # steps 2 and 3: past every row's warm-up / freeze / variance step
        state = large_states(row_id)[t]
        for pos in LARGE_POSITIONS:
            g = grads(t)
            g["w"].reshape(N, -1)[3, pos] = value
            out, update, after = b.step(g, state)
            for k in row.compressed:
                finite = np.isfinite(np.asarray(out[k], np.float32))
                assert not finite.any(), (k, t, pos, int(finite.sum()))
            assert_trees_equal(after[0], state[0])
            assert all(not np.asarray(u).any() for u in jax.tree.leaves(update)), (t, pos)


# --------------------------------------------------------------------------- 3. specs, sharded init


def test_state_specs_sharded_init_and_zero_gradient(row):
    b = built(row.id)
    state, specs = b.state0, b.specs
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    assert jax.tree.structure(state) == jax.tree.structure(specs, is_leaf=is_spec)
    pairs = list(zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec), strict=True))
    for leaf, spec in pairs:
        assert sharded_like(leaf, b.mesh, spec), (leaf.shape, leaf.sharding, spec)
    # The per-device fields of jaxcomp states, and only they, are sharded over the data axis
    # (both axes, hierarchical): device i holds row block i. Keys, counts, replicated
    # estimates and the follower's state are replicated.
    per_device = [(leaf, spec) for leaf, spec in pairs if spec != P()]
    memories = [
        leaf
        for node in jaxcomp_nodes(state)
        for field in type(node).PER_DEVICE_FIELDS
        for leaf in jax.tree.leaves(getattr(node, field))
    ]
    assert len(per_device) == len(memories) and bool(memories) == bool(row.memory)
    for leaf, spec in per_device:
        assert spec[0] == b.axes, spec
        assert leaf.sharding.shard_shape(leaf.shape) == (leaf.shape[0] // N, *leaf.shape[1:])

    # A zero gradient from a fresh state: exactly zero out, zero memories, nothing non-finite,
    # and the jitted shard_map step hands the state back with the same specs.
    zero = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    out, _, new_state = b.step(zero, state)
    for k, a in out.items():
        assert not np.asarray(a).any(), k
    for leaf in jax.tree.leaves(new_state):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    new_pairs = zip(
        jax.tree.leaves(new_state), jax.tree.leaves(specs, is_leaf=is_spec), strict=True
    )
    # the server residual's `server_chunk` stamps: the chunk each row holds, one each
    stamps = {
        id(x)
        for node in jaxcomp_nodes(new_state)
        for x in jax.tree.leaves(getattr(node, "server_chunk", None))
    }
    for leaf, spec in new_pairs:
        assert sharded_like(leaf, b.mesh, spec), (leaf.shape, leaf.sharding, spec)
        if id(leaf) in stamps:
            assert sorted(np.asarray(leaf).tolist()) == list(range(N))
        elif spec != P():
            assert not np.asarray(leaf).any()


# --------------------------------------------------------------------------- 4. orbax


def test_orbax_round_trip_continues_bit_identically(row, tmp_path):
    import orbax.checkpoint as ocp

    b = built(row.id)
    outs, states = trajectory(row.id)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", states[2])
        ckpt.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, states[2])
        restored = ckpt.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(states[2])
    for a, r in zip(jax.tree.leaves(states[2]), jax.tree.leaves(restored), strict=True):
        assert r.sharding.is_equivalent_to(a.sharding, a.ndim)
    state = restored
    for t in (2, 3):
        out, _, state = b.step(grads(t), state)
        assert_trees_equal(out, outs[t])
    assert_trees_equal(state, states[STEPS])


# --------------------------------------------------------------------------- 5. pmap == shard_map


@pytest.mark.parametrize("init", ["pmap_init", "replicate"])
def test_pmap_matches_shard_map(row, init):
    """Under ``jax.pmap`` every state leaf has a leading device axis. The state comes from
    ``jax.pmap(tx.init)`` or from ``jc.replicate(tx.init(params))``, built outside any mesh:
    the same state, or (if a field depends on where it was built) the same outputs."""
    skip_unless(row, "pmap")
    b = built(row.id)
    outs, states = trajectory(row.id)
    replicated = jc.replicate(params(), N)
    state = pmap_init(row.id)
    if init == "replicate":
        outside = jc.replicate(jax.jit(b.chain.init)(params()), N)
        if same_shapes(outside, state):  # nothing depends on where it was built: same state
            assert_trees_equal(outside, state)
            return
        if row.id not in OUTSIDE_STATE_RUNS:
            # A state built outside the mesh differs only in the server residual's room
            # (the whole vector, each device reading its chunk): the same code for every
            # exchange, run on one row per transform (a second pmap compile each).
            pytest.skip(f"server residual built outside the mesh: run on {OUTSIDE_STATE_RUNS}")
        state = outside
    for t in range(STEPS):
        out, _, state = pmap_step(row.id)(grads(t), state, replicated)
        for k in SHAPES:
            np.testing.assert_allclose(out[k], outs[t][k], rtol=1e-6, atol=1e-6, err_msg=k)
    if init == "replicate":
        return
    # The same state: per-device leaves row by row, replicated leaves on every device.
    for mine, theirs in zip(jax.tree.leaves(state), jax.tree.leaves(states[STEPS]), strict=True):
        mine, theirs = np.asarray(mine), np.asarray(theirs)
        if mine.size == theirs.size:
            mine = mine.reshape(theirs.shape)
        else:
            assert mine.size == N * theirs.size
            np.testing.assert_array_equal(mine, np.broadcast_to(mine[0], mine.shape))
            mine = mine[0]
        # atol: a few float32 ulps of the leaf's largest value (an error-feedback residual
        # x - C(x) cancels: a 1-ulp difference of x between the two compilations remains).
        scale = max(1.0, float(np.abs(theirs).max())) if theirs.size else 1.0
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6 * scale)


def test_nonfinite_gradient_under_pmap_poisons_every_device_and_freezes_state(row):
    """Item 2 under ``jax.pmap`` (no varying types: the flag must be reduced over the axis
    all the same): a NaN in device 3's compressed leaf (:func:`nan_at`) after two steps
    makes every compressed output non-finite on every device, leaves the transform's state
    bit-identical and the follower skips. Runs the step already compiled by
    :func:`test_pmap_matches_shard_map`."""
    skip_unless(row, "pmap")
    step, replicated = pmap_step(row.id), jc.replicate(params(), N)
    state = pmap_init(row.id)
    for t in range(2):
        _, _, state = step(grads(t), state, replicated)
    g = grads(2)
    leaf, at = nan_at(row)
    g[leaf][at] = np.nan
    out, update, after = step(g, state, replicated)
    for k in row.compressed:
        assert not np.isfinite(np.asarray(out[k], np.float32)).any(), k
    assert_trees_equal(after[0], state[0])
    assert all(not np.asarray(u).any() for u in jax.tree.leaves(update))
    assert np.all(np.asarray(after[1].notfinite_count) == 1)


# One row per transform: the pmap state's checkpoint is orbax's, the same for every codec.
PMAP_ORBAX_ROWS = (
    "sgd-sign",
    "sign-two_phase",
    "dgc-two_phase",
    "powersgd-start2",
    "onebit_adam",
    "zero_one_adam",
    "demo-accumulate",
)


@pytest.mark.parametrize("row_id", PMAP_ORBAX_ROWS)
def test_orbax_round_trip_under_pmap_continues_bit_identically(row_id, tmp_path):
    """Item 4 under ``jax.pmap``: the state of ``jax.pmap(tx.init)`` after 2 steps, saved
    with orbax and restored into ``jax.eval_shape(jax.pmap(tx.init), params)`` (no state
    built), gives the 3 next steps of the run that did not stop, bit for bit."""
    import orbax.checkpoint as ocp

    step, replicated = pmap_step(row_id), jc.replicate(params(), N)
    state = pmap_init(row_id)
    for t in range(2):
        _, _, state = step(grads(t), state, replicated)
    init = jax.pmap(built(row_id).chain.init, axis_name="data")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "state", jax.eval_shape(init, replicated))
    going, back = state, restored
    for t in range(2, 5):
        out, _, going = step(grads(t), going, replicated)
        again, _, back = step(grads(t), back, replicated)
        assert_trees_equal(again, out)
    assert_trees_equal(back, going)


# Rows whose state built outside the mesh (jc.replicate) is run under pmap, one per transform
# that keeps a two-phase server residual.
OUTSIDE_STATE_RUNS = ("sign-two_phase", "topk-two_phase", "dgc-two_phase", "onebit_adam")


@functools.cache
def pmap_init(row_id: str) -> Any:
    return jax.pmap(built(row_id).chain.init, axis_name="data")(jc.replicate(params(), N))


@functools.cache
def pmap_step(row_id: str) -> Blocking:
    tx, follow = built(row_id).tx, follower()

    def step(g, s, p):
        u, s_tx = tx.update(g, s[0], p)
        v, s_follow = follow.update(u, s[1], p)
        return u, v, (s_tx, s_follow)

    return Blocking(jax.pmap(step, axis_name="data"))


def same_shapes(a: Any, b: Any) -> bool:
    shapes = lambda t: [np.shape(x) for x in jax.tree.leaves(t)]  # noqa: E731
    return jax.tree.structure(a) == jax.tree.structure(b) and shapes(a) == shapes(b)


# --------------------------------------------------------------------------- 6. wire bytes


def _plain_pmean(axes) -> optax.GradientTransformation:
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.lax.pmean(u, axes), s)
    )


@functools.cache
def pmean_bytes(inner_axis: str | None) -> float:
    row = Row("pmean", lambda **kw: None, inner_axis=inner_axis)
    axes = mesh_of(row)[1]
    b = Built(row, _plain_pmean(axes))
    report = jc.comm_report(b.jitted, b.put(grads(0)), b.state0, b.params)
    return report.bytes_per_device


def test_wire_bytes_below_pmean(row):
    skip_unless(row, "bytes")
    b = built(row.id)
    report = jc.comm_report(b.jitted, b.put(grads(0)), b.state0, b.params)
    plain = pmean_bytes(row.inner_axis)
    size = sum(int(np.prod(s)) for s in SHAPES.values())
    if row.inner_axis is None:
        assert plain == pytest.approx(2 * (N - 1) / N * 4 * size, rel=0.01)
    print(f"{row.id}: {report.bytes_per_device:.0f} B/device, pmean {plain:.0f}")
    assert report.bytes_per_device < plain, str(report)


# --------------------------------------------------------------------------- 7. bad arguments


@pytest.mark.parametrize("case", ["construction", "unbound_axis", "gradient_tree", "state"])
def test_bad_arguments_name_the_argument(row, case):
    if case == "construction":
        for name, value in row.bad:
            with pytest.raises((ValueError, TypeError), match=name):
                row.build(**{name: value})
        return
    if case == "state" and not row.memory:
        pytest.skip("the state holds nothing shaped like the params")
    b = built(row.id)
    g = b.put(grads(0))
    if case == "unbound_axis":
        tx = row.build(axis_name="model")  # no such axis in the mesh
        with pytest.raises(ValueError, match="axis_name"):
            b.make_step(tx, b.specs).trace(g, b.state0, b.params)
    elif case == "gradient_tree":
        wrong = {**grads(0), "w": np.zeros((N, 64, 47), np.float32)}
        with pytest.raises(ValueError, match="gradient"):
            b.jitted.trace(b.put(wrong), b.state0, b.params)
    else:  # a state built for other params
        other = {**params(), "w": np.zeros((32, 48), np.float32)}
        state = jax.eval_shape(
            lambda p: jc.sharded_init(b.chain, p, b.mesh, b.axes),
            jax.device_put(other, NamedSharding(b.mesh, P())),
        )
        with pytest.raises(ValueError, match="state"):
            b.jitted.trace(g, state, b.params)


# --------------------------------------------------------------------------- 8. finite outliers


def finite_outlier_run(row_id: str, value: float) -> tuple[dict, Any]:
    """The row's trajectory with ``value`` at ``w[0, 0]`` of device 0 at step 0: last output
    and last state."""
    b = built(row_id)
    state = b.state0
    for t in range(STEPS):
        g = grads(t)
        if t == 0:
            g["w"][0, 0, 0] = value
        out, _, state = b.step(g, state)
    return jax.tree.map(np.asarray, out), state


@pytest.mark.parametrize("value", OUTLIERS)
def test_finite_outlier_leaves_no_state_zero_or_nonfinite(row, value):
    """A finite input never leaves carried state NaN, inf or newly zero (a PowerSGD Q column
    whose norm overflowed stayed 0 for ever): every norm and rescale of state is guarded."""
    out, state = finite_outlier_run(row.id, value)
    assert_state_survives_outlier(state, trajectory(row.id)[1][-1], value)
    for k in row.compressed:
        assert np.isfinite(out[k]).all() and np.abs(out[k]).max() > 0, k


# --------------------------------------------------------------------------- 9. memory_dtype


def test_bf16_memory_halves_the_state_and_tracks_float32():
    """``memory_dtype=jnp.bfloat16``: the memories (worker and server) are bfloat16, half the
    bytes of the float32 row's, and each of its 4 outputs is within 1% (2-norm) of the output
    with float32 memories (a rounded memory flips a few int8 levels)."""
    _, f32_states = trajectory("int8-auto")
    bf16_outs, bf16_states = trajectory("int8-auto-bf16memory")
    f32_outs = trajectory("int8-auto")[0]

    def memories(state):
        ours = jaxcomp_state(state, "memory")
        return jax.tree.leaves((ours.memory, ours.server_residual))

    ours, theirs = memories(bf16_states[-1]), memories(f32_states[-1])
    assert {str(a.dtype) for a in ours} == {"bfloat16"}
    assert sum(a.nbytes for a in ours) * 2 == sum(a.nbytes for a in theirs) > 0
    for t in range(STEPS):
        for k in ("w", "v"):
            diff = np.linalg.norm(bf16_outs[t][k] - f32_outs[t][k])
            assert diff <= 0.01 * np.linalg.norm(f32_outs[t][k]), (t, k)


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
def test_bf16_memory_with_a_codec_that_keeps_no_memory(strategy):
    """``memory_dtype="bfloat16"`` with an unbiased codec, whose ``error_feedback="auto"``
    keeps no memory (stochastic int4): the same outputs as the float32 default, bit for bit
    (there is no memory to round). It raised "isfinite requires ndarray or scalar arguments,
    got <class 'NoneType'>" while tracing (the absent memory was stored as bfloat16) until
    2026-11-27."""
    from helpers import per_device, shard

    params = {"w": np.zeros((64, 48), np.float32)}
    g = shard({"w": np.random.default_rng(0).standard_normal((N, 64, 48)).astype(np.float32)})
    outs = []
    for memory_dtype in (None, "bfloat16"):
        tx = jc.compressed_allreduce(
            jc.int_quant(4, stochastic=True), "data", strategy=strategy, memory_dtype=memory_dtype
        )
        state = jc.sharded_init(tx, params, mesh_of(ROWS[0])[0], "data")
        assert state.memory is None
        specs = jc.state_specs(state, "data")
        fn = per_device(
            lambda g, s, tx=tx: tx.update(jax.tree.map(lambda a: a[0], g), s),
            (P("data"), specs),
            (P(), specs),
        )
        outs.append(fn(g, state)[0])
    assert_trees_equal(outs[0], outs[1])
