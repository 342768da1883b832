"""Flax NNX and Linen: ``nnx.Optimizer`` through ``jc.nnx_optimizer`` trains exactly like the
``jax.shard_map`` + ``jc.sharded_init`` reference; the silent misuses are refused at trace time.

Refused (``check_vma=True``), for every transform (the check lives in the shared skeleton):
per-device state entering the step replicated (``P()``), and gradients already summed over the
devices (params differentiated without ``jax.lax.pcast``). ``jc.state_specs`` reads an
``nnx.Optimizer`` and refuses the flattened ``nnx.split`` state. Programs are traced or
compiled once per transform (module caches) on a 16-32-4 MLP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import N, mesh, per_device, shard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.axes import varying_axes

AXIS = "data"
STEPS = 20
TRANSFORMS = {
    "sgd_sign": lambda: jc.sgd(0.05, jc.sign(), AXIS, min_size=16),
    "powersgd": lambda: optax.chain(
        jc.powersgd(2, AXIS, start_step=2, min_size=16), optax.sgd(0.1, momentum=0.9)
    ),
    "compressed_allreduce_int8": lambda: optax.chain(
        jc.compressed_allreduce(jc.int_quant(8), AXIS, min_size=16), optax.sgd(0.1)
    ),
    "dgc": lambda: optax.chain(jc.dgc(0.1, AXIS, min_size=16, warmup_steps=0), optax.sgd(0.1)),
    "onebit_adam": lambda: jc.onebit_adam(1e-3, AXIS, freeze_step=2, min_size=16),
    "zero_one_adam": lambda: jc.zero_one_adam(1e-3, AXIS, var_freeze_step=2, min_size=16),
}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def batches():
    rng = np.random.RandomState(0)
    x = rng.randn(STEPS, 8 * N, 16).astype(np.float32)
    y = rng.randint(0, 4, (STEPS, 8 * N)).astype(np.int32)
    return [(shard(x[i]), shard(y[i])) for i in range(STEPS)]


def nnx_step(opt_specs, check_vma=True, pcast=True, traces=None):
    """The step Flax's docs teach: nnx.jit over nnx.shard_map, optimizer.update inside
    (``traces``: a list the step appends to each time it is traced)."""

    @nnx.jit
    @nnx.shard_map(
        mesh=mesh(),
        in_specs=(P(), opt_specs, P(AXIS), P(AXIS)),
        out_specs=P(),
        check_vma=check_vma,
    )
    def step(model, optimizer, x, y):
        if traces is not None:
            traces.append(1)
        if pcast:  # only the Params per device: what the forward writes elsewhere is kept
            with jc.nnx_local(model, AXIS) as local:
                loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
        else:
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return jax.lax.pmean(loss, AXIS)

    return step


@functools.cache
def trained(name: str) -> tuple[dict, dict]:
    """(reference params, NNX params) after STEPS steps of transform ``name``."""
    data = batches()
    tx = TRANSFORMS[name]()
    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    opt_state = jc.sharded_init(tx, params, mesh(), AXIS)
    specs = jc.state_specs(opt_state, AXIS)

    def ref_step(p, s, x, y):
        local = nnx.merge(graphdef, nnx.State(jax.lax.pcast(p, AXIS, to="varying")))
        updates, s = tx.update(nnx.to_pure_dict(nnx.grad(loss_fn)(local, x, y)), s, p)
        return optax.apply_updates(p, updates), s

    ref = per_device(ref_step, (P(), specs, P(AXIS), P(AXIS)), (P(), specs))
    p = jax.device_put(params, NamedSharding(mesh(), P()))
    for x, y in data:
        p, opt_state = ref(p, opt_state, x, y)

    model = MLP(nnx.Rngs(0))
    optimizer = jc.nnx_optimizer(model, TRANSFORMS[name](), mesh(), AXIS)
    step = nnx_step(jc.nnx_state_specs(optimizer, AXIS))
    for x, y in data:
        jax.block_until_ready(step(model, optimizer, x, y))
    return p, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("name", ["sgd_sign"])  # powersgd + momentum SGD: also 0 (run once)
def test_nnx_optimizer_trains_exactly_like_the_shard_map_reference(name):
    ref, got = trained(name)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), ref, got)))
    moved = max(jax.tree.leaves(jax.tree.map(lambda a: float(jnp.max(jnp.abs(a))), ref)))
    print(f"{name}: max |param difference| after {STEPS} steps = {diff:.3g}")
    assert moved > 0.1  # the params are real
    assert diff <= 1e-6


def test_frozen_params_and_demo_match_the_shard_map_reference():
    """``wrt=`` a filter that freezes the hidden layer, with jc.demo (its own optimizer, a
    DCT-chunked top-k of the momentum): the NNX step (nnx_optimizer, nnx_local, gradients
    of ``nnx.DiffState(0, wrt)``) gives the reference's params bit for bit after 4 steps,
    and the frozen layer does not move. Measured the same way, also 0 for jc.sgd (sign),
    compressed_allreduce (int8), dgc, powersgd, onebit_adam and zero_one_adam (docs/flax.md)."""
    wrt = nnx.All(nnx.Param, nnx.PathContains("out"))
    data = batches()[:4]
    make = lambda: jc.demo(1e-2, AXIS, chunk=8, topk=4)  # noqa: E731
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0)), wrt, ...)
    p, others = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tx = make()
    opt_state = jc.sharded_init(tx, p, mesh(), AXIS)
    specs = jc.state_specs(opt_state, AXIS)

    def ref_step(p, o, s, x, y):
        local = nnx.merge(graphdef, nnx.State(jax.lax.pcast(p, AXIS, to="varying")), nnx.State(o))
        g = nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(local, x, y)
        u, s = tx.update(nnx.to_pure_dict(nnx.state(g, wrt)), s, p)
        return optax.apply_updates(p, u), s

    ref = per_device(ref_step, (P(), P(), specs, P(AXIS), P(AXIS)), (P(), specs))
    p, others = (jax.device_put(t, NamedSharding(mesh(), P())) for t in (p, others))
    for x, y in data:
        p, opt_state = ref(p, others, opt_state, x, y)

    model = MLP(nnx.Rngs(0))
    frozen, start = np.asarray(model.hidden.kernel[...]), np.asarray(model.out.kernel[...])
    optimizer = jc.nnx_optimizer(model, make(), mesh(), AXIS, wrt=wrt)

    @nnx.jit
    @nnx.shard_map(
        mesh=mesh(),
        in_specs=(P(), jc.nnx_state_specs(optimizer, AXIS), P(AXIS), P(AXIS)),
        out_specs=P(),
    )
    def step(model, optimizer, x, y):
        with jc.nnx_local(model, AXIS) as local:
            grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(local, x, y)
        optimizer.update(model, grads)

    for x, y in data:
        jax.block_until_ready(step(model, optimizer, x, y))
    got = nnx.to_pure_dict(nnx.state(model, wrt))
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), p, got)
    assert max(jax.tree.leaves(diffs)) == 0.0, diffs
    assert np.max(np.abs(np.asarray(got["out"]["kernel"]) - start)) > 0.03  # 4 steps of 1e-2
    assert np.array_equal(np.asarray(model.hidden.kernel[...]), frozen)


def test_partitioned_params_keep_their_layout_and_specs_match_it():
    """nnx.with_partitioning on a 4 x 2 data x model mesh: with the model's own specs,
    nnx_optimizer keeps the kernel's layout and lays its memory out P("data", None, "model"),
    and nnx_state_specs (given the params' shapes) names that layout. Without the specs the
    params were placed replicated, and without params the spec of a (16, 32) kernel's memory
    read P("data", "model", None): both silent, now refused naming the argument."""
    from jax.sharding import AxisType

    m = jax.make_mesh((4, 2), (AXIS, "model"), axis_types=(AxisType.Auto,) * 2)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(m):
        model = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    specs = nnx.as_pure(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match="param_specs"):
        jc.nnx_optimizer(model, TRANSFORMS["sgd_sign"](), m, AXIS)
    optimizer = jc.nnx_optimizer(model, TRANSFORMS["sgd_sign"](), m, AXIS, param_specs=specs)
    assert model.kernel[...].sharding.spec == P(None, "model")
    with pytest.raises(ValueError, match="`params`"):
        jc.nnx_state_specs(optimizer, AXIS, param_specs=specs)
    opt_specs = jc.nnx_state_specs(optimizer, AXIS, param_specs=specs, params=params)
    named = {
        path: spec
        for spec, filt in zip(opt_specs.shardings, opt_specs.filters, strict=True)
        for path in filt.paths
    }
    memory = optimizer.opt_state[0].momentum["kernel"].get_value()
    assert memory.shape == (4, 16, 32) and memory.sharding.spec == P(AXIS, None, "model")
    assert named[("opt_state", 0, "momentum", "kernel")] == memory.sharding.spec


def test_fsdp_gather_of_nnx_state_is_that_of_the_pure_params():
    """``jc.fsdp_gather`` (int8 weights, int4 gradients) of an ``nnx.split`` state (leaves
    ``nnx.Param``), the forward ``nnx.merge(graphdef, full)(x)``: 3 steps give the shards of
    the same step written on the pure dict, bit for bit, and the params move."""

    class Wide(nnx.Module):  # every leaf a multiple of the 8 devices
        def __init__(self, rngs):
            self.hidden = nnx.Linear(16, 32, rngs=rngs)
            self.out = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    graphdef, state = nnx.split(Wide(nnx.Rngs(0)))
    pure = nnx.to_pure_dict(state)
    rng = np.random.RandomState(0)
    data = [(rng.randn(64, 16).astype(np.float32), rng.randint(0, 8, 64)) for _ in range(3)]

    def forward(full, x):
        if isinstance(full, nnx.State):
            return nnx.merge(graphdef, full)(x)
        h = jax.nn.relu(x @ full["hidden"]["kernel"] + full["hidden"]["bias"])
        return h @ full["out"]["kernel"] + full["out"]["bias"]

    def step(shards, x, y):
        def loss(shards):
            full = jc.fsdp_gather(shards, AXIS, weights=jc.int_quant(8), grads=jc.int_quant(4))
            return optax.softmax_cross_entropy_with_integer_labels(forward(full, x), y).mean()

        return jax.tree.map(lambda p, g: p - 0.5 * g, shards, jax.grad(loss)(shards))

    run = per_device(step, (P(AXIS), P(AXIS), P(AXIS)), P(AXIS))
    out = []
    for params in (state, pure):
        shards = shard(params)
        for x, y in data:
            shards = run(shards, shard(x), shard(y))
        out.append(shards)
    got, want = nnx.to_pure_dict(out[0]), out[1]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), want, pure)
    assert min(jax.tree.leaves(moved)) > 0.1, moved


def test_nnx_state_specs_shard_exactly_the_per_device_fields():
    model = MLP(nnx.Rngs(0))
    optimizer = jc.nnx_optimizer(model, TRANSFORMS["sgd_sign"](), mesh(), AXIS)
    specs = jc.nnx_state_specs(optimizer, AXIS)
    flat = {
        path: spec
        for spec, filt in zip(specs.shardings, specs.filters, strict=True)
        for path in filt.paths
    }
    assert flat[("step",)] == P()
    assert flat[("opt_state", 0, "count")] == P()
    assert flat[("opt_state", 0, "memory", "hidden", "kernel")] == P(AXIS)
    assert flat[("opt_state", 0, "momentum", "out", "bias")] == P(AXIS)
    # The small bias has no memory: its slot stays optax's MaskedNode, no Variable, no spec.
    assert ("opt_state", 0, "memory", "out", "bias") not in flat
    memory = optimizer.opt_state[0].memory["hidden"]["kernel"].get_value()
    assert memory.shape == (N, 16, 32) and memory.sharding.spec == P(AXIS, None, None)
    assert jc.state_specs(optimizer, AXIS) == specs  # state_specs reads the optimizer too
    _, state = nnx.split((model, optimizer))
    with pytest.raises(ValueError, match=r"jc\.nnx_state_specs\(optimizer, 'data'\)"):
        jc.state_specs(state, AXIS)  # nnx.split flattened the state types: refused


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def test_rng_counts_and_batch_stats_written_by_the_forward_are_kept():
    """The documented step pcasts only the Params: Dropout draws a new mask every step and
    BatchNorm's running mean moves (the mean over devices). A pcast of the whole model
    dropped both without an error: at lr 0 the loss was the same every step, count 0.
    The step is traced (and compiled) once: until 2026-11-27 ``jc.nnx_optimizer`` placed
    only the Params on the mesh, the statistics and RNG state stayed on one device, and the
    second step was traced and compiled again for the first step's outputs."""
    model = DropoutMLP(nnx.Rngs(0, dropout=1))
    tx = optax.chain(jc.compressed_allreduce(jc.int_quant(8), AXIS, min_size=16), optax.sgd(0.0))
    optimizer = jc.nnx_optimizer(model, tx, mesh(), AXIS)
    traces = []
    step = nnx_step(jc.nnx_state_specs(optimizer, AXIS), traces=traces)
    x, y = batches()[0]
    want_mean = 0.01 * np.asarray(model.hidden(x)).mean(0)  # momentum 0.99, from 0
    losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    assert len(traces) == 1
    assert len(set(losses)) == 3, losses  # a new dropout mask each step (the params stay)
    assert int(model.drop.rngs.count.get_value()) == 3
    mean = np.asarray(model.norm.mean.get_value())
    np.testing.assert_allclose(mean, want_mean * (1 + 0.99 + 0.99**2), rtol=1e-4, atol=1e-7)


def test_nnx_local_pcasts_only_the_params_and_writes_the_rest_back():
    """Inside ``jc.nnx_local`` the Params vary per device and the BatchNorm statistics and
    RNG counts do not (yet); after the forward and the block, the model holds the counts
    advanced and the statistics averaged over the devices (replicated again), and its
    Params are the replicated ones it entered with. Without averaging, the per-device
    statistics are written back as they are (varying: ``nnx.shard_map`` would refuse them
    as ``P()``)."""
    seen = {}

    def probe(average):
        model = DropoutMLP(nnx.Rngs(0, dropout=1))

        @nnx.shard_map(mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P())
        def step(model, x):
            with jc.nnx_local(model, AXIS, average_batch_stats=average) as local:
                seen["param"] = varying_axes(local.hidden.kernel.get_value())
                seen["stat"] = varying_axes(local.norm.mean.get_value())
                local(x)
            seen["after"] = varying_axes(model.norm.mean.get_value())
            seen["kernel"] = varying_axes(model.hidden.kernel.get_value())
            return jax.lax.pmean(jnp.zeros(()), AXIS)

        return model, step

    model, step = probe(True)
    x = batches()[0][0]
    jax.block_until_ready(nnx.jit(step)(model, x))
    assert seen["param"] == {AXIS} and seen["stat"] == frozenset() == seen["kernel"]
    assert seen["after"] == frozenset()  # averaged: replicated again
    assert int(model.drop.rngs.count.get_value()) == 1
    want = 0.01 * np.asarray(DropoutMLP(nnx.Rngs(0, dropout=1)).hidden(x)).mean(0)
    np.testing.assert_allclose(model.norm.mean.get_value(), want, rtol=1e-4, atol=1e-7)
    model, step = probe(False)
    with pytest.raises(Exception, match="out_specs|replicat|vary"):
        nnx.jit(step)(model, x)
    assert seen["after"] == {AXIS}  # per device, as computed


class Drop(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(x)


def test_each_device_draws_its_own_dropout_masks():
    """The model's RNG keys enter the step replicated: every one of 8 devices drew the same
    dropout mask (1 distinct mask of 8) until 2026-11-27. ``jc.nnx_local`` folds the device
    index into the local model's keys: 8 distinct masks, each keeping about half of the 512
    values; the model keeps its own key and its count advances, so the next step draws new
    masks. ``per_device_rngs=False`` keeps the replicated keys (1 mask)."""

    def masks(per_device_rngs):
        model = Drop(nnx.Rngs(0, dropout=1))
        nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh(), P())))
        key = np.asarray(jax.random.key_data(model.drop.rngs.key.get_value()))

        @nnx.jit
        @nnx.shard_map(mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P(AXIS))
        def step(model, x):
            with jc.nnx_local(model, AXIS, per_device_rngs=per_device_rngs) as local:
                return local(x) != 0

        x = shard(jnp.ones((N, 512)))
        first, second = np.asarray(step(model, x)), np.asarray(step(model, x))
        after = np.asarray(jax.random.key_data(model.drop.rngs.key.get_value()))
        np.testing.assert_array_equal(after, key)  # the model's own key, replicated
        assert int(model.drop.rngs.count.get_value()) == 2
        assert not np.array_equal(first, second)  # a new mask every step
        return first

    own = masks(True)
    assert len({m.tobytes() for m in own}) == N
    assert np.all(np.abs(own.mean(1) - 0.5) < 0.1), own.mean(1)
    assert len({m.tobytes() for m in masks(False)}) == 1


