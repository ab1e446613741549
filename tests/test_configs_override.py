"""configs.override: the one way to change the Triton backend's launch rules (docs/design.md,
"Where things live"). Rules change where the host code reads them, only for the named op, and
come back (with caches and plans dropped) when the block ends."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from fusedops.backends.triton import configs, layernorm_bwd  # noqa: E402
from fusedops.backends.triton.configs import common  # noqa: E402
from fusedops.backends.triton.configs import layernorm as ln_rules  # noqa: E402
from fusedops.backends.triton.configs import rmsnorm as rms_rules  # noqa: E402
from fusedops.backends.triton.runtime import split  # noqa: E402


def test_override_changes_the_op_where_its_host_reads_it_and_restores():
    table, plans, warps = ln_rules.RELOAD_FWD, layernorm_bwd.BWD_PLANS, layernorm_bwd.COLUMN_WARPS
    with configs.override("layernorm", RELOAD_FWD={}, COLUMN_PER_SM=3, BWD_PLANS=True,
                          COLUMN_WARPS=8):
        assert ln_rules.RELOAD_FWD == {}
        assert layernorm_bwd.BWD_PLANS is True and layernorm_bwd.COLUMN_WARPS == 8
        assert ln_rules.COLUMN_PER_SM == 3
        assert rms_rules.COLUMN_PER_SM == 2  # another op's rule of the same name and value
    assert ln_rules.RELOAD_FWD is table and layernorm_bwd.COLUMN_WARPS == warps
    assert layernorm_bwd.BWD_PLANS is plans and ln_rules.COLUMN_PER_SM == 2


def test_override_switches_and_errors():
    enabled = split.SPLIT_STATE["enabled"]
    with configs.override(SINGLE_BLOCK_LIMIT=64, SPLIT_ROWS=not enabled, ROW_BODY=False):
        assert common.single_block_limit() == 64
        assert split.SPLIT_STATE["enabled"] is (not enabled)
        assert common.ROW_BODY["enabled"] is False
    assert common.single_block_limit() == common.DEFAULT_SINGLE_BLOCK_LIMIT
    assert split.SPLIT_STATE["enabled"] is enabled and common.ROW_BODY["enabled"] is True
    with pytest.raises(ValueError, match="name the op"):
        with configs.override(UNROLLED_FWD={}):
            pass
    with pytest.raises(ValueError, match="no rule"):
        with configs.override("softmax", NOT_A_RULE=1):
            pass
    with pytest.raises(ValueError, match="power of two"):
        with configs.override(SINGLE_BLOCK_LIMIT=100):
            pass
    assert common.single_block_limit() == common.DEFAULT_SINGLE_BLOCK_LIMIT
