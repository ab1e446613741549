"""Split-row launches.

Rows too long for one program's registers are split over C programs ("chunks"). Each chunk
program keeps its piece in registers, publishes a few float32 partial statistics, waits until
all C chunks of its row have published (a per-row arrival counter), combines the partials and
writes its piece: the row is read once and written once, as in the single-block kernels.

Waiting on other programs is only safe when they are all resident at once, so these kernels run
a persistent grid no larger than the GPU holds, launched as a cooperative grid (the driver
refuses, rather than deadlocks, if it would not fit), with the work item order row-major so the
chunks of a row run in the same round. The interpreter runs programs one after another, so it
(and any launch failure) uses the looped kernels instead. The kernels' shared pieces are in
``kernels/common.py``.
"""

from __future__ import annotations

import os

import torch

from fusedops.backends.triton.kernels.common import zero_i32
from fusedops.backends.triton.runtime.caches import config_caches
from fusedops.backends.triton.runtime.device import cdiv, interpreting, num_sms
from fusedops.backends.triton.runtime.launcher import Launcher, launch_spec

# PREFETCH (a constexpr of every split-row kernel): where a program issues the loads of its
# next row (it keeps the same piece of rows num_progs / C apart): 0 = not ahead (load, reduce,
# publish, wait, write: its loads idle while it waits for its row's other pieces), 1 = before
# publishing and waiting, 2 = right after the wait, overlapping the combine and the write, 3 =
# between publishing and waiting. The release that publishes is a fence (MEMBAR.GPU in SASS):
# it waits for the publishing thread's outstanding loads, so loads issued before it (1) are
# waited for before the release, while loads issued after it (3) are in flight during the wait.
# Each kernel kind's measured choice is in its split config (configs/softmax.py, layernorm.py).
# FUSEDOPS_SPLIT_ROWS=0 turns them off (the looped kernels then handle long rows).
SPLIT_STATE = {"enabled": os.environ.get("FUSEDOPS_SPLIT_ROWS", "1") != "0"}


def split_rows_enabled(device: torch.device, n: int, chunk: int) -> bool:
    """Whether the split-row (cooperative) kernels can run rows of ``n`` on ``device`` in equal
    pieces of at most ``chunk`` elements (see :func:`split_pieces`): CUDA, not disabled, and
    all pieces of a row resident at once."""
    if not (SPLIT_STATE["enabled"] and device.type == "cuda" and not interpreting()):
        return False
    return cdiv(n, chunk) <= num_sms(device)


def disable_split_rows(reason: str) -> None:
    """Fall back to the looped kernels for the rest of the process (after a launch failure)."""
    import warnings

    if SPLIT_STATE["enabled"]:
        SPLIT_STATE["enabled"] = False
        for cache in config_caches:  # replay plans may hold split launches
            cache.cache_clear()
        warnings.warn(f"fusedops: split-row kernels disabled ({reason}); using looped kernels",
                      RuntimeWarning, stacklevel=3)


def split_pieces(n: int, chunk: int, vec: int) -> tuple[int, int]:
    """(C, L) for a split-row launch: C pieces of L elements covering rows of ``n`` (L a
    multiple of 16 with unaligned rows, ``vec`` > 0, so pieces of the body stay aligned; the
    last piece of a row whose body is shorter may then be empty, which the kernels allow)."""
    c = cdiv(n, chunk)
    length = cdiv(n, c)
    if vec:
        length = cdiv(length, 16) * 16
        c = cdiv(n, length)
    return c, length


