"""Determinism: forward and backward results are bitwise identical run to run.

Three properties, for softmax (y, dx) and LayerNorm (y, dx, dweight, dbias):

* **repeat**: the same call repeated gives the same bits;
* **fresh copies**: the same values in a freshly allocated tensor of the same shape (another
  address, another call) give the same bits: nothing depends on memory contents left behind,
  uninitialised scratch buffers or launch timing;
* **batch split**: the row-wise results (y, dx) of rows ``[0:M]`` and ``[M:2M]`` computed in two
  calls of shape ``(M, N)`` are bitwise equal to the same rows of one ``(2M, N)`` call. (dweight
  and dbias sum over rows, so their bits depend on the row count: they are compared between
  calls of the same shape.) Rows that are not a multiple of 16 bytes (N = 37) are read as an
  aligned body plus edges that depend on where the row starts: a split that moves rows to
  another 16-byte phase (M = 6) keeps the bits under ``torch.use_deterministic_algorithms``,
  one that keeps the phase (M = 8) always does.

CPU: the reference and the Triton kernels through the interpreter (single-block and looped
variants). CUDA (``gpu``): shapes that exercise the multi-program partial reductions of
dweight/dbias (M = 4096 rows of 256), wide rows (4096), looped rows (70000) and the split-row
kernels (2 x 16384, 6 x 16384 + 5), in bfloat16 and float32, with both LayerNorm backward
strategies.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _reliability import enter_target, gpu, target_params
from conftest import exhaustive_unless

from fusedops import (
    fused_layernorm,
    fused_softmax,
    get_layernorm_backward,
    layernorm_backward_mode,
)


@pytest.fixture(params=target_params())
def target(request):
    with enter_target(request.param) as device:
        yield device


def _inputs(m: int, n: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 2 + 0.3).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g))
    b = 0.5 * torch.randn(n, generator=g)
    return x.to(device), dy.to(device), w.to(device), b.to(device)


def run_softmax(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaf = x.detach().clone().requires_grad_(True)
    y = fused_softmax(leaf, -1)
    y.backward(dy)
    return y.detach(), leaf.grad


def run_layernorm(x, dy, w, b) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    y = fused_layernorm(leaves[0], x.shape[-1], leaves[1], leaves[2])
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


NAMES = {"softmax": ("y", "dx"), "layernorm": ("y", "dx", "dweight", "dbias")}


def run(op: str, x, dy, w, b) -> tuple[torch.Tensor, ...]:
    return run_softmax(x, dy) if op == "softmax" else run_layernorm(x, dy, w, b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (separates -0.0 from 0.0 and compares NaNs, unlike value equality)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_bitwise(a: tuple, b: tuple, names: tuple[str, ...], what: str) -> None:
    for name, s, t in zip(names, a, b, strict=True):
        assert s.dtype == t.dtype and s.shape == t.shape, (what, name)
        if not torch.equal(_bits(s), _bits(t)):
            diff = (s.float() - t.float()).abs().max().item()
            raise AssertionError(f"{what}: {name} differs bitwise (max |diff| {diff:.3e})")


@contextlib.contextmanager
def _deterministic(on: bool):
    was, warn = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(on or was, warn_only=warn if was else True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def check_determinism(op: str, m: int, n: int, dtype: torch.dtype, device: str,
                      repeats: int = 3) -> None:
    x, dy, w, b = _inputs(2 * m, n, dtype, device, seed=m * 31 + n)
    names = NAMES[op]
    first = run(op, x, dy, w, b)
    for i in range(repeats - 1):
        assert_bitwise(first, run(op, x, dy, w, b), names, f"{op} repeat {i + 1}")
    # Fresh copies of the same values (new storage: dirty the allocator first).
    junk = torch.full((4 * m, n + 7), float("nan"), dtype=dtype, device=device)
    copies = [t.clone() for t in (x, dy, w, b)]
    del junk
    assert_bitwise(first, run(op, *copies), names, f"{op} fresh copies")
    # Batch split: two (m, n) calls vs one (2m, n) call, row-wise results. Rows that are not a
    # multiple of 16 bytes are read as an aligned body plus edges, whose split depends on where
    # the row starts; a split that moves rows to another 16-byte phase keeps the bits only under
    # torch.use_deterministic_algorithms (see fusedops/backends/triton/configs/common.py,
    # unaligned_vec).
    elt = x.element_size()
    same_phase = (n * elt) % 16 == 0 or (m * n * elt) % 16 == 0
    with _deterministic(not same_phase):
        if not same_phase:
            first = run(op, x, dy, w, b)
        halves = [run(op, x[s].clone(), dy[s].clone(), w, b)
                  for s in (slice(0, m), slice(m, 2 * m))]
    for k in range(2):  # y and dx
        joined = torch.cat([halves[0][k], halves[1][k]])
        assert_bitwise((first[k],), (joined,), (names[k],), f"{op} batch split")
    # Reductions over rows (dweight/dbias): two identical calls of the same (m, n) shape.
    if op == "layernorm":
        with _deterministic(not same_phase):  # the mode halves[0] was computed in
            again = run(op, x[:m].clone(), dy[:m].clone(), w, b)
        assert_bitwise(halves[0], again, names, f"{op} same-shape half")


# Default run: the reference everywhere; the single-block kernels in float32 on the
# phase-changing split (deterministic mode for one half), for both ops. (bfloat16, the
# same-phase split and the looped kernels: exhaustive.)
@exhaustive_unless(lambda target, op, dtype, m: target[0] == "reference" or (
    target[2] == "single" and dtype == torch.float32 and m == 6))
@pytest.mark.parametrize("op", ["softmax", "layernorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [6, 8], ids=["phase-changing-split", "same-phase-split"])
def test_determinism(target, op, dtype, m):
    check_determinism(op, m, 37, dtype, target)


@pytest.fixture(params=target_params(looped=False))
def row_target(request):
    with enter_target(request.param) as device:
        yield device


@pytest.mark.parametrize("op", ["softmax", "layernorm"])
def test_determinism_many_rows(row_target, op):
    """140 rows: several row tiles per program and dweight/dbias split over several programs
    (the looped variant is covered above; one program per row makes it slow here)."""
    check_determinism(op, 70, 24, torch.float32, row_target, repeats=2)


# --------------------------------------------------------------------------- CUDA

GPU_SHAPES = [(4096, 256), (512, 4096), (4, 70000), (4, 2 * 16384), (3, 6 * 16384 + 5)]


@gpu
@pytest.mark.parametrize("strategy", ["default", "fast_mode", "column_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", GPU_SHAPES, ids=[f"{m}x{n}" for m, n in GPU_SHAPES])
def test_gpu_layernorm_determinism(monkeypatch, m, n, dtype, strategy, launch_rules):
    """The dweight/dbias strategies: the default for each shape (the fused backward's
    per-program partials for rows held in registers, the split-row backward's partials or the
    column kernel for long rows; partials parked in dx, the low_memory mode), the same in the
    fast mode (separate scratch), and the dx row kernel + column-blocked dweight/dbias kernel,
    forced at every row length by FUSED_BWD_MAX_BLOCK = 0 (where split rows do not apply)."""

    if strategy == "column_kernel":
        launch_rules("layernorm", FUSED_BWD_MAX_BLOCK=0)
    mode = "fast" if strategy == "fast_mode" else get_layernorm_backward()
    with layernorm_backward_mode(mode):
        check_determinism("layernorm", m, n, dtype, "cuda", repeats=5)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", GPU_SHAPES, ids=[f"{m}x{n}" for m, n in GPU_SHAPES])
def test_gpu_softmax_determinism(m, n, dtype):
    check_determinism("softmax", m, n, dtype, "cuda", repeats=5)
