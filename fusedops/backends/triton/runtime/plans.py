"""Plan caches (single-launch plans of small calls) and replay runners of recorded launch
sequences (see ``recording.py``)."""

from __future__ import annotations

import torch

from fusedops.backends.triton.runtime.caches import config_caches
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream
from fusedops.backends.triton.runtime.recording import LaunchRecord


class PlanCache(dict):
    """Launch plans of one op's small-call path, per call signature (shapes, dtypes, device,
    scalar arguments: whatever fixes every launch argument but the tensors' addresses).

    A plan is ``(go, grid, device index, tail, rows)``: the compiled kernel's direct C entry
    (:func:`direct_entry`, one taking raw pointers), its grid, the launch arguments after the
    tensors, and the call's rows where its maker gave them. A call that finds its plan allocates
    its outputs and calls ``go`` with the tensors' addresses as ints: no launch rules, no launch
    key, no pointer checks (the dispatcher only sends CUDA tensors here, the ops layer checks
    devices). About 4 µs of host
    time per small call on an H100 host (docs/performance.md, "Small shapes").

    Plans are made only by the first call that took the normal path (and only for launches
    whose arguments the key fixes); like the launch-config caches they are cleared whenever
    :func:`set_single_block_limit` runs (tests and tuning change rules that way).
    """

    MAX_PLANS = 4096  # distinct call signatures kept; a workload cycling through more restarts

    def __init__(self, replay: dict | None = None, runner=None) -> None:
        """``runner(key, plan)``, if given, returns ``(signature, run)`` to register in the
        ``fusedops._replay`` table ``replay`` for a new plan, or None."""
        super().__init__()
        self.replay, self.runner = replay, runner
        config_caches.append(self)

    def cache_clear(self) -> None:
        self.clear()

    def clear(self) -> None:
        super().clear()
        if self.replay is not None:
            self.replay.clear()  # runners replay plans: they go with them

    def add(self, key, launcher: Launcher, grid: tuple, args: tuple, num_warps: int,
            n_tensors: int, rows: int = 0) -> None:
        """Remember the launch ``launcher(grid, args, num_warps)`` just made, whose first
        ``n_tensors`` arguments are the call's tensors (in the order plan users pass them);
        ``rows``: the call's rows, for plan users that allocate per-row outputs."""
        go = launcher.entry(args, num_warps)
        if go is None or not getattr(go, "raw_pointers", False):
            return  # no direct C entry (other Triton versions, interpreter): no plans
        if len(self) >= self.MAX_PLANS:
            self.clear()
        plan = self[key] = (go, grid, args[0].get_device(), args[n_tensors:], rows)
        made = self.runner(key, plan) if self.runner is not None and len(grid) == 1 else None
        if made is not None:
            self.replay[made[0]] = made[1]


class SequencePlans(PlanCache):
    """Replay runners per call signature (cleared like :class:`PlanCache`, and when the
    split-row kernels are disabled). A value of False marks a signature whose calls cannot be
    replayed (not recorded again)."""

    def put(self, key, plan) -> None:
        if len(self) >= self.MAX_PLANS:
            self.clear()
        self[key] = plan


def sequence_steps(record: LaunchRecord, tensors: tuple, n_inputs: int) -> tuple | None:
    """Replay steps ``(go, grid, slots, tail)`` for ``record``, or None where it cannot be
    replayed. ``tensors``: the call's inputs (the first ``n_inputs``) then its outputs, None
    where absent. Every tensor argument of a launch must be one of the inputs or outputs itself
    or lie inside an output (scratch parked there; outputs must be contiguous); it becomes a
    slot ``(index, byte offset)``, so the replay passes ``pointer[index] + offset``. Tensor
    arguments must come before all others (true of every kernel here), and each launch needs a
    direct C entry that takes raw pointers (Triton 3.6, see :func:`direct_entry`). Inputs
    sharing an address are refused: a later call of the same signature need not share it."""
    if not record.replayable:
        return None
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    given = [p for p in ptrs[:n_inputs] if p is not None]
    if len(set(given)) != len(given) or any(
            p in given for p in ptrs[n_inputs:] if p is not None):
        return None
    # Outputs are new contiguous tensors: their extent is their size. (No untyped_storage() on
    # the inputs: a storage object made for a tensor of a CUDA-graph pool confuses the liveness
    # accounting of torch.compile's CUDA graph trees.)
    ends = [None if t is None or i < n_inputs else p + t.numel() * t.element_size()
            for i, (t, p) in enumerate(zip(tensors, ptrs, strict=True))]
    steps = []
    for launcher, grid, args, num_warps in record:
        go = launcher.entry(args, num_warps)
        if go is None or not getattr(go, "raw_pointers", False):
            return None
        slots = []
        for a in args:
            if not isinstance(a, torch.Tensor):
                break
            slot = next((i for i, t in enumerate(tensors) if t is a), None)
            if slot is not None:
                slots.append((slot, 0))
                continue
            p = a.data_ptr()
            slot = next((i for i in range(n_inputs, len(tensors))
                         if ptrs[i] is not None and ptrs[i] <= p < ends[i]), None)
            if slot is None:
                return None
            slots.append((slot, p - ptrs[slot]))
        tail = args[len(slots):]
        if any(isinstance(a, torch.Tensor) for a in tail):
            return None
        steps.append((go, grid, tuple(slots), tuple(tail)))
    return tuple(steps)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What launch rules read of an optional tensor argument (shape, strides, dtype, 16-byte
    alignment), for replay plans' signatures."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() & 15


