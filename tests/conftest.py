"""Shared test configuration: tolerance table, float64 oracle helpers, GPU marker, backends."""

from __future__ import annotations

import functools
import os

# The Triton kernels run on CPU tensors through the interpreter; this must be set before Triton
# is imported anywhere.
if "TRITON_INTERPRET" not in os.environ:
    # Interpreter on machines without CUDA only: on a GPU machine the compiled kernels are tested.
    import importlib.util

    _has_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch as _torch

        _has_cuda = _torch.cuda.is_available()
    os.environ["TRITON_INTERPRET"] = "0" if _has_cuda else "1"

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

if os.environ["TRITON_INTERPRET"] not in ("", "0"):
    # CPU runs: every tensor here is small, and two test processes share two cores (pytest -n 2):
    # intra-op threads only add wake-ups and spinning (more than twice the CPU time of one
    # thread). One thread per test process; subprocesses the tests start inherit it.
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")
    torch.set_num_threads(1)

# One tolerance table for every test: (atol, rtol) against a float64 reference.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float64: (1e-10, 1e-10),
}


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """kwargs for torch.testing.assert_close; ``scale`` widens both (for sums of N terms)."""
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol * scale, "rtol": rtol * scale}


def assert_close_to_ref(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype,
                        scale: float = 1.0) -> None:
    """Compare ``actual`` with a float64 reference: the reference is first rounded to the output
    dtype (the best any kernel can do), then compared with the shared tolerance."""
    expected = expected64.to(actual.dtype).to(torch.float64)
    torch.testing.assert_close(actual.to(torch.float64), expected, **tol(dtype, scale))


def assert_row_sum_close(actual: torch.Tensor, expected64: torch.Tensor, rows: int,
                         scale: float = 1.0) -> None:
    """A quantity summed over ``rows`` rows (dweight, dbias) against its float64 reference, with
    the tolerance of ``actual``'s own dtype (the parameter gradient's, not the input's). Such
    sums are accumulated in float32, whose rounding error grows like sqrt(rows): float32 (and
    float64) results get that factor; 16-bit results are dominated by their final rounding
    (the reference is rounded to their dtype first), so they keep the plain scale."""
    if actual.dtype in (torch.float32, torch.float64):
        scale *= max(rows, 1) ** 0.5
    assert_close_to_ref(actual, expected64, actual.dtype, scale)


# --- the extended matrix -------------------------------------------------------------------------
# The default run (the README's command) keeps at least one case of every feature and kernel
# path; the full cross-products and the slow interpreted cases (long rows, most 16-bit cases,
# spawned processes) carry the ``exhaustive`` marker and run in CI's second step
# (``-m exhaustive``: only them) or with ``--exhaustive`` (all).
EXHAUSTIVE = pytest.mark.exhaustive


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the tests marked exhaustive (the full cross-product "
                          "matrices); -m exhaustive runs only them")


def exhaustive_unless(keep):
    """Decorator for a parametrized test: the cases for which ``keep(**params)`` is false (params:
    the case's parameters, fixture parameters included) are marked ``exhaustive`` (except
    ``gpu`` cases). The test ids stay those of the plain parametrization."""

    def mark(fn):
        fn.exhaustive_unless = keep
        return fn

    return mark


def one_of_each(axes: dict, *extra: dict, where=None):
    """A ``keep`` for :func:`exhaustive_unless`: the diagonal of the cross product, case k
    taking value k of every axis (shorter axes cycling), so every value of every axis runs at
    least once by default; ``extra`` dicts name further cases to keep (each a partial
    assignment that must match). Axis names are parameter names; a key "m,n" stands for
    parameters parametrized together (its values are tuples). ``where``: a further condition
    (called with the case's parameters as keywords) that a kept case must also meet."""
    width = max(len(v) for v in axes.values())
    diagonal = [{name: values[k % len(values)] for name, values in axes.items()}
                for k in range(width)]

    def fields(case: dict, params: dict) -> bool:
        for name, value in case.items():
            keys = name.split(",")
            got = tuple(params[k] for k in keys) if len(keys) > 1 else params[keys[0]]
            if got != value:
                return False
        return True

    def keep(**params) -> bool:
        return (where is None or bool(where(**params))) and any(
            fields(case, params) for case in (*diagonal, *extra))

    return keep


