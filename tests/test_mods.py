"""User score and mask modifications (cuflash.mods) on the CPU: validation, the generated source and its
NVRTC builds, the NumPy path against the options it should equal, and gradients against float64 finite
differences. The GPU runs are test_mods_gpu.py's."""
import re
from dataclasses import replace

import numpy as np
import pytest

import cuflash
from cuflash import CompileError, mods as M, reference
from cuflash._dispatch.model import LINEAR_BIAS_FAMILIES, SCORING_FAMILIES, linear_bias, takes_linear_bias
from cuflash._dispatch.select import (MODS_FWD_WGMMA_TILE, PLAIN_MODS_FAMILIES, all_variants, query_groups_in_two_passes,
                                      schedule_for, takes_plain_mods, with_mods)
from cuflash._runtime.build import compile_offline

from _nvrtc import needs_nvrtc

B, H, L, D = 2, 3, 37, 16


def _inputs(seed=0, b=B, h=H, lq=L, lk=L, d=D):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h, lq, d)), rng.standard_normal((b, h, lk, d)), rng.standard_normal((b, h, lk, d)),
            rng.standard_normal((b, h, lq, d)))


def _library(h=H, b=B, length=L):
    rng = np.random.default_rng(1)
    doc = np.sort(rng.integers(0, 3, (b, length)), axis=1).astype(np.int32)
    return {
        "softcap": dict(score_mod=cuflash.softcap(3.0)),
        "alibi": dict(score_mod=cuflash.alibi(np.linspace(0.05, 0.4, h).astype(np.float32))),
        "t5": dict(score_mod=cuflash.relative_position_bias(rng.standard_normal((32, h)).astype(np.float32),
                                                            max_distance=20)),
        "document": dict(mask_mod=cuflash.document_mask(doc)),
        "prefix": dict(mask_mod=cuflash.prefix_lm_mask(np.array([5, 11][:b], np.int32))),
        "composed": dict(score_mod=(cuflash.alibi(np.full(h, 0.1, np.float32)), cuflash.softcap(2.0)),
                         mask_mod=(cuflash.document_mask(doc), cuflash.prefix_lm_mask(np.array([30, 3][:b], np.int32)))),
    }


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("bad, err, match", [
    (lambda: cuflash.ScoreMod(""), TypeError, "non-empty string"),
    (lambda: cuflash.ScoreMod("#define X 1\nscore"), ValueError, "preprocessor"),
    (lambda: cuflash.ScoreMod("score", params={"score": 1.0}), ValueError, "not usable"),
    (lambda: cuflash.ScoreMod("score", params={"cuf_x": 1.0}), ValueError, "not usable"),
    (lambda: cuflash.ScoreMod("score", params={"x": "a"}), TypeError, "number or an array"),
    (lambda: cuflash.ScoreMod("score", params={"x": float("nan")}), ValueError, "finite"),
    (lambda: cuflash.ScoreMod("score", params={"x": 2**40}), ValueError, "32 bits"),
    (lambda: cuflash.ScoreMod("score", params={"x": np.zeros(3, np.complex64)}), TypeError, "not supported"),
    (lambda: cuflash.ScoreMod("score", params={"x": np.zeros((3, 4))[:, ::2]}), ValueError, "C-contiguous"),
    (lambda: cuflash.ScoreMod("score", params={"t": np.zeros(3, np.int32)}, param_grads={"t": ("0", "1")}),
     ValueError, "float array"),
    (lambda: cuflash.ScoreMod("score", params={"t": np.zeros(3, np.float32)}, param_grads={"t": "0"}),
     TypeError, "index source"),
    (lambda: cuflash.ScoreMod("score", python=3), TypeError, "callable"),
    (lambda: cuflash.ScoreMod("score", scales=2.0), TypeError, "pair"),
    (lambda: cuflash.ScoreMod("score", scales=(1.0, 0.0)), ValueError, "> 0"),
    (lambda: cuflash.ScoreMod("score", scales=(float("inf"), 1.0)), ValueError, "> 0"),
    (lambda: cuflash.ScoreMod("score", scales=(True, 1.0)), ValueError, "> 0"),
    (lambda: cuflash.ScoreMod("score", params={"t": np.zeros(3, np.float32)}, param_grads={"t": ("0", "1")},
                              scales=(1.0, 2.0)), ValueError, "param_grads"),
    (lambda: cuflash.softcap(0.0), ValueError, "cap"),
    (lambda: cuflash.ScoreMod("score", consts={"c": np.ones(2, np.float32)}), TypeError, "Python number"),
    (lambda: cuflash.ScoreMod("score", consts={"c": float("inf")}), ValueError, "finite"),
    (lambda: cuflash.ScoreMod("score", consts={"c": 1.0}, params={"c": 2.0}), ValueError, "both"),
    (lambda: cuflash.ScoreMod("score", consts=[1.0]), TypeError, "dict"),
    (lambda: cuflash.MaskMod("true", consts={"q_idx": 1}), ValueError, "not usable"),
    (lambda: cuflash.ScoreMod("score", params={"rel_pos": 1.0}), ValueError, "not usable"),
    (lambda: cuflash.ScoreMod("score", log2_units=1), TypeError, "bool"),
    (lambda: cuflash.ScoreMod("score", everywhere="yes"), TypeError, "everywhere must be a bool"),
    (lambda: cuflash.ScoreMod("score", consts={"c": 1e39}), ValueError, "does not fit a float"),
    (lambda: cuflash.ScoreMod("score", consts={"c": 1e-50}), ValueError, "does not fit a float"),
    (lambda: cuflash.ScoreMod("score", params={"CUF_LN2": 1.0}), ValueError, "not usable"),
    (lambda: cuflash.alibi(np.ones(3)), TypeError, "float32"),
    (lambda: cuflash.relative_position_bias(np.ones((8, 3), np.float32)), ValueError, "32 buckets"),
    (lambda: cuflash.document_mask(np.ones(3, np.int32)), TypeError, "int32 array"),
    (lambda: cuflash.prefix_lm_mask(np.ones((2, 2), np.int32)), TypeError, "int32 array"),
    (lambda: cuflash.ScoreMod("score * float", params={"float": 2.0}), ValueError, "C\\+\\+ keyword"),
    (lambda: cuflash.MaskMod("threadIdx > 0", params={"threadIdx": 1}), ValueError, "not usable"),
    (lambda: cuflash.relative_position_bias(np.ones((32, 3), np.float32), max_distance=20.5), TypeError, "int"),
    (lambda: cuflash.relative_position_bias(np.ones((32, 3), np.float32), bidirectional="yes"), TypeError, "bool"),
])
def test_bad_modifications_are_refused(bad, err, match):
    with pytest.raises(err, match=match):
        bad()


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_alibi_offset_is_flash_attentions_alignment(causal):
    """alibi(slopes, offset=Lk - Lq): FlashAttention's alibi_slopes, -slope |q_idx + Lk - Lq - kv_idx| added to
    the scores (a bias written out); forward and backward on the NumPy path. offset 0 differs where queries see
    keys past their own position."""
    q, k, v, do = _inputs(lq=5, lk=19)
    slopes = np.array([0.5, 0.25, 0.125], np.float32)
    i, j = np.arange(5)[:, None], np.arange(19)[None, :]
    bias = np.broadcast_to(-slopes.astype(np.float64)[:, None, None] * np.abs(i + 14 - j), (B, H, 5, 19))
    mod = cuflash.alibi(slopes, offset=14)
    out, vjp_fn = cuflash.vjp(q, k, v, causal=causal, score_mod=mod)
    want_out, want_vjp = cuflash.vjp(q, k, v, causal=causal, bias=bias)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    for g, w in zip(vjp_fn(do)[:3], want_vjp(do)[:3]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    assert np.abs(cuflash.attention(q, k, v, causal=causal, score_mod=cuflash.alibi(slopes)) - want_out).max() > 0.1
    assert mod.light and mod.linear_slope is None and "offset" in mod.params
    with pytest.raises(TypeError, match="offset must be an int"):
        cuflash.alibi(slopes, offset=1.5)


@pytest.mark.parametrize("options, match", [
    (dict(score_mod=cuflash.alibi(np.ones(2, np.float32))), r"slopes has shape \(2,\); this call needs \(3,\)"),
    (dict(score_mod=cuflash.alibi(np.ones(8, np.float32))), r"slopes has shape \(8,\)"),
    (dict(score_mod=cuflash.relative_position_bias(np.zeros((32, 2), np.float32))), r"needs \(32, 3\)"),
    (dict(mask_mod=cuflash.prefix_lm_mask(np.array([3], np.int32))),
     r"prefix has shape \(1,\); this call needs \(2,\)"),
    (dict(score_mod=[cuflash.relative_position_bias(np.zeros((32, 3), np.float32))] * 2),
     "train parameters of one name twice"),
])
def test_library_parameters_that_do_not_fit_the_call_are_refused(options, match):
    """The library modifications' arrays against the call (the kernels index them unchecked): ALiBi's slopes
    (Hq,), T5's table (num_buckets, Hq), prefix lengths (B,); two modifications training one parameter name."""
    q, k, v, _ = _inputs()
    assert q.shape[:2] == (B, H) == (2, 3)
    with pytest.raises(ValueError, match=match):
        cuflash.attention(q, k, v, **options)


def test_document_runs_are_found_on_the_host_and_the_ids_copied():
    """document_mask keeps a copy of its ids and their runs (row, first, length) where each document is one
    run of its row; an id again later in a row (or a shorter row of ids than the call's) leaves none."""
    ids = np.array([[4, 4, 4, 0, 0, 9], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 4]], np.int32)
    mask = cuflash.document_mask(ids)
    row, first, length = mask.documents.runs
    assert row.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2] and first.tolist() == [0, 3, 5, 0, 0, 1, 2, 3, 4]
    assert length.tolist() == [3, 2, 1, 6, 1, 1, 1, 1, 2] and mask.documents.shape == (3, 6)
    ids[0, 0] = 7
    assert mask.params["doc"][0, 0] == 4   # its own copy
    assert cuflash.document_mask(np.array([[0, 0, 1, 0]], np.int32)).documents.runs is None
    assert all(x.size == 0 for x in cuflash.document_mask(np.zeros((2, 0), np.int32)).documents.runs)
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="at least max"):
        cuflash.attention(q, k, v, mask_mod=cuflash.document_mask(np.zeros((B, 3), np.int32)))


