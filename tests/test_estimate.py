"""The tile / IO estimator (CPU): counts against independent computations."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.__main__ import main


@pytest.mark.parametrize("lq,lk", [(300, 200), (200, 300), (257, 257), (1, 130)])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16"), (59, "float32"), (256, "float64")])
def test_tiles_match_the_blocked_reference(lq, lk, causal, d, dtype):
    """The visited-tile count equals what the blocked reference computes with the same tiles."""
    est = cuflash.estimate(lq=lq, lk=lk, d=d, dtype=dtype, causal=causal, batch=2, heads_q=3)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 8)) for n in (lq, lk, lk))
    _, _, stats = reference.attention_blocked(q, k, v, causal=causal, block_m=est.block_m, block_n=est.block_n,
                                              return_stats=True)
    assert est.tiles_processed == 6 * stats["tiles_computed"]
    assert est.tiles_total == 6 * stats["tiles_total"] == 6 * math.ceil(lq / est.block_m) * math.ceil(lk / est.block_n)
    allowed = reference.causal_mask(lq, lk, causal)
    assert est.allowed_pairs == 6 * (lq * lk if allowed is None else int(allowed.sum()))
    assert est.naive_score_entries == 6 * lq * lk


def test_bytes_and_flops_by_hand():
    est = cuflash.estimate(lq=128, lk=128, d=64, dtype="float16", gpu="sm_80")
    assert (est.block_m, est.block_n) == (128, 128)         # the A100's tile for contiguous fp16 D=64
    assert est.naive_hbm_bytes == 3 * 128 * 64 * 2 + 128 * 64 * 2 + 4 * 128 * 128 * 2
    # Q once; K and V (one 128-key tile) for the one query tile; O; lse in fp32
    assert est.flash_hbm_bytes == 128 * 64 * 2 + 2 * 64 * 128 * 2 + 128 * 64 * 2 + 128 * 4
    assert est.flops == 2 * 128 * 128 * 128
    assert est.naive_intensity == pytest.approx(est.flops / est.naive_hbm_bytes)
    assert est.flash_intensity > est.naive_intensity


def test_causal_visits_about_half_and_gqa_reads_fewer_kv_bytes():
    full = cuflash.estimate(lq=8192, lk=8192, d=64, heads_q=8)
    causal = cuflash.estimate(lq=8192, lk=8192, d=64, heads_q=8, causal=True)
    # (the causal call runs the band kernel, whose tiles may differ from the full one's: compare fractions)
    assert full.tiles_processed == full.tiles_total
    assert 0.5 < causal.tiles_processed / causal.tiles_total < 0.53
    assert causal.naive_hbm_bytes == full.naive_hbm_bytes        # a naive framework stores every score
    gqa = cuflash.estimate(lq=8192, lk=8192, d=64, heads_q=8, heads_k=2)
    assert gqa.naive_hbm_bytes < full.naive_hbm_bytes


def test_an_h100_takes_the_hopper_kernels_tile():
    est = cuflash.estimate(lq=4096, lk=4096, d=128, dtype="bfloat16")
    assert (est.block_m, est.block_n) == (128, 128)         # flash_fwd_wgmma's head-dim-128 tile
    assert cuflash.estimate(lq=4096, lk=4096, d=64, dtype="bfloat16").block_m == 192


def test_smaller_gpus_get_their_own_tiles():
    tiles = {gpu: cuflash.estimate(lq=64, lk=64, d=256, dtype="float64", gpu=gpu) for gpu in ("sm_90", "sm_80", "sm_86")}
    assert [(t.block_m, t.block_n) for t in tiles.values()] == [(32, 16), (32, 8), (8, 8)]


@pytest.mark.parametrize("kwargs,match", [(dict(dtype="int8"), "dtype"), (dict(gpu="sm70"), "gpu"), (dict(gpu="sm_100"), "gpu"),
                                          (dict(lq=0), "lq"), (dict(heads_q=3, heads_k=2), "multiple")])
def test_bad_arguments(kwargs, match):
    args = dict(lq=64, lk=64, d=64) | kwargs
    with pytest.raises(ValueError, match=match):
        cuflash.estimate(**args)


def test_cli(capsys):
    assert main(["estimate", "--lq", "4096", "--d", "64", "--dtype", "float16", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "causal (top-left)" in out and "tiles" in out and "FLOP/byte" in out
    with pytest.raises(SystemExit, match="positive integer"):
        main(["estimate", "--lq", "0"])
