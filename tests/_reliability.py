"""Helpers shared by the reliability suites (special values, determinism, properties, memory).

A *target* is where a test runs the fused ops: ``(backend, device, variant)``.

* ``reference`` on CPU: the PyTorch fallback (cheap, always available);
* ``triton`` on CPU: the real kernels through Triton's interpreter (``TRITON_INTERPRET=1``,
  which conftest sets on machines without CUDA);
* ``triton`` on CUDA: the compiled kernels (``gpu`` marker: skipped without a GPU).

``variant="looped"`` shrinks the Triton single-block limit to 16 elements so rows of a few dozen
elements take the looped (chunked) kernels, several chunks per row.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from conftest import TOLERANCES, triton_kernels_ready

import fusedops

INF, NAN = float("inf"), float("nan")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

gpu = pytest.mark.gpu


def target_params(*, reference: bool = True, looped: bool = True) -> list:
    """pytest params for the ``target`` fixture: CPU reference, CPU interpreter, CUDA (gpu)."""
    params = []
    if reference:
        params.append(pytest.param(("reference", "cpu", "single"), id="reference-cpu"))
    params.append(pytest.param(("triton", "cpu", "single"), id="triton-cpu"))
    if looped:
        params.append(pytest.param(("triton", "cpu", "looped"), id="triton-cpu-looped"))
    params.append(pytest.param(("triton", "cuda", "single"), id="triton-cuda", marks=gpu))
    if looped:
        params.append(pytest.param(("triton", "cuda", "looped"), id="triton-cuda-looped",
                                   marks=gpu))
    return params


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def single_block_limit(limit: int | None) -> Iterator[None]:
    """Temporarily set the Triton single-block limit (None: leave the default)."""
    if limit is None:
        yield
        return
    from fusedops.backends.triton import configs

    with configs.override(SINGLE_BLOCK_LIMIT=limit):
        yield


@contextlib.contextmanager
def enter_target(param: tuple[str, str, str]) -> Iterator[str]:
    """Force the target's backend (and kernel variant); yields the device to create tensors on.

    Skips when the target cannot run here: Triton on CPU needs the interpreter (on a CUDA
    machine conftest runs the compiled kernels instead, and the ``triton-cuda`` targets cover
    them), Triton on CUDA needs a GPU.
    """
    backend, device, variant = param
    if backend == "triton":
        if not triton_kernels_ready():
            pytest.skip("Triton kernels not available")
        if device == "cpu" and not interpreting():
            pytest.skip("TRITON_INTERPRET=0: the compiled kernels run on CUDA tensors instead")
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
    with fusedops.use_backend(backend), single_block_limit(16 if variant == "looped" else None):
        yield device


def nonfinite_masks(t: torch.Tensor) -> dict[str, torch.Tensor]:
    t = t.detach().double().cpu()
    return {"nan": torch.isnan(t), "+inf": t == INF, "-inf": t == -INF}


def assert_same_nonfinite(actual: torch.Tensor, expected: torch.Tensor, what: str,
                          kinds: bool = True) -> None:
    """NaN, +inf and -inf appear at exactly the same positions in both tensors (``kinds=False``:
    the same positions are non-finite, whether NaN or inf)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    got, want = nonfinite_masks(actual), nonfinite_masks(expected)
    if not kinds:
        got = {"non-finite": got["nan"] | got["+inf"] | got["-inf"]}
        want = {"non-finite": want["nan"] | want["+inf"] | want["-inf"]}
    for kind in got:
        diff = got[kind] != want[kind]
        if diff.any():
            where = diff.nonzero().tolist()[:8]
            raise AssertionError(
                f"{what}: {kind} positions differ from torch at {where} "
                f"(fused has {int(got[kind].sum())}, torch {int(want[kind].sum())})"
            )


def assert_finite_close(actual: torch.Tensor, expected64: torch.Tensor, where: torch.Tensor,
                        dtype: torch.dtype, scale: float, what: str) -> None:
    """Where ``where`` is true, ``actual`` is within the shared tolerance of the float64
    reference rounded to ``actual``'s dtype (conftest.assert_close_to_ref, restricted)."""
    a = actual.detach().cpu().to(torch.float64)[where]
    e = expected64.detach().cpu().to(actual.dtype).to(torch.float64)[where]
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(a, e, atol=atol * scale, rtol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the widest tolerance (for results that passed through several dtypes)."""
    return max(dtypes, key=lambda d: TOLERANCES[d][1])


def forward_backward_peak(forward, sources: list[torch.Tensor], dy: torch.Tensor) -> int:
    """Peak CUDA bytes of ``forward(*leaves).backward(dy)`` above the starting point, with the
    leaves fresh clones of ``sources`` that require grad (measured on a second call)."""
    from fusedops.tools.memory import peak_bytes

    def step():
        leaves = [t.clone().requires_grad_(True) for t in sources]
        y = forward(*leaves)
        y.backward(dy)
        del y, leaves

    return peak_bytes(step)
