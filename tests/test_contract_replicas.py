"""The contract of transforms whose params are per-device replicas: one table, the same checks.

``tests/test_contract.py`` covers transforms that return the replicated mean gradient. The
transforms here (``jc.local_sgd``, ``jc.diloco``, ``jc.gossip``, any that let each device's
params drift) take this device's own params and gradients and return updates for them:
under ``shard_map`` the params are stacked ``(n, *shape)`` with ``P(axis)``
(``jc.replica_params``), each device's step uses ``jc.own`` / ``jc.slot``, and the output is
per device. A new transform is tested by adding one :class:`Row`. The contract:

1. what must be conserved (:attr:`Row.law`): local SGD's replicas equal the mean at a sync;
   DiLoCo through a codec: the averaged pseudo-gradients applied plus the error-feedback
   memory equal the true averaged pseudo-gradients;
2. a NaN on one device: at an exchange step every exchanged output is non-finite on every
   device and the state is bit-identical; at a local step only that device's output is
   non-finite and only its slot of the per-device state is kept;
3. ``jc.sharded_init`` / ``jc.state_specs`` shard per-device fields over the data axis, a
   jitted ``shard_map`` step keeps every sharding, and zero gradients give zero updates;
4. the state checkpoints with orbax and a restored run continues bit-identically;
5. ``jax.pmap`` (params per device, no slot) gives the numbers of ``shard_map``;
6. bytes: ``comm_report`` of an exchange step against plain per-step ``pmean`` of the
   gradients, and of a local step (nothing sent);
7. bad arguments raise errors naming the argument.

Rows are built and compiled once (module cache) on a tiny tree; items share a 4-step
trajectory (the inner optimizer is ``optax.sgd(LR)``, so local params are readable).
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
    sharded_like,
    skip_unless,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import periodic, sparse_exchange
from jaxcomp._src.periodic import at_count

SHAPES = {"w": (64, 48), "b": (48,), "v": (2048,)}
STREAM_SHAPES = {"w": (64, 32), "v": (2048,)}  # two compressed leaves of equal size
STEPS = 4
LR = 0.1


def inner() -> optax.GradientTransformation:
    return optax.sgd(LR)


# --------------------------------------------------------------------------- the laws


def law_mean(row: Row, run: Trajectory) -> None:
    """At every exchange step all replicas become the mean of the devices' local params
    (``theta_i - LR g_i``, the inner SGD step); between them each device keeps its own."""
    synced = 0
    for t in range(STEPS):
        local = {k: run.replicas[t][k] - LR * run.grads[t][k] for k in row.shapes}
        after = run.replicas[t + 1]
        for k in row.shapes:
            if t in row.exchanges:
                want = np.broadcast_to(local[k].mean(0), after[k].shape)
                np.testing.assert_allclose(after[k], want, rtol=1e-6, atol=1e-7, err_msg=k)
            else:
                np.testing.assert_allclose(after[k], local[k], rtol=1e-6, atol=1e-7, err_msg=k)
        synced += t in row.exchanges
    assert synced, "the trajectory holds no exchange step"


def exchange_memory(state: Any, shapes: dict) -> np.ndarray:
    """What the nested ``jc.compressed_allreduce`` holds back, per leaf in the params' order
    (sorted names), in units of the mean: mean_i e_i + the owned chunks' server residual."""
    names = sorted(shapes)
    (ex,) = state.exchange
    held = {k: np.zeros(shapes[k]) for k in names}
    for k, m in zip(names, ex.memory, strict=True):
        if m is not None and not isinstance(m, optax.MaskedNode):
            held[k] += np.asarray(m, np.float64).mean(0)
    server = getattr(ex, "server_residual", None) or [None] * len(names)
    for k, s in zip(names, server, strict=True):
        if s is not None and not isinstance(s, optax.MaskedNode):
            size = int(np.prod(shapes[k]))
            held[k] += np.asarray(s, np.float64).reshape(-1)[:size].reshape(shapes[k])
    return held