class RematDrop(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, wrap):
        self.inner, self.wrap = Drop(rngs), wrap

    def __call__(self, x):
        return self.wrap(lambda m, x: m(x))(self.inner, x)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("wrap", [nnx.remat, nnx.jit], ids=["remat", "jit"])
def test_dropout_inside_nnx_remat_or_jit_draws_per_device_and_keeps_the_models_key(wrap, check_vma):
    """``nnx.remat`` / ``nnx.jit`` inside the forward set every variable they carry again,
    the folded RNG key among them (per device). Written back, it failed the step under
    ``check_vma=True`` (``shard_map`` out_specs ``P()`` for a varying key) and replaced the
    model's key under ``check_vma=False``, on 2026-11-27 (the code before per-device keys
    ran both). Folded keys are never written back: 8 distinct masks, the model's key as it
    was, the count advanced."""
    model = RematDrop(nnx.Rngs(0, dropout=1), wrap)
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh(), P())))
    key = np.asarray(jax.random.key_data(model.inner.drop.rngs.key.get_value()))

    @nnx.jit
    @nnx.shard_map(mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P(AXIS), check_vma=check_vma)
    def step(model, x):
        with jc.nnx_local(model, AXIS) as local:
            return local(x) != 0

    drawn = np.asarray(step(model, shard(jnp.ones((N, 64)))))
    assert len({m.tobytes() for m in drawn}) == N
    after = np.asarray(jax.random.key_data(model.inner.drop.rngs.key.get_value()))
    np.testing.assert_array_equal(after, key)
    assert int(model.inner.drop.rngs.count.get_value()) == 1


class DropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.hidden(x))))


def test_per_device_dropout_leaves_the_params_the_same_on_every_device():
    """Each device draws its own dropout masks, so its gradient differs; the exchange
    averages the gradients, so the params stay the same on every device. Under
    ``check_vma=False`` (nothing typed) the params of all 8 devices, returned per device
    after 3 steps of ``jc.sgd`` (int8): 0 apart, having moved."""
    model = DropNet(nnx.Rngs(0, dropout=1))
    start = np.asarray(model.hidden.kernel[...])
    optimizer = jc.nnx_optimizer(model, jc.sgd(0.1, jc.int_quant(8), AXIS), mesh(), AXIS)
    specs = (P(), jc.nnx_state_specs(optimizer, AXIS), P(AXIS))

    @nnx.jit
    @nnx.shard_map(mesh=mesh(), in_specs=specs, out_specs=P(AXIS), check_vma=False)
    def step(model, optimizer, x):
        with jc.nnx_local(model, AXIS) as local:
            grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(local)
        optimizer.update(model, grads)
        return model.hidden.kernel[...][None]

    x = shard(jax.random.normal(jax.random.PRNGKey(2), (N * 8, 16)))
    for _ in range(3):
        kernels = np.asarray(step(model, optimizer, x))
    assert np.abs(kernels[0] - start).max() > 1e-3  # trained
    np.testing.assert_array_equal(kernels, np.broadcast_to(kernels[0], kernels.shape))


