"""The C++ host extension (``fusedops._host_ext``, ``csrc/host/replay.cpp``) and the conversion of
replay plans into its plans (``fusedops.backends.triton.runtime.host_ext``).

On CPU the extension runs in its dry-run mode: launches are logged (function, grid, block,
shared memory, every parameter word) instead of made, which checks the argument packing and the
autograd wiring (which tensors each launch of the forward and the backward reads and writes).
The ``gpu`` tests run the attention softmax's C++ path on CUDA against a float64 reference and
against the Python path.
"""

from __future__ import annotations

import struct
import types

import pytest
import torch
from conftest import HAS_CUDA, assert_close_to_ref

from fusedops.backends.triton.runtime import host_ext

ext = host_ext.ext
needs_ext = pytest.mark.skipif(
    ext is None, reason="fusedops._host_ext is not built (pip install --no-build-isolation .)")

PTX = """
.visible .entry kern(
\t.param .u64 .ptr .global .align 1 kern_param_0,
\t.param .u64 .ptr .global .align 1 kern_param_1,
\t.param .u32 kern_param_2,
\t.param .f32 kern_param_3,
\t.param .u64 .ptr .global .align 1 kern_param_4,
\t.param .u64 .ptr .global .align 1 kern_param_5
)
{
\t.param .b32 not_an_entry_param;
}
"""


def fake_compiled(signature: dict, ptx: str = PTX, name: str = "kern"):
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature),
                                 asm={"ptx": ptx}, name=name)


