"""Swap the fused ops into an existing model, reversibly, and report what changed.

See :mod:`fusedops.patching.api` for how, and ``docs/patching.md`` for the user's view.
"""

from fusedops.patching.api import is_patched, patch_model, patched, unpatch_model
from fusedops.patching.report import PatchReport

__all__ = ["PatchReport", "is_patched", "patch_model", "patched", "unpatch_model"]