def test_nnx_local_writes_nothing_back_if_the_block_raises_and_nests():
    """``local`` holds copies of the model's variables: a block that raises leaves the
    BatchNorm statistics as they were (nnx.merge shares the Variables by default, so the
    forward's per-device writes reached ``model`` and ``nnx.shard_map`` refused them as
    ``P()``); a nested block pcasts nothing twice ("Unsupported pcast from=varying") and
    writes the same averaged statistics as one block."""
    x = batches()[0][0]

    def run(body):
        model = DropoutMLP(nnx.Rngs(0, dropout=1))

        @nnx.shard_map(mesh=mesh(), in_specs=(P(), P(AXIS)), out_specs=P())
        def step(model, x):
            body(model, x)
            return jax.lax.pmean(jnp.zeros(()), AXIS)

        jax.block_until_ready(nnx.jit(step)(model, x))
        return np.asarray(model.norm.mean.get_value()), int(model.drop.rngs.count.get_value())

    def raising(model, x):
        with pytest.raises(RuntimeError, match="boom"), jc.nnx_local(model, AXIS) as local:
            local(x)
            raise RuntimeError("boom")

    def once(model, x):
        with jc.nnx_local(model, AXIS) as local:
            local(x)

    def nested(model, x):
        with jc.nnx_local(model, AXIS) as outer, jc.nnx_local(outer, AXIS) as inner:
            inner(x)

    mean, count = run(raising)
    assert count == 0 and not mean.any()
    want, count = run(once)
    assert count == 1 and np.abs(want).max() > 1e-3
    got, count = run(nested)
    assert count == 1
    np.testing.assert_array_equal(got, want)


