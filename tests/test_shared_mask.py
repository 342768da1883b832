"""SparseLoCo's exchange through a mask shared by every device (``jc.sparseloco(mask=...)``):
the same coordinates everywhere, no index on the wire, the kept values summed; bytes from the
compiled step, error-feedback conservation, non-finite flags, the masks' choices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import shared_mask
from jaxcomp._src.shared_mask import SharedMaskState, shared_mask_feedback

SIZES = (4096, 24)  # a masked leaf and, with min_size=64, a pmean'd one


@functools.cache
def exchange_step(mask: str, codec_name: str, strategy: str, min_size: int, decay: float = 0.5):
    """One jitted exchange over 8 devices of two leaves: (means, memories, previous)."""
    codec = {"int4": jc.int_quant(4), "identity": jc.identity()}[codec_name]
    tx = shared_mask_feedback(
        codec,
        "data",
        mask=mask,
        density=0.05,
        ef_decay=decay,
        min_size=min_size,
        strategy=strategy,
        explore=0.25 if mask == "previous" else 0.0,
    )

    def step(d, e, prev, count):
        memory = [None if m is None else m[0] for m in e]
        state = SharedMaskState(memory, list(prev), count, jax.random.PRNGKey(0))
        out, new = tx.update([x[0] for x in d], state)
        mem = [None if m is None else m[None] for m in new.memory]
        return [o[None] for o in out], mem, new.previous, new.count

    def specs(x):
        return jax.tree.map(lambda _: x, tx.init([jnp.zeros(s) for s in SIZES]).memory)

    return tx, per_device(
        step,
        (P("data"), specs(P("data")), P(), P()),
        (P("data"), specs(P("data")), P(), P()),
    )


def inputs(min_size: int, mask: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    d = [rng.standard_normal((N, s)).astype(np.float32) for s in SIZES]
    e = [
        rng.standard_normal((N, 1, s)).astype(np.float32) if s >= min_size else None for s in SIZES
    ]
    prev = [
        rng.standard_normal(s).astype(np.float32) if s >= min_size and mask == "previous" else None
        for s in SIZES
    ]
    return d, e, prev


def run(mask, codec, strategy, min_size, d, e, prev, count=3, decay=0.5):
    _, fn = exchange_step(mask, codec, strategy, min_size, decay)
    args = (shard(d), shard(e), prev, np.int32(count))
    return fn(*args), (fn, args)


@pytest.mark.parametrize("mask", ["random", "previous"])
def test_kept_coordinates_are_shared_summed_and_conserved(mask):
    """Every device keeps the same ``ceil(0.05 d)`` coordinates; through an exact codec
    (identity, all-reduce) the output there is the mean of the targets ``0.5 e + D``, 0
    elsewhere; memory + sent = target on every device (sent = target on the mask); the small
    leaf is the exact mean; every device holds the same output."""
    d, e, prev = inputs(64, mask)
    (out, memory, new_prev, count), _ = run(mask, "identity", "allreduce", 64, d, e, prev)
    out0 = np.asarray(out[0])
    assert np.all(out0 == out0[:1])
    target = 0.5 * e[0][:, 0] + d[0]
    mem = np.asarray(memory[0])[:, 0]
    kept = mem == 0.0  # the sent coordinates: the memory there is target - target
    assert np.all(kept == kept[:1]) and kept[0].sum() == shared_mask.kept(4096, 0.05) == 205
    np.testing.assert_allclose(out0[0][kept[0]], target[:, kept[0]].mean(0), rtol=1e-5, atol=1e-6)
    assert np.all(out0[0][~kept[0]] == 0.0)
    np.testing.assert_array_equal(mem[:, ~kept[0]], target[:, ~kept[0]])
    np.testing.assert_allclose(np.asarray(out[1])[0], d[1].mean(0), rtol=1e-6, atol=1e-7)
    assert memory[1] is None and int(count) == 4
    if mask == "previous":
        # 154 of 205 from |previous| (its largest), 51 drawn from the rest
        top = np.argsort(-np.abs(prev[0]))[:154]
        assert np.all(kept[0][top]) and kept[0][np.argsort(-np.abs(prev[0]))[154:]].sum() == 51
        np.testing.assert_array_equal(np.asarray(new_prev[0]), out0[0])


def test_random_mask_changes_every_sync_and_is_uniform():
    """The random mask folds in the sync count: two syncs keep different coordinates
    (overlap about the density, 5%), each 205 of 4096."""
    d, e, prev = inputs(64, "random")
    masks = []
    for count in (0, 1):
        (_, memory, _, _), _ = run("random", "identity", "allreduce", 64, d, e, prev, count)
        masks.append(np.asarray(memory[0])[0, 0] == 0.0)
    assert masks[0].sum() == masks[1].sum() == 205
    assert (masks[0] & masks[1]).sum() < 40


def test_compiled_bytes_are_the_two_phase_arithmetic_and_no_index_travels():
    """int4 two-phase: the compiled step sends ``(n - 1)`` rows of ``ceil(k / n)`` values
    twice (all-to-all, all-gather of the owners' re-encoding): ``shared_mask.wire_bytes``;
    nothing else of the masked leaf; with min_size=0 the small leaf is masked too."""
    for min_size in (64, 0):
        d, e, prev = inputs(min_size, "random")
        _, (fn, args) = run("random", "int4", "two_phase", min_size, d, e, prev)
        report = jc.comm_report(fn.fn, *args)
        want = shared_mask.wire_bytes(list(SIZES), jc.int_quant(4), N, 0.05, min_size)
        assert report.bytes_per_device == want
    k = shared_mask.kept(4096, 0.05) + shared_mask.kept(24, 0.05)
    assert k == 207 and -(-k // N) == 26  # rows of 26 kept values
    assert want == 7 * 2 * (4 * 4 + 4)  # 26 int4 codes in 4 words and one scale, per row


def test_int4_error_feedback_keeps_what_the_codec_dropped():
    """Through int4 two-phase the memory is the target minus this device's int4 payload of
    the kept values: bounded by half a quantization step there, the target elsewhere."""
    d, e, prev = inputs(64, "random")
    (out, memory, _, _), _ = run("random", "int4", "two_phase", 64, d, e, prev)
    target = 0.5 * e[0][:, 0] + d[0]
    mem = np.asarray(memory[0])[:, 0]
    sent = target - mem
    on = np.any(sent != 0, axis=0)
    assert on.sum() == 205
    assert np.all(np.abs(mem[:, on]) <= np.abs(target[:, on]).max() / 14 + 1e-6)
    np.testing.assert_array_equal(mem[:, ~on], target[:, ~on])
    # the output on the mask is the mean of the sent values, re-quantized once by its owner
    out0 = np.asarray(out[0])[0]
    err = np.abs(out0[on] - sent[:, on].mean(0)).max()
    assert err <= np.abs(sent[:, on].mean(0)).max() / 14 + 1e-6 and np.all(out0[~on] == 0)


@pytest.mark.parametrize("where", [0, 1])
def test_nonfinite_outside_the_mask_flags_the_sync_and_keeps_memories(where):
    """A NaN on one device, in a coordinate the mask does not keep (where=0) or in the
    pmean'd leaf (where=1): every output NaN, every memory as it was. A zero step with a
    zero memory gives zeros, no NaN."""
    d, e, prev = inputs(64, "random")
    (_, memory, _, _), _ = run("random", "int4", "two_phase", 64, d, e, prev)
    off = int(np.flatnonzero(np.asarray(memory[0])[0, 0] != 0.0)[0])  # not kept at count 3
    bad = [x.copy() for x in d]
    bad[where][5, off if where == 0 else 3] = np.nan
    (out, after, _, count), _ = run("random", "int4", "two_phase", 64, bad, e, prev)
    assert all(np.all(np.isnan(np.asarray(o))) for o in out)
    np.testing.assert_array_equal(np.asarray(after[0]), e[0])
    zeros = [np.zeros_like(x) for x in d]
    (out, after, _, _), _ = run(
        "random", "int4", "two_phase", 64, zeros, [np.zeros_like(e[0]), None], prev
    )
    assert all(np.all(np.asarray(o) == 0.0) for o in out) and np.all(np.asarray(after[0]) == 0)


def test_sparseloco_shared_mask_trains_identical_replicas_and_checkpoints(tmp_path):
    """``jc.sparseloco(mask="previous")`` end to end: after a sync every device holds the
    same params; the state (memory, previous, count) restores from orbax and continues
    bit-identically."""
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params = {"w": jnp.ones((64, 32)) * 0.1, "b": jnp.zeros((16,))}
    tx = jc.sparseloco(optax.sgd(0.1), "data", 2, mask="previous", density=0.1, min_size=0)
    replicas = jc.replica_params(params, mesh, "data")
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")
    rspec = jax.tree.map(lambda _: P("data"), params)

    def step(r, s, x):
        p = jc.own(r)
        g = jax.grad(lambda p: jnp.sum((p["w"] @ x[0]) ** 2) + jnp.sum(p["b"] * x[0][:16]))(p)
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    fn = per_device(step, (rspec, specs, P("data")), (rspec, specs), mesh)
    xs = shard(np.random.default_rng(0).standard_normal((N, 32)).astype(np.float32), mesh)
    for _ in range(2):
        replicas, state = fn(replicas, state, xs)
    w = np.asarray(replicas["w"])
    # the same anchor everywhere, up to the rounding of p + u (docs: jc.diloco)
    assert np.abs(w - w[:1]).max() < 1e-6 and np.abs(w - 0.1).max() > 0.1
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "s", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "s", state)
    a = fn(replicas, state, xs)
    b = fn(replicas, restored, xs)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(mask="shared"), "mask"),
        (dict(mask="random", averaging="senders"), "averaging"),
        (dict(mask="random", clip=True), "clip"),
        (dict(mask="random", small_codec=jc.sign()), "small_codec"),
        (dict(mask="random", value_codec=jc.top_k(0.1)), "value_codec"),
        (dict(mask="random", strategy="ring"), "strategy"),
        (dict(mask="random", explore=0.5), "explore"),
        (dict(mask="previous", explore=1.5), "explore"),
        (dict(value_codec=jc.int_quant(4)), "value_codec"),
        (dict(mask="random", bits=1), "bits"),  # ignored before: int4 values sent
        (dict(mask="previous", chunk=1024), "chunk"),
        (dict(mask="random", value_scale="mean"), "value_scale"),
    ],
)
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises((ValueError, TypeError), match=f"`{name}`"):
        jc.sparseloco(optax.sgd(0.1), "data", 2, **kw)


def test_previous_mask_keeps_the_last_nonzeros_and_draws_the_rest_at_random():
    """A merged update nonzero on 100 coordinates (the last mask, some kept values rounded
    to 0): ``"previous"`` keeps those 100 and draws the other 105 of 205 from the zeros at
    random, not the 105 lowest indices (``jax.lax.top_k``'s tie-break); the draw is the
    shared key's, so every device makes the same one."""
    rng = np.random.default_rng(1)
    previous = np.zeros(4096, np.float32)
    on = rng.choice(4096, 100, replace=False)
    previous[on] = rng.standard_normal(100).astype(np.float32)
    key = jax.random.PRNGKey(3)
    idx = np.asarray(shared_mask.select("previous", 205, key, jnp.asarray(previous), 0.0))
    assert len(set(idx)) == 205 and set(on) <= set(idx)
    rest = np.setdiff1d(idx, on)
    assert rest.size == 105 and rest.max() > 2048  # not the lowest zeros (max 105 + 100)
    again = shared_mask.select("previous", 205, key, jnp.asarray(previous), 0.0)
    np.testing.assert_array_equal(idx, np.asarray(again))


def test_topk_defaults_are_sparseloco_signature_defaults():
    """The values a shared mask accepts for the top-k codec's arguments are their defaults."""
    import inspect

    from jaxcomp._src.sparseloco import TOPK_DEFAULTS

    params = inspect.signature(jc.sparseloco).parameters
    assert TOPK_DEFAULTS == tuple((name, params[name].default) for name, _ in TOPK_DEFAULTS)


def _captured(monkeypatch, **kw):
    """The keyword arguments ``jc.sparseloco(**kw)`` gives the shared-mask exchange."""
    seen = {}
    real = shared_mask.shared_mask_feedback

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(shared_mask, "shared_mask_feedback", spy)
    jc.sparseloco(optax.sgd(0.1), "data", 2, **kw)
    return seen


def test_previous_mask_explores_by_default_and_seed_reaches_the_exchange(monkeypatch):
    """``explore`` defaults to ``PREVIOUS_EXPLORE`` (0.5) with ``mask="previous"`` and 0 with
    ``"random"``; an explicit 0 stays 0; ``seed`` (default 0) reaches the exchange."""
    assert shared_mask.PREVIOUS_EXPLORE == 0.5
    assert _captured(monkeypatch, mask="previous")["explore"] == 0.5
    assert _captured(monkeypatch, mask="previous", explore=0.0)["explore"] == 0.0
    assert _captured(monkeypatch, mask="random")["explore"] == 0.0
    assert _captured(monkeypatch, mask="random")["seed"] == 0
    assert _captured(monkeypatch, mask="previous", seed=7)["seed"] == 7


@pytest.mark.parametrize(
    "kw", [dict(seed=1), dict(mask="random", seed=-1), dict(mask="random", seed=1.0)]
)
def test_seed_is_checked_and_only_for_a_shared_mask(kw):
    with pytest.raises((ValueError, TypeError), match="`seed`"):
        jc.sparseloco(optax.sgd(0.1), "data", 2, **kw)


def test_previous_mask_at_the_default_explore_covers_more_of_the_leaf():
    """Ten syncs of ``select("previous")``, the merged update nonzero on the last mask:
    at ``explore=0`` the mask keeps its first random draw (205 of 4096 coordinates ever
    chosen); at the default 0.5, over 1000."""
    k, size = 205, 4096

    def ever_chosen(explore):
        previous, ever = jnp.zeros(size), np.zeros(size, bool)
        for t in range(10):
            key = jax.random.fold_in(jax.random.PRNGKey(0), t)
            idx = shared_mask.select("previous", k, key, previous, explore)
            ever[np.asarray(idx)] = True
            previous = jnp.zeros(size).at[idx].set(jax.random.normal(key, (k,)) + 5.0)
        return int(ever.sum())

    assert ever_chosen(0.0) == k
    assert ever_chosen(shared_mask.PREVIOUS_EXPLORE) > 1000


def seeded_exchange(mask, seed):
    """The one-leaf exchange the seed tests compare: identity codec, density 0.05, all-gather,
    ``explore`` 0.25 with ``mask="previous"``."""
    return shared_mask_feedback(
        jc.identity(),
        "data",
        mask=mask,
        density=0.05,
        ef_decay=0.5,
        min_size=0,
        strategy="allgather",
        explore=0.25 if mask == "previous" else 0.0,
        seed=seed,
    )


def per_device_memory(state):
    """A state built inside the step with its memories typed per device, as
    ``jc.sharded_init``'s enter it (built replicated they are refused, naming `memory`)."""
    memory = [None if m is None else jax.lax.pcast(m, "data", to="varying") for m in state.memory]
    return state._replace(memory=memory)


@pytest.mark.parametrize("mask", ["random", "previous"])
def test_seed_zero_is_the_old_fixed_key_and_another_seed_draws_another_mask(mask):
    """The mask of sync 3 (leaf 0) for seeds 0 and 7 against the key every device used
    before ``seed`` existed, ``fold_in(fold_in(PRNGKey(0), count), leaf)``: seed 0 draws
    exactly its mask (existing runs unchanged, bit for bit), seed 7 another."""

    def kept_at(seed):
        tx = seeded_exchange(mask, seed)

        def step(d):
            state = per_device_memory(tx.init([d[0]]))._replace(count=jnp.int32(3))
            return tx.update([d[0]], state)[0][0][None]

        d = shard(np.ones((N, 4096), np.float32))
        out = per_device(step, P("data"), P("data"))(d)
        return set(np.flatnonzero(np.asarray(out)[0]))

    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), 3), 0)
    old = set(np.asarray(shared_mask.select(mask, 205, key, jnp.zeros(4096), 0.25)).tolist())
    assert kept_at(0) == old
    other = kept_at(7)
    assert len(other) == 205 and len(other & old) < 50  # about 205 * 0.05 by chance


