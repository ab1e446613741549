"""Recorded launch sequences.

A call whose results come from kernel launches alone (its outputs allocated, scratch parked
inside them) can be replayed from its launches: the same grids and scalar arguments, the
pointers moved to the new call's tensors. The LayerNorm backward does this (three to five
launches and their planning cost 40-110 µs of Python per call on a fast CPU, several times that
on slower GPU hosts: as much as the kernels' GPU time at 2^27 elements).
"""

from __future__ import annotations

import contextlib
import threading

# The LaunchRecord being filled per thread (record_launches): the autograd engine runs CUDA
# backward functions on one worker thread per device, so two recordings can overlap, and each
# must see its own thread's launches only. Empty (the usual case): one falsy check per launch.
recording: dict = {}


class LaunchRecord(list):
    """``(launcher, grid, args, num_warps)`` of each launch made while recording, in order.
    ``replayable`` is set (:func:`mark_replayable`) by a code path whose results come from these
    launches alone: anything else (torch operations, a fallback) leaves it False."""

    replayable = False


def record_launch(launcher, grid, args, num_warps) -> None:
    record = recording.get(threading.get_ident())
    if record is not None:
        record.append((launcher, grid, args, num_warps))


@contextlib.contextmanager
def record_launches():
    """``with record_launches() as record:`` collects the :class:`Launcher` launches this thread
    makes in the block (after each launch returns: a launch that raised is not in it). A
    recording inside another one gets its own block's launches; the outer one gets them too,
    in order (a call that records its own plan inside a recorded call is still part of it)."""
    me = threading.get_ident()
    outer = recording.get(me)
    record = recording[me] = LaunchRecord()
    try:
        yield record
    finally:
        if outer is None:
            del recording[me]
        else:
            outer.extend(record)
            recording[me] = outer


def mark_replayable() -> None:
    """Called by a code path whose results come from its launches alone (see LaunchRecord)."""
    record = recording.get(threading.get_ident()) if recording else None
    if record is not None:
        record.replayable = True