SIG = {"x": "*fp16", "y": "*fp16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def test_ptx_param_count_reads_the_entry_only():
    assert host_ext.ptx_param_count(PTX, "kern") == 6
    assert host_ext.ptx_param_count(PTX, "other") is None


@pytest.mark.parametrize(("ty", "value", "bits"), [
    ("i32", 7, 7), ("i32", -1, (1 << 64) - 1), ("i64", 1 << 40, 1 << 40), ("i1", True, 1),
    ("u32", 5, 5), ("fp32", 0.125, f32_bits(0.125)),
    ("fp64", 0.1, struct.unpack("<Q", struct.pack("<d", 0.1))[0]),
    ("fp16", 1.0, None), ("bf16", 1.0, None), ("*fp32", 0, None)])
def test_scalar_bits(ty, value, bits):
    """The low bytes of the word are the parameter (little-endian): an i32 of -1 packs as
    0xffffffff in its four bytes; 16-bit floats are not packed (the Python path keeps them)."""
    assert host_ext.scalar_bits(ty, value) == bits


def test_kernel_args_skip_constexprs_and_append_scratch():
    """Pointers from their slots, scalars as bits, constexprs dropped, and the kernel's two
    parameters past its arguments (Triton's scratch pointers, per the PTX) passed null."""
    args = host_ext.kernel_args(fake_compiled(SIG), ((0, 0), (2, 64)), (100, 0.5, 1024))
    assert args == [(0, 0), (2, 64), (-1, 100), (-1, f32_bits(0.5)), (-1, 0), (-1, 0)]


@pytest.mark.parametrize("case", ["count", "pointer-scalar", "scalar-slot", "half-scalar",
                                  "too-many-params", "no-ptx"])
def test_kernel_args_refuse_what_they_cannot_pack(case):
    sig, slots, tail, ptx = dict(SIG), ((0, 0), (1, 0)), (100, 0.5, 1024), PTX
    if case == "count":
        tail = tail[:2]
    elif case == "pointer-scalar":
        sig["n"] = "*i32"
    elif case == "scalar-slot":
        sig["y"] = "i64"
    elif case == "half-scalar":
        sig["scale"] = "fp16"
    elif case == "too-many-params":
        ptx = PTX.replace("kern_param_5", "kern_param_5,\n\t.param .u64 a,\n\t.param .u64 b")
    compiled = fake_compiled(sig, ptx)
    if case == "no-ptx":
        compiled.asm = {}
    assert host_ext.kernel_args(compiled, slots, tail) is None


def fake_go(coop=False, pdl=False, ctas=1, warps=4, shared=0, compiled=None):
    def go(grid, stream, args):
        raise AssertionError("not launched by host plans")
    go.c_entry = (None, 0xF00, coop, pdl, (warps, ctas, shared))
    go.compiled = compiled or fake_compiled(SIG)
    return go


@needs_ext
def test_host_plan_launches_what_the_steps_say(monkeypatch):
    monkeypatch.setattr(host_ext, "AVAILABLE", True)
    steps = ((fake_go(warps=8, shared=512), (6,), ((0, 0), (1, 16)), (33, 2.0, 64), None),
             (fake_go(), (2, 3), ((1, 0), (0, 0)), (-4, 1.0, 64), None))
    handle = host_ext.host_plan(steps)
    assert isinstance(handle, int)
    a, b = torch.zeros(8), torch.zeros(8)
    ext.set_dry_run(True)
    try:
        ext.run(handle, [a, b])
        log = ext.take_dry_log()
    finally:
        ext.set_dry_run(False)
    pa, pb = a.data_ptr(), b.data_ptr()
    assert log == [
        [0xF00, 6, 1, 1, 256, 512, pa, pb + 16, 33, f32_bits(2.0), 0, 0],
        [0xF00, 2, 3, 1, 128, 0, pb, pa, (1 << 64) - 4, f32_bits(1.0), 0, 0]]


@needs_ext
@pytest.mark.parametrize("case", ["coop", "pdl", "cluster", "seeded", "no-entry", "unpackable"])
def test_host_plan_refusals(monkeypatch, case):
    monkeypatch.setattr(host_ext, "AVAILABLE", True)
    go = fake_go(coop=case == "coop", pdl=case == "pdl", ctas=2 if case == "cluster" else 1)
    if case == "no-entry":
        del go.c_entry
    if case == "unpackable":
        go.compiled = fake_compiled({**SIG, "scale": "bf16"})
    seeded = (1, 2) if case == "seeded" else None
    assert host_ext.host_plan(((go, (4,), ((0, 0), (1, 0)), (1, 1.0, 64), seeded),)) is None


def test_host_plan_needs_the_extension(monkeypatch):
    monkeypatch.setattr(host_ext, "AVAILABLE", False)
    assert host_ext.host_plan(((fake_go(), (4,), ((0, 0), (1, 0)), (1, 1.0, 64), None),)) is None


@needs_ext
@pytest.mark.parametrize("masked", [False, True])
def test_masked_softmax_node_wiring(masked):
    """The C++ autograd node: the forward launches its plan on (x, mask, y), saves y, and the
    backward launches its plan on (y, dy, dx), dx becoming x's gradient; a dy that is not
    contiguous is copied first. (Dry run: the values are not computed here.)"""
    fwd = ext.make_plan([(1, [4, 1, 1], 128, 0, [(0, 0), (1, 0), (2, 0), (-1, 7)])])
    bwd = ext.make_plan([(2, [4, 1, 1], 64, 0, [(0, 0), (1, 0), (2, 0)])])
    x = torch.randn(1, 2, 4, 16, requires_grad=True)
    mask = torch.zeros(1, 1, 1, 16) if masked else None
    ext.set_dry_run(True)
    try:
        y = ext.masked_softmax(fwd, bwd, 0, 0, 1.0, x, mask)
        assert y.shape == x.shape and y.dtype == x.dtype and y.requires_grad
        dy = torch.randn(1, 2, 16, 4).transpose(-1, -2)  # not contiguous
        y.backward(dy)
        log = ext.take_dry_log()
    finally:
        ext.set_dry_run(False)
    mptr = mask.data_ptr() if masked else 0
    assert log[0] == [1, 4, 1, 1, 128, 0, x.data_ptr(), mptr, y.data_ptr(), 7]
    assert log[1][:6] == [2, 4, 1, 1, 64, 0]
    assert log[1][6] == y.data_ptr() and log[1][7] not in (0, dy.data_ptr())
    assert log[1][8] == x.grad.data_ptr() and x.grad.shape == x.shape
    assert len(log) == 2


@needs_ext
def test_masked_softmax_node_backward_with_create_graph():
    """Under create_graph=True the node's backward is scale * y * (dy - sum(dy * y)) in ATen
    ops on the saved output, which launches nothing and keeps the graph (second derivatives
    see y, whose own backward is the node again)."""
    fwd = ext.make_plan([(1, [1, 1, 1], 32, 0, [(0, 0), (1, 0), (2, 0)])])
    bwd = ext.make_plan([(2, [1, 1, 1], 32, 0, [(0, 0), (1, 0), (2, 0)])])
    x = torch.randn(1, 1, 2, 8, requires_grad=True)
    ext.set_dry_run(True)
    try:
        y = ext.masked_softmax(fwd, bwd, 0, 0, 0.5, x, None)
        dy = torch.randn_like(y, requires_grad=True)
        dx, = torch.autograd.grad(y, x, dy, create_graph=True)
        assert len(ext.take_dry_log()) == 1  # (the forward only)
        assert dx.requires_grad and dx.shape == x.shape
        ddy, = torch.autograd.grad(dx.sum(), dy, retain_graph=True)
        yd = y.detach()
        want = 0.5 * (yd - yd * yd.sum(-1, keepdim=True))  # d(sum dx)/d dy
        torch.testing.assert_close(ddy, want, equal_nan=True)
    finally:
        ext.set_dry_run(False)


@needs_ext
def test_masked_softmax_declines_other_tensors():
    """None (the caller's Python path) for a non-contiguous x, another alignment than the
    plans', or a mask on another device."""
    fwd = ext.make_plan([(1, [1, 1, 1], 32, 0, [(0, 0)])])
    x = torch.randn(1, 2, 4, 16)
    assert ext.masked_softmax(fwd, fwd, 0, 0, 1.0, x.transpose(-1, -2), None) is None
    assert ext.masked_softmax(fwd, fwd, 4, 0, 1.0, x, None) is None
    assert ext.masked_softmax(fwd, fwd, 0, 8, 1.0, x, torch.zeros(16)) is None
    if HAS_CUDA:
        assert ext.masked_softmax(fwd, fwd, 0, 0, 1.0, x, torch.zeros(16, device="cuda")) is None


# ----------------------------------------------------------------------------------------------
# CUDA: the C++ path of a replayed training call, against float64 and the Python path.

needs_cuda_ext = pytest.mark.skipif(
    HAS_CUDA and not host_ext.AVAILABLE,
    reason="fusedops._host_ext is not built with CUDA here (pip install --no-build-isolation .)")


def _reference(x, mask, scale):
    z = x.double() * scale
    if mask is not None:
        z = z.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else z + mask.double()
    return torch.softmax(z, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "mask_kind"), [
    ((2, 12, 128, 128), "float"), ((1, 4, 64, 77), "bool"), ((2, 2, 8, 1024), "none"),
    ((1, 3, 16, 4096), "float")])
