"""Split-row kernels in thread-block clusters (Hopper): the per-row exchange on chip.

A split-row kernel (see ``runtime/split.py``) has C programs share a row: each
reduces its piece, the C partial sums are combined, and each writes its piece. Exchanging the
sums through global memory (store, release, a per-row counter, a poll, the peers' sums read
back from L2) costs a quarter of the LayerNorm backward's time at 16K-64K (H100: the same loop
with the exchange taken out, giving wrong results, took a quarter less time). Hopper runs the
CTAs of a *thread-block cluster* at once on neighbouring SMs; they can store into each other's
shared memory and meet at a hardware barrier.

Triton's ``tl`` exposes neither (a kernel compiled with ``num_ctas > 1`` fails Triton 3.6's CTA
planning once it reduces), so here an ordinary one-CTA kernel

* is launched through its compiled launcher with the packed metadata's CTA count set to C: the
  launcher asks the driver for clusters of C CTAs, so program ``pid`` is piece ``pid % C`` (its
  rank in the cluster) of cluster ``pid // C``; and with 16·C bytes of dynamic shared memory
  beyond Triton's own use, the exchange *slots* (two parities x C ranks x (s1, s2));
* exchanges each row's sums in inline PTX (:func:`cluster_publish`, :func:`cluster_peer_sums`):
  threads 0..C-1 of each CTA store the CTA's pair into slot [parity][rank] of CTA t's shared
  memory (``mapa``, ``st.shared::cluster``), the cluster meets at ``barrier.cluster`` (release,
  acquire), and each CTA reads the C pairs from its own slots into a (C_P2,) vector summed like
  the global-memory path's (the same bits). Rows alternate parities: a slot is written again
  only after the next row's barrier, which its reader reaches only after reading it.

Clusters depend on nothing outside themselves, so no cooperative launch is needed: the grid is
the number of clusters the GPU holds at once (``cuOccupancyMaxActiveClusters``; more would run
in a second wave). The interpreter has no clusters and no inline PTX: there the split-row
kernels are off anyway (``split_rows_enabled``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

from fusedops.backends.triton.runtime.caches import config_caches
from fusedops.backends.triton.runtime.launcher import (
    current_stream,
    direct_entry,
    hooks_registered,
    launch_key,
)
from fusedops.backends.triton.runtime.recording import record_launch, recording
from fusedops.backends.triton.runtime.split import split_rows_enabled

CLUSTER_STATE = {"enabled": os.environ.get("FUSEDOPS_CLUSTERS", "1") != "0"}

# Pieces per row a cluster may hold: the sizes tested on a GPU (16 is the most a Hopper cluster
# may hold, beyond the portable 8).
CLUSTER_SIZES = (2, 4, 8, 16)


def clusters_enabled(device: torch.device, n: int, chunk: int, chunks: int) -> bool:
    """Whether a split-row kernel may run rows of ``n`` in ``chunks`` pieces of ``chunk`` as
    clusters: the split-row kernels are on, the device is Hopper or newer, and C is 2, 4, 8 or
    16 (the sizes tested on a GPU; 16 is the most a Hopper cluster may hold, beyond the
    portable 8). Other piece counts (rows that are no power of two) stay cooperative."""
    if not (CLUSTER_STATE["enabled"] and chunks in CLUSTER_SIZES
            and split_rows_enabled(device, n, chunk)):
        return False
    return hopper_or_newer(device.index)


@functools.cache
def hopper_or_newer(index: int) -> bool:
    """Whether CUDA device ``index`` runs thread-block clusters (compute capability 9+)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def disable_clusters(reason: str) -> None:
    """Run split-row kernels on cooperative grids for the rest of the process (warned once)."""
    if CLUSTER_STATE["enabled"]:
        CLUSTER_STATE["enabled"] = False
        for cache in config_caches:  # launch configs (and plans) chose clusters
            cache.cache_clear()
        warnings.warn(f"fusedops: cluster split-row kernels disabled ({reason}); using "
                      "cooperative grids", RuntimeWarning, stacklevel=3)


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


def opt_in_shared(function: int, shared: int) -> None:
    """Let the loaded kernel ``function`` (a CUfunction handle) launch with ``shared`` bytes of
    dynamic shared memory, beyond the 48 KB every launch gets (Hopper: up to 227 KB)."""
    rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(function),
                                       _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    if rc != 0:
        raise RuntimeError(f"{shared} bytes of shared memory per CTA: CUresult {rc}")


class _Attr(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


def max_active_clusters(function: int, chunks: int, num_warps: int, shared: int) -> int:
    """How many clusters of ``chunks`` CTAs of the loaded kernel ``function`` (a CUfunction
    handle) the current GPU holds at once, with ``num_warps`` warps and ``shared`` bytes of
    dynamic shared memory per CTA (the driver's count: it knows how SMs group into clusters)."""
    cuda = _libcuda()
    func = ctypes.c_void_p(function)
    if chunks > 8:  # Triton's launcher allows it for 16 only; the count needs it first
        cuda.cuFuncSetAttribute(func, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    attr = _Attr()
    attr.id = _CLUSTER_DIMENSION
    attr.value[0], attr.value[1], attr.value[2] = chunks, 1, 1
    cfg = _Config()
    cfg.grid[:] = [chunks * 1024, 1, 1]
    cfg.block[:] = [32 * num_warps, 1, 1]
    cfg.smem = shared
    cfg.attrs = ctypes.pointer(attr)
    cfg.num_attrs = 1
    count = ctypes.c_int(0)
    rc = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), func, ctypes.byref(cfg))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters returned CUresult {rc}")
    return count.value


