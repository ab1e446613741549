"""Host cost of the ways to launch one compiled Triton kernel (CUDA only, Triton 3.6 ABI).

For softmax forward (64x768 fp16) and LayerNorm forward (same shape), with buffers ready:
our Launcher, its cache key alone, Triton's runner (``compiled.run``), Triton's C launcher
called directly (``compiled.run.launch``: no Python wrapper, tensors or raw pointers), and
``cuLaunchKernel`` through ctypes with the parameters packed into a preallocated buffer. Each
variant's output is checked against torch first. Prints a table; ``--json`` writes it.

    python benchmarks/dev/launch_paths.py --json out/launch_paths.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import struct

import torch
import triton
from host_breakdown import per_call_us  # same folder: run as a script

from fusedops.triton import _common
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm

_FORMATS = {"i32": "i4x", "i64": "q", "i1": "b7x", "fp32": "f4x", "u32": "I4x", "u64": "Q"}


class CtypesLaunch:
    """cuLaunchKernel with every parameter in an 8-byte slot of one preallocated buffer."""

    lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL stays held (the buffer is shared)
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int

    def __init__(self, compiled, n_runtime: int) -> None:
        compiled._init_handles()
        sig = list(compiled.src.signature.values())[:n_runtime]
        self.index = [i for i, ty in enumerate(sig) if ty != "constexpr"]
        self.ptr = [sig[i][0] == "*" for i in self.index]
        self.fmt = "=" + "".join("Q" if sig[i][0] == "*" else _FORMATS[sig[i]] for i in self.index)
        n = len(self.index) + 2  # + global and profile scratch pointers (Triton 3.6 ABI)
        self.buf = ctypes.create_string_buffer(8 * n)
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * n)(*[base + 8 * k for k in range(n)])
        self.function = compiled.function
        self.block = 32 * compiled.metadata.num_warps
        self.shared = compiled.metadata.shared
        self.sig = sig

    def __call__(self, grid: int, args: tuple, stream: int) -> None:
        vals = [args[i].data_ptr() if p else args[i]
                for i, p in zip(self.index, self.ptr, strict=True)]
        struct.pack_into(self.fmt, self.buf, 0, *vals)
        err = self.fn(self.function, grid, 1, 1, self.block, 1, 1, self.shared, stream,
                      self.params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel: {err}")


def variants(name, kernel, launcher, grid, args, warps, check):
    n = launcher.n_runtime
    compiled = kernel[(grid,)](*args, num_warps=warps)
    compiled._init_handles()
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
    stream = _common.current_stream(0)
    launch = run.launch
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    ptrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    ct = CtypesLaunch(compiled, n)
    keyfn = _common._key_function(args, n)
    out = {}
    old_cache = {_common._launch_key(warps, args, n): (run, fn, meta)}

    def old_launcher():  # the eighth session's Launcher.__call__ (generic key, Triton's runner)
        key = _common._launch_key(warps, args, n)
        entry = old_cache.get(key)
        if entry is not None and not _common.hooks_registered():
            r, f, m = entry
            g = ((grid,) + (1, 1))
            r(g[0], g[1], g[2], _common.current_stream(key[0]), f, m, None, None, None, *args)

    cases = {
        "Launcher (key + run)": lambda: launcher((grid,), args, warps),
        "previous Launcher": old_launcher,
        "launch key only": lambda: _common._launch_key(warps, args, n),
        "generated key only": lambda: keyfn(warps, args),
        "compiled.run (tensors)": lambda: run(grid, 1, 1, stream, fn, meta, None, None, None,
                                              *args),
        "run.launch (tensors)": lambda: launch(grid, 1, 1, stream, fn, coop, pdl, None, None,
                                               meta, None, None, None, *args),
        "run.launch (ints ready)": lambda: launch(grid, 1, 1, stream, fn, coop, pdl, None, None,
                                                  meta, None, None, None, *ptrs),
        "run.launch (data_ptr per call)": lambda: launch(
            grid, 1, 1, stream, fn, coop, pdl, None, None, meta, None, None, None,
            *[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]),
        "ctypes cuLaunchKernel": lambda: ct(grid, args, stream),
    }
    for label, f in cases.items():
        if "key only" not in label:
            check(f)
        out[label] = per_call_us(f)
    out["signature"] = str(ct.sig)
    return out


class _Counting:
    """Stands in for a JIT kernel: counts the launches that went through Triton."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