def test_naive_nnx_optimizer_is_refused_with_the_fix_named():
    """nnx.Optimizer's own init, passed as P(): one memory copy for all devices."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TRANSFORMS["sgd_sign"](), wrt=nnx.Param)
    x, y = batches()[0]
    with pytest.raises(ValueError, match=r"`memory`.*jc\.nnx_optimizer\(model, tx, mesh"):
        nnx_step(P())(model, optimizer, x, y)


NAIVE = {
    "demo": (lambda: jc.demo(1e-2, AXIS, chunk=8, topk=4), "momentum"),
    "sparseloco": (
        lambda: jc.sparseloco(optax.sgd(0.1), AXIS, 1, density=1 / 16, chunk=16, min_size=0),
        "memory",
    ),
}


@pytest.mark.parametrize("name", sorted(NAIVE))
def test_naive_nnx_optimizer_of_demo_or_sparseloco_names_the_replicated_field(name):
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` passed as P() with jc.demo (its momentum)
    or jc.sparseloco (its memory): refused by jaxcomp, naming the field and the fix. Until
    2026-11-27 their updates checked the fields' shapes but not their types: jax refused the
    step later, DeMo's with "out_specs ... which require replication which can't be
    statically inferred", SparseLoCo's with "cond branches must have equal output types",
    naming neither the field nor jc.nnx_optimizer. Traced only, not compiled."""
    make, field = NAIVE[name]
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
    x, y = batches()[0]
    match = rf"`{field}` \(one value per device\) entered the step replicated.*jc\.nnx_optimizer"
    with pytest.raises(ValueError, match=match):
        nnx_step(P())(model, optimizer, x, y)


