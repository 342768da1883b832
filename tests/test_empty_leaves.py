"""An empty leaf in the params takes no part in a collective, and its update is empty.

That no collective carries a zero-element operand is read from the lowered program (what
XLA compiles differs between jaxlib versions; docs/errors.md has XLA:CPU 0.11.2's segfault
on a zero-element operand of a shard_map, and jc.sharded_init's way around it). One program
holds the four transforms whose own averaging sees the user's tree (jc.delayed's pmean,
jc.diloco's and jc.local_sgd's parameter averaging, jc.gossip's mixing): one compile, two
steps.
"""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import N, WithoutEmpty, jaxcomp_state, mesh, per_device, shard
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.sharding import init_program
from jaxcomp._src.skeleton import varying_like

LR = 0.1
PARAMS = {"w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), "e": np.zeros((0, 3))}
REPLICAS = ("diloco", "local_sgd", "gossip")  # per-device params
# Every collective's operand types: all-reduce, all-gather, all-to-all, reduce-scatter,
# collective-permute (ppermute).
COLLECTIVE = (
    r'"stablehlo\.(?:all_\w+|reduce_scatter|collective_permute)"\(.*?(?:\}\) )?: \(([^)]*)\)'
)


def _transforms():
    return {
        "delayed": jc.delayed(optax.sgd(LR), axis_name="data"),
        "diloco": jc.diloco(optax.sgd(LR), "data", 1),
        "local_sgd": jc.local_sgd(optax.sgd(LR), "data", 1),
        "gossip": jc.gossip(optax.sgd(LR), "data", gamma=0.5),
    }


# XLA:CPU in jaxlib 0.11.2 segfaults compiling a shard_map program that takes a zero-element
# operand beside another one and reads it (`shard_map(lambda a, b: (a + 1, b + 1))` of f32[0]
# and f32[1] on 2 devices; no collective, no jaxcomp). jc.sharded_init keeps the params' empty
# leaves out of its program's operands; these tests' steps take them as a user's step would,
# so on jax 0.11 they run as WithoutEmpty (the empty operands rebuilt inside as zeros). jaxlib
# 0.10.2 and 0.12.0.1 compile both (and a psum of {f32[0], f32[1031]}).
RUNS = tuple(int(v) for v in jax.__version__.split(".")[:2]) != (0, 11)
STEP = per_device if RUNS else WithoutEmpty


def _built():
    """The jitted step of every transform (and the one to run: :data:`STEP`), their sharded
    states, params and gradients."""
    txs = _transforms()
    m = mesh()
    params = shard(PARAMS, m, P())
    states = {k: jc.sharded_init(tx, params, m, "data") for k, tx in txs.items()}
    specs = {k: jc.state_specs(s, "data") for k, s in states.items()}

    def step(g, s, p):
        g = jax.tree.map(lambda a: a[0], g)
        outs, new = {}, {}
        for k, tx in txs.items():
            own = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
            u, new[k] = tx.update(g, s[k], own if k in REPLICAS else p)
            outs[k] = jax.tree.map(lambda a: varying_like(a, g["w"])[None], u)
        return outs, new

    specs = (P("data"), specs, P()), (P("data"), specs)
    scale = np.arange(1, N + 1, dtype=np.float32).reshape(N, 1, 1)
    grads = shard({"w": scale * np.ones((N, 4, 6), np.float32), "e": np.zeros((N, 0, 3))}, m)
    return per_device(step, *specs, m), STEP(step, *specs, m), states, params, grads


def test_empty_leaf_is_left_out_of_every_collective_and_updates_empty():
    f, run, states, params, grads = _built()
    ops = re.findall(COLLECTIVE, f.lower(grads, states, params).as_text(), re.S)
    zero = [o for o in ops if re.search(r"tensor<(\d+x)*0x", o)]
    # delayed's pmean, diloco's and local_sgd's averages, gossip's two ppermutes and flag.
    assert len(ops) >= 6 and not zero, (len(ops), zero)
    out0, states = run(grads, states, params)
    out1, _ = run(grads, states, params)
    g = np.arange(1, N + 1, dtype=np.float32)[:, None, None] * np.ones((N, 4, 6))
    for k in _transforms():
        assert out1[k]["e"].shape == (N, 0, 3), k
    np.testing.assert_array_equal(out0["delayed"]["w"], 0.0)  # step 0 applies nothing
    # Step 1: minus lr times the mean of step 0's gradients (mean_i i = 4.5), every device.
    np.testing.assert_allclose(out1["delayed"]["w"], -LR * 4.5, rtol=1e-6)
    # Local SGD syncing every step: the mean of the devices' steps.
    np.testing.assert_allclose(out0["local_sgd"]["w"], -LR * 4.5, rtol=1e-6)
    # Exact ring gossip: x_i + gamma w (x_{i-1} + x_{i+1} - 2 x_i), x_i = w - lr g_i.
    weight = jc.topology("ring", N).weight
    x = -LR * g
    mixed = x + 0.5 * weight * (np.roll(x, 1, 0) + np.roll(x, -1, 0) - 2 * x)
    np.testing.assert_allclose(out0["gossip"]["w"], mixed, rtol=1e-5, atol=1e-7)
    assert np.isfinite(out0["diloco"]["w"]).all() and np.abs(out0["diloco"]["w"]).max() > 0


def test_empty_leaf_through_all_gather_psum_scatter_and_fsdp_gradients():
    """jc.all_gather, jc.psum_scatter and jc.fsdp_gather's transpose (with and without a
    gradient codec) leave an empty leaf out of their collectives; the other leaves are exact."""
    m = mesh()
    w = np.arange(N * N * 3, dtype=np.float32).reshape(N, N, 3)  # device i: f32[8, 3]
    tree = shard({"w": w, "e": np.zeros((N, 0, 3), np.float32)}, m)

    def body(t):
        t = jax.tree.map(lambda a: a[0], t)

        def loss(s, grads):
            full = jc.fsdp_gather(s, "data", weights=None, grads=grads)
            return sum(jax.numpy.sum(v**2) for v in jax.tree.leaves(full))

        outs = {
            "gather": jc.all_gather(t, "data", jc.identity()),
            "scatter": jc.psum_scatter(t, "data", jc.identity()),
            "fsdp": jax.grad(loss)(t, None),
            "fsdp_int8": jax.grad(loss)(t, jc.int_quant(8)),
        }
        return jax.tree.map(lambda a: varying_like(a, t["w"])[None], outs)

    f = per_device(body, (P("data"),), P("data"), m)
    ops = re.findall(COLLECTIVE, f.lower(tree).as_text(), re.S)
    assert len(ops) >= 5 and not [o for o in ops if re.search(r"tensor<(\d+x)*0x", o)], ops
    out = f(tree)
    assert out["gather"]["e"].shape == (N, 0, 3) and out["scatter"]["e"].shape == (N, 0, 3)
    assert out["fsdp"]["e"].shape == (N, 0, 3) and out["fsdp_int8"]["e"].shape == (N, 0, 3)
    np.testing.assert_array_equal(
        out["gather"]["w"], np.broadcast_to(w.reshape(1, -1, 3), (N, N * N, 3))
    )
    np.testing.assert_array_equal(out["scatter"]["w"], w.sum(0).reshape(N, 1, 3))
    # The loss on every device reads the gathered weights: the shard's gradient sums 8 of 2 w.
    np.testing.assert_array_equal(out["fsdp"]["w"], 2 * N * w)
    np.testing.assert_allclose(out["fsdp_int8"]["w"], 2 * N * w, rtol=2e-2, atol=2 * N * 2)


def test_empty_leaf_left_out_of_adam_gradient_sums_and_autotune_pmean():
    """jc.onebit_adam's and jc.zero_one_adam's full-precision rounds (``gradient_sum``) and
    jc.autotune's plain ``pmean`` row leave an empty leaf out of their all-reduces (lowered
    only: no program is compiled)."""
    from jaxcomp._src import autotune

    m = mesh()
    params = shard(PARAMS, m, P())
    grads = shard({"w": np.ones((N, 4, 6), np.float32), "e": np.zeros((N, 0, 3))}, m)
    txs = {
        "onebit": jc.onebit_adam(1e-2, "data", freeze_step=2, min_size=1),
        "zero_one": jc.zero_one_adam(1e-2, "data", var_freeze_step=3, min_size=1),
    }
    texts = []
    for tx in txs.values():
        state = jax.eval_shape(lambda tx=tx: jc.sharded_init(tx, params, m, "data"))
        specs = jc.state_specs(state, "data")

        def step(g, s, p, tx=tx):
            return tx.update(jax.tree.map(lambda a: a[0], g), s, p)

        f = per_device(step, (P("data"), specs, P()), (P(), specs), m)
        texts.append(f.lower(grads, state, params).as_text())
    row = autotune.Candidate("none", None, "pmean", 1 << 20, 0, 0.0, 0.0, np.nan)
    texts.append(autotune.lowered_path(PARAMS, grads, m, "data", row).as_text())
    for name, text in zip([*txs, "autotune"], texts, strict=True):
        ops = re.findall(COLLECTIVE, text, re.S)
        zero = [o for o in ops if re.search(r"tensor<(\d+x)*0x", o)]
        assert ops and not zero, (name, len(ops), zero)


@pytest.mark.parametrize("name", ["onebit", "zero_one"])
def test_empty_tree_through_the_adam_recipes(name):
    """An empty params tree (``{}``: a partition of ``optax.multi_transform`` with no leaves)
    gives an empty update, as ``optax.adam`` does; the per-leaf levels of the 1-bit recipes
    stacked no leaf ("Need at least one array to stack") before."""
    tx = {
        "onebit": jc.onebit_adam(1e-2, "data", freeze_step=1),
        "zero_one": jc.zero_one_adam(1e-2, "data", var_freeze_step=1),
    }[name]
    m = mesh()
    state = jc.sharded_init(tx, {}, m, "data")
    specs = jc.state_specs(state, "data")
    f = per_device(lambda s: tx.update({}, s, {}), (specs,), (P(), specs), m)
    for _ in range(2):  # the warm-up step, then a compressed one
        out, state = f(state)
        assert out == {}


SPARSELOCO_EDGES = {
    "random": dict(mask="random", min_size=0),
    "previous": dict(mask="previous", min_size=0),
    "clip": dict(clip=True, min_size=0),
    "small_codec-clip": dict(small_codec=jc.sign(), clip=True),
}


@pytest.mark.parametrize("variant", list(SPARSELOCO_EDGES))
def test_empty_leaf_through_sparseloco_shared_masks(variant):
    """``jc.sparseloco`` with an empty leaf in the params, through its shared masks
    (``min_size=0``) and its clipping: the leaf comes back empty, the other leaf is synced.
    Before, the shared masks flagged a NaN into the first kept value, which an empty leaf
    lacks (IndexError while tracing), and ``clip=True`` took the max of its empty norm
    ("zero-size array to reduction operation max")."""
    tx = jc.sparseloco(optax.sgd(LR), "data", 1, **SPARSELOCO_EDGES[variant])
    m = mesh()
    params = shard(PARAMS, m, P())
    replicas = jc.replica_params(params, m, "data")
    state = jc.sharded_init(tx, params, m, "data")
    specs, rspecs = jc.state_specs(state, "data"), jc.replica_specs(PARAMS, "data")

    def step(r, s, g):
        p = jc.own(r)
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    f = STEP(step, (rspecs, specs, P("data")), (rspecs, specs), m)
    g = {"w": np.ones((N, 4, 6), np.float32), "e": np.zeros((N, 0, 3), np.float32)}
    replicas, state = f(replicas, state, shard(g, m))
    assert replicas["e"].shape == (N, 0, 3)
    w = np.asarray(replicas["w"])
    assert np.isfinite(w).all() and (w == w[:1]).all()  # synced: the same on every device
    assert (w != PARAMS["w"]).any()  # and moved


def _init_txs():
    return {
        "sparseloco": jc.sparseloco(optax.sgd(LR), "data", 1, mask="random", min_size=0),
        "diloco": jc.diloco(optax.sgd(LR), "data", 1, codec=jc.int_quant(8), min_size=0),
        "sign-two_phase": jc.compressed_allreduce(
            jc.sign(), "data", strategy="two_phase", min_size=0
        ),
        "dgc": jc.dgc(0.1, "data", warmup_steps=0, min_size=0),
        "demo": jc.demo(0.1, "data", chunk=4, topk=2),
    }


def _zero_operands(program, *operands) -> list:
    """The zero-element tensors among the lowered program's arguments."""
    text = program.lower(*operands).as_text()
    args = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    return re.findall(r"tensor<(?:\d+x)*0x[^>]*>", args)


def _bits(x):
    return np.asarray(
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    )


@pytest.mark.parametrize("name", ["sparseloco", "diloco", "sign-two_phase", "dgc", "demo"])
def test_sharded_init_takes_no_empty_operand_and_gives_the_same_state(name):
    """``jc.sharded_init``'s program takes no zero-element operand: the params' empty leaves
    are rebuilt inside it (XLA:CPU in jaxlib 0.11.2 segfaulted compiling sparseloco's init
    with one beside another operand). Its state is bit-identical, leaf for leaf and sharding
    for sharding, to ``jit(shard_map(tx.init))`` of the params as given, compiled where
    XLA:CPU can (jaxlib 0.10.2, 0.12.0.1)."""
    tx = _init_txs()[name]
    m = mesh()
    params = shard(PARAMS, m, P())
    program, operands = init_program(tx, params, m, "data")
    naive = jax.jit(
        jax.shard_map(
            tx.init,
            mesh=m,
            in_specs=P(),
            out_specs=jc.state_specs(jax.eval_shape(lambda: program(*operands)), "data"),
        )
    )
    assert not _zero_operands(program, *operands)
    state = jc.sharded_init(tx, params, m, "data")
    if name in ("sparseloco", "diloco"):  # their states hold a copy of the params
        assert _zero_operands(naive, params), "the check sees the empty operand it rules out"
        assert any(0 in x.shape for x in jax.tree.leaves(state)), "an empty state leaf"
    if not RUNS and _zero_operands(naive, params):
        pytest.skip("jaxlib 0.11.2 segfaults compiling the reference (the empty operand)")
    reference = naive(params)
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert x.sharding == y.sharding and x.dtype == y.dtype
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_sharded_init_with_param_specs_takes_no_empty_operand():
    """The data x model path (``param_specs``): an empty leaf sharded over "model" is rebuilt
    in its block shape; it keeps no memory (plain pmean) and the other leaf's memory is
    bit-identical, sharding included, to the path without it."""
    m = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    specs = {"w": P(None, "model"), "e": P(None, "model")}
    host = {
        "w": np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8),
        "e": np.zeros((0, 4), np.float32),
    }
    params = {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in host.items()}
    tx = jc.compressed_allreduce(jc.sign(), "data", min_size=0, param_specs=specs)
    program, operands = init_program(tx, params, m, "data", specs)
    assert not _zero_operands(program, *operands)
    state = jc.sharded_init(tx, params, m, "data", param_specs=specs)
    memory = jaxcomp_state(state).memory
    assert isinstance(memory["e"], optax.MaskedNode)
    alone = jc.sharded_init(
        jc.compressed_allreduce(jc.sign(), "data", min_size=0, param_specs={"w": specs["w"]}),
        {"w": params["w"]},
        m,
        "data",
        param_specs={"w": specs["w"]},
    )
    np.testing.assert_array_equal(memory["w"], jaxcomp_state(alone).memory["w"])
    assert memory["w"].sharding == jaxcomp_state(alone).memory["w"].sharding


