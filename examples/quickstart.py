"""Quickstart: run both fused ops (forward and backward) and compare them with PyTorch.

    python examples/quickstart.py

Uses the best device present (CUDA, then MPS, then CPU) and prints which backend ran: on a
machine with no GPU that is PyTorch's own ops.
"""

import torch
import torch.nn.functional as F

import fusedops
from fusedops import _dispatch


def main() -> None:
    if torch.cuda.is_available():
        device = "cuda"
    elif torch.backends.mps.is_available():
        device = "mps"
    else:
        device = "cpu"
    dtype = torch.float32
    torch.manual_seed(0)

    # softmax over the last dim of attention-like scores
    x = torch.randn(4, 8, 128, 128, device=device, dtype=dtype, requires_grad=True)
    y = fusedops.fused_softmax(x, dim=-1)
    y_ref = torch.softmax(x, dim=-1)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    backend = _dispatch.backend_for(x).NAME.replace("reference", "native")
    print(f"fused_softmax   on {device} ({backend} backend): "
          f"max |y - torch| = {(y - y_ref).abs().max().item():.3g}, "
          f"max |dx - torch| = {(dx - dx_ref).abs().max().item():.3g}")

    # LayerNorm over the hidden dim of token embeddings
    h = torch.randn(8, 256, 512, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(512, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(512, device=device, dtype=dtype, requires_grad=True)
    z = fusedops.fused_layernorm(h, (512,), w, b, eps=1e-5)
    z_ref = F.layer_norm(h, (512,), w, b, eps=1e-5)
    dz = torch.randn_like(z)
    grads = torch.autograd.grad(z, (h, w, b), dz)
    grads_ref = torch.autograd.grad(z_ref, (h, w, b), dz)
    errs = ", ".join(f"max |d{n} - torch| = {(g - r).abs().max().item():.3g}"
                     for n, g, r in zip("xwb", grads, grads_ref, strict=True))
    print(f"fused_layernorm on {device} ({backend} backend): "
          f"max |y - torch| = {(z - z_ref).abs().max().item():.3g}, {errs}")
    if not _dispatch.is_fused(_dispatch.backend_for(x)):
        print("note: no fused kernel for this device; PyTorch's own ops ran (the same results, "
              "not faster). On CUDA the Triton kernels run, on Apple GPUs the Metal kernels.")


if __name__ == "__main__":
    main()
