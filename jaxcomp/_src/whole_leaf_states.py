"""Which optax states belong to a transform whose step reads a whole leaf, and which leaves.

Most optax optimizers step each value from its own gradient and state (SGD, momentum, Adam,
Lion, RMSProp): on a device's block of a leaf they step as on the leaf. Some read the whole
leaf: a block taken for the leaf gives another update, with no error. Where a state type
belongs to one such transform, the state says which leaves it steps (optax 0.2.8):

* ``optax.contrib.MuonState`` (Jordan et al., 2024, Muon): the 2-D leaves its momentum
  ``mu`` holds (the others are ``optax.MaskedNode``) are stepped by ``O = UV^T`` of the
  momentum ``M = U S V^T``, orthogonalized whole (Newton-Schulz iterations).
* ``optax.FactoredState`` (Shazeer and Stern, 2018, Adafactor): a leaf whose two largest
  dimensions are ``>= min_dim_size_to_factor`` gets the second moment ``R C / 1^T R`` of its
  row and column means of ``g^2``, over the whole matrix; ``optax.adafactor`` also clips each
  leaf's update by its RMS, ``u / max(1, RMS(u) / d)``, and scales it by the param's RMS:
  every leaf in the state is read whole (``scale_by_factored_rms`` alone steps the leaves it
  does not factor value by value: those are named too, a false alarm).
* ``optax.ScaleByNovogradState`` (Ginsburg et al., 2019, NovoGrad): per leaf
  ``v = beta_2 v + (1 - beta_2) ||g||^2``, the norm of the whole leaf's gradient.
* ``optax.ScaleBySM3State`` (Anil et al., 2019, SM3): a leaf of >= 2 dimensions keeps, per
  dimension, the maximum of the accumulator over the other dimensions of the whole leaf.

Stateless transforms return ``optax.EmptyState()``, the same for all of them:
``scale_by_trust_ratio`` (``optax.lamb``, ``optax.lars``: ``||w|| / ||u||`` per leaf),
``clip_by_block_rms``, ``adaptive_grad_clip``, ``clip_by_global_norm`` (the norm of every
leaf) cannot be told from ``optax.scale`` or ``add_decayed_weights`` by their state, so they
are not seen. Transforms that take norms or inner products over the whole tree into a scalar
state (Prodigy, D-Adaptation, DoG, Mechanic, COCOB, L-BFGS) are not listed either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax


class Reader(NamedTuple):
    """A state type whose transform reads whole leaves."""

    state_type: type  # the optax state NamedTuple
    name: str  # the transform, as the user wrote it
    field: str  # a field of the state shaped like the params tree (MaskedNode: not stepped)
    min_ndim: int  # the leaves of fewer dimensions are stepped value by value
    max_ndim: int | None  # the leaves of more dimensions are not known to be read whole
    reads: str  # what the step reads of the whole leaf


def _readers() -> tuple:
    """The readers this optax has (a type missing from an optax version is skipped)."""
    contrib = getattr(optax, "contrib", None)
    known = (
        (getattr(contrib, "MuonState", None), "optax.contrib.muon", "mu", 2, 2,
         "orthogonalizes the whole matrix"),
        (getattr(optax, "FactoredState", None), "optax.adafactor", "v", 0, None,
         "takes row and column means of the whole matrix and the RMS of the whole leaf"),
        (getattr(optax, "ScaleByNovogradState", None), "optax.novograd", "nu", 0, None,
         "divides by the norm of the whole leaf's gradient"),
        (getattr(optax, "ScaleBySM3State", None), "optax.sm3", "nu", 2, None,
         "takes maxima over the whole leaf's other dimensions"),
    )  # fmt: skip
    return tuple(Reader(*k) for k in known if isinstance(k[0], type))


READERS = _readers()


def _found(state: Any) -> list:
    """``(reader, state)`` for every state of a :data:`READERS` type nested in ``state``."""
    types = tuple(r.state_type for r in READERS)
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, types))
    return [(r, x) for x in found for r in READERS if type(x) is r.state_type]


def whole_leaf_readers(state: Any, params: Any, is_slot: Any) -> list:
    """Per slot of ``params`` (flattened with ``is_slot``), the sorted names of the transforms
    in ``state`` that read that leaf whole (empty: none). A state field of another tree
    structure than the params is skipped."""
    slots, treedef = jax.tree.flatten(params, is_leaf=is_slot)
    names: list = [set() for _ in slots]
    for reader, found in _found(state):
        tree = getattr(found, reader.field)
        if jax.tree.structure(tree, is_leaf=is_slot) != treedef:
            continue
        for i, (x, s) in enumerate(zip(slots, jax.tree.leaves(tree, is_leaf=is_slot), strict=True)):
            ndim = len(getattr(x, "shape", ()))
            top = ndim if reader.max_ndim is None else reader.max_ndim
            if not is_slot(s) and not is_slot(x) and reader.min_ndim <= ndim <= top:
                names[i].add(reader.name)
    return [tuple(sorted(n)) for n in names]


def reads(name: str) -> str:
    """What the transform ``name`` reads of the whole leaf."""
    return next(r.reads for r in READERS if r.name == name)
