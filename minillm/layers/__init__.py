"""Model building blocks whose weight storage is pluggable (see ``linear.py``)."""

from minillm.layers.linear import PLAIN, Linear, LinearMethod, PlainMethod

__all__ = ["PLAIN", "Linear", "LinearMethod", "PlainMethod"]