def test_autotune_times_no_codec_program_of_an_empty_leaf():
    """``jc.autotune``'s leaf sizes leave an empty leaf out (the exchange sends nothing for
    it): its codec timing compiled an encode of f32[0] beside the other leaves', which
    XLA:CPU in jaxlib 0.11.2 segfaults on (an empty leaf in the params crashed
    ``jc.autotune(params, mesh, "data")`` there)."""
    from jaxcomp._src import autotune

    sizes = autotune._check_args(PARAMS, "data", mesh(), [jc.sign()])
    assert sizes == [24]


def test_autotune_step_with_an_empty_leaf_takes_no_empty_operand_and_steps():
    """``jc.autotune(..., loss_fn=...)`` times whole steps: the step program takes no
    zero-element operand (jaxlib 0.11.2 segfaulted compiling it with an empty param) and one
    step of its plain-pmean row is SGD on the mean gradient, the empty leaf kept empty."""
    from jaxcomp._src import autotune, autotune_steps

    m = mesh()
    params = {"w": PARAMS["w"], "e": np.zeros((0, 3), np.float32)}
    x = np.linspace(-1, 1, 8 * N * 4, dtype=np.float32).reshape(8 * N, 4)
    y = np.ones((8 * N, 6), np.float32)

    def loss(p, x, y):
        return jax.numpy.mean((x @ p["w"] - y) ** 2) + jax.numpy.sum(p["e"])

    batch = autotune_steps.place_batch((x, y), m, "data")
    row = autotune.Candidate("none", None, "pmean", 1 << 20, 0, 0.0, 0.0, np.nan)
    tx = optax.chain(autotune._exchange_tx(row, "data"), optax.sgd(LR))
    lowered = autotune_steps.step_lowered(params, batch, m, "data", tx, loss)
    args = re.search(r"func\.func public @main\((.*?)\)\s*->", lowered.as_text(), re.S).group(1)
    assert "tensor<" in args and not re.findall(r"tensor<(?:\d+x)*0x[^>]*>", args)
    program = autotune_steps.step_program(params, batch, m, "data", row, loss, optax.sgd(LR))
    runner = autotune_steps.StepRunner(program, params, batch, m, "data")
    runner.run(1, timed=False)
    assert runner.params["e"].shape == (0, 3)
    expected = params["w"] - LR * jax.grad(loss)(params, x, y)["w"]
    np.testing.assert_allclose(runner.params["w"], expected, rtol=1e-5, atol=1e-6)


