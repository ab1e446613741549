"""Developer probe (GPU): where a split-row kernel's time goes. Times the shipped kernel next
to copies of its module with the cross-program synchronisation taken out (results then wrong;
only the time matters): ``nowait`` publishes but never waits for its row's other pieces,
``nosync`` neither publishes nor waits. If ``nowait`` is much faster, the wait is on the
critical path; if not, the kernel is bound by its own loads and arithmetic.

Usage: OUT=dir python benchmarks/dev/split_anatomy.py  (writes $OUT/split_anatomy.json)"""

import importlib.util
import json
import os
import pathlib
import tempfile

import torch
import triton
from triton.testing import do_bench

from fusedops.triton import _common
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm

TOTAL = 1 << 27
NAME = torch.cuda.get_device_properties(0).name
src = torch.empty(TOTAL * 2, dtype=torch.float32, device="cuda")
dst = torch.empty_like(src)
COPY = 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9
del src, dst
print(NAME, torch.__version__, triton.__version__, f"copy {COPY:.3f} TB/s", flush=True)
TMP = pathlib.Path(tempfile.mkdtemp())
EDITS = {"nowait": [("await_row(count_ptr, row, C)", "pass")],
         "nosync": [("await_row(count_ptr, row, C)", "pass"),
                    ("publish_row(count_ptr, row)", "pass")]}


def variant(mod, name):
    """A copy of module ``mod`` with EDITS[name] applied to its source."""
    text = pathlib.Path(mod.__file__).read_text()
    for old, new in EDITS[name]:
        assert old in text, old
        text = text.replace(old, new)
    path = TMP / f"{mod.__name__.rsplit('.', 1)[-1]}_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


mods = {"ln": {"base": tln}, "sm": {"base": tsm}}
for name in EDITS:
    mods["ln"][name] = variant(tln, name)
    mods["sm"][name] = variant(tsm, name)

records = []


def run(op, dt, N, cfg):
    M = TOTAL // N
    x = torch.randn(M, N, device="cuda", dtype=dt)
    elt = x.element_size()
    res = {}
    for vname in ("base", "nowait", "nosync"):
        if op == "ln_bwd":
            m = mods["ln"][vname]
            m.SPLIT_BWD_CONFIG = cfg
            w = torch.randn(N, device="cuda", dtype=dt)
            dy = torch.randn_like(x)
            _, mean, rstd = tln.layernorm_forward(x, w, w, 1e-5, dt)
            fn = lambda: m.layernorm_backward(dy, x, w, mean, rstd, True, True, True)  # noqa: E731
            nbytes = 3 * M * N * elt
        elif op == "ln_fwd":
            m = mods["ln"][vname]
            m.SPLIT_CONFIG = cfg
            w = torch.randn(N, device="cuda", dtype=dt)
            fn = lambda: m.layernorm_forward(x, w, w, 1e-5, dt)  # noqa: E731
            nbytes = 2 * M * N * elt
        else:
            m = mods["sm"][vname]
            m.SPLIT_CONFIG["fwd"] = cfg
            fn = lambda: m.softmax_forward(x, dt)  # noqa: E731
            nbytes = 2 * M * N * elt
        fn()
        res[vname] = nbytes / do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e9
        records.append(dict(op=op, dtype=str(dt)[6:], N=N, cfg=cfg, variant=vname,
                            tbps=res[vname], frac_copy=res[vname] / COPY))
    print(f"{op} {str(dt)[6:]:8s} N={N:6d} {cfg}: " + "  ".join(
        f"{k} {v:.2f} ({v / COPY:.2f})" for k, v in res.items()), flush=True)


bf, f32 = torch.bfloat16, torch.float32
run("ln_bwd", bf, 32768, (8192, 8, 3))
run("ln_bwd", bf, 32768, (4096, 8, 3, 1))
run("ln_bwd", bf, 131072, (8192, 16, 1))
run("ln_bwd", f32, 32768, (2048, 4, 0))
run("sm_fwd", bf, 131072, (8192, 8, 3))
run("sm_fwd", f32, 131072, (8192, 8, 1))
run("ln_fwd", bf, 131072, (8192, 8, 1))
run("ln_fwd", bf, 65536, (8192, 8, 3))
# softmax forward 16-bit 64K runs single-block (0.76 of copy): on split rows instead
_common.KIND_CAPS["softmax_fwd"] = 32768
_common.set_single_block_limit(_common.single_block_limit())  # clears the config caches
run("sm_fwd", bf, 65536, (8192, 8, 3))
run("sm_fwd", bf, 65536, (4096, 4, 3))
with open(os.path.join(os.environ.get("OUT", "."), "split_anatomy.json"), "w") as f:
    json.dump({"device": NAME, "torch": torch.__version__, "triton": triton.__version__,
               "copy_tbps": COPY, "records": records}, f, indent=1)