def old_exchange(mask, seed, d, syncs, decay=0.5, explore=0.25):
    """The means of ``syncs`` exchanges of one leaf (identity codec) as the code before the
    key was state computed them, in numpy: the mask drawn with ``fold_in(fold_in(PRNGKey(seed),
    count), 0)``, ``t_i = decay e_i + d_i``, ``out[S] = mean_i t_i[S]``, ``e_i = t_i`` off
    ``S`` and 0 on it; ``previous`` the last mean."""
    memory, previous, outs = np.zeros_like(d), np.zeros(d.shape[1], np.float32), []
    k = shared_mask.kept(d.shape[1], 0.05)
    for count in range(syncs):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), count), 0)
        ex = explore if mask == "previous" else 0.0
        idx = np.asarray(shared_mask.select(mask, k, key, jnp.asarray(previous), ex))
        t = decay * memory + d
        out = np.zeros(d.shape[1], np.float32)
        out[idx] = t[:, idx].mean(0)
        memory = t.copy()
        memory[:, idx] = 0.0
        previous = out
        outs.append(out)
    return np.stack(outs)


@pytest.mark.parametrize("mask", ["random", "previous"])
def test_the_key_in_the_state_draws_the_old_masks_for_every_seed(mask):
    """The key is state (``PRNGKey(seed)``, kept as is) and the masks of three syncs, and
    their means, are those of the old program constant ``fold_in(PRNGKey(seed), count)``,
    for seeds 0 and 3: the same kept coordinates exactly, the means to float32 rounding."""
    d = np.random.default_rng(5).standard_normal((N, 4096)).astype(np.float32)
    for seed in (0, 3):
        tx = seeded_exchange(mask, seed)

        def step(x, tx=tx):
            state, outs = per_device_memory(tx.init([x[0]])), []
            for _ in range(3):
                out, state = tx.update([x[0]], state)
                outs.append(out[0])
            return jnp.stack(outs)[None], state.key, state.count

        outs, key, count = per_device(step, P("data"), (P("data"), P(), P()))(shard(d))
        np.testing.assert_array_equal(np.asarray(key), np.asarray(jax.random.PRNGKey(seed)))
        assert int(count) == 3
        want = old_exchange(mask, seed, d, 3)
        got = np.asarray(outs)[0]
        for s in range(3):  # the same kept coordinates, sync by sync
            assert set(np.flatnonzero(got[s])) == set(np.flatnonzero(want[s]))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # numpy's sum order


def test_a_state_whose_key_is_not_a_prng_key_pair_is_refused_naming_the_field():
    """A state from elsewhere (a typed ``jax.random.key``, shape ()) is named by its field."""
    tx = shared_mask_feedback(
        jc.identity(), "data", mask="random", density=0.05, ef_decay=0.5, min_size=0
    )
    x = jnp.zeros(64)
    state = tx.init([x])._replace(key=jax.random.key(0))
    with pytest.raises(ValueError, match="field `key`"):
        jax.eval_shape(lambda: tx.update([x], state))
