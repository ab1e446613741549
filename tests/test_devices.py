"""Device and stream correctness on CUDA (``gpu`` marker; skipped without a GPU).

* A side stream: the kernels run on the *current* stream. Everything (input preparation behind a
  long ``torch.cuda._sleep``, forward, backward) is issued on a side stream and only that stream
  is synchronised: a kernel launched on another stream would read the input before it is written
  and give NaN.
* A second GPU: tensors on ``cuda:1`` while the current device is ``cuda:0`` are computed on
  ``cuda:1``: every kernel the profiler records runs on device 1, outputs and gradients are
  there with correct values, the current device stays 0 and nothing is allocated on ``cuda:0``.
  Run in a subprocess: launching on the wrong device can be a sticky CUDA error that would take
  the rest of the session down with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusedops import fused_layernorm, fused_softmax

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
SLEEP_CYCLES = 100_000_000  # ~50 ms on a ~2 GHz GPU: far longer than the launches below


def _ops(n: int):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g)
    b = torch.randn(n, generator=g)
    return {
        "softmax": (lambda x, w, b: fused_softmax(x, -1), lambda x, w, b: torch.softmax(x, -1)),
        "layernorm": (lambda x, w, b: fused_layernorm(x, n, w, b),
                      lambda x, w, b: F.layer_norm(x, (n,), w, b)),
    }, w, b


@pytest.mark.parametrize("n", [1000, 70000])  # single-block and looped kernels
@pytest.mark.parametrize("op", ["softmax", "layernorm"])
def test_gpu_side_stream(op, n):
    ops, w, b = _ops(n)
    fused, ref = ops[op]
    g = torch.Generator().manual_seed(1)
    src = torch.randn(64, n, generator=g).cuda()
    dy = torch.randn(64, n, generator=g).cuda()
    w, b = w.cuda().requires_grad_(True), b.cuda().requires_grad_(True)
    x_ref = src.clone().requires_grad_(True)
    y_ref = ref(x_ref, w, b)
    y_ref.backward(dy)
    grads_ref = [x_ref.grad] + [None if p.grad is None else p.grad.clone() for p in (w, b)]
    w.grad = b.grad = None

    x = torch.full_like(src, float("nan"))  # what a kernel on the wrong stream would read
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(src)
        leaf = x.requires_grad_(True)
        y = fused(leaf, w, b)
        y.backward(dy)
    side.synchronize()  # only the side stream
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, grads_ref[0], atol=1e-5, rtol=1e-5)
    if op == "layernorm":
        torch.testing.assert_close(w.grad, grads_ref[1], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(b.grad, grads_ref[2], atol=1e-3, rtol=1e-4)


_SECOND_GPU = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    import fusedops

    dev = torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    g = torch.Generator().manual_seed(0)
    for n in (1000, 70000):
        x0 = torch.randn(32, n, generator=g)
        dy0 = torch.randn(32, n, generator=g)
        w0 = torch.randn(n, generator=g)
        b0 = torch.randn(n, generator=g)
        x, dy, w, b = (t.to(dev) for t in (x0, dy0, w0, b0))
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(0)
        results = {}
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with prof:
            fusedops.fused_softmax(x, -1).sum().item()
            fusedops.fused_layernorm(x, n, w, b).sum().item()
        kernels = [(e.name, e.device_index) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        if kernels:  # (empty when CUPTI is unavailable: then the checks below must do)
            assert all(idx == 1 for _, idx in kernels), f"kernels not on cuda:1: {kernels}"
        else:
            print("note: the profiler recorded no CUDA kernels; device check by memory only")
        for name, fused, ref in (
            ("softmax", lambda x, w, b: fusedops.fused_softmax(x, -1),
             lambda x, w, b: torch.softmax(x, -1)),
            ("layernorm", lambda x, w, b: fusedops.fused_layernorm(x, n, w, b),
             lambda x, w, b: F.layer_norm(x, (n,), w, b)),
        ):
            for fn, tag in ((fused, "fused"), (ref, "torch")):
                leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
                y = fn(*leaves)
                y.backward(dy)
                results[name, tag] = [y.detach()] + [t.grad for t in leaves]
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0, "the current device changed"
        assert torch.cuda.memory_allocated(0) == before, "memory was allocated on cuda:0"
        for name in ("softmax", "layernorm"):
            got, want = results[name, "fused"], results[name, "torch"]
            for label, a, e in zip(("y", "dx", "dw", "db"), got, want):
                if e is None:
                    assert a is None, (name, label)
                    continue
                assert a.device == dev, (name, label, a.device)
                tol = 1e-5 if label in ("y", "dx") else 1e-3
                torch.testing.assert_close(a, e, atol=tol, rtol=1e-4)
        # The current stream of cuda:1 (a side stream), synchronising only that stream.
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            y = fusedops.fused_softmax(x, -1)
        side.synchronize()
        torch.testing.assert_close(y, results["softmax", "torch"][0], atol=1e-5, rtol=1e-5)
        assert torch.cuda.memory_allocated(0) == before, "memory was allocated on cuda:0"
    print("SECOND_GPU_OK")
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_tensors_on_second_device():
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SECOND_GPU], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SECOND_GPU_OK" in proc.stdout, out[-4000:]