def law_pseudo_gradient(row: Row, run: Trajectory) -> None:
    """DiLoCo through a codec with outer ``sgd(1)``: the anchor moves by minus the averaged
    pseudo-gradient applied, so ``sum_s (x_s - x_{s+1}) + held == sum_s (x_s - mean_i
    theta_i,s)`` over the sync steps ``s`` (``held``: the exchange's error feedback)."""
    applied = {k: np.zeros(s) for k, s in row.shapes.items()}
    true = {k: np.zeros(s) for k, s in row.shapes.items()}
    for t in row.exchanges:
        before, after = run.states[t].anchor, run.states[t + 1].anchor
        for k in row.shapes:
            local = run.replicas[t][k] - LR * run.grads[t][k]
            x = np.asarray(before[k], np.float64)
            applied[k] += x - np.asarray(after[k], np.float64)
            true[k] += x - local.mean(0)
        # every device restarts from the new anchor
        for k in row.shapes:
            want = np.broadcast_to(np.asarray(after[k]), run.replicas[t + 1][k].shape)
            np.testing.assert_allclose(run.replicas[t + 1][k], want, rtol=1e-6, atol=1e-7)
    held = exchange_memory(run.states[-1], row.shapes)
    for k in row.shapes:
        np.testing.assert_allclose(applied[k] + held[k], true[k], atol=2e-5, err_msg=k)
    assert max(float(np.abs(held[k]).max()) for k in row.compressed) > 1e-5


def law_gossip(topology: str, exact: bool) -> Callable[[Row, Trajectory], None]:
    """Gossip: the mean of the replicas moves by the mean of the local SGD steps, every step
    (doubly stochastic mixing; CHOCO's public copies move together); exact gossip with
    ``gamma = 1`` is the mixing matrix applied to the local params; the replicas differ."""
    w = jc.topology(topology, N).matrix()

    def law(row: Row, run: Trajectory) -> None:
        for t in range(STEPS):
            local = {k: run.replicas[t][k] - LR * run.grads[t][k] for k in row.shapes}
            after = run.replicas[t + 1]
            for k in row.shapes:
                np.testing.assert_allclose(after[k].mean(0), local[k].mean(0), atol=1e-6)
                if exact:
                    want = np.tensordot(w, local[k], axes=1)
                    np.testing.assert_allclose(after[k], want, rtol=1e-5, atol=1e-6)
                assert np.abs(after[k] - after[k].mean(0)).max() > 1e-4, (t, k)

    return law


def at_gossip(state: Any, count: int) -> Any:
    return state._replace(count=np.int32(count))


# --------------------------------------------------------------------------- the table

