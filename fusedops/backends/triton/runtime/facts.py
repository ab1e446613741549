"""What the launch rules know of a device: :class:`DeviceFacts`, an argument of every
``configs.<op>.forward_config`` / ``backward_config`` (which read no device themselves)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusedops.backends.triton.runtime.clusters import CLUSTER_STATE, hopper_or_newer
from fusedops.backends.triton.runtime.device import device_name, interpreting, num_sms
from fusedops.backends.triton.runtime.split import SPLIT_STATE


class DeviceFacts(NamedTuple):
    """The device a call runs on, as the launch rules see it."""

    cuda: bool  # a CUDA GPU (False: CPU tensors, run by the Triton interpreter)
    num_sms: int  # streaming multiprocessors (a small constant on the CPU)
    name: str  # the GPU's name ("" on the CPU): per-GPU rule tables match parts of it
    split_rows: bool  # the cooperative split-row kernels may run (compiled, not turned off)
    clusters: bool  # ... and also as thread-block clusters (Hopper or newer, not turned off)


_CPU = torch.device("cpu")


def device_facts(index: int) -> DeviceFacts:
    """The facts of CUDA device ``index`` (-1: the CPU), read now. Host files memoize configs
    per device index; the switches read here (``SPLIT_ROWS``, ``CLUSTERS``) clear those memos
    when they change."""
    if index < 0:
        return DeviceFacts(False, num_sms(_CPU), "", False, False)
    split = SPLIT_STATE["enabled"] and not interpreting()
    return DeviceFacts(True, num_sms(torch.device("cuda", index)), device_name(index), split,
                       split and CLUSTER_STATE["enabled"] and hopper_or_newer(index))
