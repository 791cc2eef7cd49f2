"""cuflash.torch on CPU tensors (cuflash's NumPy path) and, with marker `gpu`, on CUDA tensors: the
SDPA and FlashAttention-2 signatures against PyTorch's own SDPA, gradients (float64 gradcheck on the
CPU), masks and biases with their gradient, GQA, dropout reproducible under torch.manual_seed, the
features not there yet refused by name, and torch.compile keeping the op in one graph."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (cuflash.torch is optional)")
F = torch.nn.functional

import cuflash.torch as ct  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    return torch.device(name)


def _qkv(device, dtype=torch.float64, b=2, hq=4, hk=4, lq=33, lk=47, d=16, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
               for h, n in ((hq, lq), (hk, lk), (hk, lk)))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _close(a, b, dtype):
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float64),
                                           pytest.param("cuda", torch.float64, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_pytorch_forward_and_backward(device, dtype, is_causal):
    """Against PyTorch's own SDPA on the same tensors: float64 to 1e-10 (on CUDA its math backend);
    lower precisions within twice SDPA's own error against the float64 result, plus a floor."""
    dev = _device(device)
    q, k, v = _qkv(dev, dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dev, dtype)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))

    def run(fn, q, k, v, d):
        out = fn(q, k, v, is_causal=is_causal)
        return [out, *torch.autograd.grad(out, (q, k, v), d)]

    exact = run(F.scaled_dot_product_attention, q64, k64, v64, dout.double())
    ours = run(ct.scaled_dot_product_attention, q, k, v, dout)
    if dtype == torch.float64:
        for a, b in zip(ours, exact):
            _close(a, b, dtype)
        return
    theirs = run(F.scaled_dot_product_attention, q, k, v, dout)
    floor = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        err = float((a.double() - e).norm() / e.norm())
        peer = float((b.double() - e).norm() / e.norm())
        assert err <= 2 * peer + floor, f"{name}: {err:.2e} against SDPA's {peer:.2e}"


def test_gradcheck_in_float64():
    q, k, v = _qkv("cpu", b=1, hq=2, hk=1, lq=5, lk=7, d=4)
    bias = torch.randn(1, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, bias: ct.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True),
        (q, k, v, bias))


@pytest.mark.parametrize("device", DEVICES)
def test_bool_and_float_masks(device):
    dev = _device(device)
    dtype = torch.float64 if dev.type == "cpu" else torch.float32
    q, k, v = _qkv(dev, dtype)
    keep = torch.rand(2, 1, 33, 47, generator=torch.Generator().manual_seed(1)).to(dev) < 0.7
    _close(ct.scaled_dot_product_attention(q, k, v, attn_mask=keep),
           F.scaled_dot_product_attention(q, k, v, attn_mask=keep), dtype)
    bias = torch.randn(1, 4, 33, 47, dtype=dtype, device=dev, requires_grad=True)
    out = ct.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    _close(out, want, dtype)
    (g,) = torch.autograd.grad(out.sum(), bias)
    (h,) = torch.autograd.grad(want.sum(), bias)
    _close(g, h, dtype)
    fixed = bias.detach()                     # a float mask that needs no gradient: none is formed
    q, k, v = _qkv(dev, dtype, grad=True)
    ours = torch.autograd.grad(ct.scaled_dot_product_attention(q, k, v, attn_mask=fixed).sum(), (q, k, v))
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=fixed).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        _close(a, b, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_query_attention_needs_enable_gqa(device):
    dev = _device(device)
    dtype = torch.float64 if dev.type == "cpu" else torch.float32
    q, k, v = _qkv(dev, dtype, hq=8, hk=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        ct.scaled_dot_product_attention(q, k, v)
    _close(ct.scaled_dot_product_attention(q, k, v, enable_gqa=True),
           F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_func_layout_and_bottom_right_causal(device):
    dev = _device(device)
    dtype = torch.float64 if dev.type == "cpu" else torch.float16
    q, k, v = _qkv(dev, dtype, lq=20, lk=50)
    qb, kb, vb = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))   # (B, L, H, D)
    out = ct.flash_attn_func(qb, kb, vb, causal=True, window_size=(10, -1))
    assert out.shape == (2, 20, 4, 16) and out.is_contiguous()
    i, j = torch.arange(20)[:, None], torch.arange(50)[None, :]
    allowed = (j <= i + 30) & (j >= i + 30 - 10)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.to(dev)).transpose(1, 2)
    _close(out, want, dtype)
    dq, = torch.autograd.grad(out.sum(), qb)
    assert dq.shape == qb.shape


def test_dropout_is_reproducible_under_manual_seed():
    q, k, v = _qkv("cpu", grad=False)
    torch.manual_seed(3)
    a = ct.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    b = ct.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    c = ct.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)


def test_missing_features_are_refused_by_name():
    q, k, v = (x.transpose(1, 2) for x in _qkv("cpu", grad=False))
    for kwargs, name in ((dict(softcap=30.0), "softcap"), (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
                         (dict(return_attn_probs=True), "return_attn_probs")):
        with pytest.raises(NotImplementedError, match=name):
            ct.flash_attn_func(q, k, v, **kwargs)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    for kwargs, name in ((dict(softcap=30.0), "softcap"), (dict(block_table=torch.zeros(1)), "block_table"),
                         (dict(return_attn_probs=True), "return_attn_probs")):
        with pytest.raises(NotImplementedError, match=name):
            ct.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 33, 33, **kwargs)
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        ct.flash_attn_with_kvcache(q, k, v, rotary_cos=torch.ones(1))