def test_overlapped_step_with_an_empty_leaf_is_delayed_sgd():
    """``jc.overlapped_step`` compiles its two programs on ``sharding.drop_empty`` of their
    inputs (jaxlib 0.11.2 segfaulted compiling them with an empty param): three steps give
    jc.delayed's SGD on the mean gradient (step 0 applies nothing), the empty leaf kept."""
    m = mesh()
    params = shard({"w": PARAMS["w"], "e": np.zeros((0, 3), np.float32)}, m, P())
    x = np.linspace(-1, 1, 2 * N * 4, dtype=np.float32).reshape(2 * N, 4)
    y = np.ones((2 * N, 6), np.float32)

    def loss(p, x, y):
        return jax.numpy.mean((x @ p["w"] - y) ** 2) + jax.numpy.sum(p["e"])

    step = jc.overlapped_step(loss, optax.sgd(LR), m, "data", pmean=True)
    state = step.init(params)
    batch = shard(x, m), shard(y, m)
    p, previous = params, None
    for _ in range(3):  # delayed: a step applies the mean gradient the step before took
        w = np.asarray(p["w"])
        taken = np.asarray(jax.grad(loss)({"w": w, "e": np.zeros((0, 3))}, x, y)["w"])
        p, state = step(p, state, *batch)
        expected = w if previous is None else w - LR * previous
        np.testing.assert_allclose(p["w"], expected, rtol=1e-5, atol=1e-6)
        previous = taken
    step.close()
    assert p["e"].shape == (0, 3)
