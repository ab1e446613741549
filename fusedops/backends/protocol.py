"""The contract every backend module satisfies (``fusedops._dispatch`` picks one per call).

Every backend works on the *2-D row contract* (docs/design.md, "Backends"): ``x``/``dy`` are
``(M, N)`` with unit column stride and any row stride, outputs are contiguous, ``mean``/``rstd``
are ``(M,)`` float32, ``dw``/``db`` come back as float32 ``(N,)`` (or already in
``grad_dtypes`` where a backend chose to cast them). The autograd Functions in
``fusedops.ops`` reduce every user call to it.

Optional attributes the ops read with ``getattr`` (absent means False / None):
``ROWS_ND`` (softmax_forward / layernorm_forward_y / rmsnorm_forward_y also take contiguous
tensors of any rank), ``EPILOGUE_ROWS_ND`` (the same for layernorm_epilogue_forward),
``softmax_masked_ops_runner`` (makes ``fusedops._replay.SOFTMAX_MASKED`` runners). A backend
that lacks an epilogue function falls back to the reference (``_dispatch.backend_fn``).
"""

from __future__ import annotations

from typing import Protocol

import torch

Tensor = torch.Tensor
OptTensor = torch.Tensor | None
GradDtypes = tuple[torch.dtype | None, torch.dtype | None] | None


class Backend(Protocol):
    """A backend module: ``fusedops.backends.triton``, ``.metal`` or ``.reference``."""

    NAME: str

    def softmax_forward(self, x: Tensor, out_dtype: torch.dtype) -> Tensor: ...

    def softmax_backward(self, y: Tensor, dy: Tensor, out_dtype: torch.dtype) -> Tensor: ...

    def layernorm_forward(self, x: Tensor, weight: OptTensor, bias: OptTensor, eps: float,
                          out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]: ...

    def layernorm_forward_y(self, x: Tensor, weight: OptTensor, bias: OptTensor, eps: float,
                            out_dtype: torch.dtype) -> Tensor: ...

    def layernorm_backward(self, dy: Tensor, x: Tensor, weight: OptTensor, mean: Tensor,
                           rstd: Tensor, need_dx: bool, need_dw: bool, need_db: bool,
                           grad_dtypes: GradDtypes = None
                           ) -> tuple[OptTensor, OptTensor, OptTensor]: ...

    def rmsnorm_forward(self, x: Tensor, weight: OptTensor, eps: float,
                        out_dtype: torch.dtype) -> tuple[Tensor, Tensor]: ...

    def rmsnorm_forward_y(self, x: Tensor, weight: OptTensor, eps: float,
                          out_dtype: torch.dtype) -> Tensor: ...

    def rmsnorm_backward(self, dy: Tensor, x: Tensor, weight: OptTensor, rstd: Tensor,
                         need_dx: bool, need_dw: bool, grad_dtypes: GradDtypes = None
                         ) -> tuple[OptTensor, OptTensor]: ...

    def softmax_masked_forward(self, x: Tensor, mask: OptTensor, scale: float, causal: bool,
                               out_dtype: torch.dtype) -> Tensor: ...

    def softmax_masked_backward(self, y: Tensor, dy: Tensor, scale: float,
                                out_dtype: torch.dtype) -> Tensor: ...

    def layernorm_epilogue_forward(self, x: Tensor, residual: OptTensor, weight: OptTensor,
                                   bias: OptTensor, eps: float, out_dtype: torch.dtype,
                                   dropout_p: float, seed: int, activation: str | None,
                                   need_stats: bool
                                   ) -> tuple[Tensor, OptTensor, OptTensor, OptTensor]: ...

    def layernorm_epilogue_backward(self, dout: Tensor, ds: OptTensor, s: Tensor,
                                    weight: OptTensor, bias: OptTensor, mean: Tensor,
                                    rstd: Tensor, dropout_p: float, seed: int,
                                    activation: str | None, need_dx: bool, need_dw: bool,
                                    need_db: bool, grad_dtypes: GradDtypes = None
                                    ) -> tuple[OptTensor, OptTensor, OptTensor]: ...