def test_bad_calls_are_refused_before_anything_runs():
    q, k, v, do = _inputs()
    with pytest.raises(TypeError, match="score_mod must be a cuflash.ScoreMod"):
        cuflash.attention(q, k, v, score_mod=cuflash.document_mask(np.zeros((B, L), np.int32)))
    with pytest.raises(TypeError, match="mask_mod must be a cuflash.MaskMod"):
        cuflash.attention(q, k, v, mask_mod="kv_idx <= q_idx")
    with pytest.raises(ValueError, match="NumPy twin"):
        cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("score * 2"))
    many = tuple(cuflash.ScoreMod("score", params={f"p{i}": 1.0 for i in range(9)}, python=lambda s, *a, **p: s)
                 for _ in range(2))
    with pytest.raises(ValueError, match="at most 16"):
        cuflash.attention(q, k, v, score_mod=many)
    out, lse = cuflash.attention_forward(q, k, v, score_mod=cuflash.ScoreMod("score", python=lambda s, *a: s))
    with pytest.raises(ValueError, match="derivative: give grad"):
        cuflash.attention_backward(do, q, k, v, out, lse, score_mod=cuflash.ScoreMod("score", python=lambda s, *a: s))


# --------------------------------------------------------------------------- the generated source

def test_prelude_switches_and_slots():
    mods = M.resolve(tuple(_library()["composed"]["score_mod"]) + (_library()["t5"]["score_mod"],),
                     _library()["composed"]["mask_mod"])
    text = mods.prelude(True)
    for switch in ("CUF_USER_SCORE 1", "CUF_USER_MASK 1", "CUF_USER_PARAM_GRADS 1", "CUF_FAST_SPECIAL 1"):
        assert f"#define {switch}" in text
    assert "#define CUF_FAST_SPECIAL 0" in mods.prelude(False)
    # alibi (slopes), t5 (table + its gradient, bucket_of), document (doc, length), prefix (prefix); softcap's
    # cap is compiled in
    assert mods.slots == 7
    slots = [int(re.search(r"cuf_args\[(\d+)\]", line).group(1)) for line in text.splitlines()
             if "cuf_args[" in line and "=" in line]
    assert list(dict.fromkeys(slots)) == list(range(7))   # each function of a modification reads its own
    cap = 2.0 * M._LOG2E   # softcap(2.0) in log2 units: its scales (1 / c, c), literals in the chain
    assert f"A({cap!r}) * cuf_score_1<A>(A({1 / cap!r}) * " in text
    assert mods.key() == M.resolve(*_as_pair(mods)).key()   # the same modifications, the same builds
    plain = M.resolve(None, _library()["prefix"]["mask_mod"]).prelude(False)
    assert "CUF_USER_SCORE" not in plain and "CUF_USER_MASK 1" in plain


