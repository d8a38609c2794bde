"""numbaflash.torch: autograd, the SDPA and flash-attn drop-ins, on CPU tensors.

CPU tensors run through the NumPy path, so under NUMBA_ENABLE_CUDASIM=1 every test here
runs the kernels in the simulator; shapes are tiny. What is checked:

- the layer adds no arithmetic: its forward and gradients are bitwise numbaflash.attention's
  and attention_backward's on the same arrays, and they pass TESTING.md's rule against
  the float64 reference (tests/tolerance.py, tests/backward_checks.py);
- torch.autograd.gradcheck in float64;
- scaled_dot_product_attention equals PyTorch's (float64, forward and gradients): top-left
  is_causal, bool and float masks (broadcast, expanded), GQA;
- flash_attn_func: the (batch, seqlen, heads, d) layout and flash-attn's semantics
  (bottom-right causal, window, softcap, ALiBi) against references built without it;
- bfloat16 tensors pass as int16 views (no copy): out and gradients are bfloat16 with
  exactly the bits numbaflash gives for the same ``ml_dtypes.bfloat16`` arrays, through
  attention, SDPA, flash_attn_func and flash_attn_varlen_func (flash_attn_with_kvcache
  refuses them), and close to the float64 gradients (bfloat16's rounding);
- bad input raises before any launch;
- a tiny model trains to the same loss curve as with PyTorch's SDPA.

PyTorch is optional (pip install numbaflash[torch]): without it this module is skipped.
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import numbaflash  # noqa: E402
import numbaflash.api  # noqa: E402
from numbaflash import reference  # noqa: E402
from numbaflash.masks import visible  # noqa: E402
import numbaflash.torch as nft  # noqa: E402
from numbaflash import torch_dropins as dropins  # noqa: E402

from backward_checks import check_backward  # noqa: E402
from tolerance import (assert_bitwise_equal, assert_close_f64,  # noqa: E402
                       assert_matches_reference, forward_magnitudes, forward_oracle)

F64 = torch.float64
BF16 = ml_dtypes.bfloat16
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split(".")[:2])


def randn(*shape, dtype=F64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


def qkv(B=1, Hq=2, Sq=5, Sk=6, d=4, Hkv=None, dtype=F64, seed=0):
    Hkv = Hq if Hkv is None else Hkv
    return (randn(B, Hq, Sq, d, dtype=dtype, seed=seed),
            randn(B, Hkv, Sk, d, dtype=dtype, seed=seed + 1),
            randn(B, Hkv, Sk, d, dtype=dtype, seed=seed + 2))


def host(t):
    """A CPU tensor as the NumPy array numbaflash takes: bfloat16 as ``ml_dtypes.bfloat16``
    (a view of its int16 view), other dtypes through ``.numpy()``."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def grads_of(fn, inputs, dout):
    """(out, [grad of each input]) of out = fn(*inputs) for the upstream gradient dout."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(dout)
    return out.detach(), [x.grad for x in inputs]


def test_numbaflash_does_not_import_torch():
    code = "import sys, numbaflash; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- attention: the layer adds no arithmetic ------------------------------------------------

@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict()),
    (torch.float32, dict(causal=True, Hkv=1)),
    (torch.float64, dict(causal="top_left", window_size=(2, 1))),
    (torch.float16, dict()),
])
def test_attention_is_numbaflash_attention(dtype, options):
    options = dict(options)
    Hkv = options.pop("Hkv", None)
    q, k, v = qkv(dtype=dtype, Hkv=Hkv)
    dout = randn(*q.shape, dtype=dtype, seed=9, grad=False)
    out, grads = grads_of(lambda a, b, c: nft.attention(a, b, c, **options), (q, k, v), dout)
    assert out.dtype == dtype and out.device == q.device and out.shape == q.shape

    Q, K, V, dO = (x.detach().numpy() for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, return_lse=True, **options)
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse, **options)
    assert_bitwise_equal("O", out.numpy(), want_out)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, want_grads):
        assert_bitwise_equal(name, got.numpy(), want)

    if dtype == torch.float16:
        return                  # the float16 rule is the kernel suites' business
    ref_O, _, base_O, _ = forward_oracle(Q, K, V, **options)
    mag_O, _ = forward_magnitudes(Q, K, V, **options)
    assert_matches_reference("O", out.numpy(), ref_O, base_O, magnitude=mag_O)
    check_backward(dO, Q, K, V, want_out, want_lse, [g.numpy() for g in grads], **options)


def test_dropout_seed_comes_from_torch_and_the_backward_reuses_it():
    """Without dropout_seed, a seed is drawn from PyTorch's default generator: the same
    torch.manual_seed gives the same output, and forward and backward are numbaflash's
    calls with that seed, bit for bit."""
    q, k, v = qkv(Hq=2, Sq=6, Sk=7)
    dout = randn(*q.shape, seed=9, grad=False)
    torch.manual_seed(123)
    out, grads = grads_of(lambda a, b, c: nft.attention(a, b, c, dropout_p=0.25), (q, k, v),
                          dout)
    torch.manual_seed(123)
    again, _ = grads_of(lambda a, b, c: nft.attention(a, b, c, dropout_p=0.25), (q, k, v),
                        dout)
    assert_bitwise_equal("O (same torch seed)", again.numpy(), out.numpy())
    torch.manual_seed(123)
    seed = nft._torch_seed()
    Q, K, V, dO = (x.detach().numpy() for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, return_lse=True, dropout_p=0.25,
                                              dropout_seed=seed)
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse,
                                               dropout_p=0.25, dropout_seed=seed)
    assert_bitwise_equal("O", out.numpy(), want_out)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, want_grads):
        assert_bitwise_equal(name, got.numpy(), want)
    # the mask is there: some entries of P were dropped for this seed
    assert not numbaflash.dropout_mask(1, 2, 6, 7, 0.25, seed).all()


# --- gradcheck --------------------------------------------------------------------------------

@pytest.mark.parametrize("Sq, Sk, options, fast", [
    (3, 4, dict(), False),
    (4, 3, dict(causal=True), True),          # bottom-right: row 0 sees no key
    (3, 4, dict(softcap=1.5, window_size=(1, 0)), True),
    (4, 5, dict(dropout_p=0.4, dropout_seed=11), True),     # the gradients of the dropped O
])
def test_gradcheck_float64(Sq, Sk, options, fast):
    """Full Jacobians for plain attention; gradcheck's fast mode (a random projection of
    the Jacobian, half the simulated launches) for the variants."""
    q, k, v = qkv(B=1, Hq=1, Sq=Sq, Sk=Sk, d=2, seed=3)
    assert torch.autograd.gradcheck(lambda a, b, c: nft.attention(a, b, c, **options),
                                    (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6,
                                    fast_mode=fast)


# --- scaled_dot_product_attention: PyTorch's semantics ----------------------------------------

def _sdpa_case(case, H=2, Sq=5, Sk=7):
    """(kwargs for both SDPAs, Hkv) of a named case."""
    g = torch.Generator().manual_seed(5)
    if case == "plain":
        return {}, H
    if case == "causal":
        return dict(is_causal=True), H
    if case == "causal_sq_gt_sk":
        return dict(is_causal=True), H
    if case == "bool_mask":
        mask = torch.rand(Sq, Sk, generator=g) > 0.4
        mask[:, 0] = True
        return dict(attn_mask=mask), H
    if case == "bool_mask_expanded":          # stride-0 dims: never materialised
        mask = torch.ones(Sq, Sk, dtype=torch.bool).tril().expand(1, H, Sq, Sk)
        return dict(attn_mask=mask), H
    if case == "float_mask":                  # with -inf entries; requires_grad: no grad
        bias = torch.randn(1, H, Sq, Sk, generator=g, dtype=F64)
        bias[..., 1] = -torch.inf
        return dict(attn_mask=bias.requires_grad_()), H
    if case == "gqa":
        return dict(enable_gqa=True, scale=0.3), 1 if H == 1 else H // 2
    raise ValueError(case)


@pytest.mark.parametrize("case", ["plain", "causal", "causal_sq_gt_sk", "bool_mask",
                                  "bool_mask_expanded", "float_mask", "gqa"])
def test_sdpa_equals_pytorch(case):
    if case == "gqa" and TORCH_VERSION < (2, 5):
        pytest.skip("PyTorch's enable_gqa needs PyTorch 2.5")
    H, Sq, Sk = 2, 5, 7
    if case == "causal_sq_gt_sk":
        Sq, Sk = 7, 4
    kwargs, Hkv = _sdpa_case(case, H, Sq, Sk)
    q, k, v = qkv(Hq=H, Hkv=Hkv, Sq=Sq, Sk=Sk, d=4, seed=11)
    dout = randn(*q.shape, seed=12, grad=False)
    out, grads = grads_of(lambda a, b, c: nft.scaled_dot_product_attention(a, b, c, **kwargs),
                          (q, k, v), dout)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.requires_grad:
        assert mask.grad is None              # documented: no gradient to attn_mask
    want, want_grads = grads_of(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs),
                                (q, k, v), dout)
    assert_close_f64("O", out.numpy(), want.numpy(), rtol=1e-13)
    for name, got, w in zip(("dQ", "dK", "dV"), grads, want_grads):
        assert_close_f64(name, got.numpy(), w.numpy(), rtol=1e-13)


def test_sdpa_mqa_broadcasts_without_enable_gqa_as_pytorch_does():
    q, k, v = qkv(Hq=2, Hkv=1, Sq=3, Sk=3, d=2)
    want = F.scaled_dot_product_attention(q, k, v)
    assert_close_f64("O", nft.scaled_dot_product_attention(q, k, v).detach().numpy(),
                     want.detach().numpy(), rtol=1e-13)


def test_sdpa_takes_five_dim_inputs():
    q, k, v = (x.detach().unsqueeze(0) for x in qkv(Hq=2, Sq=3, Sk=4, d=2))
    mask = torch.ones(3, 4, dtype=torch.bool).tril()
    got = nft.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.shape == want.shape
    assert_close_f64("O", got.numpy(), want.numpy(), rtol=1e-13)


# --- flash_attn_func: flash-attn's layout and semantics ----------------------------------------

@pytest.mark.parametrize("Sq, Sk, Hkv, options", [
    (6, 4, 2, dict(causal=True)),               # bottom-right: rows 0, 1 see no key
    (4, 6, 2, dict(causal=True)),
    (5, 7, 1, dict(window_size=(2, 1), softmax_scale=0.4)),
    (5, 5, 2, dict(softcap=2.0, causal=True, window_size=(3, -1))),
    (4, 6, 2, dict(alibi_slopes="heads")),
])
def test_flash_attn_func(Sq, Sk, Hkv, options):
    B, H, d = 1, 2, 4
    options = dict(options)
    if options.get("alibi_slopes") == "heads":
        options["alibi_slopes"] = torch.tensor([0.5, 0.25], dtype=F64)
    q = randn(B, Sq, H, d, seed=21)                 # (batch, seqlen, heads, d)
    k = randn(B, Sk, Hkv, d, seed=22)
    v = randn(B, Sk, Hkv, d, seed=23)
    dout = randn(B, Sq, H, d, seed=24, grad=False)
    out, grads = grads_of(lambda a, b, c: nft.flash_attn_func(a, b, c, **options), (q, k, v),
                          dout)
    assert out.shape == (B, Sq, H, d) and out.is_contiguous()

    # The reference in (batch, heads, seqlen, d), numbaflash's names for the options.
    Q, K, V, dO = (x.detach().transpose(1, 2).numpy() for x in (q, k, v, dout))
    kw = dict(causal=options.get("causal", False), scale=options.get("softmax_scale"),
              window_size=options.get("window_size"), softcap=options.get("softcap"))
    if "alibi_slopes" in options:
        kw["alibi_slopes"] = options["alibi_slopes"].numpy()
    ref_O, _ = reference.forward(Q, K, V, **kw)
    ref_grads = reference.backward(dO, Q, K, V, **kw)
    assert_close_f64("O", out.transpose(1, 2).numpy(), ref_O, rtol=1e-12)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_grads):
        assert_close_f64(name, got.transpose(1, 2).numpy(), want, rtol=1e-12,
                         magnitude=1.0)

    if set(options) == {"causal"}:
        # flash-attn's causal, independently of numbaflash's reference: PyTorch's SDPA
        # with the bottom-right mask written out.
        mask = torch.from_numpy(visible(Sq, Sk, "bottom_right"))
        qe, ke, ve = (x.detach().transpose(1, 2) for x in (q, k, v))
        want = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask)
        want = torch.nan_to_num(want).transpose(1, 2)     # rows that see no key: 0
        assert_close_f64("O vs SDPA", out.numpy(), want.numpy(), rtol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(2, 1), softcap=3.0),
                                     dict(dropout_p=0.3)])
def test_flash_attn_func_reads_its_layout_with_the_same_bits(dtype, options):
    """float16, bfloat16 and float32: flash_attn_func on (batch, seqlen, heads, d) tensors
    gives the bits of numbaflash.torch.attention on (batch, heads, seqlen, d) copies, out
    and gradients, each back in flash-attn's layout (GQA, Sq != Sk, a row past a tile).
    Dropout: the same seed (from PyTorch's generator) gives the same mask."""
    B, Sq, Sk, Hq, Hkv, d = 2, 5, 7, 4, 2, 8
    q = randn(B, Sq, Hq, d, dtype=dtype, seed=31)
    k = randn(B, Sk, Hkv, d, dtype=dtype, seed=32)
    v = randn(B, Sk, Hkv, d, dtype=dtype, seed=33)
    dout = randn(B, Sq, Hq, d, dtype=dtype, seed=34, grad=False)
    torch.manual_seed(0)
    out, grads = grads_of(lambda a, b, c: nft.flash_attn_func(a, b, c, **options), (q, k, v),
                          dout)
    assert out.shape == (B, Sq, Hq, d) and out.is_contiguous()
    kw = dict(options)
    kw["window_size"] = kw.get("window_size")
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(True)
                  for x in (q, k, v))
    torch.manual_seed(0)
    want, want_grads = grads_of(lambda a, b, c: nft.attention(a, b, c, **kw), (qt, kt, vt),
                                dout.transpose(1, 2).contiguous())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert_bitwise_equal("out", host(out.transpose(1, 2)), host(want))
    for name, got, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_bitwise_equal(name, host(got.transpose(1, 2)), host(w))