@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_native_masked_softmax(dtype, shape, mask_kind):
    """Third and later calls of a signature run the C++ node; forward and gradient match the
    float64 reference and the Python path's results bitwise."""
    import fusedops

    torch.manual_seed(0)
    b, _, q, n = shape
    mask = None
    if mask_kind == "float":
        mask = torch.zeros(b, 1, 1, n, device="cuda", dtype=dtype)
        mask[..., n // 2:] = torch.finfo(dtype).min
    elif mask_kind == "bool":
        mask = torch.rand(b, 1, q, n, device="cuda") < 0.7
        mask[..., 0] = True
    results = []
    for _ in range(4):
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        with torch.no_grad():
            x.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype))
        dy = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to("cuda", dtype)
        y = fusedops.fused_softmax(x, -1, scale=0.125, mask=mask)
        dx, = torch.autograd.grad(y, x, dy)
        results.append((y.grad_fn.name(), y.detach(), dx))
    names = [r[0] for r in results]
    assert "ReplayedMaskedSoftmaxBackward" in names[1], names
    assert "MaskedSoftmax" in names[3] and "Replayed" not in names[3], names
    ref = _reference(x.detach(), mask, 0.125)
    ydd = ref * (dy.double() - (dy.double() * ref).sum(-1, keepdim=True)) * 0.125
    for _, y, dx in results:
        assert_close_to_ref(y, ref, dtype)
        assert_close_to_ref(dx, ydd, dtype, scale=4.0)
    for _, y, dx in results[2:]:
        torch.testing.assert_close(y, results[1][1], atol=0, rtol=0)
        torch.testing.assert_close(dx, results[1][2], atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_native_takes_any_gradient_layout():
    """An expanded (stride 0) or sliced gradient reaches the C++ backward; it is copied to the
    layout its plan was recorded for, with the same result as a contiguous one."""
    import fusedops

    shape = (1, 4, 32, 64)
    mask = torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    x = torch.randn(shape, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(3):
        y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
        torch.autograd.grad(y, x, torch.ones_like(y))
    y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
    assert "Replayed" not in y.grad_fn.name()
    want, = torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
    got, = torch.autograd.grad(y, x, torch.ones((), device="cuda",
                                                dtype=torch.float16).expand(shape))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
    wide = torch.randn(1, 4, 32, 128, device="cuda", dtype=torch.float16)
    got, = torch.autograd.grad(y, x, wide[..., ::2])
    want, = torch.autograd.grad(fusedops.fused_softmax(x, -1, scale=0.5, mask=mask), x,
                                wide[..., ::2].contiguous())
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_native_second_derivatives():
    """The C++ node's backward under create_graph=True gives torch's second derivatives."""
    import fusedops

    shape = (1, 2, 16, 32)
    mask = torch.zeros(1, 1, 1, 32, device="cuda")
    mask[..., 24:] = -1e4
    x0 = torch.randn(shape, device="cuda")
    for _ in range(3):
        x = x0.clone().requires_grad_()
        y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
        torch.autograd.grad(y.square().sum(), x)
    x = x0.clone().requires_grad_()
    y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
    assert "MaskedSoftmax" in y.grad_fn.name() and "Replayed" not in y.grad_fn.name()
    gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    got, = torch.autograd.grad(gx.square().sum(), x)
    xr = x0.double().requires_grad_()
    yr = torch.softmax(xr * 0.5 + mask.double(), -1)
    rx, = torch.autograd.grad(yr.square().sum(), xr, create_graph=True)
    want, = torch.autograd.grad(rx.square().sum(), xr)
    assert_close_to_ref(got, want, torch.float32, scale=16.0)