def test_bfloat16_on_the_cpu_path():
    q, k, v = _qkv("cpu", torch.bfloat16, grad=False)
    out = ct.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    _close(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double()), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_keeps_one_graph(device):
    dev = _device(device)
    q, k, v = _qkv(dev, torch.float64 if dev.type == "cpu" else torch.float16)

    def layer(q, k, v):
        return ct.scaled_dot_product_attention(q * 2, k, v, is_causal=True).sum()

    explained = torch._dynamo.explain(layer)(q, k, v)
    assert explained.graph_break_count == 0
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    torch.testing.assert_close(got, layer(q, k, v))
    grads = torch.autograd.grad(got, (q, k, v))
    assert all(g is not None and math.isfinite(float(g.abs().sum())) for g in grads)
    assert np.isfinite(float(got.detach()))


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_with_kvcache_appends_and_attends(device):
    dev = _device(device)
    dtype = torch.float64 if dev.type == "cpu" else torch.float16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64).to(dev, dtype)        # (B, Lq, Hq, D)
    k_cache, v_cache = (torch.randn(2, 30, 2, 16, generator=g, dtype=torch.float64).to(dev, dtype) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 16, generator=g, dtype=torch.float64).to(dev, dtype) for _ in range(2))
    lengths = torch.tensor([4, 20], dtype=torch.int32, device=dev)
    before = k_cache.clone()
    out = ct.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
    assert out.shape == (2, 1, 8, 16)
    for b, n in enumerate((4, 20)):
        torch.testing.assert_close(k_cache[b, n], k_new[b, 0], rtol=0, atol=0)
        keys, values = k_cache[b, :n + 1].transpose(0, 1), v_cache[b, :n + 1].transpose(0, 1)   # (Hk, L, D)
        want = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys, values, enable_gqa=True)
        _close(out[b].transpose(0, 1), want, dtype)
    keep = torch.ones(30, dtype=torch.bool)
    keep[[4, 20]] = False
    torch.testing.assert_close(k_cache[0, keep], before[0, keep], rtol=0, atol=0)


def test_flash_attn_with_kvcache_paged():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float64)
    k_pages, v_pages = (torch.randn(7, 8, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))  # (pages, 8, Hk, D)
    table = torch.tensor([[5, 0, 3], [6, 2, 1]], dtype=torch.int32)
    lengths = torch.tensor([10, 19], dtype=torch.int32)
    out = ct.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, causal=True)
    for b in range(2):
        keys = torch.cat([k_pages[p] for p in table[b].tolist()])[:int(lengths[b])]       # (L, Hk, D)
        values = torch.cat([v_pages[p] for p in table[b].tolist()])[:int(lengths[b])]
        want = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                              enable_gqa=True)
        _close(out[b].transpose(0, 1), want, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lq,lk,window", [(9, 30, (25, 2)), (30, 9, (3, 25)), (17, 17, (3, 0)), (9, 30, (30, -1))])
def test_flash_attn_func_windows_align_to_the_bottom_right(device, lq, lk, window):
    """FlashAttention's window without causal: query i sees keys i + Lk - Lq - left .. i + Lk - Lq + right."""
    dev = _device(device)
    q, k, v = (x.transpose(1, 2) for x in _qkv(dev, lq=lq, lk=lk, grad=False))
    left, right = window
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    allowed = (j >= i + lk - lq - left) & ((j <= i + lk - lq + right) if right >= 0 else True)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=allowed.to(dev)).transpose(1, 2)
    got = ct.flash_attn_func(q, k, v, window_size=window)
    rows = allowed.any(dim=1)   # SDPA gives NaN for a row that sees nothing, cuflash 0
    _close(got[:, rows.to(dev)], want[:, rows.to(dev)], torch.float64)


def test_flash_attn_func_refuses_a_window_past_its_diagonal():
    q, k, v = (x.transpose(1, 2) for x in _qkv("cpu", lq=9, lk=30, grad=False))
    with pytest.raises(NotImplementedError, match="window"):
        ct.flash_attn_func(q, k, v, window_size=(3, 2))   # query i: keys i + 18 .. i + 23, no key i or before


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_matches_each_sequence(device, causal):
    """Packed (total, H, D) sequences through flash_attn_varlen_func: output and gradients equal to
    flash_attn_func on each sequence alone (GQA, an empty sequence, bottom-right causal per sequence)."""
    dev = _device(device)
    lq, lk = [5, 0, 17, 8], [9, 3, 17, 4]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=torch.float64).to(dev).requires_grad_(True)
    k, v = (torch.randn(sum(lk), 2, 16, generator=g, dtype=torch.float64).to(dev).requires_grad_(True)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + list(np.cumsum(n)), dtype=torch.int32, device=dev) for n in (lq, lk))
    out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dev)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lq)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq[b] == 0:
            continue
        qb, kb, vb = (x.detach()[s][None].requires_grad_(True) for x, s in ((q, rows), (k, keys), (v, keys)))
        want = ct.flash_attn_func(qb, kb, vb, causal=causal)
        _close(out[rows], want[0], torch.float64)
        wg = torch.autograd.grad(want, (qb, kb, vb), dout[rows][None])
        for got, w, s in zip(grads, wg, (rows, keys, keys)):
            _close(got[s], w[0], torch.float64)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, max(lk))
