"""The ``gpu`` tier's sample of a GPU test's grid: the other cases carry ``gpu_sweep``.

A parametrize axis built by :func:`sampled` keeps the values in ``keep`` as they are (the ``gpu`` tier
runs them with every value of the other axes) and marks the rest ``gpu_sweep``: ``python -m pytest -m
gpu_sweep`` runs the whole grid, nothing is lost. tests/conftest.py keeps a ``gpu_sweep`` case out of
any run whose ``-m`` expression does not name ``gpu_sweep``.
"""
import pytest


def sampled(values, keep, *, multi=False):
    """``values`` for one parametrize axis, those not in ``keep`` marked ``gpu_sweep``. ``multi``: each
    value is a tuple of several argument values (``"lq,lk,d"``)."""
    missing = [k for k in keep if k not in values]
    assert not missing, f"sampled values not in the axis: {missing}"
    return [v if v in keep else pytest.param(*(v if multi else (v,)), marks=pytest.mark.gpu_sweep) for v in values]