def unaligned_rows() -> dict:
    """Host time of the shifted weight copies, launches that missed the direct path, and wall
    time per call of the two forward paths for 16-bit rows of 8193 (reload kernel + copies vs
    the single-block kernel) as the batch grows."""
    n = 8193
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = {"shifted weights": per_call_us(lambda: tln._shifted_weights(w, w, 8, n))}
    counters = []
    for name in ("_launch_shift_weights", "_launch_fwd_reload_vec", "_launch_fwd_single"):
        launcher = getattr(tln, name)
        launcher.kernel = _Counting(launcher.kernel)
        counters.append((name, launcher))
    for m in (2, 64, 512, 2048, 8192):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for label, rules in (("reload", dict(tln.RELOAD_VEC_FWD)), ("single", {})):
            saved = tln.RELOAD_VEC_FWD
            tln.RELOAD_VEC_FWD = rules
            try:
                out[f"{m} rows {label}"] = per_call_us(
                    lambda x=x: tln.layernorm_forward(x, w, w, 1e-5, torch.bfloat16),
                    calls=300 if m >= 2048 else 2000)
            finally:
                tln.RELOAD_VEC_FWD = saved
    for name, launcher in counters:
        out[f"{name}: Triton-path launches"] = float(launcher.kernel.calls)
        launcher.kernel = launcher.kernel.kernel
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 768, device="cuda", dtype=torch.float16)
    M, N = x.shape
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "cases": {}}
    with torch.no_grad():
        y = torch.empty_like(x)
        single, block, rows, warps = _common.row_config(N, "softmax_fwd", 2)
        tiles = _common.cdiv(M, rows)
        args = (x, y, M, N, N, N, tiles, tiles, block, rows, 0)

        def check_sm(f):
            y.zero_()
            f()
            torch.testing.assert_close(y, torch.softmax(x, -1))

        sm = variants("softmax", tsm._softmax_fwd_single, tsm._launch_fwd_single, tiles, args,
                      warps, check_sm)
        sm["torch.softmax"] = per_call_us(lambda: torch.softmax(x, -1))
        sm["torch.empty_like"] = per_call_us(lambda: torch.empty_like(x))
        sm["fused_softmax"] = per_call_us(lambda: __import__("fusedops").fused_softmax(x))
        res["cases"]["softmax 64x768 fp16"] = sm

        w = torch.randn(N, device="cuda", dtype=x.dtype)
        b = torch.randn(N, device="cuda", dtype=x.dtype)
        single, block, rows, warps, vec = _common.unaligned_config(N, "ln_fwd", 2, 0)
        tiles = _common.num_row_tiles(M, rows, 0)
        progs = _common.grid_size(tiles, warps, "ln_fwd", x.device, block, 0, False)
        args = (x, w, b, y, y, y, M, N, N, N, 1e-5, tiles, progs, block, rows, True, True, 0,
                tln._hold_w(block, warps), False)

        def check_ln(f):
            y.zero_()
            f()
            torch.testing.assert_close(
                y, torch.nn.functional.layer_norm(x, (N,), w, b), atol=2e-2, rtol=2e-2)

        ln = variants("layernorm", tln._ln_fwd_single, tln._launch_fwd_single, progs, args,
                      warps, check_ln)
        ln["F.layer_norm"] = per_call_us(lambda: torch.nn.functional.layer_norm(x, (N,), w, b))
        ln["fused_layernorm"] = per_call_us(
            lambda: __import__("fusedops").fused_layernorm(x, (N,), w, b))
        res["cases"]["layernorm 64x768 fp16"] = ln
        res["cases"]["unaligned 8193 bf16"] = unaligned_rows()
    for case, vals in res["cases"].items():
        print(case, vals.pop("signature", ""))
        for k, v in vals.items():
            print(f"  {v:7.2f} us  {k}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