LOCAL_SGD_ERRORS = (
    ("inner", "sgd"),
    ("sync_every", 0),
    ("sync_every", 2.0),
    ("start_step", -1),
    ("codec", "int8"),
    ("error_feedback", "momentum"),
)
DILOCO_ERRORS = (
    ("inner", None),
    ("outer", "nesterov"),
    ("sync_every", 0),
    ("sync_every", ()),
    ("sync_every", (2, 0)),
    ("fragments", 0),
    ("fragments", 3),  # more than sync_every = 2
    ("delay", 2),  # not below sync_every = 2
    ("delay", -1),
    ("mix", 1.5),
    ("mix", "half"),
    ("codec", "int4"),
)
SPARSELOCO_ERRORS = (
    ("inner", None),
    ("outer", "sgd"),
    ("sync_every", 0),
    ("density", 0.0),
    ("density", 1.5),
    ("chunk", 0),
    ("bits", 9),
    ("ef_decay", 1.5),
    ("averaging", "median"),
    ("min_size", -1),
)
GOSSIP_ERRORS = (
    ("inner", "sgd"),
    ("topology", "star"),
    ("gamma", 0.0),
    ("gamma", 1.5),
    ("every", 0),
    ("codec", "int8"),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One transform whose params are per-device replicas.

    ``make(axis_name=..., **overrides)`` builds it. ``law(row, trajectory)`` checks what it
    conserves (None: ``skip`` says why not). ``exchanges``: the steps (0-based, of
    ``STEPS``) whose update exchanges every leaf; ``local``: a step that sends nothing (None
    if there is none). ``at(state, t)``: the state with its step fixed to ``t`` so the
    compiled step shows that step's collectives only (None: the whole step is measured).
    ``compressed``: leaves whose exchange holds something back; ``bad``: (argument, value)
    pairs ``make`` must refuse. A new transform is one more Row in :data:`ROWS`.
    """

    id: str
    make: Callable[..., optax.GradientTransformation]
    law: Callable[[Row, Trajectory], None] | None = law_mean
    exchanges: tuple[int, ...] = (1, 3)
    local: int | None = 2
    at: Callable[[Any, int], Any] | None = at_count
    shapes: dict = dataclasses.field(default_factory=lambda: dict(SHAPES))
    compressed: tuple[str, ...] = ()
    bad: tuple[tuple[str, Any], ...] = LOCAL_SGD_ERRORS
    skip: tuple[tuple[str, str], ...] = ()
    wire: Callable[[dict], float] | None = None  # bytes of an exchange step, from the shapes

    def build(self, **overrides) -> optax.GradientTransformation:
        overrides.setdefault("axis_name", "data")
        return self.make(**overrides)

    def skip_reason(self, item: str) -> str | None:
        return dict(self.skip).get(item)


def local_sgd(**kw):
    return functools.partial(jc.local_sgd, inner(), **kw)


def diloco(**kw):
    return functools.partial(jc.diloco, inner(), **kw)


def gossip(topology: str, codec=None) -> dict:
    """A gossip row's arguments: every step exchanges; bytes from ``jc.gossip_bytes``."""
    return dict(
        make=functools.partial(jc.gossip, inner=inner(), topology=topology, codec=codec),
        law=law_gossip(topology, codec is None),
        exchanges=tuple(range(STEPS)),
        local=None,
        at=at_gossip,
        bad=GOSSIP_ERRORS,
        wire=lambda shapes: jc.gossip_bytes(params(shapes), N, topology=topology, codec=codec),
    )


def sparse_wire(codec, shapes: dict, min_size: int = 1024, small=None) -> float:
    """Bytes per device of a chunked top-k all-gather of every leaf (below min_size: pmean,
    or the ``small`` codec's all-gather)."""
    sizes = [int(np.prod(s)) for s in shapes.values()]
    codecs = [codec if d >= min_size else small for d in sizes]
    return sparse_exchange.wire_bytes(sizes, codecs, N)


# Compiling a codec's exchange under pmap costs ~15 s on the 2-core CI host: the periodic
# core's pmap path is checked by the local SGD rows, compressed_allreduce's by test_contract.
PMAP_SHARED = "the shared core under pmap: local SGD rows; the codec under pmap: test_contract"

ROWS = [
    Row("local_sgd-H2", local_sgd(sync_every=2)),
    Row(
        "post_local_sgd-H2",
        local_sgd(sync_every=2, start_step=1),
        exchanges=(0, 2),
        local=1,
        skip=(("pmap", "the same program as local_sgd-H2's under pmap, another schedule"),),
    ),
    Row(
        # The streaming row's leaves: its full sync is what each fragment's is measured by.
        "diloco-int4",
        diloco(sync_every=2, outer=optax.sgd(1.0), codec=jc.int_quant(4)),
        law=law_pseudo_gradient,
        shapes=dict(STREAM_SHAPES),
        compressed=("w", "v"),
        bad=DILOCO_ERRORS,
        skip=(("pmap", PMAP_SHARED),),
    ),
    Row(
        # Two equal leaves, two fragments: fragment 1 (w) syncs at steps 0 and 2, fragment 0
        # (v) at 1 and 3; each exchange lands a step later, mixed in with weight 0.5.
        "streaming_diloco-F2-delay1",
        diloco(sync_every=2, fragments=2, delay=1, codec=jc.int_quant(4)),
        law=None,
        exchanges=(),
        local=0,
        shapes=dict(STREAM_SHAPES),
        compressed=("w", "v"),
        bad=DILOCO_ERRORS,
        skip=(
            ("law", "Nesterov outer, delayed and mixed: conservation is diloco-int4's"),
            ("pmap", PMAP_SHARED),
        ),
    ),
]
ROWS += [
    Row(
        # Plain residual feedback (ef_decay=1) and the mean over all devices, the small leaf
        # (16 values) through 1-bit signs with the same error feedback (small_codec): nothing
        # is lost, so DiLoCo's law holds. One row: the same without the small leaf checked
        # nothing this one does not, at ~17 s a row.
        "sparseloco-ef1",
        functools.partial(
            jc.sparseloco,
            inner(),
            sync_every=2,
            ef_decay=1.0,
            averaging="all",
            small_codec=jc.sign(),
        ),
        law=law_pseudo_gradient,
        shapes={**STREAM_SHAPES, "b": (16,)},
        compressed=("w", "v", "b"),
        bad=SPARSELOCO_ERRORS + (("small_codec", jc.top_k(0.5)),),
        skip=(("pmap", PMAP_SHARED),),
        wire=lambda shapes: sparse_wire(jc.chunked_top_k(32, 2048, 2), shapes, small=jc.sign()),
    ),
    Row(
        # The top-k inside sub-chunks of 256 (4 kept in each, 8-bit indices) under one 1-bit
        # scale at the mean per 4096: plain residual feedback loses nothing (DiLoCo's law),
        # and the all-gather sends the sub-chunk codec's payloads.
        "sparseloco-subchunk-ef1",
        functools.partial(
            jc.sparseloco,
            inner(),
            sync_every=2,
            ef_decay=1.0,
            averaging="all",
            bits=1,
            value_scale="mean",
            sub_chunk=256,
        ),
        law=law_pseudo_gradient,
        shapes=dict(STREAM_SHAPES),
        compressed=("w", "v"),
        bad=SPARSELOCO_ERRORS + (("sub_chunk", 100), ("sub_chunk", 256.0)),
        skip=(("pmap", PMAP_SHARED),),
        wire=lambda shapes: sparse_wire(jc.chunked_top_k(64, 4096, 1, "mean", 256), shapes),
    ),
    Row(
        # Through jc.compressed_allreduce's two-phase exchange: its server residual holds
        # the owners' second error, and the law counts it.
        "sparseloco-two_phase-ef1",
        functools.partial(jc.sparseloco, inner(), sync_every=2, ef_decay=1.0, strategy="two_phase"),
        law=law_pseudo_gradient,
        shapes=dict(STREAM_SHAPES),
        compressed=("w", "v"),
        bad=SPARSELOCO_ERRORS + (("strategy", "ring"), ("averaging", "senders")),
        skip=(
            ("pmap", PMAP_SHARED),
            ("bytes", "compressed_allreduce's two-phase bytes: test_contract's two_phase rows"),
        ),
    ),
]
ROWS += [
    Row(
        # A shared random mask (a quarter of each leaf, the same coordinates on every
        # device), int8 values all-gathered: plain residual feedback (ef_decay=1) loses
        # nothing, so DiLoCo's law holds; no index on the wire.
        "sparseloco-random-ef1",
        functools.partial(
            jc.sparseloco,
            inner(),
            sync_every=2,
            ef_decay=1.0,
            mask="random",
            density=0.25,
            value_codec=jc.int_quant(8),
            strategy="allgather",
        ),
        law=law_pseudo_gradient,
        shapes=dict(STREAM_SHAPES),
        compressed=("w", "v"),
        bad=SPARSELOCO_ERRORS  # chunk, bits: the top-k codec's, refused with a shared mask
        + (("mask", "shared"), ("explore", 0.5), ("value_codec", jc.top_k(0.5))),
        skip=(("pmap", PMAP_SHARED),),
        wire=lambda shapes: (N - 1) * jc.int_quant(8).payload_bytes(2 * 512),
    ),
]
ROWS += [
    Row("gossip-ring-int8", **gossip("ring", jc.int_quant(8))),
    Row(
        # The exponential graph is the same core with log2(n) permutations: tests/test_gossip.py
        "gossip-ring",
        **gossip("ring"),
        skip=(
            ("state", "exact gossip after plain SGD keeps nothing shaped like the params"),
            ("pmap", "the gossip core under pmap: gossip-ring-int8"),
        ),
    ),
]
ROW_BY_ID = {r.id: r for r in ROWS}
assert len(ROW_BY_ID) == len(ROWS), "row ids must be unique"


# --------------------------------------------------------------------------- building a row


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def params(shapes: dict) -> dict:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def grads(t: int, shapes: dict) -> dict:
    """Per-device gradients, stacked on a leading device axis."""
    rng = np.random.default_rng(100 + t)
    return {k: (rng.standard_normal((N, *s)) + 0.3).astype(np.float32) for k, s in shapes.items()}


class Built:
    """A row's transform, its sharded state, replicas and jitted step.

    ``step(replicas, state, grads) -> (out, replicas, state)``: ``out`` is each device's
    update, stacked ``(n, *shape)`` like the replicas.
    """

    def __init__(self, row: Row):
        self.row, self.tx, self.mesh = row, row.build(), mesh()
        self.params = params(row.shapes)
        self.replicas0 = jc.replica_params(self.params, self.mesh, "data")
        self.state0 = jc.sharded_init(self.tx, self.params, self.mesh, "data")
        self.specs = jc.state_specs(self.state0, "data")
        self.jitted = self.make_step(self.tx)
        self.step_fn = Blocking(self.jitted)

    def make_step(self, tx, at: int | None = None):
        row = self.row

        def step(r, s, g):
            if at is not None:
                s = row.at(s, at)
            p, g = jc.own(r), jc.own(g)
            u, s = tx.update(g, s, p)
            return jc.slot(u), jc.slot(optax.apply_updates(p, u)), s

        specs = jc.replica_specs(self.params, "data")
        return jax.jit(
            jax.shard_map(
                step,
                mesh=self.mesh,
                in_specs=(specs, self.specs, P("data")),
                out_specs=(P("data"), specs, self.specs),
            )
        )

    def put(self, g: dict) -> dict:
        return jax.device_put(g, NamedSharding(self.mesh, P("data")))

    def step(self, replicas, state, t_or_grads):
        g = grads(t_or_grads, self.row.shapes) if isinstance(t_or_grads, int) else t_or_grads
        return self.step_fn(replicas, state, self.put(g))


@functools.cache
def built(row_id: str) -> Built:
    return Built(ROW_BY_ID[row_id])


@dataclasses.dataclass
class Trajectory:
    grads: list  # per step, {name: (n, *shape)} numpy
    outs: list  # per step, {name: (n, *shape)} numpy
    replicas: list  # before step t (t = 0..STEPS), as numpy, and the arrays themselves
    states: list  # before step t (t = 0..STEPS)
    arrays: list


@functools.cache
def trajectory(row_id: str) -> Trajectory:
    b = built(row_id)
    shapes = b.row.shapes
    run = Trajectory([], [], [], [b.state0], [b.replicas0])
    for t in range(STEPS):
        out, reps, state = b.step(run.arrays[-1], run.states[-1], t)
        run.grads.append({k: a.astype(np.float64) for k, a in grads(t, shapes).items()})
        run.outs.append(jax.tree.map(np.asarray, out))
        run.arrays.append(reps)
        run.states.append(state)
    run.replicas = [jax.tree.map(lambda a: np.asarray(a, np.float64), r) for r in run.arrays]
    return run


@pytest.fixture(scope="module", params=[r.id for r in ROWS])
def row(request) -> Row:
    return ROW_BY_ID[request.param]


def per_device_fields(state: Any) -> tuple[str, ...]:
    return getattr(type(state), "PER_DEVICE_FIELDS", ())


# --------------------------------------------------------------------------- 1. conservation


def test_what_must_be_conserved_is(row):
    skip_unless(row, "law")
    row.law(row, trajectory(row.id))


# --------------------------------------------------------------------------- 2. poison and freeze


@pytest.mark.parametrize("where", ["exchange", "local"])
def test_nonfinite_gradient_poisons_output_and_freezes_state(row, where):
    b, run = built(row.id), trajectory(row.id)
    t = (row.exchanges or (None,))[0] if where == "exchange" else row.local
    if t is None:
        pytest.skip(f"no step exchanges every leaf from this step's gradients ({where})")
    g = grads(t, row.shapes)
    first = sorted(row.shapes)[-1]
    g[first].reshape(N, -1)[3, 7] = np.nan  # device 3, one value
    out, _, after = b.step(run.arrays[t], run.states[t], g)
    out = jax.tree.map(np.asarray, out)
    if where == "exchange":
        for k in row.shapes:
            assert not np.isfinite(out[k]).any(), k
        assert_trees_equal(after, run.states[t])  # the whole state, the count too
        return
    assert not np.isfinite(out[first][3]).all()  # the inner update of a NaN gradient
    others = np.delete(np.arange(N), 3)
    assert all(np.isfinite(out[k][others]).all() for k in row.shapes)
    for field in after._fields:
        new, old = getattr(after, field), getattr(run.states[t], field)
        # A delayed snapshot carries the NaN to its landing, with the count it was taken at
        # (test_delayed_snapshot_of_a_nonfinite_update_is_flagged_where_it_lands).
        if field in ("pending", "taken"):
            continue
        if field in per_device_fields(after):  # device 3 keeps its slot
            for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
                np.testing.assert_array_equal(np.asarray(x)[3], np.asarray(y)[3])
        elif field == "count":
            assert int(new) == int(old) + 1
        else:  # replicated fields: a local step does not touch them
            assert_trees_equal(new, old)


# Leaves of 8,192 values: XLA:CPU's float max / min reduce over 4,096 values or more drops
# NaN (docs/errors.md). A NaN or +inf at the first, a middle and the last value of device 3's
# ``w`` at an exchange step: every output non-finite, the state as it was.
LARGE = {"w": (128, 64), "v": (8192,)}
LARGE_ROW_IDS = ("local_sgd-H2", "diloco-int4", "sparseloco-ef1", "sparseloco-two_phase-ef1")


@functools.cache
def built_large(row_id: str) -> Built:
    row = ROW_BY_ID[row_id]
    return Built(
        dataclasses.replace(row, shapes={k: LARGE.get(k, s) for k, s in row.shapes.items()})
    )


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("row_id", LARGE_ROW_IDS)
def test_nonfinite_in_a_large_leaf_poisons_the_exchange_and_freezes_state(row_id, value):
    b = built_large(row_id)
    t = b.row.exchanges[0]
    replicas, state = b.replicas0, b.state0
    for s in range(t):
        _, replicas, state = b.step(replicas, state, s)
    for pos in (0, 4133, 8191):
        g = grads(t, b.row.shapes)
        g["w"].reshape(N, -1)[3, pos] = value
        out, _, after = b.step(replicas, state, g)
        for k, a in out.items():
            finite = np.isfinite(np.asarray(a))
            assert not finite.any(), (k, pos, int(finite.sum()))
        assert_trees_equal(after, state)


# --------------------------------------------------------------------------- 3. specs, sharded init


def test_state_specs_sharded_init_and_zero_gradient(row):
    b = built(row.id)
    state, specs = b.state0, b.specs
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    pairs = list(zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec), strict=True))
    for leaf, spec in pairs:
        assert sharded_like(leaf, b.mesh, spec), (leaf.shape, leaf.sharding, spec)
    # Per-device fields hold one slot per device, sharded over the data axis.
    for field in per_device_fields(state):
        for leaf in jax.tree.leaves(getattr(state, field)):
            assert leaf.shape[0] == N and leaf.sharding.shard_shape(leaf.shape)[0] == 1
    # Zero gradients through an exchange: zero updates, params unchanged, shardings kept.
    zero = {k: np.zeros((N, *s), np.float32) for k, s in row.shapes.items()}
    reps = b.replicas0
    for _ in range(2):
        out, reps, state = b.step(reps, state, zero)
        for k, a in out.items():
            assert not np.asarray(a).any(), k
    for k, a in reps.items():
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.replicas0[k]))
    new_pairs = zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=is_spec), strict=True)
    for leaf, spec in new_pairs:
        assert sharded_like(leaf, b.mesh, spec), (leaf.shape, leaf.sharding, spec)