def test_special_function_modifications_are_counted_for_the_softmax():
    """CUF_USER_SPECIAL: the tanh calls a score modification makes on the special-function unit (the 16-bit
    Hopper forward then forms part of its probabilities on the FMA pipe: softmax.cuh), only under
    CUF_FAST_SPECIAL."""
    softcap = M.resolve(cuflash.softcap(30.0))
    assert "#define CUF_USER_SPECIAL 1" in softcap.prelude(True)
    assert "CUF_USER_SPECIAL" not in softcap.prelude(False)
    assert "CUF_USER_SPECIAL" not in M.resolve(cuflash.alibi(np.ones(4, np.float32))).prelude(True)
    twice = M.resolve((cuflash.softcap(30.0), cuflash.ScoreMod("cuf_tanh(score) + cuf_tanh (score * 2)",
                                                               grad="acc_t(0)")))
    assert "#define CUF_USER_SPECIAL 3" in twice.prelude(True)


def test_consts_are_compiled_in_and_reach_the_twins():
    """A const is a literal in the source (exact: the double's repr), takes no parameter word, enters the
    builds' key by value, and is passed to the NumPy twins by name."""
    def scaled(c):
        return cuflash.ScoreMod("score * c + n", grad="c", consts={"c": c, "n": 3},
                                python=lambda s, b, h, q, kv, c, n: s * c + n, python_grad=lambda s, *a, c, n: c)
    mods = M.resolve(scaled(0.1))
    text = mods.prelude(True)
    assert "constexpr acc_t c = acc_t(0.1);" in text and "constexpr int n = int(3);" in text
    assert mods.slots == 0 and "cuf_args[" not in text.split('#line 1 "cuflash"')[0].split("cuf_tanh")[-1]
    assert mods.key() != M.resolve(scaled(0.2)).key() and mods.key() == M.resolve(scaled(0.1)).key()
    q, k, v, _ = _inputs()
    np.testing.assert_allclose(cuflash.attention(q, k, v, score_mod=scaled(0.5)),
                               cuflash.attention(q, k, v, scale=0.5 / np.sqrt(D)), rtol=1e-12)


