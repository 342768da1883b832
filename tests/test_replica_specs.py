"""``jc.sharded_init`` / ``jc.state_specs`` with ``param_specs`` for the replica transforms.

A ``("replica", "data")`` mesh of 2 x 4: ``jc.diloco`` / ``jc.local_sgd`` / ``jc.sparseloco``
(and ``jc.accumulate`` around them) over ``"replica"``, FSDP over ``"data"`` inside each
replica for one leaf (``P("data")``, through ``jc.fsdp_gather``) beside a leaf whole on the
replica's devices (``P()``). Their states nest an optimizer state per device, per-fragment
outer and exchange states and raveled accumulators: each laid out from the param specs.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Blocking
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.axes import varying_axes

BOTH = ("replica", "data")
D, OUT = 32, 6  # a: (32, 32) sharded over "data" (blocks of 8 x 32 = 256); b: (32, 6) whole
SPECS = {"a": P("data"), "b": P()}
STEPS = 4
NESTEROV = optax.sgd(0.7, momentum=0.6, nesterov=True)


def _mesh():
    return jax.make_mesh(
        (2, 4), BOTH, axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8]
    )


def _params():
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"a": jax.random.normal(k[0], (D, D)) / 6, "b": jax.random.normal(k[1], (D, OUT)) / 6}


def _step(tx):
    """One step on this device's replica: ``a`` gathered through ``jc.fsdp_gather`` (its
    gradient summed over the replica's devices), ``b`` whole (under ``check_vma`` its
    gradient is summed over them too); both divided by 4, the replica's mean gradient."""

    def step(reps, state, x, y):
        p = jc.own(reps)
        gather = functools.partial(jc.fsdp_gather, axis_name="data", weights=None, grads=None)

        def loss(q):
            return jnp.mean((jnp.tanh(x @ gather(q["a"])) @ q["b"] - y) ** 2)

        g = jax.tree.map(lambda v: v / 4, jax.grad(loss)(p))
        u, state = tx.update(g, state, p)
        return jc.slot(optax.apply_updates(p, u)), state

    return step


def _typed_like_carried(state):
    """``state`` of ``tx.init`` inside the step, each per-device array typed as a carried
    state is: varying over ``"replica"``, and over ``"data"`` where it belongs to ``a`` (its
    size a multiple of a's block of 256; b's arrays hold 192 values, counts 1)."""
    per_device = jc.state_specs(state, "replica")

    def cast(spec, x):
        if "replica" not in tuple(spec):
            return x
        axes = BOTH if x.size % 256 == 0 else ("replica",)
        axes = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, axes, to="varying") if axes else x

    return jax.tree.map(cast, per_device, state)


def _data(m):
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    xs = jax.random.normal(k[0], (STEPS, 64, D))
    ys = jax.random.normal(k[1], (STEPS, 64, OUT))
    return xs, ys


def _train(make, inside):
    """The replicas after ``STEPS`` steps: the state from ``jc.sharded_init(...,
    param_specs=SPECS)`` fed to each step with ``jc.state_specs(..., SPECS, params, mesh)``,
    or (``inside``) built by ``tx.init`` inside one program that runs every step."""
    m, tx = _mesh(), make()
    pspec = {k: P("replica", *s) for k, s in SPECS.items()}
    reps = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(m, s)),
        jc.replica_params(_params(), m, "replica"),
        pspec,
    )
    xs, ys = _data(m)
    step = _step(tx)
    if inside:

        def run(reps, xs, ys):
            state = _typed_like_carried(tx.init(jc.own(reps)))
            for t in range(STEPS):
                reps, state = step(reps, state, xs[t], ys[t])
            return reps

        batch = P(None, BOTH)
        fn = jax.jit(jax.shard_map(run, mesh=m, in_specs=(pspec, batch, batch), out_specs=pspec))
        put = lambda a: jax.device_put(a, NamedSharding(m, batch))  # noqa: E731
        return jax.block_until_ready(fn(reps, put(xs), put(ys)))
    state = jc.sharded_init(tx, _params(), m, "replica", param_specs=SPECS)
    specs = jc.state_specs(state, "replica", SPECS, _params(), m)
    gspec = P(BOTH)
    fn = Blocking(
        jax.jit(
            jax.shard_map(
                step, mesh=m, in_specs=(pspec, specs, gspec, gspec), out_specs=(pspec, specs)
            )
        )
    )
    put = lambda a: jax.device_put(a, NamedSharding(m, gspec))  # noqa: E731
    for t in range(STEPS):
        reps, state = fn(reps, state, put(xs[t]), put(ys[t]))
    return reps