# --------------------------------------------------------------------------- 4. orbax


def test_orbax_round_trip_continues_bit_identically(row, tmp_path):
    import orbax.checkpoint as ocp

    b, run = built(row.id), trajectory(row.id)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", run.states[2])
        ckpt.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, run.states[2])
        restored = ckpt.restore(tmp_path / "state", target)
    for a, r in zip(jax.tree.leaves(run.states[2]), jax.tree.leaves(restored), strict=True):
        assert r.sharding.is_equivalent_to(a.sharding, a.ndim)
    state, reps = restored, run.arrays[2]
    for t in (2, 3):
        out, reps, state = b.step(reps, state, t)
        assert_trees_equal(out, run.outs[t])
    assert_trees_equal(state, run.states[STEPS])


# --------------------------------------------------------------------------- 5. pmap == shard_map


def test_pmap_matches_shard_map(row):
    """Under ``jax.pmap`` each device's params are its own (no slot) and every state leaf has
    a leading device axis: ``jax.pmap(tx.init)`` of the replicated params."""
    skip_unless(row, "pmap")
    b, run = built(row.id), trajectory(row.id)
    tx = b.tx

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return u, optax.apply_updates(p, u), s

    pstep = Blocking(jax.pmap(step, axis_name="data"))
    state = jax.pmap(tx.init, axis_name="data")(jc.replicate(b.params, N))
    reps = jc.replicate(b.params, N)
    for t in range(STEPS):
        out, reps, state = pstep(reps, state, grads(t, row.shapes))
        for k in row.shapes:
            np.testing.assert_allclose(out[k], run.outs[t][k], rtol=1e-6, atol=1e-6, err_msg=k)
    for k in row.shapes:
        np.testing.assert_allclose(reps[k], run.replicas[STEPS][k], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- 6. wire bytes


@functools.cache
def pmean_bytes(shapes_key: tuple) -> float:
    """Plain data parallel: one f32 pmean of the gradients every step."""
    shapes = dict(shapes_key)
    m = mesh()
    fn = jax.jit(
        jax.shard_map(
            lambda g: jax.lax.pmean(jc.own(g), "data"), mesh=m, in_specs=P("data"), out_specs=P()
        )
    )
    g = jax.device_put(grads(0, shapes), NamedSharding(m, P("data")))
    return jc.comm_report(fn, g).bytes_per_device


def step_bytes(row: Row, t: int) -> float:
    """Bytes per device of the step at count ``t`` (compiled once per row and step)."""
    ROW_BY_ID.setdefault(row.id, row)
    return _step_bytes(row.id, t)


@functools.cache
def _step_bytes(row_id: str, t: int) -> float:
    b, row = built(row_id), ROW_BY_ID[row_id]
    fn = b.make_step(b.tx, at=t)
    return jc.comm_report(fn, b.replicas0, b.state0, b.put(grads(0, row.shapes))).bytes_per_device


def test_wire_bytes_of_exchange_and_local_steps(row):
    skip_unless(row, "bytes")
    if row.at is None:
        pytest.skip("the step's schedule cannot be fixed: nothing to compare")
    plain = pmean_bytes(tuple(sorted(row.shapes.items())))
    size = sum(int(np.prod(s)) for s in row.shapes.values())
    assert plain == pytest.approx(2 * (N - 1) / N * 4 * size, rel=0.01)
    if row.local is not None:
        assert step_bytes(row, row.local) == 0.0
    t = row.exchanges[0] if row.exchanges else 2  # the streaming row: a fragment lands
    sync = step_bytes(row, t)
    print(f"{row.id}: exchange {sync:.0f} B/device, per-step pmean {plain:.0f}")
    assert sync > 0
    if row.wire is not None:  # its own bytes model (no gradient-sized all-reduce in it)
        assert sync == pytest.approx(row.wire(row.shapes))
    elif row.compressed:
        assert sync < plain / 3
    else:
        assert sync == pytest.approx(plain, rel=0.01)


def test_streaming_sync_sends_one_fragment():
    """Streaming DiLoCo with F = 2 fragments of equal size: each step that exchanges sends at
    most half of what the same DiLoCo without fragments sends at its sync."""
    row = ROW_BY_ID["streaming_diloco-F2-delay1"]
    full = step_bytes(ROW_BY_ID["diloco-int4"], 1)  # the same leaves, codec and H, F = 1
    parts = [step_bytes(row, t) for t in (1, 2)]  # fragment 1 lands at 1, fragment 0 at 2
    # every exchange with residual feedback also psums one float32 (the mean waits on the
    # new memories: compressed_allreduce._after_memory), whatever it sends
    order = 2 * (N - 1) / N * 4
    assert full > 0 and all(0 < p - order <= (full - order) / 2 * 1.001 for p in parts), (
        full,
        parts,
    )


# A growing H (``sync_every`` a sequence of intervals): syncs after 1 and 3 steps, then every
# 3 (counts 0, 2, 5, ...). Not a contract row: the core and its other items are local_sgd-H2's.
GROWING = Row("local_sgd-H1,2,3", local_sgd(sync_every=(1, 2, 3)), exchanges=(0, 2), local=1)
ROW_BY_ID[GROWING.id] = GROWING


def test_delayed_snapshot_of_a_nonfinite_update_is_flagged_where_it_lands():
    """A NaN in device 3's update at the step its fragment's pseudo-gradient is snapshotted
    (``w`` at step 0, landing at step 1): the landing's mean is NaN, so every device's ``w``
    update is NaN and the whole state stays as it was. Until 2026-11-27 device 3 kept its
    previous snapshot (zeros): the landing averaged it, finite, and the other devices went
    on with an anchor that had silently left device 3 out, at every sync after."""
    b, run = built("streaming_diloco-F2-delay1"), trajectory("streaming_diloco-F2-delay1")
    g = grads(0, b.row.shapes)
    g["w"].reshape(N, -1)[3, 7] = np.nan
    _, reps, state = b.step(run.arrays[0], run.states[0], g)
    pending = np.asarray(state.pending[1][0])  # fragment 1 holds w
    assert not np.isfinite(pending[3]).all() and np.isfinite(np.delete(pending, 3, 0)).all()
    out, _, after = b.step(reps, state, 1)
    assert not np.isfinite(np.asarray(out["w"])).any()  # NaN on every device
    assert_trees_equal(after, state)  # the anchor, the outer state and the count too
    # the retried landing reads the same snapshot: it fails again (jc.apply_if_finite around
    # the transform skips the snapshot step instead, docs/local-sgd-diloco.md)
    out, _, again = b.step(reps, after, 2)
    assert not np.isfinite(np.asarray(out["w"])).any()
    assert_trees_equal(again, state)


def test_growing_sync_every_syncs_at_the_early_steps_then_every_h():
    """The replicas are the mean after the steps ending each interval and their own
    elsewhere (the traced count), a local step sends nothing and a sync what plain ``pmean``
    sends (the count fixed); the schedule against the traced condition over 100 steps."""
    law_mean(GROWING, trajectory(GROWING.id))
    want = [5, 15, 30, 60, 90]
    for start in (0, 3):
        kw = dict(sync_every=(5, 10, 15, 30), start_step=start)
        cfg = dataclasses.replace(
            periodic.Config("", tuple, None, None, 30, None, None, None, start_step=start),
            early=(5, 15, 30),
        )
        traced = np.asarray(jax.jit(jax.vmap(functools.partial(cfg.due, f=0)))(np.arange(100)))
        fixed = [periodic.schedule(c, **kw)[0] for c in range(100)]
        assert list(traced) == fixed
        assert [c + 1 for c in range(start, 100) if fixed[c]] == [start + w for w in want]
        assert all(fixed[:start])  # averaged at every step before start_step


# --------------------------------------------------------------------------- 7. bad arguments


@pytest.mark.parametrize(
    "case", ["construction", "unbound_axis", "gradient_tree", "state", "devices"]
)
def test_bad_arguments_name_the_argument(row, case):
    if case == "construction":
        for name, value in row.bad:
            with pytest.raises((ValueError, TypeError), match=name):
                row.build(**{name: value})
        return
    skip_unless(row, case)
    b = built(row.id)
    g = b.put(grads(0, row.shapes))
    if case == "unbound_axis":
        tx = row.build(axis_name="model")  # no such axis in the mesh
        with pytest.raises(ValueError, match="axis_name"):
            b.make_step(tx).trace(b.replicas0, b.state0, g)
    elif case == "gradient_tree":
        first = sorted(row.shapes)[0]
        wrong = {**grads(0, row.shapes), first: np.zeros((N, 3), np.float32)}
        with pytest.raises(ValueError, match="gradient"):
            b.jitted.trace(b.replicas0, b.state0, b.put(wrong))
    elif case == "state":  # a state built for other params
        other = {k: np.zeros((2, *s), np.float32) for k, s in row.shapes.items()}
        state = jax.eval_shape(lambda p: jc.sharded_init(b.tx, p, b.mesh, "data"), other)
        with pytest.raises(ValueError, match="state"):
            b.jitted.trace(b.replicas0, state, g)
    else:  # saved on 2n devices, restored on n without jc.resize_state: 2 rows per device
        # (sparseloco's exchange read the first row and dropped the other, with no error)
        def double(a, spec):
            if a is None or spec == P():
                return a
            return jax.ShapeDtypeStruct(
                (2 * a.shape[0], *a.shape[1:]), a.dtype, sharding=a.sharding
            )

        doubled = jax.tree.map(double, b.state0, b.specs, is_leaf=lambda x: x is None)
        pairs = zip(jax.tree.leaves(doubled), jax.tree.leaves(b.state0), strict=True)
        if all(x is y for x, y in pairs):
            pytest.skip("no per-device field: nothing depends on the number of devices")
        with pytest.raises(ValueError, match="state"):
            b.jitted.trace(b.replicas0, doubled, g)


# --------------------------------------------------------------------------- 8. finite outliers


@pytest.mark.parametrize("value", OUTLIERS)
def test_finite_outlier_leaves_no_state_zero_or_nonfinite(row, value):
    """A finite outlier in device 0's gradient at step 0 leaves no state NaN, inf or newly
    zero, and every output finite (the replicas may leave float32's range: -LR * 3e38 fits)."""
    b = built(row.id)
    replicas, state = b.replicas0, b.state0
    for t in range(STEPS):
        g = grads(t, row.shapes)
        if t == 0:
            g[sorted(row.shapes)[-1]].reshape(N, -1)[0, 0] = value
        out, replicas, state = b.step(replicas, state, g)
        assert all(np.isfinite(np.asarray(o)).all() for o in jax.tree.leaves(out)), t
    assert_state_survives_outlier(state, trajectory(row.id).states[-1], value)