# --- bfloat16: an int16 view in, the same bits out ---------------------------------------------

def bf16_randn(*shape, seed=0, grad=True):
    return randn(*shape, dtype=torch.float32, seed=seed, grad=False).bfloat16().requires_grad_(
        grad)


def test_bfloat16_passes_as_an_int16_view_without_a_copy():
    """A bfloat16 CPU tensor reaches numbaflash as an ``ml_dtypes.bfloat16`` view of its own
    memory (through its int16 view), strided views included, and a bfloat16 result comes
    back as a tensor over the array's memory: no copy either way, the values unchanged."""
    t = bf16_randn(2, 3, 4, seed=3)                     # requires grad: detached, no copy
    a = nft._array(t)
    assert a.dtype == BF16 and a.shape == (2, 3, 4)
    assert a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a.astype(np.float32), t.detach().float().numpy())
    view = nft._array(t.transpose(1, 2))
    assert view.ctypes.data == t.data_ptr() and view.strides == (24, 2, 8)
    np.testing.assert_array_equal(view, a.transpose(0, 2, 1))
    back = nft._tensor(a, t.device)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t.detach())


def _bf16_case(Hkv=2, Sq=5, Sk=6):
    """bfloat16 q, k, v (requiring grad) and dout: (1, 2, Sq, 8) and (1, Hkv, Sk, 8)."""
    return (bf16_randn(1, 2, Sq, 8, seed=41), bf16_randn(1, Hkv, Sk, 8, seed=42),
            bf16_randn(1, Hkv, Sk, 8, seed=43), bf16_randn(1, 2, Sq, 8, seed=44, grad=False))