def test_scales_are_the_twins_factors_and_the_forwards_fold_the_outer_ones():
    """scales=(a, c) is c f(a score): the NumPy twins take it so (the same attention as the spelled-out form,
    value and gradient), the full chain carries both factors, and the forwards' folded chain leaves the first
    modification's a (with its unit conversion) to CUF_USER_IN_SCALE and the last one's c (with the conversion
    back) to CUF_USER_OUT_SCALE."""
    a, c = 0.3, 1.7
    inner = cuflash.ScoreMod("score * score * acc_t(0.1) + score", grad="score * acc_t(0.2) + acc_t(1)", scales=(a, c),
                             python=lambda t, *r: 0.1 * t * t + t, python_grad=lambda t, *r: 0.2 * t + 1)
    spelled = cuflash.ScoreMod("score", grad="acc_t(1)", python=lambda s, *r: c * (0.1 * (a * s) ** 2 + a * s),
                               python_grad=lambda s, *r: c * a * (0.2 * a * s + 1))
    q, k, v, do = _inputs()
    for causal in (False, True):
        out, vjp = cuflash.vjp(q, k, v, causal=causal, score_mod=inner)
        out_ref, vjp_ref = cuflash.vjp(q, k, v, causal=causal, score_mod=spelled)
        np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-13)
        for g, g_ref in zip(vjp(do)[:3], vjp_ref(do)[:3]):
            np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-12)
    text = M.resolve(inner).prelude(True)   # natural units: IN = ln 2 a, OUT = c log2 e
    assert f"#define CUF_USER_IN_SCALE {M._LN2 * a!r}" in text
    assert f"#define CUF_USER_OUT_SCALE {c * M._LOG2E!r}" in text
    folded = text[text.index("cuf_user_score_folded(A score"):].split("}")[0]
    assert "score = cuf_score_0<A>(score, " in folded and "return score;" in folded
    full = text[text.index("cuf_user_score(A score"):].split("}")[0]
    assert f"A({c!r}) * cuf_score_0<A>(A({a!r}) * cuf_to_natural(score)" in full
    cap = 3.0 * M._LOG2E
    composed = M.resolve((cuflash.alibi(np.ones(H, np.float32)), cuflash.softcap(3.0))).prelude(True)
    assert "#define CUF_USER_IN_SCALE 1.0" in composed and f"#define CUF_USER_OUT_SCALE {cap!r}" in composed
    folded = composed[composed.index("cuf_user_score_folded(A score"):].split("}")[0]
    assert f"cuf_score_1<A>(A({1 / cap!r}) * (score)" in folded and f"A({cap!r})" not in folded
    masks_only = M.resolve(None, cuflash.prefix_lm_mask(np.array([5, 11][:B], np.int32))).prelude(True)
    assert "#define CUF_USER_IN_SCALE 1.0" in masks_only and "#define CUF_USER_OUT_SCALE 1.0" in masks_only


def test_log2_units_convert_only_where_the_units_change():
    """The generated chain holds scores in log2 units and converts into each modification's units only where
    they differ from the score's, and back at the end."""
    nat = cuflash.ScoreMod("score + acc_t(1)", grad="acc_t(1)", python=lambda s, *a: s + 1)
    log2 = cuflash.ScoreMod("score * acc_t(2)", grad="acc_t(2)", log2_units=True, python=lambda s, *a: s * 2)
    text = M.resolve((nat, nat, log2, nat)).prelude(True)
    chain = text[text.index("cuf_user_score(A score"):].split("}")[0]
    assert re.findall(r"score = cuf_score_(\d)<A>\((\w*)\(score\)", chain) == [
        ("0", "cuf_to_natural"), ("1", ""), ("2", "cuf_to_log2"), ("3", "cuf_to_natural")]
    assert "return cuf_to_log2(score);" in chain
    only_log2 = M.resolve(log2).prelude(True)
    chain = only_log2[only_log2.index("cuf_user_score(A score"):].split("}")[0]
    assert "cuf_to_" not in chain


def test_everywhere_selects_only_when_every_score_modification_has_it():
    """The prelude's switch for the branch-free form (USER_SCORE_EVERYWHERE) is set only where every score
    modification of the call allows evaluation at masked positions; the library's score modifications do."""
    anywhere = cuflash.ScoreMod("score + acc_t(1)", grad="acc_t(1)", everywhere=True, python=lambda s, *a: s + 1)
    guarded = cuflash.ScoreMod("score + acc_t(1)", grad="acc_t(1)", python=lambda s, *a: s + 1)
    switch = "#define CUF_USER_SCORE_EVERYWHERE 1"
    assert switch in M.resolve(anywhere).prelude(True)
    assert switch not in M.resolve((anywhere, guarded)).prelude(True)
    assert switch not in M.resolve(guarded).prelude(True)
    assert switch in M.resolve((cuflash.softcap(30.0), cuflash.alibi(np.ones(H, np.float32)))).prelude(True)
    t5 = cuflash.relative_position_bias(np.zeros((32, H), np.float32))   # a load an element: kept behind a branch
    assert switch not in M.resolve((cuflash.softcap(30.0), t5)).prelude(True)
    assert M.resolve(anywhere).key() != M.resolve(guarded).key()   # another source: another build


