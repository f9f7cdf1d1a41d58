"""``init_distributed``'s per-attempt store prefix is safe on one node only: with
torchrun restarts on several nodes, rank 0 warns and names the fix (pytorch#135712)."""

import pytest

from distlab.runtime import multi_node_restart_warning


@pytest.mark.parametrize(
    "env",
    [
        {},  # not under torchrun
        {"GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "3"},  # one node
        {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "0"},  # no restarts
    ],
)
def test_no_warning_where_the_prefix_is_safe(env):
    assert multi_node_restart_warning(env) == ""


def test_restarts_on_several_nodes_are_warned_with_the_fix():
    env = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    warning = multi_node_restart_warning(env)
    assert "2 nodes" in warning and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