def _check_bf16_grads_are_analytic(fn, inputs, dout, got_out, got_grads):
    """A gradcheck-like sanity for bfloat16: out and the gradients are within a few of
    bfloat16's roundings (2^-8 relative) of fn's in float64 on the same values, relative
    to each tensor's largest entry. (The kernel suites hold the accuracy rule.)"""
    want_out, want_grads = grads_of(fn, [x.detach().double() for x in inputs], dout.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (got_out, *got_grads),
                               (want_out, *want_grads)):
        err = (got.double() - want).abs().max().item()
        assert err <= 2.0 ** -5 * want.abs().max().item(), (name, err)


@pytest.mark.parametrize("options", [
    dict(),
    dict(causal=True, Hkv=1),
    dict(causal="top_left", window_size=(2, 1), softcap=3.0, Sq=6, Sk=4),
    dict(dropout_p=0.25, dropout_seed=5),
    dict(causal=True, version="v7"),                    # reads the bits itself
], ids=["plain", "causal-mqa", "window-softcap", "dropout", "v7"])
def test_bfloat16_attention_is_numbaflash_attention(options):
    """numbaflash.torch.attention on bfloat16 tensors, with autograd: out and the gradients
    are bfloat16 with exactly the bits of numbaflash.attention and attention_backward on
    the same ``ml_dtypes.bfloat16`` arrays."""
    options = dict(options)
    shape = {n: options.pop(n) for n in ("Hkv", "Sq", "Sk") if n in options}
    q, k, v, dout = _bf16_case(**shape)
    out, grads = grads_of(lambda a, b, c: nft.attention(a, b, c, **options), (q, k, v), dout)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3

    Q, K, V, dO = (host(x) for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, return_lse=True, **options)
    backward = {n: x for n, x in options.items() if n != "version"}
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse, **backward)
    assert want_out.dtype == BF16
    assert_bitwise_equal("O", host(out), want_out)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, want_grads):
        assert_bitwise_equal(name, host(got), want)
    if not options.get("dropout_p"):
        _check_bf16_grads_are_analytic(                 # float64 on the default versions
            lambda a, b, c: nft.attention(a, b, c, **backward), (q, k, v), dout, out, grads)


@pytest.mark.parametrize("case", ["is_causal", "bool_mask", "bf16_mask_expanded"])
def test_bfloat16_sdpa_is_numbaflash_attention(case):
    """scaled_dot_product_attention on bfloat16 tensors: bfloat16 out and gradients, bitwise
    numbaflash.attention's on the ``ml_dtypes.bfloat16`` arrays (top-left causal; a bool
    mask; a bfloat16 float mask, PyTorch's dtype for one, widened to float32 exactly and
    not materialised where it is expanded), and close to PyTorch's SDPA in float64."""
    q, k, v, dout = _bf16_case(Sq=5, Sk=7)
    g = torch.Generator().manual_seed(8)
    kw, want_kw = {}, {}
    if case == "is_causal":
        kw, want_kw = dict(is_causal=True), dict(causal="top_left")
    elif case == "bool_mask":
        mask = torch.rand(1, 2, 5, 7, generator=g) < 0.7
        mask[..., 0] = True                             # every row sees a key, as in PyTorch
        kw, want_kw = dict(attn_mask=mask), dict(attn_mask=mask.numpy())
    else:
        bias = torch.randn(1, 1, 5, 7, generator=g).bfloat16()
        kw = dict(attn_mask=bias.expand(1, 2, 5, 7))
        want_kw = dict(attn_mask=bias.float().numpy())
    out, grads = grads_of(lambda a, b, c: nft.scaled_dot_product_attention(a, b, c, **kw),
                          (q, k, v), dout)
    assert out.dtype == torch.bfloat16 and [x.dtype for x in grads] == [torch.bfloat16] * 3
    Q, K, V, dO = (host(x) for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, return_lse=True, **want_kw)
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse, **want_kw)
    assert_bitwise_equal("O", host(out), want_out)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, want_grads):
        assert_bitwise_equal(name, host(got), want)
    f64 = {n: (x.double() if n == "attn_mask" and x.is_floating_point() else x)
           for n, x in kw.items()}
    _check_bf16_grads_are_analytic(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **f64), (q, k, v), dout,
        out, grads)


@pytest.mark.parametrize("slopes", [None, torch.float32, torch.bfloat16])
def test_bfloat16_flash_attn_func_is_numbaflash_attention(slopes):
    """flash_attn_func on bfloat16 (batch, seqlen, heads, d) tensors: bfloat16 out and
    gradients in that layout, bitwise numbaflash.attention's on transposed
    ``ml_dtypes.bfloat16`` arrays (bottom-right causal, GQA, Sq > Sk; ALiBi slopes in
    float32 as flash-attn takes them, or in bfloat16, widened exactly)."""
    B, Sq, Sk, Hq, Hkv, d = 2, 6, 4, 4, 2, 8
    q = bf16_randn(B, Sq, Hq, d, seed=51)
    k, v = bf16_randn(B, Sk, Hkv, d, seed=52), bf16_randn(B, Sk, Hkv, d, seed=53)
    dout = bf16_randn(B, Sq, Hq, d, seed=54, grad=False)
    kw, want_kw = dict(causal=True), dict(causal=True)
    if slopes is not None:
        alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=slopes)
        kw["alibi_slopes"], want_kw["alibi_slopes"] = alibi, alibi.float().numpy()
    out, grads = grads_of(lambda a, b, c: nft.flash_attn_func(a, b, c, **kw), (q, k, v),
                          dout)
    assert out.dtype == torch.bfloat16 and out.shape == (B, Sq, Hq, d)
    T = lambda x: np.ascontiguousarray(host(x).transpose(0, 2, 1, 3))
    Q, K, V, dO = (T(x) for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, return_lse=True, **want_kw)
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse, **want_kw)
    assert_bitwise_equal("out", T(out), want_out)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert got.dtype == torch.bfloat16
        assert_bitwise_equal(name, T(got), want)


