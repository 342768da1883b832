"""Named codec configurations: one place for CLIs, benchmarks and the parameterized tests.

A new codec is tested everywhere by adding one line to :data:`CODECS`.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.chunked import chunked_top_k
from jaxcomp._src.codecs.quantize import (
    cast,
    identity,
    int_quant,
    natural,
    qsgd,
    terngrad,
    threshold_2bit,
)
from jaxcomp._src.codecs.sign import sign
from jaxcomp._src.codecs.sparse import random_k, threshold, top_k

CODECS: dict[str, Callable[[], Codec]] = {
    "identity": identity,
    "bf16": lambda: cast("bf16"),
    "fp16": lambda: cast("fp16"),
    "fp16_unscaled": lambda: cast("fp16", scaled=False),
    "fp8": lambda: cast("fp8_e4m3"),
    "fp8_e5m2": lambda: cast("fp8_e5m2"),
    "int8": lambda: int_quant(8),
    "int8_sr": lambda: int_quant(8, stochastic=True),
    "int4": lambda: int_quant(4),
    "int3_sr": lambda: int_quant(3, block_size=100, stochastic=True),
    "int2": lambda: int_quant(2),
    "int1": lambda: int_quant(1),
    "int1_sr": lambda: int_quant(1, stochastic=True),
    "qsgd": lambda: qsgd(16),
    "qsgd4": lambda: qsgd(4, bucket_size=128),
    "terngrad": terngrad,
    "natural": natural,
    "sign": lambda: sign("mean"),
    "sign_block": lambda: sign("mean", block_size=128),
    "sign_rms": lambda: sign("rms"),
    "signsgd": lambda: sign(None),
    "2bit": lambda: threshold_2bit(0.5),
    "topk1%": lambda: top_k(0.01, approx=True),
    "topk10%_sample": lambda: top_k(0.1, approx="sample"),
    "topk10%_ternary": lambda: top_k(0.1, values="sign"),
    "randk10%": lambda: random_k(0.1),
    "threshold": lambda: threshold(0.5, 64),
    "chunked_topk_2bit": lambda: chunked_top_k(8, chunk=256, bits=2),
    "chunked_topk_f32": lambda: chunked_top_k(8, chunk=256, bits=None),
}
"""Named codec configurations: ``name -> factory`` (zero-argument), e.g. ``"int8"`` ->
``int_quant(8)``, ``"sign"`` -> ``sign("mean")``, ``"qsgd"`` -> ``qsgd(16)``. The math and the
paper of each are in its factory's docstring. Used by the examples' ``--codec`` flags, the
benchmarks and the parameterized tests; other modules add theirs with :func:`register`."""


def register(name: str, factory: Callable[[], Codec]) -> None:
    """Add a named codec configuration (used by codec families defined in other modules)."""
    CODECS[name] = factory


def get_codec(name: str) -> Codec:
    """The codec registered as ``name`` (e.g. ``"int8"``, ``"sign"``, ``"topk1%"``).

    ``get_codec(name) == CODECS[name]()``; see :data:`CODECS` for the names.

    Args:
      name: a key of :data:`CODECS`.

    Raises:
      ValueError: ``name`` is not registered (the message lists the known names).
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec name {name!r}; known: {', '.join(sorted(CODECS))}")
    return CODECS[name]()