class SplitLauncher:
    """Launches a split-row kernel on a cooperative persistent grid sized from its occupancy.

    The kernel's last runtime parameter must be ``num_progs`` (the grid size), followed only by
    constexprs.
    """

    __slots__ = ("launcher", "blocks_per_sm")

    def __init__(self, kernel, fp_fusion: bool = True, maxnreg: int | None = None) -> None:
        self.launcher = Launcher(kernel, cooperative=True, fp_fusion=fp_fusion, maxnreg=maxnreg)
        self.blocks_per_sm: dict = {}

    def programs(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, vec: int = 0) -> int:
        """The grid size a launch with these arguments uses: a multiple of the chunk count (so
        all chunks of a row run in the same round, and a program keeps one chunk). It depends
        only on the arguments' specialisation, never on earlier calls, so the same shapes always
        get the same grid (and kernels with per-program partials the same summation order).

        With unaligned rows (``vec`` > 0, see :func:`split_piece`) a grid smaller than
        ``items`` is a multiple of ``chunks * vec``: a program's rows are then a multiple of
        ``vec`` apart and share one misalignment (its weight columns stay fixed). Returns 0 if
        neither one item per program nor such a grid fits on the device at once."""
        per_sm = self._per_sm(chunks, runtime, consts, num_warps)
        resident = num_sms(device) * per_sm
        unit = chunks * max(vec, 1)
        fit = resident // unit * unit
        # One item per program whenever all of them fit (items is a multiple of chunks).
        if items <= resident or (not vec and items <= chunks):
            return items
        return fit if fit else (0 if vec else chunks)

    @staticmethod
    def _key(chunks: int, runtime: tuple, consts: tuple, num_warps: int) -> tuple:
        # Occupancy is per compiled kernel: dtypes and alignment change its register count.
        return (num_warps, chunks, consts, *map(launch_spec, runtime))

    def _per_sm(self, chunks: int, runtime: tuple, consts: tuple, num_warps: int) -> int:
        """Programs per SM that fit at once, from the compiled kernel's register count (compiled
        ahead of the first launch, without running it)."""
        key = self._key(chunks, runtime, consts, num_warps)
        per_sm = self.blocks_per_sm.get(key)
        if per_sm is None:
            per_sm = 1
            try:
                compiled = self.launcher.kernel.warmup(
                    *runtime, 1024, *consts, grid=(1,), num_warps=num_warps,
                    **self.launcher.options)
                compiled._init_handles()
                regs = int(compiled.n_regs or 0)
                # Registers are allocated per warp in units of 256.
                per_warp = -(-regs * 32 // 256) * 256
                if per_warp:
                    per_sm = max(1, min(65536 // (per_warp * num_warps),
                                        2048 // (32 * num_warps)))
                shared = int(getattr(compiled.metadata, "shared", 0) or 0)
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 0
                if shared and smem:  # the driver reserves 1 KiB per resident block
                    per_sm = max(1, min(per_sm, smem // (shared + 1024)))
            except Exception:  # noqa: BLE001 - an unknown Triton API: one program per SM
                per_sm = 1
            self.blocks_per_sm[key] = per_sm
        return per_sm

    def __call__(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, progs: int | None = None, vec: int = 0) -> int:
        """Launch on ``progs`` programs (default :meth:`programs`); returns the grid size, or 0
        if the launch was refused or no grid fits (the caller then uses another kernel)."""
        if progs is None:
            progs = self.programs(items, chunks, runtime, consts, num_warps, device, vec)
        if not progs:
            return 0
        try:
            self.launcher((progs,), (*runtime, progs, *consts), num_warps)
        except Exception as exc:  # cooperative launch refused, option unknown to this Triton...
            key = self._key(chunks, runtime, consts, num_warps)
            if self.blocks_per_sm.get(key, 1) > 1:
                self.blocks_per_sm[key] = 1  # the occupancy estimate was too high: retry lower
            else:
                disable_split_rows(f"{type(exc).__name__}: {exc}")
            return 0
        return progs


_launch_zero = Launcher(zero_i32)


def zero_counters(t: torch.Tensor) -> torch.Tensor:
    """Zero a contiguous int32 tensor (the split kernels' row counters) with a launch rather
    than ``zero_()``, so that a recorded call (:func:`record_launches`) replays it."""
    n = t.numel()
    _launch_zero((cdiv(n, 1024),), (t, n, 1024), 4)
    return t