# --------------------------------------------------------------------------- every transform


def _params():
    return nnx.to_pure_dict(nnx.split(MLP(nnx.Rngs(0)))[1])


def _trace(tx, state, state_spec, grads_spec):
    """Trace (not compile) one update under shard_map, check_vma on."""

    def body(p, s, x):
        g = jax.tree.map(lambda a: a * jnp.sum(x), p)  # varying where p is
        if grads_spec == "summed":  # what jax.grad gives for P() params: the psum
            g = jax.lax.psum(g, AXIS)
        return tx.update(g, s, p)[0]

    fn = jax.shard_map(
        body, mesh=mesh(), in_specs=(P(), state_spec, P(AXIS)), out_specs=P(), check_vma=True
    )
    p = jax.device_put(_params(), NamedSharding(mesh(), P()))
    return jax.jit(fn).trace(p, state, shard(np.ones(N, np.float32)))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_refuses_replicated_state_and_summed_gradients(name):
    tx = TRANSFORMS[name]()
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh(), AXIS), _params())
    with pytest.raises(ValueError, match=r"jax\.lax\.pcast\(params, 'data', to='varying'\)"):
        _trace(tx, state, jc.state_specs(state, AXIS), "summed")
    replicated = jax.eval_shape(tx.init, _params())
    with pytest.raises(ValueError, match=r"entered the step replicated.*jc\.sharded_init"):
        _trace(tx, replicated, P(), "varying")