def test_bfloat16_flash_attn_varlen_func_is_attention_varlen():
    """flash_attn_varlen_func on bfloat16 packed tensors: out and the gradients autograd
    returns are bfloat16, bitwise numbaflash.attention_varlen's and
    attention_varlen_backward's on the ``ml_dtypes.bfloat16`` arrays (an empty sequence,
    GQA)."""
    lens_q, lens_k = [3, 0, 4], [4, 2, 5]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = bf16_randn(int(cu_q[-1]), 2, 8, seed=61)
    k, v = bf16_randn(int(cu_k[-1]), 1, 8, seed=62), bf16_randn(int(cu_k[-1]), 1, 8, seed=63)
    dout = bf16_randn(int(cu_q[-1]), 2, 8, seed=64, grad=False)
    kw = dict(causal=True, softcap=5.0)
    out, grads = grads_of(lambda a, b, c: nft.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 4, 5,
                                                                     **kw), (q, k, v), dout)
    assert out.dtype == torch.bfloat16 and [x.dtype for x in grads] == [torch.bfloat16] * 3
    arrays = [host(x) for x in (q, k, v)]
    want, lse = numbaflash.attention_varlen(*arrays, cu_q.numpy(), cu_k.numpy(),
                                            return_lse=True, **kw)
    assert_bitwise_equal("out", host(out), want)
    want_grads = numbaflash.attention_varlen_backward(host(dout), *arrays, want, lse,
                                                      cu_q.numpy(), cu_k.numpy(), **kw)
    for name, got, want_grad in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_bitwise_equal(name, host(got), want_grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_cuda_tensors_give_numbaflash_bits():
    """bfloat16 CUDA tensors, on a side stream: attention's out and gradients (autograd)
    are bitwise numbaflash's on Numba device arrays of the same ``ml_dtypes.bfloat16``
    values, their memory comes from PyTorch's allocator, SDPA and flash_attn_func agree
    with attention, and a repeated forward call gives the same bits (by the direct launch
    when the forward reads bfloat16 itself, forward v7, else by the whole path)."""
    from numba import cuda

    from numbaflash import dtypes
    from numbaflash.kernels import forward as forward_kernels
    from numbaflash.validate import check_attention_inputs

    q, k, v, dout = (x.detach().cuda() for x in _bf16_case(Hkv=1, Sq=77, Sk=130))
    Q, K, V, dO = (cuda.to_device(host(x.cpu())) for x in (q, k, v, dout))
    want_out, want_lse = numbaflash.attention(Q, K, V, causal=True, return_lse=True)
    want_grads = numbaflash.attention_backward(dO, Q, K, V, want_out, want_lse, causal=True)
    want_out, *want_grads = (torch.from_numpy(x.copy_to_host().view(np.int16)).cuda()
                             for x in (want_out, *want_grads))
    nft._FAST.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        before = torch.cuda.memory_allocated()
        out = nft.attention(*inputs, causal=True)
        assert torch.cuda.memory_allocated() - before >= out.numel() * 2
        out.backward(dout)
        with torch.no_grad():
            again = nft.attention(q, k, v, causal=True)
            remembered = len(nft._FAST)
            sdpa = nft.scaled_dot_product_attention(q, k, v, is_causal=True)
            flash = nft.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True)
    torch.cuda.synchronize()

    def differ(got, want):
        """How many of the bits differ, for the assert's message."""
        if got.shape != want.shape or got.device != want.device:
            return (f"{tuple(got.shape)} on {got.device} against {tuple(want.shape)} "
                    f"on {want.device}")
        return f"{int((got != want).sum())} of {want.numel()} values differ"

    assert out.dtype == torch.bfloat16 and out.is_cuda
    got_out = out.detach().view(torch.int16)
    assert torch.equal(got_out, want_out), "autograd's out: " + differ(got_out, want_out)
    for name, x, want in zip(("dq", "dk", "dv"), inputs, want_grads):
        assert x.grad.dtype == torch.bfloat16, name
        got = x.grad.view(torch.int16)
        assert torch.equal(got, want), f"autograd's {name}: " + differ(got, want)
    for name, got in (("the repeated call", again), ("flash_attn_func", flash.transpose(1, 2))):
        got = got.view(torch.int16)
        assert torch.equal(got, want_out), f"{name}'s out: " + differ(got, want_out)
    top_left = numbaflash.attention(Q, K, V, causal="top_left")
    want_sdpa = torch.from_numpy(top_left.copy_to_host().view(np.int16))
    got_sdpa = sdpa.view(torch.int16).cpu()
    assert torch.equal(got_sdpa, want_sdpa), "SDPA's out: " + differ(got_sdpa, want_sdpa)
    plan = numbaflash.explain(Q, K, V, causal=True)
    p = check_attention_inputs(Q, K, V, True)
    direct = not dtypes.widens(p, forward_kernels.module(plan.version))
    assert remembered == int(direct), (f"{remembered} direct forward calls remembered; "
                                       f"forward {plan.version} reads bfloat16 itself: "
                                       f"{direct}")


# --- errors, before any launch ---------------------------------------------------------------

def _errors():
    q, k, v = (x.detach() for x in qkv(Hq=4, Hkv=2, Sq=3, Sk=3, d=2))
    qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))
    return {
        "sdpa dropout 1": (ValueError, r"dropout_p must lie in \[0, 1\)",
                           lambda: nft.scaled_dot_product_attention(q, q, q, dropout_p=1.0)),
        "sdpa gqa without enable_gqa": (RuntimeError, "enable_gqa",
                                        lambda: nft.scaled_dot_product_attention(q, k, v)),
        "sdpa mask and is_causal": (RuntimeError, "is_causal",
                                    lambda: nft.scaled_dot_product_attention(
                                        q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool),
                                        is_causal=True)),
        "sdpa one query head": (ValueError, "expand query",
                                lambda: nft.scaled_dot_product_attention(q[:, :1], k, v)),
        "sdpa value head dim": (ValueError, "Ev",
                                lambda: nft.scaled_dot_product_attention(
                                    q, q, torch.zeros(1, 4, 3, 5, dtype=F64))),
        "sdpa mask shape": (ValueError, "broadcast",
                            lambda: nft.scaled_dot_product_attention(
                                q, q, q, attn_mask=torch.ones(2, 3, dtype=torch.bool))),
        "flash dropout negative": (ValueError, "dropout_p",
                                   lambda: nft.flash_attn_func(qf, kf, vf, dropout_p=-0.1)),
        "attention dropout seed": (ValueError, "dropout_seed",
                                   lambda: nft.attention(q, q, q, dropout_p=0.1,
                                                         dropout_seed=-1)),
        "flash attn probs": (NotImplementedError, "return_attn_probs",
                             lambda: nft.flash_attn_func(qf, kf, vf, return_attn_probs=True)),
        "flash 3 dims": (ValueError, "batch, seqlen, heads",
                         lambda: nft.flash_attn_func(qf[0], kf[0], vf[0])),
        "flash bad window": (ValueError, "window_size",
                             lambda: nft.flash_attn_func(qf, kf, vf, window_size=3)),
        "attention 5 dims": (ValueError, "rank",
                             lambda: nft.attention(q[None], q[None], q[None])),
        "attention non-contiguous 5 dims": (ValueError, "rank",
                                            lambda: nft.attention(*(x[None].transpose(-1, -2)
                                                                    for x in (q, q, q)))),
        "attention dtype mismatch": (TypeError, "same dtype",
                                     lambda: nft.attention(q, q.float(), q)),
        "attention int16": (TypeError, "dtype torch.int16",
                            lambda: nft.attention(*(q.to(torch.int16),) * 3)),
        "attention bfloat16 with float16": (TypeError, "same dtype",
                                            lambda: nft.attention(q.bfloat16(), q.half(),
                                                                  q.half())),
        "attention numpy": (TypeError, "torch.Tensor",
                            lambda: nft.attention(q.numpy(), q, q)),
        "attention devices": (ValueError, "device",
                              lambda: nft.attention(q, q.to("meta"), q)),
        "attention heads": (ValueError, "multiple",
                            lambda: nft.attention(q, q[:, :3], q[:, :3])),
        "attention score_mod without grad": (ValueError, "score_mod_grad",
                                             lambda: nft.attention(
                                                 q.requires_grad_(), q, q,
                                                 score_mod=lambda s, b, h, i, j: s)),
        "attention backward version": (ValueError, "version",
                                       lambda: nft.attention(q.detach().requires_grad_(), q, q,
                                                             backward_version="v99")),
    }