def test_a_log2_unit_modification_equals_its_natural_twin():
    """softcap in log2 units with its cap compiled in, and a trainable per-head offset written in log2 units,
    against the same modifications in natural units: outputs and every gradient (the parameter's through the
    log2 chain's factor ln 2) on the NumPy path."""
    q, k, v, do = _inputs(7)
    cap = 2.0
    natural_cap = cuflash.ScoreMod("cap * cuf_tanh(score / cap)", grad="acc_t(1)", params={"cap": cap},
                                   python=lambda s, b, h, q_, kv, cap: cap * np.tanh(s / cap),
                                   python_grad=lambda s, b, h, q_, kv, cap: 1 - np.tanh(s / cap) ** 2)
    w = np.linspace(-0.5, 0.5, H)

    def offset(log2):
        f = M._LOG2E if log2 else 1.0   # the offset w[h] of natural scores in the modification's units
        return cuflash.ScoreMod("score + w[h] * f", grad="acc_t(1)", params={"w": w}, consts={"f": f},
                                param_grads={"w": ("h", "f")}, log2_units=log2,
                                python=lambda s, b, h, q_, kv, w, f: s + w[h] * f,
                                python_grad=lambda s, *a, w, f: np.ones_like(s),
                                python_param_grads={"w": lambda s, b, h, q_, kv, w, f: (h + 0 * s, f + 0 * s)})
    want = cuflash.vjp(q, k, v, causal=True, score_mod=(offset(False), natural_cap))
    got = cuflash.vjp(q, k, v, causal=True, score_mod=(offset(True), cuflash.softcap(cap)))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-13)
    for g, w_ in zip(got[1](do), want[1](do)):
        if isinstance(g, dict):
            np.testing.assert_allclose(g["w"], w_["w"], rtol=1e-10, atol=1e-12)
        else:
            np.testing.assert_allclose(g, w_, rtol=1e-10, atol=1e-12)


def test_a_new_length_builds_nothing_new():
    """The document mask's length is a parameter: one prelude (one build) for every sequence length."""
    preludes = {M.resolve(None, cuflash.document_mask(np.zeros((2, n), np.int32))).prelude(False) for n in (64, 4095)}
    assert len(preludes) == 1


def test_light_modifications():
    """ScoreMod.light: evaluated everywhere, no integer position, no trainable parameter."""
    slopes = np.ones(4, np.float32)
    assert cuflash.softcap(30.0).light and cuflash.alibi(slopes).light
    assert not cuflash.relative_position_bias(np.zeros((32, 4), np.float32)).light
    assert not cuflash.ScoreMod("score - acc_t(q_idx - kv_idx)", everywhere=True).light
    assert not cuflash.ScoreMod("score", grad="acc_t(kv_idx > 0)", everywhere=True).light
    assert cuflash.ScoreMod("score + acc_t(0.5) * rel_pos", everywhere=True).light
    assert not cuflash.ScoreMod("score + acc_t(0.5) * rel_pos").light


def _as_pair(mods):
    return mods.score, mods.mask


@pytest.mark.parametrize("form", ["light", "everywhere", "branch"])
def test_modifications_go_on_the_scoring_variants_only(form):
    """Where modifications go, and the Hopper forward's tile and schedule with them: one light modification
    (softcap) keeps a plain variant's tile and schedule; walking as the table's where they all run everywhere
    (softcap and ALiBi at once); a CTA a block for a band where they run behind a branch."""
    cap = cuflash.softcap(30.0)
    everywhere = form != "branch"
    mod = {"light": cap, "everywhere": (cap, cuflash.alibi(np.ones(4, np.float32))),
           "branch": cuflash.ScoreMod(cap.source, grad=cap.grad, consts=cap.consts, log2_units=True)}[form]
    prelude = M.resolve(mod).prelude(True)
    assert ("#define CUF_USER_SCORE_LIGHT 1" in prelude) == (form == "light")
    for v in all_variants():
        if not v.extra and v.family in SCORING_FAMILIES and not v.packed and not takes_plain_mods(v):
            with pytest.raises(ValueError, match="EXTRA variants"):
                with_mods(v, prelude)
            continue
        w = with_mods(v, prelude)
        if v.family not in SCORING_FAMILIES or v.packed or v.acc_out:
            assert w is v
            continue
        assert w.prelude == prelude and w.name.split("<")[0] == v.name.split("<")[0]
        if form == "light" and not v.extra:
            assert (w.tile, w.schedule, w.short) == (v.tile, v.schedule, v.short)
        elif v.family == "fwd_wgmma" and (v.tile.warps == 16 or v.tile.ctas > 1):
            assert w.tile == MODS_FWD_WGMMA_TILE
        if v.family == "fwd_wgmma" and v.band and not everywhere:
            assert w.schedule == "block"
        if v.family == "fwd_wgmma" and everywhere:
            assert w.schedule == schedule_for(w) and (w.tile == v.tile or w.tile == MODS_FWD_WGMMA_TILE)
    for family in ("fwd_decode", "bwd_dsum"):
        with pytest.raises(ValueError, match="scoring kernels"):
            replace(next(v for v in all_variants() if v.family == family), prelude=prelude)


_FAMILIES = [("sm_80", "fwd_mma", "bfloat16"), ("sm_90", "fwd_wgmma", "float16"), ("sm_90", "bwd_dkdv_wgmma", "bfloat16"),
             ("sm_80", "bwd_dkdv_mma", "float16"), ("sm_80", "bwd_dbias_mma", "bfloat16"),
             ("sm_90", "fwd_wgmma_tf32x3", "float32"), ("sm_80", "bwd_dq_tf32x3", "float32"),
             ("sm_90", "fwd_dmma", "float64"), ("sm_90", "bwd_dkdv_dmma", "float64"), ("sm_80", "bwd_dkdv_fma", "float32")]


def _every_library_mod(masks: bool = True):
    lib = _library()
    return M.resolve(lib["composed"]["score_mod"] + (lib["t5"]["score_mod"],),
                     lib["composed"]["mask_mod"] if masks else None)


