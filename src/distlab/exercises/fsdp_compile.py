"""FSDP2 with torch.compile, exercise: put checkpointing, per-block compile and
sharding together."""

from __future__ import annotations

from collections.abc import Callable

from distlab.exercises._common import on_ranks, passed, require_callable

STEPS = 2


def _both(parallelize: Callable) -> tuple[dict, dict]:
    from distlab.chapters.fsdp_compile import run_order, train_with

    return train_with(parallelize, STEPS), run_order("eager", STEPS)


def check_parallelize(parallelize: Callable) -> None:
    """``parallelize(model, backend)`` checkpoints each block of the tiny GPT, compiles
    each block with ``backend``, shards each block and the root with FSDP2, and returns
    the model. Trained two steps (FSDP2 on a group of one rank: the graphs are the same
    on any number of ranks), it must compile one graph with the checkpoint inside, break
    no graph, keep the plain model's checkpoint keys (DCP's ``get_model_state_dict``,
    which drops ``_orig_mod.``), and give eager FSDP2's losses exactly."""
    require_callable(
        parallelize, "parallelize", "def parallelize(model, backend): ...; return model"
    )
    got, eager = on_ranks(
        lambda: _both(parallelize), nprocs=1, what="parallelize", timeout=120
    )[0]
    judge(got, eager)


def judge(got: dict, eager: dict) -> None:
    """Pass or fail one trained run (``train_with``'s report) against eager FSDP2's."""
    if "error" in got:
        raise AssertionError(f"training the parallelized model failed: {got['error']}")
    n_blocks = 2
    if got["fsdp_units"] != n_blocks + 1:
        raise AssertionError(
            f"{got['fsdp_units']} FSDP units, not {n_blocks + 1}: call "
            "fully_shard on each block, then on the model"
        )
    if not got["graphs"]:
        reason = (
            f" (graph breaks: {got['graph_breaks']})" if got["graph_breaks"] else ""
        )
        raise AssertionError(
            f"the backend was handed no graph: nothing was compiled{reason}"
        )
    if len(got["graphs"]) > 1:
        raise AssertionError(
            f"{len(got['graphs'])} graphs: compile each block (identical blocks "
            "share one graph)"
        )
    if not got["graphs"][0]["checkpoint_inside"]:
        raise AssertionError(
            "the graph has no checkpoint inside it: checkpoint the blocks "
            "before compiling them"
        )
    if got["graph_breaks"]:
        raise AssertionError(f"graph breaks: {got['graph_breaks']}")
    if not got["dcp_keys_as_plain_model"]:
        raise AssertionError(
            f"the checkpoint keys changed (e.g. {got['dcp_first_key']!r}): "
            "get_model_state_dict must name the parameters as the plain model does"
        )
    if got["losses"] != eager["losses"]:
        raise AssertionError(
            f"losses {got['losses']} differ from eager FSDP2's {eager['losses']}"
        )
    calls = got["graphs"][0]["calls"]
    passed(
        f"1 graph, checkpoint inside, called {calls} times in {STEPS} steps; "
        "losses equal eager FSDP2's"
    )