@pytest.mark.parametrize("name", list(_errors()))
def test_bad_input_raises_before_any_launch(name, no_launch):
    error, words, call = _errors()[name]
    with pytest.raises(error, match=words):
        call()


# --- a tiny model trains as with PyTorch's SDPA ----------------------------------------------

class TinyAttentionModel(torch.nn.Module):
    """One causal self-attention layer and a linear head: x (B, S, D) -> (B, S, D)."""

    def __init__(self, sdpa, D=8, H=2):
        super().__init__()
        self.sdpa, self.H = sdpa, H
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)

    def forward(self, x):
        B, S, D = x.shape
        # (3, B, H, S, d): q, k, v as non-contiguous views, as real models make them
        q, k, v = self.qkv(x).view(B, S, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)
        o = self.sdpa(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, D))


def _loss_curve(sdpa, dtype, steps=4):
    torch.manual_seed(0)
    model = TinyAttentionModel(sdpa).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 8, generator=g, dtype=dtype)
    y = torch.randn(2, 6, 8, generator=g, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5),
                                         (torch.bfloat16, 2.0 ** -6)])
def test_tiny_model_trains_like_sdpa(dtype, rtol):
    got = _loss_curve(nft.scaled_dot_product_attention, dtype)
    want = _loss_curve(F.scaled_dot_product_attention, dtype)
    assert got[-1] < got[0]                       # it learns
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


# --- torch.compile and CUDA graphs ------------------------------------------------------------

def _compile_case():
    q, k, v = qkv(Sq=7, Sk=9)
    dout = randn(1, 2, 7, 4, seed=7, grad=False)
    return q, k, v, dout


def test_compile_keeps_the_kernels_in_one_graph():
    """torch.compile(fullgraph=True) of the three functions: no graph break (the custom
    ops numbaflash::attention_forward and attention_backward are in the graph), and the
    results and gradients are bitwise the eager ones (the same kernels run)."""
    q, k, v, dout = _compile_case()

    def fn(q, k, v):
        return (nft.attention(q, k, v, causal=True, window_size=(3, 0), softcap=2.0)
                + nft.scaled_dot_product_attention(q, k, v, is_causal=True)
                + nft.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2),
                                      v.transpose(1, 2), causal=True).transpose(1, 2))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    out, grads = grads_of(compiled, (q, k, v), dout)
    out_e, grads_e = grads_of(fn, (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_e, *grads_e)):
        assert_bitwise_equal(name, a.numpy(), b.numpy())


@pytest.mark.skipif(TORCH_VERSION < (2, 4), reason="torch._dynamo.explain's fields")
def test_compile_with_a_mask_mod_breaks_the_graph_once():
    """A mask_mod is a Numba device function, which an op cannot carry: that call runs
    eagerly, one graph break, and gives the eager result."""
    from numba import cuda

    @cuda.jit(device=True)
    def even_keys(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    q, k, v, dout = _compile_case()

    def fn(q, k, v):
        return nft.attention(q * 2, k, v, mask_mod=even_keys) * 3
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 1, explained
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", dynamic=False)
    out, grads = grads_of(compiled, (q, k, v), dout)
    out_e, grads_e = grads_of(fn, (q, k, v), dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_e, *grads_e)):
        assert_bitwise_equal(name, a.numpy(), b.numpy())