@needs_nvrtc
@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("arch, family, dtype", _FAMILIES)
def test_library_modifications_compile_without_spills(arch, family, dtype, extra):
    """Every library modification at once compiled into a variant of each kind of kernel: zero spills (the
    sweep compiles every scoring variant so). Score modifications alone run on the plain variants."""
    if not extra and family not in PLAIN_MODS_FAMILIES:
        pytest.skip(f"{family} takes modifications on its EXTRA variants")
    mods = _every_library_mod(masks=extra)
    v = next(v for v in all_variants() if v.extra == extra and not v.packed and v.family == family and v.dtype == dtype
             and v.compile_target(arch))
    v = with_mods(v, mods.prelude(dtype in ("float16", "bfloat16")))
    build = compile_offline(v.entry, v.name, v.compile_target(arch), v.prelude)
    assert build.spills == 0 and build.stack_frame == 0, build.log


@pytest.mark.sweep
@needs_nvrtc
@pytest.mark.parametrize("dtype, family", sorted({(v.dtype, v.family) for v in all_variants()
                                                  if v.family in SCORING_FAMILIES}))
def test_every_scoring_variant_compiles_with_modifications(dtype, family):
    """Every scoring variant that takes modifications with every library modification compiled in (the plain
    ones of PLAIN_MODS_FAMILIES: the score modifications alone), and the plain ones also with those evaluated
    everywhere (ALiBi and softcap: no branch an element, the walking Hopper forwards on their own tiles) and
    the Hopper forward's with each of them alone (light: its widest tiles), for
    the architecture its table row is tuned for (sm_90 for the sm90 rows and Hopper's own, sm_80 for the
    others): zero spills. Head dim 256's Hopper backward takes none."""
    bad = []
    fast = dtype in ("float16", "bfloat16")
    lib = _library()
    everywhere = M.resolve(lib["composed"]["score_mod"]).prelude(fast)   # ALiBi and softcap
    assert "CUF_USER_SCORE_EVERYWHERE 1" in everywhere
    # one light modification alone: the Hopper forward's plain variants keep their widest tiles with it
    light = tuple(M.resolve(m).prelude(fast) for m in lib["composed"]["score_mod"]) if family == "fwd_wgmma" else ()
    assert all("CUF_USER_SCORE_LIGHT 1" in p for p in light)
    for v in {with_mods(v, prelude)
              for u in all_variants() if u.dtype == dtype and u.family == family and not u.packed
              for v in query_groups_in_two_passes([u])   # the dK/dV passes a call with modifications runs
              if (v.extra or takes_plain_mods(v)) and not (v.family == "bwd_dkdv_wgmma" and v.head == 256)
              for prelude in ((_every_library_mod(masks=v.extra).prelude(fast),) if v.extra
                              else (_every_library_mod(masks=False).prelude(fast), everywhere) + light)}:
        arch = "sm_80" if v.arch == "sm80" else "sm_90"
        build = compile_offline(v.entry, v.name, v.compile_target(arch), v.prelude)
        if build.spills or build.stack_frame:
            bad.append((v.name, build.spills))
    assert not bad, bad


def _linear_variants(dtype: str, family: str):
    """The variants that take the linear bias (alibi under a causal band), with its prelude."""
    prelude = M.resolve(cuflash.alibi(np.ones(4, np.float32))).linear_prelude()
    return sorted({replace(v, prelude=prelude) for v in all_variants()
                   if v.family == family and v.dtype == dtype and takes_linear_bias(v)}, key=lambda v: v.name)


def test_only_the_plain_hopper_kernels_take_the_linear_bias():
    prelude = M.resolve(cuflash.alibi(np.ones(4, np.float32))).linear_prelude()
    plain = [v for v in all_variants() if takes_linear_bias(v)]
    assert {v.family for v in plain} == set(LINEAR_BIAS_FAMILIES) and all(v.head <= 128 for v in plain)
    for v in all_variants():
        if v.family in LINEAR_BIAS_FAMILIES and (v.extra or v.packed or v.acc_out or v.head > 128):
            with pytest.raises(ValueError, match="linear bias|not on packed"):
                replace(v, prelude=prelude)


@needs_nvrtc
@pytest.mark.parametrize("dtype, family", [("bfloat16", "fwd_wgmma"), ("float16", "bwd_dkdv_wgmma")])
def test_the_linear_bias_compiles_without_spills(dtype, family):
    """ALiBi's tensor-core form (kernels_cu/linear_bias.cuh) in a Hopper kernel at head dims 64 and 128: zero
    spills and no wgmma fence ptxas adds itself (C7519: the A fragment formed after the kernel's fence). The
    sweep compiles every such variant."""
    for v in [v for v in _linear_variants(dtype, family) if v.band][:2]:
        assert linear_bias(v)
        build = compile_offline(v.entry, v.name, "sm_90a", v.prelude)
        assert build.spills == 0 and build.stack_frame == 0 and "C7519" not in build.log, build.log


@pytest.mark.sweep
@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", LINEAR_BIAS_FAMILIES)
def test_every_linear_bias_variant_compiles(dtype, family):
    bad = []
    for v in _linear_variants(dtype, family):
        build = compile_offline(v.entry, v.name, "sm_90a", v.prelude)
        if build.spills or build.stack_frame or "C7519" in build.log:
            bad.append((v.name, build.spills))
    assert not bad, bad


