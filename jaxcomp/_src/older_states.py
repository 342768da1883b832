"""Restoring a state saved by an older jaxcomp, whose state types have gained fields since.

Each state type declares the fields it gained after it was first released next to its
definition, in a class attribute ``ADDED_FIELDS``: a mapping from the field's name to what a
state saved without it gets,

* :data:`FRESH`: the field of a fresh state built with the same arguments (a PRNG key of the
  same ``seed``, zero levels, the chunk stamps of the layout it is restored into);
* :data:`NONE`: None, with which the state runs as it did before the field;
* a :class:`NoDefault`: no value makes the state run as it did; refused, saying why.

orbax (0.12.8) restores a checkpoint only into a target of the tree it saved: today's state
lacks nothing the checkpoint holds but holds fields it lacks, and orbax refuses it naming the
first of them. :func:`restore_template` cuts those fields from a fresh state, guided by the
checkpoint's metadata tree (``ckpt.metadata(path).item_metadata``), and
:func:`complete_state` puts them back into what orbax restored, each with its default. No
state type has lost or renamed a field (its git history): a checkpoint holding a field its
type lacks is of another transform, and both refuse it, naming the field.
Nothing here reads orbax: both walk pytrees (a NamedTuple state appears in orbax's metadata
as a dict of its fields, a tuple as a list, an empty optax state as None).
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

FRESH = "fresh"  # the field of a fresh state built with the same arguments
NONE = "none"  # None: the state runs as before the field


class NoDefault(NamedTuple):
    """A field with no safe default for a state saved without it: ``why`` says why."""

    why: str


def _is_state(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _fields_of(node: Any) -> Any:
    """A node of the saved tree as a mapping of its fields, or None where it has none."""
    if _is_state(node):
        return node._asdict()
    return node if isinstance(node, Mapping) else None


def _default(fresh: Any, field: str, path: str, name: str) -> Any:
    """The value a state saved without ``field`` gets: declared in ``ADDED_FIELDS`` of the
    state's type, or refused naming the field (not declared, or declared :class:`NoDefault`)."""
    kind = getattr(type(fresh), "ADDED_FIELDS", {}).get(field)
    where = f"`{type(fresh).__name__}.{field}` (at `{path}.{field}`)"
    if kind is None:
        raise ValueError(
            f"`{name}` lacks the field {where}, which no older jaxcomp saved without: the "
            "checkpoint holds the state of another transform or other arguments; build "
            "`fresh_state` with the transform and arguments that saved it"
        )
    if isinstance(kind, NoDefault):
        raise ValueError(f"`{name}` lacks the field {where}, which has no safe default: {kind.why}")
    return getattr(fresh, field) if kind == FRESH else None


def _check_no_extra(fresh: Any, saved: Mapping, path: str, name: str) -> None:
    """Refuse a field ``saved`` holds that the state type of ``fresh`` lacks: no jaxcomp
    state type has had a field removed or renamed, so it is not a state of this type (orbax
    would refuse it too, "Source: MISSING", and dropping it could drop held-back error)."""
    extra = [f for f in saved if f not in fresh._fields]
    if extra:
        kind = type(fresh).__name__
        raise ValueError(
            f"`{name}` holds the field `{kind}.{extra[0]}` (at `{path}.{extra[0]}`), which "
            f"`{kind}` does not have (its fields: {', '.join(fresh._fields)}): no jaxcomp "
            "release removed or renamed a field, so the checkpoint holds the state of another "
            "transform or other arguments (or of a newer version of the library that defines "
            "the type); build `fresh_state` with the transform and arguments that saved it"
        )


def _missing(fresh: Any, saved: Mapping, path: str) -> list[str]:
    """The fields of the state ``fresh`` that ``saved`` lacks, each checked to have a default;
    a field ``saved`` holds that ``fresh`` lacks is refused."""
    _check_no_extra(fresh, saved, path, "saved")
    missing = [f for f in fresh._fields if f not in saved]
    for field in missing:
        _default(fresh, field, path, "saved")
    return missing


def _template(fresh: Any, saved: Any, path: str) -> Any:
    """``fresh`` cut to the tree of ``saved`` (see :func:`restore_template`)."""
    fields = _fields_of(saved)
    if _is_state(fresh) and fields is not None:
        kept = {
            f: _template(getattr(fresh, f), fields[f], f"{path}.{f}")
            for f in fresh._fields
            if f in fields
        }
        return kept if _missing(fresh, fields, path) else type(fresh)(**kept)
    if isinstance(fresh, (tuple, list)) and isinstance(saved, (tuple, list)):
        if len(fresh) == len(saved):
            parts = [
                _template(a, s, f"{path}[{i}]")
                for i, (a, s) in enumerate(zip(fresh, saved, strict=True))
            ]
            return type(fresh)(parts)
    if isinstance(fresh, dict) and fields is not None:
        return {
            k: _template(v, fields[k], f"{path}[{k!r}]") if k in fields else v
            for k, v in fresh.items()
        }
    return fresh