def stageable(x: torch.Tensor, y: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a staged kernel (``kernels/staging.py``) takes a call: x, y and the present
    parameters start on 16-byte boundaries (whole vectors are copied and stored), y has x's
    dtype, and the parameters share one dtype, x's or (16-bit x) float32."""
    if y.dtype != x.dtype:
        return False
    addresses = x.data_ptr() | y.data_ptr()
    kinds = set()
    for p in params:
        if p is not None:
            addresses |= p.data_ptr()
            kinds.add(p.dtype)
    return not addresses & 15 and (not kinds or kinds == {x.dtype} or (
        kinds == {torch.float32} and x.element_size() == 2))


class ClusterLauncher:
    """Launches a split-row kernel (CLUSTER mode) in clusters of C CTAs, one cluster per row at
    a time; the interface of :class:`~fusedops.backends.triton.runtime.split.SplitLauncher`.
    A kernel that lands its pieces in shared memory (``kernels/staging.py``) is launched on a
    grid of one cluster per row (``progs`` = rows x C) with those bytes as ``staged``.

    The kernel's last runtime parameter is ``num_progs`` (the CTA count, a multiple of C),
    followed only by constexprs. Each specialisation is compiled ahead (``warmup``) and always
    launched through its compiled launcher with the cluster metadata: never through Triton's
    own launch path, which would run the kernel without clusters.
    """

    __slots__ = ("kernel", "options", "entries", "n_runtime")

    def __init__(self, kernel, maxnreg: int | None = None) -> None:
        self.kernel = kernel
        self.options = {"maxnreg": maxnreg} if maxnreg else {}
        self.entries: dict = {}  # launch key -> (go, clusters held at once)
        # None under the interpreter, whose wrapper has no params (clusters never run there)
        params = getattr(kernel, "params", None)
        self.n_runtime = [p.is_constexpr for p in params].index(True) if params else 0

    def _prepare(self, args: tuple, chunks: int, num_warps: int, staged: int = 0):
        key = launch_key(num_warps, args, self.n_runtime)
        entry = self.entries.get(key)
        if entry is None:
            compiled = self.kernel.warmup(*args, grid=(1,), num_warps=num_warps, **self.options)
            compiled._init_handles()
            shared = -(-int(compiled.metadata.shared) // 16) * 16 + staged + 16 * chunks
            if shared > 48 * 1024:  # beyond what a launch gets without opting in
                opt_in_shared(compiled.function, shared)
            go = direct_entry(compiled, (num_warps, chunks, shared))
            held = max_active_clusters(compiled.function, chunks, num_warps, shared)
            if go is None or held < 1:
                raise RuntimeError("no cluster launch for this kernel")
            entry = self.entries[key] = (go, held)
        return entry

    def programs(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, vec: int = 0) -> int:
        """The CTA count: as many clusters as the GPU holds at once, at most one per row
        (``items`` = rows x chunks); 0 if no cluster launch is possible (``vec`` must be 0:
        unaligned rows stay on cooperative grids). The count comes from the kernel compiled
        with C standing in for the CTA count (the launch compiles its own specialisation, as
        SplitLauncher's estimate does; their registers, hence the count, agree)."""
        if vec:
            return 0
        try:
            _, held = self._prepare((*runtime, chunks, *consts), chunks, num_warps)
        except Exception as exc:  # noqa: BLE001 - an unknown Triton or driver API
            disable_clusters(f"{type(exc).__name__}: {exc}")
            return 0
        return min(held, items // chunks) * chunks

    def __call__(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, progs: int | None = None, vec: int = 0,
                 staged: int = 0) -> int:
        """Launch on ``progs`` CTAs (default :meth:`programs`); returns it, or 0 if the launch
        failed (clusters are then off) or a profiler's launch hooks are registered (Triton's
        own path, which they need, cannot launch clusters): the caller then uses a cooperative
        grid. ``staged``: bytes of dynamic shared memory a CTA's piece lands in
        (``kernels/staging.py``), the same for every launch of these constexprs."""
        if hooks_registered():
            return 0
        if progs is None:
            progs = self.programs(items, chunks, runtime, consts, num_warps, device, vec)
        if not progs:
            return 0
        args = (*runtime, progs, *consts)
        try:
            go, _ = self._prepare(args, chunks, num_warps, staged)
            go((progs // chunks,), current_stream(device.index), args)
        except Exception as exc:  # noqa: BLE001
            disable_clusters(f"{type(exc).__name__}: {exc}")
            return 0
        if recording:
            record_launch(self, (progs // chunks,), args, num_warps)
        return progs

    def entry(self, args: tuple, num_warps: int):
        """The launch callable for these arguments (see ``sequence_steps``), or None."""
        entry = self.entries.get(launch_key(num_warps, args, self.n_runtime))
        return entry[0] if entry else None