def _runs_exhaustive(config) -> bool:
    return config.getoption("--exhaustive") or "exhaustive" in (config.getoption("-m") or "")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        keep = getattr(getattr(item, "function", None), "exhaustive_unless", None)
        callspec = getattr(item, "callspec", None)
        # (gpu cases stay: compiled kernels are quick, and -m gpu is how GPU runs select)
        if keep is not None and callspec is not None and not item.get_closest_marker("gpu") \
                and not keep(**callspec.params):
            item.add_marker(EXHAUSTIVE)
    if not _runs_exhaustive(config):
        extended = [item for item in items if item.get_closest_marker("exhaustive")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_run_the_kernels(request):
    """GPU tests exercise the Triton kernels at the small shapes tests use, which the size rule
    (``fusedops._dispatch.NATIVE_BELOW``) would send to PyTorch's ops: the backend is forced for
    them, unless a test is marked ``auto_backend`` (it tests automatic selection itself)."""
    if HAS_CUDA and "gpu" in request.keywords and "auto_backend" not in request.keywords:
        import fusedops

        with fusedops.use_backend("triton"):
            yield
    else:
        yield


@pytest.fixture
def triton_backend():
    """Force the Triton kernels (interpreted on CPU tensors, compiled on CUDA); skips where
    Triton is not installed (macOS)."""
    import fusedops

    if not triton_kernels_ready():
        pytest.skip("Triton is not installed here")
    with fusedops.use_backend("triton"):
        yield


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture
def triton_on_cpu(triton_backend):
    """The Triton kernels on CPU tensors: only through the interpreter. On a GPU machine (compiled
    Triton, which cannot take CPU tensors) these tests skip; their CUDA counterparts are the
    ``gpu``-marked tests (e.g. test_gpu_hf_eager_triton, test_gpu_patched_*)."""
    if not INTERPRETING:
        pytest.skip("CPU tensors need the Triton interpreter; CUDA variants cover this here")
    yield


@functools.cache
def _metal_lib():
    emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")
    return emu.load()


@pytest.fixture
def metal_lib():
    """The shipped Metal shaders compiled for the CPU emulation (tests/metal_emu; built once,
    cached on disk), loaded once per test process."""
    return _metal_lib()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


# --- kernel-test helpers (op test suites) ------------------------------------------------------


def triton_backend_module():
    """The Triton backend module for a test file that calls its kernels directly; skips the
    whole file where it cannot run them (Triton missing, or CPU tensors without the
    interpreter). Call at module level: ``tb = triton_backend_module()``."""
    pytest.importorskip("triton")
    from fusedops.backends import triton as tb

    if not tb.AVAILABLE:
        pytest.skip("Triton not available", allow_module_level=True)
    if not HAS_CUDA and not INTERPRETING:
        pytest.skip("CPU tensors need the Triton interpreter", allow_module_level=True)
    return tb


def triton_kernels_ready() -> bool:
    """True where Triton is installed (every Linux install; not macOS): the Triton backend then
    implements the whole row contract, so a missing entry point fails a test, not skips it."""
    from fusedops.backends import triton as tb

    return bool(tb.AVAILABLE)


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """Run a test on the PyTorch reference, then on the Triton kernels (interpreted on CPU)."""
    import fusedops

    if request.param == "triton" and not triton_kernels_ready():
        pytest.skip("Triton kernels not available")
    with fusedops.use_backend(request.param):
        yield request.param


def single_block_limits(*kinds: str, default: int = 65536) -> list[int]:
    """The Triton single-block/looped switch points (padded row length) for the given kernel
    kinds (e.g. ``"softmax_fwd"``, ``"ln_bwd"``), for 16-bit and float32 rows: rows of
    N <= limit take the single-block kernel, N = limit + 1 the looped one. ``default`` where
    Triton is not installed (macOS: the reference path only)."""
    from fusedops.backends import triton as tb

    if not tb.AVAILABLE:
        return [default]
    from fusedops.backends.triton.configs import common as tcfg

    base = tcfg.single_block_limit()
    return sorted({min(base, tcfg._cap(kind, elt)) for kind in kinds for elt in (2, 4)})


@pytest.fixture
def small_single_block():
    """Shrink the Triton single-block limit to 16 elements, so rows of a few dozen elements take
    the looped (chunked) kernels, several chunks per row, under the interpreter."""
    from _reliability import single_block_limit

    with single_block_limit(16):
        yield 16


@pytest.fixture(params=["single-block", "looped"])
def single_block_or_looped(request):
    """Run a test with the default single-block limit, then with it shrunk to 16 elements (the
    looped kernels, as ``small_single_block``); yields the variant's name."""
    from _reliability import single_block_limit

    with single_block_limit(16 if request.param == "looped" else None):
        yield request.param


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from torch's generator seeded with 0, whatever ran before it in the
    process (pytest -n distributes tests differently from run to run); tests that want other
    data seed on their own."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _tensors_on_device(request):
    """Kernel suites (modules that set ``ON_DEVICE = True``) create their tensors on the GPU when
    there is one, so the same tests drive the compiled kernels there; on CPU nothing changes."""
    if not HAS_CUDA or not getattr(request.module, "ON_DEVICE", False):
        yield
        return
    torch.set_default_device("cuda")
    try:
        yield
    finally:
        torch.set_default_device(None)  # None also pops torch's default-device mode


@pytest.fixture(autouse=True)
def _fresh_backward_plans():
    """LayerNorm backward replay plans (recorded on GPUs with Triton 3.6) are dropped after each
    test, so that launch rules or launchers a later test monkeypatches are not bypassed by a
    plan recorded before."""
    yield
    if HAS_CUDA:
        try:
            from fusedops.backends.triton import layernorm_bwd as tlnb
            from fusedops.backends.triton import layernorm_epilogue as tle
            from fusedops.backends.triton import softmax_masked as tsmm
        except ImportError:
            return
        for plans in (tlnb._bwd_plans, tle._fwd_plans, tle._bwd_plans, tsmm._fwd_plans,
                      tsmm._bwd_plans):
            plans.clear()


def require_replay_plans(enabled: bool = True) -> None:
    """Skip a replay test where no call can replay: it would only compare the normal path with
    itself. Plans need compiled kernels (a CUDA GPU), Triton's C launch entries
    (``rt_launcher._C_ENTRY_VERSIONS``) and the module's plan switch (``enabled``) on."""
    import triton

    from fusedops.backends.triton.runtime import device as rt_device
    from fusedops.backends.triton.runtime import launcher as rt_launcher

    if not torch.cuda.is_available() or rt_device.interpreting():
        pytest.skip("replay plans need compiled kernels on a CUDA GPU")
    if not triton.__version__.startswith(rt_launcher._C_ENTRY_VERSIONS):
        pytest.skip(f"replay plans need Triton's C launch entries "
                    f"({', '.join(rt_launcher._C_ENTRY_VERSIONS)}x); Triton {triton.__version__} "
                    "runs every call on the normal path, which this test would compare with "
                    "itself")
    if not enabled:
        pytest.skip("replay plans are switched off here (the module's PLANS flag)")


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so that each call appends its arguments to the returned list (the
    replay tests count the calls that took the normal path)."""
    real = getattr(module, name)
    calls: list = []

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def relative_args(args, bases) -> tuple:
    """A launch's arguments with each tensor or raw address (host addresses are above 2^40)
    as (base index, byte offset) inside one of ``bases`` (the call's inputs and outputs), or
    "scratch" for the call's own temporaries; the other arguments as given. A base spans its
    storage from its first element: an expanded tensor's numel would overstate its memory and
    claim a tensor allocated right after it."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.data_ptr()
        elif not (isinstance(a, int) and a > 1 << 40):
            out.append(a)
            continue
        out.append(next(((i, a - t.data_ptr()) for i, t in enumerate(bases) if t is not None
                         and t.data_ptr() <= a
                         < t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()),
                        "scratch"))
    return tuple(out)


@pytest.fixture
def recording_entries(monkeypatch, launch_rules):
    """Replay plans on (as with Triton 3.6's C entries) for the sequence-replaying backends
    (the LayerNorm backward, the LayerNorm epilogues, the masked softmax), each entry recording
    its calls in the returned ``log`` as ("replay", grid, raw args); normal launches log
    ("normal", grid, args). Their plans are dropped afterwards."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton import layernorm_epilogue as tle
    from fusedops.backends.triton import softmax_masked as tsmm
    from fusedops.backends.triton.runtime import launcher as rt_launcher
    from fusedops.backends.triton.runtime import plans as rt_plans

    log = []

    def entry(self, args, num_warps):
        def go(grid, stream, raw):
            log.append(("replay", grid, raw))
        go.raw_pointers = True
        return go

    real_call = rt_launcher.Launcher.__call__

    def spy(self, grid, args, num_warps):
        log.append(("normal", grid, args))
        return real_call(self, grid, args, num_warps)

    launch_rules("layernorm", BWD_PLANS=True)
    launch_rules("layernorm_epilogue", PLANS=True)
    launch_rules("softmax_masked", PLANS=True)
    monkeypatch.setattr(rt_launcher.Launcher, "entry", entry)
    monkeypatch.setattr(rt_launcher.Launcher, "__call__", spy)
    for mod in (tln, tlnb, tle, tsmm):
        monkeypatch.setattr(mod, "hooks_registered", lambda: False)
    for mod in (tln, tlnb, rt_launcher, rt_plans):
        monkeypatch.setattr(mod, "current_stream", lambda device: ("stream", device))
    yield log
    for plans in (tlnb._bwd_plans, tle._fwd_plans, tle._bwd_plans, tsmm._fwd_plans,
                  tsmm._bwd_plans):
        plans.clear()


@pytest.fixture
def fake_stream(monkeypatch):
    """The Triton forwards' plan and replay paths with a stand-in stream (("stream", device))
    and no launch hooks; their plans are dropped afterwards."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import rmsnorm as trms
    from fusedops.backends.triton import softmax as tsm

    for mod in (tsm, tln, trms):
        monkeypatch.setattr(mod, "current_stream", lambda device: ("stream", device))
        monkeypatch.setattr(mod, "hooks_registered", lambda: False)
    yield
    tsm._fwd_plans.clear()
    tln._fwd_plans.clear()
    trms._fwd_plans.clear()


@pytest.fixture
def launch_rules():
    """``launch_rules(op, **rules)``: ``fusedops.backends.triton.configs.override(op, **rules)``
    for the rest of the test (rules restored, caches and plans dropped, at teardown)."""
    from fusedops.backends.triton import configs

    with contextlib.ExitStack() as stack:
        yield lambda *op, **rules: stack.enter_context(configs.override(*op, **rules))


def forced_split_config(fwd, bwd):
    """A ``split_config`` rule giving ``fwd`` / ``bwd`` whatever the row (for overrides)."""
    return lambda kind, *args, **kwargs: fwd if kind == "fwd" else bwd


def ln_backward_vec(x: torch.Tensor, dy: torch.Tensor) -> int:
    """VEC of a LayerNorm backward on (M, N) rows of x and dy (configs.common.unaligned_vec, as
    the host computes it), for the LayerNorm backward rules that take it."""
    from fusedops.backends.triton.configs import common

    n = x.shape[1]
    return common.unaligned_vec(n, (dy.stride(0), x.stride(0), n), x.element_size(), (dy, x))