def test_cuda_graph_capture_is_refused_with_a_clear_error(monkeypatch, no_launch):
    """Under capture (simulated here: the check asks PyTorch whether the current stream is
    capturing) a CUDA call raises before anything runs; CPU tensors are never captured."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        nft._refuse_capture(torch.device("cuda", 0))
    nft._refuse_capture(torch.device("cpu"))


def test_flash_layout_cu_seqlens_of_empty_sequences():
    """flash_attn_func's packed view of (batch, seqlen, heads, d) tensors: cu_seqlens 0, S,
    2 S, ..., with S = 0 too (no query rows, or no keys); CPU tensors take the copies."""
    options = dict(causal=False, scale=None, window_size=None, softcap=None,
                   alibi_slopes=None)
    q = torch.zeros(2, 0, 4, 8, dtype=torch.float16)
    k = v = torch.zeros(2, 3, 4, 8, dtype=torch.float16)
    layout = dropins._FlashLayout(q, k, v, options)
    assert layout.cu_q.tolist() == [0, 0, 0] and layout.cu_k.tolist() == [0, 3, 6]
    assert layout.cu_q.dtype == torch.int32 and not layout.in_place
    layout = dropins._FlashLayout(k, q, q, options)
    assert layout.cu_q.tolist() == [0, 3, 6] and layout.cu_k.tolist() == [0, 0, 0]


def test_flash_attn_func_with_gradients_in_place_where_measured_faster():
    """With gradients, flash_attn_func runs in place for float32 without the causal mask
    and for float16 and bfloat16, and through the copies for float32 with the causal mask
    (torch_dropins._FLASH_GRAD_IN_PLACE says why)."""
    assert dropins._flash_grad_in_place(np.float32, False)
    assert not dropins._flash_grad_in_place(np.float32, True)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for causal in (False, True):
            assert dropins._flash_grad_in_place(dtype, causal)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, causal, d", [(torch.float16, True, 64),
                                              (torch.bfloat16, False, 64),
                                              (torch.float32, False, 64),
                                              (torch.float32, True, 128)])
def test_flash_attn_func_reads_cuda_tensors_in_place(monkeypatch, dtype, causal, d):
    """Plain flash_attn_func on CUDA tensors without gradients reads them in place
    (torch_dropins.py's _FlashLayout: numbaflash.attention, the copies' path, is never
    called; float16 and bfloat16 on forward v10, float32 on v8 and v9), a repeated call
    launches directly, and out is the bits of numbaflash.torch.attention on (batch,
    heads, seqlen, d) copies: the same kernels' arithmetic, on a packed batch of equal
    lengths (Sq != Sk, rows past a tile). With gradients, through the copies and in place on
    the packed backward (float32 backward v6, 16-bit v9), the gradients are attention's
    bits."""
    B, Sq, Sk, H = 2, 77, 130, 4
    q, k, v = (randn(B, S, H, d, dtype=dtype, seed=40 + n).detach().cuda()
               for n, S in enumerate((Sq, Sk, Sk)))
    dout = randn(B, Sq, H, d, dtype=dtype, seed=43, grad=False).cuda()
    copies = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    with torch.no_grad():
        want = nft.attention(*copies, causal=causal).transpose(1, 2)
    # a repeated call of attention's kind: its direct launch
    want_out, want_grads = grads_of(lambda a, b, c: nft.attention(a, b, c, causal=causal),
                                    copies, dout.transpose(1, 2).contiguous())
    assert torch.equal(want_out.transpose(1, 2).view(bits), want.view(bits)), \
        "attention's direct launch"

    def refuse(*args, **kwargs):
        raise AssertionError("flash_attn_func took the copies' path")

    with monkeypatch.context() as patch:
        patch.setattr(nft.api, "attention", refuse)
        nft._FAST.clear()
        dropins._FLASH.clear()
        with torch.no_grad():
            first = nft.flash_attn_func(q, k, v, causal=causal)
            assert any(key[0] == "flash" for key in nft._FAST), "not remembered"
            again = nft.flash_attn_func(q, k, v, causal=causal)       # launched directly
    (layout,) = dropins._FLASH.values()
    numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16,
                   torch.bfloat16: ml_dtypes.bfloat16}[dtype]
    default_grad = dropins._flash_grad_in_place(numpy_dtype, causal)
    assert layout.in_place and layout.in_place_grad == default_grad
    ways = []
    for in_place in (False, True):      # with gradients: the copies, and in place
        layout.in_place_grad = in_place
        ways.append(grads_of(lambda a, b, c: nft.flash_attn_func(a, b, c, causal=causal),
                             (q, k, v), dout))
    layout.in_place_grad = default_grad         # as other calls find it
    torch.cuda.synchronize()
    assert first.shape == (B, Sq, H, d) and first.is_contiguous()
    for name, got in (("first", first), ("again", again), ("with autograd", ways[0][0]),
                      ("with autograd in place", ways[1][0])):
        assert torch.equal(got.view(bits), want.contiguous().view(bits)), name
    for way, (_, grads) in zip(("copies", "in place"), ways):
        for name, got, w in zip(("dq", "dk", "dv"), grads, want_grads):
            assert torch.equal(got.view(bits),
                               w.transpose(1, 2).contiguous().view(bits)), (way, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_raises_on_the_gpu():
    q, k, v = (x.detach().cuda() for x in qkv(dtype=torch.float32))
    nft.attention(q, k, v)                              # compile outside the capture
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                nft.attention(q, k, v)
        finally:
            graph.capture_end()                         # an empty graph: nothing ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_outputs_come_from_pytorchs_allocator():
    """The outputs (and gradients) of a CUDA call are memory of PyTorch's caching
    allocator: torch.cuda.memory_allocated grows by at least their size while they live."""
    q, k, v = (x.detach().cuda().requires_grad_() for x in qkv(Sq=300, Sk=300, d=64,
                                                                dtype=torch.float32))
    nft.attention(q, k, v).sum().backward()                 # compile outside the count
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = nft.attention(q, k, v)
    assert torch.cuda.memory_allocated() - before >= out.numel() * 4
    for x in (q, k, v):
        x.grad = None
    before = torch.cuda.memory_allocated()
    # retain_graph: the tensors the forward saved (lse among them) stay allocated, so
    # that freeing them does not offset the count
    out.sum().backward(retain_graph=True)
    grads = q.numel() + k.numel() + v.numel()
    assert torch.cuda.memory_allocated() - before >= grads * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("options", [dict(), dict(causal=True, window_size=(40, 0)),
                                     dict(dropout_p=0.2, dropout_seed=7)],
                         ids=["plain", "window", "dropout"])
def test_repeated_cuda_calls_launch_directly_with_the_same_bits(monkeypatch, dtype, options):
    """The second call of a kind (shapes, dtype, device, options) on CUDA tensors takes
    the direct launch (torch.py's _FastForward: numbaflash.attention is not called;
    without dropout no step of the whole path either, _repeated) and gives the bits of
    the whole path, for new tensors of that kind, on a side stream, in
    and out of autograd; another dropout seed gives that seed's results."""
    def inputs(seed):
        q, k, v = qkv(B=2, Hq=4, Hkv=2, Sq=77, Sk=130, d=64, dtype=dtype, seed=seed)
        return [x.detach().cuda() for x in (q, k, v)]

    def whole_path(q, k, v, **opts):            # with the direct calls forgotten
        nft._FAST.clear()
        with torch.no_grad():
            out = nft.attention(q, k, v, **opts)
        nft._FAST.clear()
        return out

    other_seed = dict(options, dropout_seed=2**40 + 3) if "dropout_p" in options else None
    q2, k2, v2 = inputs(10)
    want = whole_path(q2, k2, v2, **options)
    want_other = whole_path(q2, k2, v2, **other_seed) if other_seed else None
    q, k, v = inputs(0)
    with torch.no_grad():
        nft.attention(q, k, v, **options)       # the whole path, remembered
    assert len(nft._FAST) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the repeated call took the whole path")

    monkeypatch.setattr(nft.api, "attention", refuse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.no_grad():
            with monkeypatch.context() as patch:
                if not other_seed:      # no step of the whole path at all (_repeated)
                    patch.setattr(nft, "_check_tensors", refuse)
                fast = nft.attention(q2, k2, v2, **options)
            other = nft.attention(q2, k2, v2, **other_seed) if other_seed else None
        graded = [x.clone().requires_grad_() for x in (q2, k2, v2)]
        fast_grad = nft.attention(*graded, **options)
    torch.cuda.synchronize()
    (remembered,) = nft._FAST.values()
    assert remembered.prepared is not None, "not launched through launcher.PreparedLaunch"
    assert torch.equal(fast, want)
    assert torch.equal(fast_grad.detach(), want)
    assert fast_grad.grad_fn is not None
    if other_seed:
        assert torch.equal(other, want_other)
        assert not torch.equal(other, fast)


def test_tensor_words_are_a_c_contiguous_arrays_launch_words():
    """The direct calls' parameter words for a tensor seen as (BH, S, d): Numba's words of
    a C-contiguous array (launcher._array_words): two null words, size, itemsize, the
    pointer, the shape, the byte strides."""
    t = torch.zeros(2, 3, 5, 4, dtype=torch.float16)
    assert nft._tensor_words(t, (6, 5, 4)) == (0, 0, 120, 2, t.data_ptr(), 6, 5, 4, 40, 8, 2)
    assert nft._tensor_words(t, (6, 20)) == (0, 0, 120, 2, t.data_ptr(), 6, 20, 40, 2)


def test_cpu_tensors_are_never_launched_directly():
    """Only CUDA tensors take the direct calls; CPU calls leave nothing remembered."""
    nft._FAST.clear()
    q, k, v = qkv(dtype=torch.float32)
    with torch.no_grad():
        nft.attention(q, k, v)
        nft.attention(q, k, v)
    assert nft._FAST == {}


def test_flash_attn_with_kvcache_layout_and_in_place_writes():
    """flash-attn's decoding call on CPU tensors: (batch, seqlen, heads, d) caches get the
    new rows in place at cache_seqlens (the rest untouched), and out and lse are bitwise
    numbaflash.attention_with_kvcache's on the same arrays in (batch, heads, seqlen, d)
    order (the layer adds no arithmetic; tests/test_kvcache.py checks that call against
    the float64 reference)."""
    g = torch.Generator().manual_seed(5)
    B, S_max, Hk, Hq, d = 2, 16, 1, 2, 8
    q = torch.randn(B, 1, Hq, d, generator=g)
    k_cache, v_cache = (torch.randn(B, S_max, Hk, d, generator=g) for _ in range(2))
    k, v = (torch.randn(B, 1, Hk, d, generator=g) for _ in range(2))
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    k0, v0 = k_cache.clone(), v_cache.clone()
    out, lse = nft.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                           cache_seqlens=lengths, causal=True,
                                           num_splits=2, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (B, Hq, 1)
    want_k, want_v = k0.clone(), v0.clone()
    for b, n in enumerate(lengths.tolist()):
        want_k[b, n], want_v[b, n] = k[b, 0], v[b, 0]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    T = lambda x: np.ascontiguousarray(x.numpy().transpose(0, 2, 1, 3))
    kh, vh = T(k0), T(v0)
    want, want_lse = numbaflash.attention_with_kvcache(
        T(q), kh, vh, cache_seqlens=lengths.numpy(), k=T(k), v=T(v), causal=True,
        num_splits=2, return_lse=True)
    assert_bitwise_equal("out", out.transpose(1, 2).numpy(), want)
    assert_bitwise_equal("lse", lse.numpy(), want_lse)
    for bad in ("rotary_cos", "cache_batch_idx", "block_table"):
        with pytest.raises(NotImplementedError, match=bad):
            nft.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                        **{bad: torch.zeros(1)})
    with pytest.raises(ValueError, match="cache_seqlens"):
        nft.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v)


