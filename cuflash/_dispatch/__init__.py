"""Dispatch: the variant model, the tile tables, the choice of kernels for a call and its plan."""
from . import tables  # noqa: F401  (fills model.TABLES)
