"""Codecs: pure encode/decode pairs. Nothing here knows about devices or axes."""

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.quantize import (
    cast,
    identity,
    int_quant,
    natural,
    qsgd,
    terngrad,
    threshold_2bit,
)
from jaxcomp._src.codecs.registry import CODECS, get_codec, register
from jaxcomp._src.codecs.sign import sign

__all__ = [
    "CODECS",
    "get_codec",
    "register",
    "Codec",
    "cast",
    "identity",
    "int_quant",
    "natural",
    "qsgd",
    "sign",
    "terngrad",
    "threshold_2bit",
]
