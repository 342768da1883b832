"""Data x model meshes: params sharded over "model", shard_map manual over "data" only.

Each device compresses its own block of every model-sharded leaf (``param_specs=``), so no
gradient-sized float32 collective crosses the model axis and a device sends about half of
what it sends with the same params replicated over "model".
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SIZES = (256, 1024, 256)
SPECS = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None), "b1": P()}


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))


def _params(mesh, sharded):
    rng = np.random.RandomState(0)
    d_in, hidden, d_out = SIZES
    host = {
        "w0": rng.standard_normal((d_in, hidden)).astype(np.float32) / 16,
        "b0": np.zeros((hidden,), np.float32),
        "w1": rng.standard_normal((hidden, d_out)).astype(np.float32) / 32,
        "b1": np.zeros((d_out,), np.float32),
    }
    specs = SPECS if sharded else {k: P() for k in SPECS}
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}, specs


def _loss(params, x, y):
    h = jax.nn.relu(x @ params["w0"] + params["b0"])
    return jnp.mean((h @ params["w1"] + params["b1"] - y) ** 2)


def _step(
    mesh, codec, sharded, loss=_loss, param_specs=True, auto_axes=False, inner=None, **exchange
):
    """``(jitted step, (params, state, x, y))``; ``param_specs=False``: the transform gets
    none. ``auto_axes``: an Explicit model axis made Auto for the step
    (``jax.sharding.auto_axes``; lower it under ``jax.set_mesh(mesh)``). ``inner``: the
    optax transform after the exchange (``optax.sgd(0.1)``). ``exchange``: more arguments
    of ``jc.compressed_allreduce``."""
    params, specs = _params(mesh, sharded)
    # replicated params: P() specs say so (no warning about an unseen model axis)
    extra = {"param_specs": specs, **exchange} if param_specs else dict(exchange)
    inner = optax.sgd(0.1) if inner is None else inner
    tx = optax.chain(jc.compressed_allreduce(codec, "data", min_size=512, **extra), inner)
    state = jc.sharded_init(tx, params, mesh, "data", **({"param_specs": specs} if sharded else {}))
    sspecs = jc.state_specs(state, "data")

    def step(params, state, x, y):
        grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fn = jax.shard_map(
        step,
        mesh=None if auto_axes else mesh,
        in_specs=(P(), sspecs, P("data"), P("data")),
        out_specs=(P(), sspecs),
        axis_names={"data"},
    )
    if auto_axes:
        layout = jax.tree.map(lambda a: a.sharding.spec, (params, state))
        fn = jax.sharding.auto_axes(fn, axes="model", out_sharding=layout)
    fn = jax.jit(fn)
    rng = np.random.RandomState(1)
    x = jax.device_put(
        rng.standard_normal((32, SIZES[0])).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    y = jax.device_put(
        rng.standard_normal((32, SIZES[2])).astype(np.float32), NamedSharding(mesh, P("data"))
    )
    return fn, (params, state, x, y)


def test_model_sharded_step_sends_blocks_not_gradients():
    codec = jc.sign()
    mesh = _mesh()
    sharded = jc.comm_report(*_step_args(mesh, codec, True))
    replicated = jc.comm_report(*_step_args(mesh, codec, False))
    assert sharded.bytes_per_device <= 0.6 * replicated.bytes_per_device
    # An Explicit model axis, made Auto for the step (the pattern jaxcomp's refusal names):
    # the same bytes. (Without auto_axes the step's shard_map alone sent 5.57 MB.)
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    fn, args = _step(explicit, codec, True, auto_axes=True)
    with jax.set_mesh(explicit):
        made_auto = jc.comm_report(fn, *args)
    assert made_auto.bytes_per_device == sharded.bytes_per_device
    block = SIZES[0] * SIZES[1] // 2 * 4  # bytes of one model block of w0
    big_f32 = [c for c in sharded.collectives if "f32" in c.dtypes and c.array_bytes >= block // 4]
    assert not big_f32, big_f32


def test_model_sharded_step_does_not_warn_about_shard_axis():
    """``param_specs`` blocks over "model" run in jaxcomp's own shard_map (no varying types
    there): their flags are or-ed over the blocks already, so no warning asks for
    ``shard_axis`` (until 2026-11-27 every such step warned, naming shard_axis='model')."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jc.comm_report(*_step_args(_mesh(), jc.sign(), True))
    assert not [w for w in caught if "shard_axis" in str(w.message)]