def _completed(fresh: Any, restored: Any, path: str) -> Any:
    """``restored`` with every field it lacks filled in (see :func:`complete_state`)."""
    fields = _fields_of(restored)
    if _is_state(fresh) and fields is not None:
        _check_no_extra(fresh, fields, path, "restored")
        return type(fresh)(
            **{
                f: _completed(getattr(fresh, f), fields[f], f"{path}.{f}")
                if f in fields
                else _default(fresh, f, path, "restored")
                for f in fresh._fields
            }
        )
    if isinstance(fresh, (tuple, list)) and isinstance(restored, (tuple, list)):
        if len(fresh) == len(restored):
            pairs = enumerate(zip(fresh, restored, strict=True))
            return type(fresh)([_completed(a, r, f"{path}[{i}]") for i, (a, r) in pairs])
    if isinstance(fresh, dict) and fields is not None:
        return {
            k: _completed(fresh[k], v, f"{path}[{k!r}]") if k in fresh else v
            for k, v in fields.items()
        }
    return restored


def _tree(saved: Any) -> Any:
    """orbax's ``TreeMetadata`` (``item_metadata``) as its tree; any other tree as it is."""
    tree = getattr(saved, "tree", None)
    return tree if isinstance(tree, (Mapping, list, tuple)) else saved


def _check_tree(name: str, tree: Any) -> None:
    if not isinstance(tree, (Mapping, list, tuple)):
        raise TypeError(
            f"`{name}` must be a tree of the state's fields (a dict per state, as orbax's "
            "`ckpt.metadata(path).item_metadata['opt_state']` and its restore give them; a "
            f"list or tuple for a chain), got {type(tree).__name__}"
        )


def restore_template(fresh_state: Any, saved: Any) -> Any:
    """The restore target of a state saved by an older jaxcomp: ``fresh_state`` with only
    the fields ``saved`` has.

    Where a state type gained fields since the save, orbax refuses today's state as the
    target ("tree structures do not match", naming the first field the checkpoint lacks).
    This cuts each such field from ``fresh_state`` (that state node becomes a dict of the
    fields it keeps, the tree orbax saved it as); nodes that lack nothing stay as they are.
    Every field cut must be declared in its state type's ``ADDED_FIELDS`` with a default
    (docs: checkpoints); one with none is refused here, before anything is read.

    Args:
      fresh_state: the state today's transform builds (``jc.sharded_init(tx, params, mesh,
        axis)``, or its abstract target): its leaves are kept as they are, so map
        ``ocp.utils.to_shape_dtype_struct`` over the result as over a state.
      saved: the saved state's tree, from the checkpoint's metadata:
        ``ckpt.metadata(path).item_metadata["opt_state"]`` (orbax 0.12.8; a NamedTuple is a
        dict of its fields there, a tuple a list).

    Returns:
      ``fresh_state`` with the fields ``saved`` lacks cut; restore into it and pass the
      result to :func:`complete_state`.

    Raises:
      TypeError: ``saved`` is not a tree of fields.
      ValueError: ``saved`` lacks a field that has no default (named), or one its type does
        not declare as added (the checkpoint of another transform); or holds a field its
        type does not have (named: no state type has lost or renamed a field).
    """
    saved = _tree(saved)
    _check_tree("saved", saved)
    return _template(fresh_state, saved, "state")


def complete_state(fresh_state: Any, restored: Any) -> Any:
    """A state restored through :func:`restore_template`, with each field it lacks filled
    by its declared default (the state type's ``ADDED_FIELDS``): the field of
    ``fresh_state`` (:data:`FRESH`: a key of the same ``seed``, zero levels, chunk stamps
    of this layout) or None (:data:`NONE`: the state runs as before the field).

    Args:
      fresh_state: the state :func:`restore_template` was given (arrays: a filled field
        takes the fresh array, with its sharding).
      restored: what orbax restored into that template (dicts in place of the states that
        lacked fields); a tree that lacks nothing comes back as it is.

    Returns:
      The state of today's types, every saved array as restored.

    Raises:
      TypeError: ``restored`` is not a tree of fields.
      ValueError: ``restored`` lacks a field that has no default (named), or one its type
        does not declare as added; or holds a field its type does not have (named).
    """
    _check_tree("restored", restored)
    return _completed(fresh_state, restored, "state")
