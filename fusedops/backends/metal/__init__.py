"""Metal backend for Apple GPUs: the 2-D row contract (see ``fusedops._dispatch``) on MPS tensors.

Fallback chain, decided once per process by :func:`is_available`:

1. the compiled Objective-C++ extension ``fusedops._metal_ext`` (built by ``setup.py`` on macOS),
   which encodes the kernels on PyTorch's current MPS stream;
2. ``torch.mps.compile_shader`` over the same shader sources (when this PyTorch has it), driven
   by the host code of this package;
3. neither: :func:`is_available` is False and the dispatcher uses the PyTorch reference with a
   one-time warning.

The shader sources are ``fusedops/_shaders/*.metal`` in an installed package (``setup.py``
copies ``metal/`` there) or ``<repo>/metal/*.metal`` in a source checkout.

Layout: ``rules.py`` (the host/shader contract: flags, type pairs, dispatch geometry),
``host.py`` (kernel choice and argument helpers shared by the ops), ``softmax.py`` /
``norms.py`` / ``epilogue.py`` (the ``*_with(launcher, ...)`` host code per op), ``loader.py``
(which path runs, the shader sources), ``shader_source.py`` (the one Metal source). This file
holds the backend's entry points (``fusedops.backends.Backend``).

The host logic (kernel choice, dispatch geometry, argument order, flags) is written once
against a small *launcher* protocol: ``launcher(name, args, groups, threads)``,
``launcher.max_threads(name)`` and ``launcher.has(name)``. The compile_shader path implements it
with ``torch.mps.compile_shader``; the test-suite implements it with the CPU emulation of the
shaders (``tests/metal_emu``), so this exact code is what the Linux tests run. The extension in
``csrc/fusedops_metal.mm`` mirrors the same constants and geometry in C++ (a test compares them).
"""

from __future__ import annotations

import torch

from fusedops.backends import reference
from fusedops.backends.metal.epilogue import (
    layernorm_epilogue_backward_with,
    layernorm_epilogue_forward_with,
)
from fusedops.backends.metal.host import seed_arg
from fusedops.backends.metal.loader import Extension, get_impl, implementation, is_available
from fusedops.backends.metal.norms import (
    layernorm_backward_with,
    layernorm_forward_with,
    rmsnorm_backward_with,
    rmsnorm_forward_with,
)
from fusedops.backends.metal.softmax import (
    softmax_backward_with,
    softmax_forward_with,
    softmax_masked_backward_with,
    softmax_masked_forward_with,
)

NAME = "metal"
__all__ = ["NAME", "implementation", "is_available"]  # and the Backend entry points below


def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, out_dtype) in impl.softmax_fwd:
            return impl.ext.softmax_forward(x, out_dtype)
        return reference.softmax_forward(x, out_dtype)
    return softmax_forward_with(impl, x, out_dtype)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    impl = get_impl()
    if isinstance(impl, Extension):
        if (y.dtype, out_dtype) in impl.softmax_bwd:
            return impl.ext.softmax_backward(y, dy, out_dtype)
        return reference.softmax_backward(y, dy, out_dtype)
    return softmax_backward_with(impl, y, dy, out_dtype)


def layernorm_forward(x, weight, bias, eps, out_dtype):
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, out_dtype) in impl.layernorm_fwd:
            return tuple(impl.ext.layernorm_forward(x, weight, bias, float(eps), out_dtype))
        return reference.layernorm_forward(x, weight, bias, eps, out_dtype)
    return layernorm_forward_with(impl, x, weight, bias, eps, out_dtype)


def layernorm_forward_y(x, weight, bias, eps, out_dtype):
    return layernorm_forward(x, weight, bias, eps, out_dtype)[0]


def layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight/dbias themselves; the caller casts here.
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, dy.dtype) in impl.layernorm_bwd:
            return tuple(impl.ext.layernorm_backward(dy, x, weight, mean, rstd, bool(need_dx),
                                                     bool(need_dw), bool(need_db)))
        return reference.layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw,
                                            need_db)
    return layernorm_backward_with(impl, dy, x, weight, mean, rstd, need_dx, need_dw,
                                   need_db)


def rmsnorm_forward(x, weight, eps, out_dtype):
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, out_dtype) in impl.rmsnorm_fwd:
            return tuple(impl.ext.rmsnorm_forward(x, weight, float(eps), out_dtype))
        return reference.rmsnorm_forward(x, weight, eps, out_dtype)
    return rmsnorm_forward_with(impl, x, weight, eps, out_dtype)


def rmsnorm_forward_y(x, weight, eps, out_dtype):
    return rmsnorm_forward(x, weight, eps, out_dtype)[0]


def rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight themselves; the caller casts here.
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, dy.dtype) in impl.rmsnorm_bwd:
            return tuple(impl.ext.rmsnorm_backward(dy, x, weight, rstd, bool(need_dx),
                                                   bool(need_dw)))
        return reference.rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw)
    return rmsnorm_backward_with(impl, dy, x, weight, rstd, need_dx, need_dw)


def softmax_masked_forward(x, mask, scale, causal, out_dtype):
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, out_dtype) in impl.softmax_masked_fwd:
            return impl.ext.softmax_masked_forward(x, mask, float(scale), bool(causal), out_dtype)
        return reference.softmax_masked_forward(x, mask, scale, causal, out_dtype)
    return softmax_masked_forward_with(impl, x, mask, scale, causal, out_dtype)


def softmax_masked_backward(y, dy, scale, out_dtype):
    impl = get_impl()
    if isinstance(impl, Extension):
        if (y.dtype, out_dtype) in impl.softmax_masked_bwd:
            return impl.ext.softmax_masked_backward(y, dy, float(scale), out_dtype)
        return reference.softmax_masked_backward(y, dy, scale, out_dtype)
    return softmax_masked_backward_with(impl, y, dy, scale, out_dtype)


def layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed,
                               activation, need_stats):
    impl = get_impl()
    if isinstance(impl, Extension):
        if (x.dtype, out_dtype) in impl.layernorm_epilogue_fwd and (
                residual is None or residual.dtype == x.dtype):
            return tuple(impl.ext.layernorm_epilogue_forward(
                x, residual, weight, bias, float(eps), out_dtype, float(dropout_p),
                seed_arg(seed), activation, bool(need_stats)))
        return reference.layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype,
                                                    dropout_p, seed, activation, need_stats)
    return layernorm_epilogue_forward_with(impl, x, residual, weight, bias, eps, out_dtype,
                                           dropout_p, seed, activation, need_stats)


def layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed,
                                activation, need_dx, need_dw, need_db, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight/dbias themselves; the caller casts here.
    impl = get_impl()
    if isinstance(impl, Extension):
        if (s.dtype, dout.dtype) in impl.layernorm_epilogue_bwd:
            return tuple(impl.ext.layernorm_epilogue_backward(
                dout, ds, s, weight, bias, mean, rstd, float(dropout_p), seed_arg(seed),
                activation, bool(need_dx), bool(need_dw), bool(need_db)))
        return reference.layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd,
                                                     dropout_p, seed, activation, need_dx,
                                                     need_dw, need_db)
    return layernorm_epilogue_backward_with(impl, dout, ds, s, weight, bias, mean, rstd,
                                            dropout_p, seed, activation, need_dx, need_dw,
                                            need_db)