def replay_runner(record: LaunchRecord, inputs: tuple, out: tuple, scratch: tuple = (),
                  seed_at=None):
    """``run(*inputs, words=None) -> out``: allocates outputs and scratch like the call that
    produced ``out`` (and wrote the temporaries ``scratch``) and replays ``record`` with the
    new tensors' addresses; None where it cannot be replayed (see :func:`sequence_steps`).
    ``seed_at(launcher)``: for kernels that take two per-call words (a random seed), the index
    of the first among their arguments (the second follows), else None; ``run`` passes its
    ``words`` there, the recorded ones where ``words`` is None."""
    made = (*out, *scratch)
    if any(t is not None and not t.is_contiguous() for t in made):
        return None
    steps = sequence_steps(record, (*inputs, *made), len(inputs))
    if steps is None:
        return None
    split = []
    for (go, grid, slots, tail), (launcher, *_) in zip(steps, record, strict=True):
        at = None if seed_at is None else seed_at(launcher)
        if at is None:
            split.append((go, grid, slots, tail, None))
            continue
        if at < len(slots):
            return None
        at -= len(slots)
        split.append((go, grid, slots, tail[:at + 2], tail[at + 2:]))
    metas = tuple(None if t is None else (t.shape, t.dtype) for t in made)
    n_out, index = len(out), inputs[0].get_device()

    def run(*ins, words=None):
        dev = ins[0].device
        new = [None if m is None else torch.empty(m[0], dtype=m[1], device=dev) for m in metas]
        ptrs = [0 if t is None else t.data_ptr() for t in (*ins, *new)]
        stream = current_stream(index)
        for go, grid, slots, head, rest in split:
            p = [ptrs[i] + off for i, off in slots]
            if rest is None or words is None:
                go(grid, stream, (*p, *head) if rest is None else (*p, *head, *rest))
            else:
                go(grid, stream, (*p, *head[:-2], *words, *rest))
        return tuple(new[:n_out])

    run.steps = tuple(split)  # (go, grid, slots, tail, seeded tail): for host_ext.host_plan
    run.metas = metas  # ((shape, dtype) or None per output, then per scratch): host_ext.host_node
    return run


def run_steps(steps: tuple, ptrs: tuple, stream: int) -> None:
    """Launch replay ``steps`` (see :func:`sequence_steps`) with the call's tensor addresses."""
    for go, grid, slots, tail in steps:
        go(grid, stream, (*[ptrs[i] + off for i, off in slots], *tail))


def param_ptr(t, dtype, n: int, device: int) -> int:
    """The address of parameter ``t`` (weight or bias) if a replayed plan, made for a parameter
    of ``dtype`` (None: no parameter) on ``device``, can read it as it read the registering
    call's: a plain tensor or Parameter of that dtype and shape (n,), contiguous, 16-byte
    aligned, on that CUDA device; -1 otherwise (0 for no parameter)."""
    if t is None:
        return 0 if dtype is None else -1
    cls = t.__class__
    if ((cls is not torch.Tensor and cls is not torch.nn.Parameter) or t.dtype is not dtype
            or not t.is_cuda or t.get_device() != device
            or t.shape != (n,) or not t.is_contiguous()):
        return -1
    p = t.data_ptr()
    return -1 if p & 15 else p
