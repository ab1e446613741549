"""Shared test configuration: tolerance table, float64 oracle helpers, GPU marker, backends."""

from __future__ import annotations

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

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

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


def pytest_collection_modifyitems(config, items):
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
    """Force the Triton kernels (interpreted on CPU tensors, compiled on CUDA)."""
    import fusedops

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


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


# --- kernel-test helpers (op test suites) ------------------------------------------------------


def triton_kernels_ready() -> bool:
    """True once fusedops.triton implements the row contract (not a placeholder, Triton present)."""
    try:
        from fusedops import triton as tb
    except ImportError:
        return False
    return bool(tb.AVAILABLE) and callable(getattr(tb, "softmax_forward", None))


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
    kinds (e.g. ``"softmax_fwd"``, ``"ln_bwd"``): rows of N <= limit take the single-block
    kernel, N = limit + 1 the looped one."""
    try:
        from fusedops.triton import _common
    except ImportError:
        return [default]
    base = getattr(_common, "single_block_limit", lambda: default)()
    caps = getattr(_common, "KIND_CAPS", {})
    return sorted({min(base, caps.get(kind, base)) for kind in kinds})


@pytest.fixture
def small_single_block():
    """Shrink the Triton single-block limit to 16 elements, so rows of a few dozen elements take
    the looped (chunked) kernels, several chunks per row, under the interpreter."""
    from fusedops.triton import _common

    setter = getattr(_common, "set_single_block_limit", None)
    if setter is None:
        pytest.skip("fusedops.triton has no set_single_block_limit")
    setter(16)
    try:
        yield 16
    finally:
        setter(None)


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
            from fusedops.triton import layernorm as tln
            from fusedops.triton import layernorm_epilogue as tle
            from fusedops.triton import softmax_masked as tsmm
        except ImportError:
            return
        for plans in (tln._bwd_plans, tle._fwd_plans, tle._bwd_plans, tsmm._fwd_plans,
                      tsmm._bwd_plans):
            plans.clear()


@pytest.fixture
def recording_entries(monkeypatch):
    """Replay plans on (as with Triton 3.6's C entries) for the sequence-replaying backends
    (the LayerNorm backward, the LayerNorm epilogues, the masked softmax), each entry recording
    its calls in the returned ``log`` as ("replay", grid, raw args); normal launches log
    ("normal", grid, args). Their plans are dropped afterwards."""
    from fusedops.triton import _common
    from fusedops.triton import layernorm as tln
    from fusedops.triton import layernorm_epilogue as tle
    from fusedops.triton import softmax_masked as tsmm

    log = []

    def entry(self, args, num_warps):
        def go(grid, stream, raw):
            log.append(("replay", grid, raw))
        go.raw_pointers = True
        return go

    real_call = _common.Launcher.__call__

    def spy(self, grid, args, num_warps):
        log.append(("normal", grid, args))
        return real_call(self, grid, args, num_warps)

    monkeypatch.setattr(tln, "BWD_PLANS", True)
    monkeypatch.setattr(tle, "PLANS", True)
    monkeypatch.setattr(tsmm, "PLANS", True)
    monkeypatch.setattr(_common.Launcher, "entry", entry)
    monkeypatch.setattr(_common.Launcher, "__call__", spy)
    for mod in (tln, tle, tsmm):
        monkeypatch.setattr(mod, "hooks_registered", lambda: False)
    for mod in (tln, _common):
        monkeypatch.setattr(mod, "current_stream", lambda device: ("stream", device))
    yield log
    for plans in (tln._bwd_plans, tle._fwd_plans, tle._bwd_plans, tsmm._fwd_plans,
                  tsmm._bwd_plans):
        plans.clear()


@pytest.fixture
def fake_stream(monkeypatch):
    """The Triton forwards' plan and replay paths with a stand-in stream (("stream", device))
    and no launch hooks; their plans are dropped afterwards."""
    from fusedops.triton import layernorm as tln
    from fusedops.triton import rmsnorm as trms
    from fusedops.triton import softmax as tsm

    for mod in (tsm, tln, trms):
        monkeypatch.setattr(mod, "current_stream", lambda device: ("stream", device))
        monkeypatch.setattr(mod, "hooks_registered", lambda: False)
    yield
    tsm._fwd_plans.clear()
    tln._fwd_plans.clear()
    trms._fwd_plans.clear()