def _step_args(mesh, codec, sharded):
    fn, args = _step(mesh, codec, sharded)
    return (fn, *args)


def test_model_sharded_memories_keep_the_params_sharding_and_train():
    mesh = _mesh()
    fn, (params, state, x, y) = _step(mesh, jc.int_quant(8), True)
    memory = state[0].memory
    assert memory["w0"].sharding.spec == P("data", None, "model")
    assert memory["w1"].sharding.spec == P("data", "model")
    # Each device holds its block only.
    assert memory["w0"].addressable_shards[0].data.shape == (1, SIZES[0], SIZES[1] // 2)
    before = float(jax.jit(_loss)(params, x, y))
    for _ in range(5):
        params, state = jax.block_until_ready(fn(params, state, x, y))
    after = float(jax.jit(_loss)(params, x, y))
    assert after < 0.9 * before
    assert state[0].memory["w0"].sharding.spec == P("data", None, "model")


def test_model_sharded_optax_moments_keep_the_params_sharding_and_train():
    """``optax.adam`` after the exchange: its moments of a model-sharded param are laid out
    like it (each device inits its block). Until 2026-11-27 ``jc.sharded_init`` gave every
    optax array ``P()`` and failed in jax's "out_specs ... mu['w0'] is P()"."""
    mesh = _mesh()
    fn, (params, state, x, y) = _step(mesh, jc.int_quant(8), True, inner=optax.adam(1e-2))
    for name in ("mu", "nu"):
        moments = getattr(state[1][0], name)
        for k, a in moments.items():
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), a.ndim), k
    params, state = jax.block_until_ready(fn(params, state, x, y))  # the step takes them
    assert state[1][0].mu["w0"].sharding.spec == P(None, "model")
    assert float(jnp.abs(state[1][0].mu["w0"]).max()) > 0


def _elementwise_loss(params, x, y):
    # No contraction over a sharded dimension: explicit axes would need an out_sharding.
    h = x @ params["w0"] + params["b0"]
    return jnp.mean(h**2) + jnp.mean((params["w1"] - 0.1) ** 2) + jnp.mean(params["b1"] ** 2)


def test_explicit_model_axis_is_refused_with_the_auto_pattern():
    """A shard_map manual over "data" gathers every operand sharded over an Explicit model
    axis at its boundary (jax 0.10; 5.6 MB per device on this step against 0.10 MB with
    replicated params): refused at trace time, naming AxisType.Auto and param_specs=."""
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit)
    )
    for given in (True, False):  # param_specs=, or the shardings read from the types
        fn, args = _step(mesh, jc.int_quant(8), True, loss=_elementwise_loss, param_specs=given)
        with pytest.raises(ValueError, match=r"`param_specs`.*Explicit.*AxisType\.Auto.*auto_axes"):
            jax.eval_shape(fn, *args)


def test_model_sharded_tree_without_param_specs_warns():
    # Auto shardings are not in the types: the transform cannot see them, the compiler
    # gathers each leaf in float32 first (2.39x the bytes): a warning names param_specs=.
    fn, args = _step(_mesh(), jc.sign(), True, param_specs=False)
    with pytest.warns(UserWarning, match="param_specs="):
        jax.eval_shape(fn, *args)


def test_fused_residuals_on_model_sharded_params_give_the_same_bits():
    """``fuse_residuals=True`` on each device's model block (int8 in blocks of 64, gathered
    whole): over 4 steps, the third with a NaN in one device's batch, params and state are
    those of the passes over whole leaves, bit for bit, and the NaN step keeps the memory."""
    mesh, runs = _mesh(), {}
    host = np.random.RandomState(1).standard_normal((32, SIZES[0])).astype(np.float32)
    for fuse in (False, True):
        fn, (params, state, _, y) = _step(
            mesh, jc.int_quant(8, 64), True, strategy="allgather", fuse_residuals=fuse
        )
        outs = []
        for t in range(4):
            x = host * (1 + t)
            if t == 2:
                x[0, 0] = np.nan
            x = jax.device_put(x, NamedSharding(mesh, P("data")))
            if t == 0:
                text = fn.lower(params, state, x, y).compile().as_text()
            new_params, state = jax.block_until_ready(fn(params, state, x, y))
            outs.append(jax.tree.map(np.asarray, (new_params, state)))
            params = params if t == 2 else new_params
        runs[fuse] = outs, text.count(" while(")
    (fused, loops), (plain, plain_loops) = runs[True], runs[False]
    assert loops > plain_loops  # the chunked loops are compiled in only when asked
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
    memory = [jax.tree.leaves(fused[t][1][0].memory) for t in (1, 2, 3)]
    for before, nan_step in zip(memory[0], memory[1], strict=True):
        np.testing.assert_array_equal(before, nan_step)
    assert all(np.isfinite(m).all() for m in memory[2])