def test_flash_attn_with_kvcache_bfloat16_in_place():
    """bfloat16 caches on the CPU: the new rows land in the tensors' own memory (through
    their int16 view), and out and lse are bitwise numbaflash.attention_with_kvcache's on
    the same ml_dtypes.bfloat16 arrays."""
    g = torch.Generator().manual_seed(6)
    B, S_max, Hk, Hq, d = 2, 16, 1, 2, 8
    q = torch.randn(B, 1, Hq, d, generator=g).bfloat16()
    k_cache, v_cache = (torch.randn(B, S_max, Hk, d, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, 1, Hk, d, generator=g).bfloat16() for _ in range(2))
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    k0, v0 = k_cache.clone(), v_cache.clone()
    out, lse = nft.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                           cache_seqlens=lengths, causal=True,
                                           num_splits=2, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_k, want_v = k0.clone(), v0.clone()
    for b, n in enumerate(lengths.tolist()):
        want_k[b, n], want_v[b, n] = k[b, 0], v[b, 0]
    assert torch.equal(k_cache.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), want_v.view(torch.int16))
    T = lambda x: np.ascontiguousarray(x.view(torch.int16).numpy().view(BF16)
                                       .transpose(0, 2, 1, 3))
    want, want_lse = numbaflash.attention_with_kvcache(
        T(q), T(k0), T(v0), cache_seqlens=lengths.numpy(), k=T(k), v=T(v), causal=True,
        num_splits=2, return_lse=True)
    assert_bitwise_equal("out", out.transpose(1, 2).view(torch.int16).numpy(),
                         want.view(np.int16))
    assert_bitwise_equal("lse", lse.numpy(), want_lse)


# --- flash_attn_with_kvcache's repeated calls (numbaflash/decode_direct.py) -------------------

def test_decode_words_are_spliced_back_in_order():
    """FastDecode keeps each recorded launch's parameter words with the pointers of the
    call's arrays cut out; given the first call's pointers back it rebuilds exactly the
    words the launcher made (launcher.array_words for arrays, the makers' words for the
    rest), and the outputs' shapes are the recorded ones."""
    from numbaflash import decode_direct, kvcache, launcher

    def make(a):
        if isinstance(a, np.ndarray):
            return launcher.array_words(a.size, a.itemsize, a.ctypes.data, a.shape, a.strides)
        return (a,)

    class Direct:
        makers = [make] * 6

    q, k_cache, out, lse = (np.zeros(shape, np.float32) for shape in
                            ((2, 4, 1, 8), (2, 2, 16, 8), (8, 1, 8), (8, 1)))
    args = (q, k_cache, 7, out, lse, 0.5)
    roles = ("q", "k_cache", None, "out", "lse", None)
    fast = decode_direct.FastDecode([kvcache.Launched(Direct(), args, roles)], 0)
    (direct, chunks, names), = fast.launches
    assert names == ("q", "k_cache", "out", "lse")
    pointers = {name: a.ctypes.data for name, a in zip(roles, args) if name}
    words = list(chunks[0])
    for name, chunk in zip(names, chunks[1:]):
        words += [pointers[name], *chunk]
    assert words == [w for a in args for w in make(a)]
    assert fast.made == {"out": ((8, 1, 8), np.float32), "lse": ((8, 1), np.float32)}


def test_decode_outputs_are_made_after_the_split_kernel_that_leaves_them_unused():
    """With a combine after it, the split kernel's out and lse are UNUSED: their pointer
    words are 0 in every launch, and a repeated call allocates out and lse only after
    the split kernel is launched (the partial results before it); the scratch layout
    puts the lengths (an int's) first, each part 256-byte aligned."""
    from numbaflash import decode_direct, kvcache, launcher

    def make(a):
        if isinstance(a, np.ndarray):
            return launcher.array_words(a.size, a.itemsize, a.ctypes.data, a.shape, a.strides)
        return (a,)

    events = []

    class Direct:
        def __init__(self, name, n):
            self.name, self.makers = name, [make] * n

        def prepare(self, words, slots, device):
            return None                 # launched through launch_words below

        def launch_words(self, words, stream, device):
            events.append((self.name, list(words)))

    unused = decode_direct.UNUSED
    seqlens, out, lse = (np.zeros(s, t) for s, t in (((3,), np.int32),
                                                      ((6, 1, 8), np.float16),
                                                      ((6, 1), np.float32)))
    o_parts, l_parts = np.zeros((5, 6, 1, 8), np.float32), np.zeros((5, 6, 1), np.float32)
    split = kvcache.Launched(Direct("split", 5), (seqlens, out, lse, o_parts, l_parts),
                             ("seqlens", unused, unused, "o_parts", "l_parts"))
    combine = kvcache.Launched(Direct("combine", 4), (o_parts, l_parts, out, lse),
                               ("o_parts", "l_parts", "out", "lse"))
    fast = decode_direct.FastDecode([split, combine], 0)
    assert [names for _, _, names in fast.launches] == [
        ("seqlens", "o_parts", "l_parts"), ("o_parts", "l_parts", "out", "lse")]
    assert fast.make_before == [("o_parts", "l_parts"), ("out", "lse")]
    # lengths 3 x 4 bytes -> 256; o_parts 240 floats -> 1024; l_parts 30 floats -> 256
    assert fast.scratch[False] == ({"seqlens": 0, "o_parts": 256, "l_parts": 1280}, 1536)
    assert fast.scratch[True] == ({"o_parts": 0, "l_parts": 1024}, 1280)

    def allocate(role, shape, dtype):
        events.append(("allocate", role))
        return role, 1000 + len(events)
    saved = launcher.PREPARED_LAUNCH
    try:
        launcher.PREPARED_LAUNCH = False
        made = fast.launch({"seqlens": 11}, allocate, stream=None)
    finally:
        launcher.PREPARED_LAUNCH = saved
    assert [e[:2] if e[0] == "allocate" else e[0] for e in events] == [
        ("allocate", "o_parts"), ("allocate", "l_parts"), "split",
        ("allocate", "out"), ("allocate", "lse"), "combine"]
    assert made == {r: r for r in ("o_parts", "l_parts", "out", "lse")}
    split_words = events[2][1]
    want = [w for a in (seqlens, out, lse, o_parts, l_parts) for w in make(a)]
    n_seq, n_out, n_lse = (len(make(a)) for a in (seqlens, out, lse))
    want[4] = 11                                    # the call's lengths
    want[n_seq + 4] = want[n_seq + n_out + 4] = 0   # out and lse: unused, pointer 0
    want[n_seq + n_out + n_lse + 4] = 1001          # o_parts
    want[n_seq + n_out + n_lse + len(make(o_parts)) + 4] = 1002     # l_parts
    assert split_words == want