@needs_nvrtc
def test_the_block_state_kernel_compiles():
    mods = M.resolve(None, _library()["composed"]["mask_mod"])
    build = compile_offline("mask_mod_states.cu", "mask_mod_states", "sm_80", mods.prelude(False))
    assert build.spills == 0


@needs_nvrtc
def test_a_compile_error_quotes_the_users_line():
    bad = cuflash.ScoreMod("{\n  acc_t y = score * 2;\n  return y + undefined_name;\n}", grad="acc_t(2)",
                           name="my_mod")
    v = with_mods(next(v for v in all_variants() if v.extra and v.family == "fwd_mma"), M.resolve(bad).prelude(True))
    with pytest.raises(CompileError) as info:
        compile_offline(v.entry, v.name, "sm_80", v.prelude)
    assert "my_mod(3)" in info.value.log and "undefined_name" in info.value.log
    assert "in my_mod, line 3: return y + undefined_name;" in info.value.log


@needs_nvrtc
@pytest.mark.parametrize("source, message, line", [
    ("{\n  if (score > 0) return score;\n}", "missing return statement", None),   # at the body's end
    ("{\n  if (score > 0) return score;\n  return;\n}", "should return a value", 3),
])
def test_a_body_that_can_end_without_a_value_is_a_compile_error(source, message, line):
    """NVRTC's warnings 940 and 117 (a path out of a non-void body without a value) are errors in a build with
    user modifications, naming the user's modification and line: not a kernel reading garbage."""
    bad = cuflash.ScoreMod(source, grad="acc_t(1)", name="my_mod")
    v = with_mods(next(v for v in all_variants() if v.extra and v.family == "fwd_mma"), M.resolve(bad).prelude(True))
    with pytest.raises(CompileError) as info:
        compile_offline(v.entry, v.name, "sm_80", v.prelude)
    assert message in info.value.log and "my_mod(" in info.value.log
    if line is not None:
        assert f"my_mod({line})" in info.value.log and f"in my_mod, line {line}: return;" in info.value.log


# --------------------------------------------------------------------------- the NumPy path