def test_pcast_params_and_sharded_state_trace():
    """The right pattern passes both checks (the refusals above are not over-eager)."""
    tx = TRANSFORMS["compressed_allreduce_int8"]()

    def body(p, s, x):
        local = jax.lax.pcast(p, AXIS, to="varying")
        g = jax.grad(lambda q: sum(jnp.sum(a) for a in jax.tree.leaves(q)) * jnp.sum(x))(local)
        return tx.update(g, s, p)[0]

    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh(), AXIS), _params())
    specs = jc.state_specs(state, AXIS)
    fn = jax.shard_map(body, mesh=mesh(), in_specs=(P(), specs, P(AXIS)), out_specs=P())
    p = jax.device_put(_params(), NamedSharding(mesh(), P()))
    jax.jit(fn).trace(p, state, shard(np.ones(N, np.float32)))


def test_a_mesh_without_the_axis_is_a_value_error_naming_it():
    tx = TRANSFORMS["sgd_sign"]()
    with pytest.raises(ValueError, match=r"`axis_name`='batch'.*axes: \('data',\)"):
        jc.sharded_init(tx, _params(), mesh(), "batch")
    state = jax.eval_shape(tx.init, _params())
    with pytest.raises(ValueError, match=r"`axis_name`='batch'"):
        jc.state_specs(state, "batch", param_specs=_params(), mesh=mesh())
    with pytest.raises(ValueError, match=r"`axis_name`='batch'"):
        jc.nnx_optimizer(MLP(nnx.Rngs(0)), tx, mesh(), "batch")


# --------------------------------------------------------------------------- Flax Linen TrainState


def test_linen_train_state_shard_map_equals_pmap():
    """examples/linen_pmap.py's TrainState step, jc.compressed_allreduce(sign) in its tx:
    under shard_map (jc.sharded_init + jc.state_specs of the whole TrainState) the params
    after 3 steps equal those of the pmap step (jc.replicate)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import linen_pmap as example
    from flax.training import train_state

    model = example.MLP(hidden=16)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 64)))["params"]
    tx = optax.chain(jc.compressed_allreduce(jc.sign(), example.AXIS, min_size=16), optax.sgd(0.1))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    kernel0 = np.asarray(params["Dense_0"]["kernel"])  # the steps donate their input
    m = mesh(name=example.AXIS)
    sharded = example.sharded_state(state, m)
    specs = jc.state_specs(sharded, example.AXIS)
    assert specs.params["Dense_0"]["kernel"] == P() and specs.step == P()
    assert specs.opt_state[0].memory["Dense_0"]["kernel"] == P(example.AXIS)
    sm_step = example.make_shard_map_step("ef", jc.sign(), m, specs)
    pmap_step = example.make_step("ef", jc.sign())
    stacked = jc.replicate(state, N)
    rng = np.random.RandomState(0)
    for _ in range(3):
        x = rng.rand(8 * N, 64).astype(np.float32)
        y = rng.randint(0, 10, 8 * N).astype(np.int32)
        sharded = sm_step(sharded, shard(x, m, P(example.AXIS)), shard(y, m, P(example.AXIS)))
        stacked = pmap_step(stacked, x.reshape(N, 8, 64), y.reshape(N, 8))
    diff = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)[0]))),
        sharded.params,
        stacked.params,
    )
    print(f"Linen TrainState, shard_map vs pmap after 3 steps: {max(jax.tree.leaves(diff)):.3g}")
    assert max(jax.tree.leaves(diff)) <= 1e-6
    assert np.max(np.abs(np.asarray(sharded.params["Dense_0"]["kernel"]) - kernel0)) > 0


def test_state_over_nnx_state_params_keeps_their_variables():
    # A transform's state that mirrors an nnx.State of Params (PowerSGD: the bias is not a
    # matrix, its slot a MaskedNode) keeps the Param nodes; its specs match its structure.
    model = nnx.Sequential(
        nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.LayerNorm(128, rngs=nnx.Rngs(0))
    )
    params = nnx.state(model, nnx.Param)
    tx = optax.chain(jc.powersgd(2, "data"), optax.adamw(1e-3))
    state = jc.sharded_init(tx, params, mesh(), "data")
    specs = jc.state_specs(state, "data")
    assert jax.tree.structure(specs) == jax.tree.structure(jax.tree.map(lambda _: P(), state))
    error = state[0].error
    w = jax.tree.leaves(error, is_leaf=lambda x: isinstance(x, jax.Array))[0]
    assert w.shape == (N, 64, 128) and w.sharding.spec[0] == "data"
