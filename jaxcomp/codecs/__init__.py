"""Codecs: pure encode/decode pairs. Nothing here knows about devices or axes."""

from jaxcomp.codecs.base import Codec
from jaxcomp.codecs.quantize import (
    cast,
    identity,
    int_quant,
    natural,
    qsgd,
    terngrad,
    threshold_2bit,
)
from jaxcomp.codecs.registry import CODECS, get_codec, register
from jaxcomp.codecs.sign import sign

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