@pytest.mark.parametrize(
    "inner",
    [optax.sm3(0.02), optax.adafactor(0.01, min_dim_size_to_factor=8)],
    ids=["sm3", "adafactor_factored"],
)
def test_optax_statistics_of_one_dimension_are_laid_out_as_the_step_reads_them(inner):
    """SM3's per-dimension accumulators and Adafactor's factored row / column means after
    the exchange, on model-sharded params: each array is laid out as ``tx.init`` of the
    global params builds it (the step, manual over "data" only, reads it whole over the Auto
    model axis): the accumulator of a sharded dimension ``P("model")``, of an unsharded one
    ``P()``. Until 2026-11-27 ``jc.sharded_init`` gave them ``P()`` and failed in jax's
    out_specs check ("mu['w0'][1] is P() ... varying over {model}"). Through the lossless
    exchange, 3 steps give the params of the same run with the params replicated."""
    mesh = _mesh()
    fn, (params, state, x, y) = _step(mesh, jc.identity(), True, inner=inner)
    ref_fn, (ref_params, ref_state, _, _) = _step(mesh, jc.identity(), False, inner=inner)
    shapes = lambda s: jax.tree.map(jnp.shape, s[1])  # noqa: E731
    assert shapes(state) == shapes(ref_state)
    first = state[1][0]
    laid = lambda a, spec: a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim)  # noqa: E731
    if hasattr(first, "mu"):  # SM3: an accumulator per dimension
        assert laid(first.mu["w0"][0], P()) and laid(first.mu["w0"][1], P("model"))
        assert laid(first.mu["w1"][0], P("model")) and laid(first.mu["w1"][1], P())
    else:  # the row / column means of w0 and w1: of the hidden dimension (1024) sharded
        means = [first.v_row["w0"], first.v_col["w0"], first.v_row["w1"], first.v_col["w1"]]
        assert sorted(a.shape for a in means) == [(256,), (256,), (1024,), (1024,)]
        assert all(laid(a, P("model") if a.shape == (1024,) else P()) for a in means)
    for _ in range(3):
        params, state = jax.block_until_ready(fn(params, state, x, y))
        ref_params, ref_state = jax.block_until_ready(ref_fn(ref_params, ref_state, x, y))
    for k in params:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref_params[k]), atol=1e-6)


def _per_param_init(make):
    """An optax transform whose state is ``make(param)`` per 2-D param (0 elsewhere)."""

    def init(params):
        return jax.tree.map(lambda p: make(p) if p.ndim == 2 else jnp.zeros(()), params)

    return optax.GradientTransformation(init, lambda u, s, p=None: (u, s))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p.reshape(-1), r"dimension of 262144 \(131072 in a block\) is no param"),
        (lambda p: p.sum(axis=1), r"gave the blocks of one param different values"),
    ],
    ids=["no_param_dimension", "blocks_differ"],
)
def test_an_optax_state_array_with_no_layout_is_refused_naming_tx(make, match):
    """An optax state array built from each device's block that no spec lays out as the
    global init builds it: a dimension of the raveled param (no param dimension of those
    sizes), or a replicated shape whose blocks hold different values (a row sum of a
    column-sharded param: taking one device's would silently drop the others'). Refused
    naming ``tx`` and the array, where jax's out_specs check (or nothing) spoke before."""
    mesh = _mesh()
    params, specs = _params(mesh, True)
    tx = optax.chain(
        jc.compressed_allreduce(jc.identity(), "data", min_size=512, param_specs=specs),
        _per_param_init(make),
    )
    with pytest.raises(ValueError, match=r"`tx`'s state array at \[1\]\['w0'\]") as got:
        jc.sharded_init(tx, params, mesh, "data", param_specs=specs)
    assert re.search(match, str(got.value)), str(got.value)