CASES = {
    # inner AdamW state per device, the anchor, Nesterov's momentum, int8 error feedback
    "diloco": (
        lambda: jc.diloco(
            optax.adamw(3e-3), "replica", 2, outer=NESTEROV, codec=jc.int_quant(8), min_size=0
        ),
        True,
    ),
    # two fragments (their outer and exchange states, pending snapshots), int4, delay 1
    "diloco-fragments-delay": (
        lambda: jc.diloco(
            optax.adamw(3e-3),
            "replica",
            2,
            fragments=2,
            delay=1,
            codec=jc.int_quant(4),
            min_size=0,
        ),
        False,
    ),
    "local_sgd": (
        lambda: jc.local_sgd(
            optax.sgd(0.1, momentum=0.9), "replica", 2, codec=jc.int_quant(8), min_size=0
        ),
        True,
    ),
    # decayed error feedback per device, outer momentum
    "sparseloco": (
        lambda: jc.sparseloco(
            optax.adamw(3e-3),
            "replica",
            2,
            chunk=64,
            density=1 / 8,
            min_size=0,
            outer=NESTEROV,
        ),
        True,
    ),
    # the raveled per-device accumulator around DiLoCo (syncing at every applied update)
    "accumulate-diloco": (
        lambda: jc.accumulate(jc.diloco(optax.adamw(3e-3), "replica", 1), 2),
        True,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_init_with_param_specs_trains_as_the_state_built_inside_the_step(name):
    """4 steps (2 syncs; ``accumulate``: 2 applied updates, each a sync) from the state of
    ``jc.sharded_init(tx, params, mesh, "replica", param_specs=...)`` end where the state
    built by ``tx.init`` inside the step ends, to float32 rounding: the reference is one
    program of the 4 steps, which XLA fuses otherwise (measured on params up to 0.51: 0 for
    diloco and local_sgd, bit for bit; 1.5e-8 for sparseloco and accumulate-diloco; 3.0e-8
    with fragments and delay). After a sync without ``delay`` the two replicas agree to the
    rounding of ``p + u`` (docs/lm.md; measured at most 9.3e-10 apart); with ``delay`` they
    are 0.014 apart. Until
    2026-11-27 ``jc.sharded_init`` failed in jax's out_specs check (the inner optimizer's
    arrays, the per-fragment states and the accumulator were laid out ``P("replica")``), and
    with a codec (or ``delay``, or SparseLoCo) the sync of ``b`` failed while tracing
    ("cond branches must have equal output types"): ``b``'s payload shared a bucket with
    ``a``'s shards and came back typed as varying over ``"data"``."""
    make, synced = CASES[name]
    got = _train(make, inside=False)
    want = _train(make, inside=True)
    for k in got:
        a, b = np.asarray(got[k]), np.asarray(want[k])
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-7)
        if synced:
            np.testing.assert_allclose(a[0], a[1], rtol=0, atol=1e-6 * np.abs(a).max())
        else:  # delay mixes the anchor in over the next steps: the replicas stay apart
            assert np.abs(a[0] - a[1]).max() > 1e-4


def test_state_specs_of_streaming_fragments_of_sharded_params_need_the_mesh():
    """Streaming DiLoCo cuts its fragments by each device's block sizes: with ``param_specs``
    that shard a leaf and no ``mesh`` those are unknown, and a wrong cut would lay a leaf's
    state out by another leaf's spec. Refused naming ``mesh``."""
    m = _mesh()
    tx = jc.diloco(optax.adamw(3e-3), "replica", 2, fragments=2)
    state = jc.sharded_init(tx, _params(), m, "replica", param_specs=SPECS)
    with pytest.raises(ValueError, match="`mesh`"):
        jc.state_specs(state, "replica", SPECS, _params())
    specs = jc.state_specs(state, "replica", SPECS, _params(), m)
    assert specs.inner[0].mu["a"] == P("replica", "data", None)
    assert specs.inner[0].mu["b"] == P("replica", None, None)
    assert specs.anchor == {"a": P("data", None), "b": P(None, None)}
    assert [len(o[0].trace) for o in specs.outer] == [1, 1]


# inner optimizers that read a whole leaf, told by their optax state types (MuLoCo: Muon)
WHOLE_LEAF = {
    "optax.contrib.muon": lambda: optax.contrib.muon(0.02),
    "optax.adafactor": lambda: optax.adafactor(0.02),
    "optax.novograd": lambda: optax.novograd(0.02),
}


def _init_warnings(tx, specs, m):
    """``jc.sharded_init``'s state and the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jc.sharded_init(tx, _params(), m, "replica", param_specs=specs)
    return state, [str(w.message) for w in caught]


def _gather_where_sharded(specs):
    """``a`` as the loss uses it: gathered over ``"data"`` where ``specs`` shard it."""
    if specs["a"] == P():
        return lambda q: q
    axis = len(tuple(specs["a"])) - 1  # P("data"): rows; P(None, "data"): columns
    return functools.partial(jc.fsdp_gather, axis_name="data", weights=None, grads=None, axis=axis)


CLIP = 0.05  # binds: unclipped, the same run moves the params 0.71, clipped 0.051
INNERS = {
    **WHOLE_LEAF,
    "optax-clip": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.5)),
    "jc-clip": lambda: optax.chain(
        jc.clip_by_global_norm(CLIP, None, shard_axis="data"), optax.sgd(0.5)
    ),
}


@functools.cache
def _inner_run(name, specs_items):
    """``a`` after ``STEPS`` DiLoCo steps (``INNERS[name]`` inside, sync every 2) on the
    2 x 4 mesh (``a`` sharded or whole as ``specs`` give it, ``b`` whole), and the warnings
    of ``jc.sharded_init`` and the steps."""
    specs = dict(specs_items)
    m, tx = _mesh(), jc.diloco(INNERS[name](), "replica", 2)
    pspec = {k: P("replica", *s) for k, s in specs.items()}
    reps = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(m, s)),
        jc.replica_params(_params(), m, "replica"),
        pspec,
    )
    use = _gather_where_sharded(specs)

    def step(reps, state, x, y):
        p = jc.own(reps)

        def loss(q):
            return jnp.mean((jnp.tanh(x @ use(q["a"])) @ q["b"] - y) ** 2)

        g = jax.tree.map(lambda v: v / 4, jax.grad(loss)(p))
        u, state = tx.update(g, state, p)
        return jc.slot(optax.apply_updates(p, u)), state

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jc.sharded_init(tx, _params(), m, "replica", param_specs=specs)
        sspec, gspec = jc.state_specs(state, "replica", specs, _params(), m), P(BOTH)
        fn = Blocking(
            jax.jit(
                jax.shard_map(
                    step, mesh=m, in_specs=(pspec, sspec, gspec, gspec), out_specs=(pspec, sspec)
                )
            )
        )
        xs, ys = _data(m)
        put = lambda a: jax.device_put(a, NamedSharding(m, gspec))  # noqa: E731
        for t in range(STEPS):
            reps, state = fn(reps, state, put(xs[t]), put(ys[t]))
    return np.asarray(reps["a"]), [str(w.message) for w in caught if "whole" in str(w.message)]


@pytest.mark.parametrize(
    ("name", "spec", "least"),
    [
        ("optax.contrib.muon", P("data"), 1.0),  # measured 1.59
        ("optax.contrib.muon", P(None, "data"), 0.5),  # 0.74
        ("optax.adafactor", P("data"), 0.03),  # 0.054
        ("optax.adafactor", P(None, "data"), 0.05),  # 0.087
        ("optax.novograd", P("data"), 0.5),  # 0.99
        ("optax.novograd", P(None, "data"), 0.5),  # 1.00
    ],
)
def test_whole_leaf_inner_optimizers_on_fsdp_shards_step_blocks_and_sharded_init_warns(
    name, spec, least
):
    """DiLoCo with ``a`` (32 x 32) sharded inside each replica: an inner optimizer that reads
    the whole leaf steps each device's block (8 x 32 rows, or 32 x 8 columns) as the leaf.
    After 4 steps (2 syncs) ``a`` is away from the run with ``a`` whole on the replica's
    devices (``P()``), in Frobenius norm relative to how far that run moved it: Muon 1.59
    (rows) and 0.74 (columns), ``optax.adafactor`` (its defaults: a 32 x 32 leaf is not
    factored, its block-RMS clipping and parameter scale read the leaf) 0.054 and 0.087,
    ``optax.novograd`` 0.99 and 1.00 (AdamW inside: 0 apart). Until 2026-11-27
    ``jc.sharded_init`` said nothing (for Muon: until 09b0f36); it now warns once, naming
    ``param_specs``, the leaf and the transform, and stays silent where ``a`` is whole; the
    steps' traces add no warning of their own (the inner state's check runs in ``init``)."""
    whole, quiet = _inner_run(name, (("a", P()), ("b", P())))
    blocks, caught = _inner_run(name, (("a", spec), ("b", P())))
    assert not quiet
    assert len(caught) == 1, caught
    assert (
        caught[0].startswith("jc.sharded_init: param_specs")
        and f"['a'] over ('data',) by {name}" in caught[0]
    )
    start = np.asarray(_params()["a"])[None]
    off = np.linalg.norm(blocks - whole) / np.linalg.norm(whole - start)
    assert off > least, off


@pytest.mark.parametrize("spec", [P("data"), P(None, "data")])
def test_global_norm_clipping_of_fsdp_shards_inside_diloco_is_the_whole_leaves(spec):
    """``jc.clip_by_global_norm(c, None, shard_axis="data")`` in DiLoCo's inner optimizer,
    ``a`` sharded inside each replica: each replica's gradient clipped by its whole norm (a
    scalar ``psum`` over ``"data"``, ``b`` counted once), the run ends where
    ``optax.clip_by_global_norm(c)`` on the whole leaves ends (measured: 3.0e-8 at most, of
    params moved 0.051). Until 2026-11-27 refused: the params differ per device over
    ``"replica"`` too (each device's own replica) and were taken for shards there; the
    message's ``shard_axis=("data", "replica")`` clipped every replica by the norm of both
    replicas' gradients (0.29 of the move off, largest value 1.5e-3 against a move of
    5.2e-3). ``optax.clip_by_global_norm`` on the shards fails while tracing: ``b`` scaled
    by a factor that differs per shard."""
    whole, _ = _inner_run("optax-clip", (("a", P()), ("b", P())))
    clipped, _ = _inner_run("jc-clip", (("a", spec), ("b", P())))
    np.testing.assert_allclose(clipped, whole, rtol=0, atol=2e-7)
    start = np.asarray(_params()["a"])[None]
    assert np.abs(whole - start).max() > 1e-3


def test_global_norm_of_the_local_shards_inside_diloco_is_refused_naming_inner():
    """``optax.clip_by_global_norm(c)`` in DiLoCo's inner chain with ``a`` sharded: each
    device clips by the norm of its own shard of ``a`` and of ``b``, so ``b`` (whole on the
    replica's devices) gets a factor that differs per device, and its copies would go apart
    within the replica. Until 2026-11-27 jax refused it at the sync, "cond branches must have
    equal output types" (TypeError); now a ValueError naming ``inner``, the leaf, the axis
    and ``jc.clip_by_global_norm(c, None, shard_axis="data")``."""
    with pytest.raises(ValueError, match=r"`inner`.*\['b'\].*\('data',\)") as info:
        _inner_run("optax-clip", (("a", P("data")), ("b", P())))
    assert "jc.clip_by_global_norm(c, None, shard_axis='data')" in str(info.value)


@pytest.mark.parametrize("name", list(WHOLE_LEAF))
def test_whole_leaf_split_over_an_auto_axis_or_elementwise_gives_no_warning(name):
    """No warning where the inner optimizer sees whole leaves: ``a`` split over an
    ``AxisType.Auto`` axis (the step manual over the other axis only), or AdamW inside."""
    auto = jax.make_mesh(
        (2, 4), BOTH, axis_types=(AxisType.Explicit, AxisType.Auto), devices=jax.devices()[:8]
    )
    _, caught = _init_warnings(jc.diloco(WHOLE_LEAF[name](), "replica", 2), SPECS, auto)
    assert not [w for w in caught if "param_specs" in w]
    _, caught = _init_warnings(jc.diloco(optax.adamw(3e-3), "replica", 2), SPECS, _mesh())
    assert not [w for w in caught if "param_specs" in w]


RECIPES = {
    "jc.diloco": lambda inner: jc.diloco(inner, "replica", 2),
    "jc.local_sgd": lambda inner: jc.local_sgd(inner, "replica", 2),
    "jc.sparseloco": lambda inner: jc.sparseloco(inner, "replica", 2, chunk=64, min_size=0),
}


def _init_in_step_warnings(tx, specs, m, manual=BOTH):
    """The warnings of ``tx.init`` traced inside a ``shard_map`` manual over ``manual``, of
    the replicas' params (``a`` laid out by ``specs``; over an Auto axis not in ``manual``
    each device sees the whole leaf)."""
    global_specs = {k: P("replica", *s) for k, s in specs.items()}
    in_specs = {
        k: P("replica", *s) if set(manual) == set(BOTH) else P("replica") for k, s in specs.items()
    }
    reps = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(m, s)),
        jc.replica_params(_params(), m, "replica"),
        global_specs,
    )

    def init_only(reps):
        tx.init(jc.own(reps))
        return reps

    fn = jax.shard_map(
        init_only, mesh=m, in_specs=(in_specs,), out_specs=in_specs, axis_names=set(manual)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(fn, reps)
    return [str(w.message) for w in caught if "whole" in str(w.message)]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(WHOLE_LEAF))
def test_inner_state_built_inside_the_step_on_fsdp_shards_warns(recipe, name):
    """The state built by ``tx.init`` inside the step (``jc.sharded_init`` not called): the
    recipe's init sees the inner state's types and the params' types, ``a`` differing per
    device over ``"data"`` beside ``"replica"`` (a block of one leaf), and warns naming the
    recipe, ``inner``, the leaf and the transform. Silent with ``a`` whole (``P()``), over an
    ``AxisType.Auto`` data axis (the step manual over ``"replica"`` only: each device sees
    the whole leaf), and with AdamW inside. Until 2026-11-27 silent."""
    tx = RECIPES[recipe](WHOLE_LEAF[name]())
    caught = _init_in_step_warnings(tx, SPECS, _mesh())
    assert len(caught) == 1, caught
    assert caught[0].startswith(f"{recipe}: the inner optimizer (`inner`)")
    assert f"['a'] over ('data',) by {name}" in caught[0]
    assert not _init_in_step_warnings(tx, {"a": P(), "b": P()}, _mesh())
    auto = jax.make_mesh(
        (2, 4), BOTH, axis_types=(AxisType.Explicit, AxisType.Auto), devices=jax.devices()[:8]
    )
    assert not _init_in_step_warnings(tx, SPECS, auto, manual=("replica",))
    assert not _init_in_step_warnings(RECIPES[recipe](optax.adamw(3e-3)), SPECS, _mesh())