def _dense(kind, q, k, v):
    """The same attention from the plain options: an explicit bias or boolean mask."""
    lib = _library()
    i = np.arange(L)
    if kind == "alibi":
        slopes = lib["alibi"]["score_mod"].params["slopes"].astype(np.float64)
        return dict(bias=-slopes[:, None, None] * np.abs(i[:, None] - i[None, :]))
    if kind == "t5":
        table = lib["t5"]["score_mod"].params["table"].astype(np.float64)
        return dict(bias=np.moveaxis(table[M.t5_bucket(i[None, :] - i[:, None], 32, 20, True)], -1, 0))
    if kind == "document":
        doc = lib["document"]["mask_mod"].params["doc"]
        return dict(mask=doc[:, None, :, None] == doc[:, None, None, :])
    if kind == "prefix":
        pre = lib["prefix"]["mask_mod"].params["prefix"]
        return dict(mask=(i < pre[:, None, None, None]) | (i[None, :] <= i[:, None]))
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["alibi", "t5", "document", "prefix"])
def test_library_modifications_equal_their_explicit_bias_or_mask(kind):
    q, k, v, do = _inputs()
    got, lse = cuflash.attention_forward(q, k, v, causal=kind != "prefix", **_library()[kind])
    want, want_lse = cuflash.attention_forward(q, k, v, causal=kind != "prefix", **_dense(kind, q, k, v))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    grads = cuflash.vjp(q, k, v, causal=kind != "prefix", **_library()[kind])[1](do)
    want_grads = cuflash.vjp(q, k, v, causal=kind != "prefix", **_dense(kind, q, k, v))[1](do)
    for g, w in zip(grads[:3], want_grads[:3]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_softcap_is_the_formula():
    q, k, v, _ = _inputs()
    got = cuflash.attention(q, k, v, causal=True, window=(20, None), score_mod=cuflash.softcap(2.5))
    s = 2.5 * np.tanh(q @ k.swapaxes(-1, -2) / np.sqrt(D) / 2.5)
    i = np.arange(L)
    s = np.where((i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 20), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(got, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-12, atol=1e-12)


def test_modifications_apply_in_order_and_masks_all_apply():
    q, k, v, _ = _inputs()
    a, s = cuflash.alibi(np.full(H, 0.5, np.float32)), cuflash.softcap(1.0)
    assert not np.allclose(cuflash.attention(q, k, v, score_mod=(a, s)), cuflash.attention(q, k, v, score_mod=(s, a)))
    twice = cuflash.ScoreMod("score * 2", grad="acc_t(2)", python=lambda s, *a: s * 2)
    np.testing.assert_allclose(cuflash.attention(q, k, v, score_mod=(twice, twice)),
                               cuflash.attention(q, k, v, scale=4 / np.sqrt(D)), rtol=1e-12)
    m1, m2 = _library()["document"]["mask_mod"], _library()["prefix"]["mask_mod"]
    both = _dense("document", q, k, v)["mask"] & _dense("prefix", q, k, v)["mask"]
    np.testing.assert_allclose(cuflash.attention(q, k, v, mask_mod=(m1, m2)), cuflash.attention(q, k, v, mask=both),
                               rtol=1e-12, atol=1e-12)


def test_modifications_compose_with_the_other_options():
    """bias (added before the modification), mask, window, dropout, block layout, GQA: the reference of
    each against the modified NumPy path."""
    rng = np.random.default_rng(3)
    q, k, v, do = _inputs(4)
    k, v = k[:, :1], v[:, :1]   # grouped-query: 3 query heads a K/V head
    opts = dict(causal="bottom_right", window=(25, None), bias=rng.standard_normal((1, H, L, L)),
                mask=rng.random((B, 1, 1, L)) < 0.9, dropout_p=0.1, seed=7,
                block_layout=cuflash.BlockLayout(rng.random((H, 3, 3)) < 0.8, 16), **_library()["composed"])
    out = cuflash.attention(q, k, v, **opts)
    naive = reference.attention_naive(q, k, v, **opts)[0]
    np.testing.assert_allclose(out, naive, rtol=1e-11, atol=1e-12)
    grads = cuflash.vjp(q, k, v, **opts)[1](do)
    naive_grads = reference.attention_backward_naive(do, q, k, v, **opts)
    for g, w in zip(grads, naive_grads):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- gradients

def _fd_check(f, x, grad, points=6, eps=1e-6, seed=0):
    rng = np.random.default_rng(seed)
    for idx in zip(*(rng.integers(0, n, points) for n in x.shape)):
        e = np.zeros_like(x)
        e[idx] = eps
        fd = (f(x + e) - f(x - e)) / (2 * eps)
        assert abs(fd - grad[idx]) <= 1e-6 * (1 + abs(fd)), (idx, fd, grad[idx])


@pytest.mark.parametrize("kind", ["softcap", "alibi", "composed"])
def test_gradients_match_finite_differences(kind):
    q, k, v, do = _inputs(2)
    opts = dict(causal=True, **_library()[kind])
    dq, dk, dv = cuflash.vjp(q, k, v, **opts)[1](do)
    _fd_check(lambda x: (cuflash.attention(x, k, v, **opts) * do).sum(), q, dq)
    _fd_check(lambda x: (cuflash.attention(q, x, v, **opts) * do).sum(), k, dk)
    _fd_check(lambda x: (cuflash.attention(q, k, x, **opts) * do).sum(), v, dv)


def test_the_relative_position_table_gradient_matches_finite_differences():
    q, k, v, do = _inputs(5)
    table = np.random.default_rng(6).standard_normal((32, H))
    rel = cuflash.relative_position_bias(table, max_distance=20)
    *_, grads = cuflash.vjp(q, k, v, causal=True, score_mod=(rel, cuflash.softcap(2.0)))[1](do)
    assert set(grads) == {"table"} and grads["table"].shape == table.shape and grads["table"].dtype == table.dtype

    def f(t):
        mod = cuflash.relative_position_bias(t, max_distance=20)
        return (cuflash.attention(q, k, v, causal=True, score_mod=(mod, cuflash.softcap(2.0))) * do).sum()

    _fd_check(f, table, grads["table"], points=10)
    # causal: keys after the query never seen, so their buckets (16 and up, bidirectional) get nothing
    assert (grads["table"][16:] == 0).all() and np.abs(grads["table"][:16]).sum() > 0


def test_t5_buckets_are_t5s():
    """T5's _relative_position_bucket, written out for a few distances (32 buckets, max distance 128)."""
    rel = np.array([-200, -128, -50, -9, -8, -7, -1, 0, 1, 7, 8, 50, 128, 200])
    want = [15, 15, 13, 8, 8, 7, 1, 0, 17, 23, 24, 29, 31, 31]
    assert M.t5_bucket(rel, 32, 128, True).tolist() == want
    assert M.t5_bucket(np.array([-20, -1, 0, 5]), 32, 128, False).tolist() == [17, 1, 0, 0]


def _bench_mods():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_mods.py"
    spec = importlib.util.spec_from_file_location("bench_mods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_fresh_modification_is_the_same_but_new():
    """bench_mods.py's first-call rows build a modification never built before: the same function (the NumPy
    path gives the same attention), another source (another build)."""
    bench_mods = _bench_mods()
    q, k, v, _ = _inputs(7)
    for mod in (cuflash.softcap(3.0), cuflash.prefix_lm_mask(np.array([4, 9], np.int32))):
        fresh = bench_mods._fresh(mod)
        assert fresh.source != mod.source and type(fresh) is type(mod)
        kw = "score_mod" if isinstance(mod, cuflash.ScoreMod) else "mask_mod"
        assert M.resolve(**{kw: fresh}).key() != M.resolve(**{kw: mod}).key()
        np.testing.assert_array_equal(cuflash.attention(q, k, v, **{kw: fresh}), cuflash.attention(q, k, v, **{kw: mod}))
    ids = bench_mods._documents(4096)
    assert ids.shape == (bench_mods.B, 4096) and (np.diff(ids, axis=1) >= 0).all() and (ids[:, -1] == 3).all()
    row = {"mod": "softcap", "D": 64, "L": 4096, "pass": "fwd", "contender": "cuflash", "ms": 0.5, "vs plain": 1.1,
           "first call s": 1.2, "new length s": 0.001, "note": ""}
    assert "| softcap | 64 | 4096 | fwd | cuflash | 0.500 | 1.10 | 1.20 | 0.001 |" in bench_mods.markdown([row], "X")