def test_cpu_decoding_calls_are_never_launched_directly():
    """Only CUDA tensors have a decoding kind; calls with ALiBi slopes have none either."""
    q = torch.zeros(1, 2, 1, 8)
    caches = torch.zeros(1, 1, 16, 8)
    options = dict(causal=False, scale=None, window_size=None, softcap=None,
                   alibi_slopes=None, num_splits=None)
    assert dropins._decode_key([q, caches, caches, None, None], 5, options) is None


def _decode_inputs(dtype, seed, B=2, Hq=8, Hk=2, S_max=300, d=64):
    """q, k_cache, v_cache, k, v in flash-attn's (batch, seqlen, heads, d) layout, CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=dtype)
    return (make(B, 1, Hq, d), make(B, S_max, Hk, d), make(B, S_max, Hk, d),
            make(B, 1, Hk, d), make(B, 1, Hk, d))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", ["int", "tensor"])
@pytest.mark.parametrize("new_rows", [False, True], ids=["no_new", "new_rows"])
def test_repeated_decoding_calls_launch_directly_with_the_same_bits(monkeypatch, dtype,
                                                                     lengths, new_rows):
    """The second decoding call of a kind (decode_direct.py) does not call
    numbaflash.attention_with_kvcache, and gives the whole path's bits for other tensors
    of that kind, on a side stream: out, lse and the caches with the new rows written."""
    from numbaflash import decode_direct
    seqlens = (120 if lengths == "int" else
               torch.tensor([37, 250], dtype=torch.int32, device="cuda"))

    def call(q, k_cache, v_cache, k, v):
        new = dict(k=k, v=v) if new_rows else {}
        return nft.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                           causal=True, return_softmax_lse=True, **new)

    second = _decode_inputs(dtype, 1)
    copies = [x.clone() for x in second]
    decode_direct.forget()
    want_out, want_lse = call(*copies)                  # the whole path on a copy
    decode_direct.forget()
    call(*_decode_inputs(dtype, 0))                     # the whole path, remembered
    assert any(key[0] == "torch" for key in decode_direct._REMEMBERED)

    def refuse(*args, **kwargs):
        raise AssertionError("the repeated call took the whole path")

    monkeypatch.setattr(dropins.api_kvcache, "attention_with_kvcache", refuse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = call(*second)
    torch.cuda.synchronize()
    # launched through PreparedLaunch (the whole path's inner call on device arrays
    # remembers a kind of its own, never repeated here)
    repeated = [fast for key, fast in decode_direct._REMEMBERED.items() if key[0] == "torch"]
    assert repeated and all(prepared is not None
                            for fast in repeated for prepared in fast.prepared)
    bits = lambda x: x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    assert out.shape == second[0].shape and lse.shape == (2, 8, 1)
    assert torch.equal(bits(out), bits(want_out)) and torch.equal(lse, want_lse)
    for name, got, want in zip(("k_cache", "v_cache"), second[1:3], copies[1:3]):
        assert torch.equal(bits(got), bits(want)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_decoding_step_captured_in_a_cuda_graph(dtype):
    """A decoding step (new rows written, then attention) captured after a warm-up call
    and replayed with new q, k, v and advanced lengths copied into its static tensors
    gives the bits of the same step called eagerly; a kind never run before is refused
    inside the capture with a clear error, before anything is launched."""
    from numbaflash import decode_direct
    decode_direct.forget()
    q, k_cache, v_cache, k, v = _decode_inputs(dtype, 2)
    seqlens = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    eager_caches = [k_cache.clone(), v_cache.clone()]

    def step(q, k_cache, v_cache, k, v, seqlens):
        return nft.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                           cache_seqlens=seqlens, return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # the warm-up, as PyTorch asks
        step(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_lse = step(q, k_cache, v_cache, k, v, seqlens)
    for lengths, seed in (((11, 150), 3), ((201, 40), 4)):     # two replays, new inputs
        new = _decode_inputs(dtype, seed)
        for static, x in zip((q, k, v), (new[0], new[3], new[4])):
            static.copy_(x)
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        want_out, want_lse = step(q, *eager_caches, k, v, seqlens)
        torch.cuda.synchronize()
        assert torch.equal(captured_out, want_out) and torch.equal(captured_lse, want_lse)
        assert torch.equal(k_cache, eager_caches[0]) and torch.equal(v_cache, eager_caches[1])
    with pytest.raises(RuntimeError, match="already run outside the capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step(q, k_cache, v_cache, k, v, 5)          # an int: a new kind


def test_flash_attn_varlen_func_is_attention_varlen_with_autograd():
    """flash-attn's packed-batch call on CPU tensors: out is bitwise
    numbaflash.attention_varlen's on the same arrays, and the gradients autograd returns
    are bitwise numbaflash.attention_varlen_backward's (the layer adds no arithmetic;
    tests/test_varlen.py checks those calls against the float64 reference). Also: GQA,
    an empty sequence, max_seqlen larger than needed, the refusals."""
    g = torch.Generator().manual_seed(7)
    lens_q, lens_k = [3, 0, 5], [4, 2, 5]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 2, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 1, 8, generator=g, requires_grad=True)
            for _ in range(2))
    options = dict(causal=True, window_size=(3, 1), softcap=5.0)
    out = nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 5, **options)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    kw = dict(causal=True, window_size=(3, 1), softcap=5.0)
    want, lse = numbaflash.attention_varlen(*arrays, cu_q.numpy(), cu_k.numpy(),
                                            return_lse=True, **kw)
    assert_bitwise_equal("out", out.detach().numpy(), want)
    grads = numbaflash.attention_varlen_backward(dout.numpy(), *arrays, want, lse,
                                                 cu_q.numpy(), cu_k.numpy(), **kw)
    for name, x, want_grad in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert_bitwise_equal(name, x.grad.numpy(), want_grad)
    with pytest.raises(NotImplementedError, match="block_table"):
        nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, block_table=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, return_attn_probs=True)
    with pytest.raises(TypeError, match="int32"):
        nft.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 5, 5)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5)
