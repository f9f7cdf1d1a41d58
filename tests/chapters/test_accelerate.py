"""What book/accelerate.md does not run: the fingerprint's sensitivity, lab 6's choice
of mixed precision and plugin fields, lab 6's sharded model saved and resumed in
Accelerate's FSDP2 mode, and the exercise checker catching wrong answers. The page
asserts what it runs (without cpu=True, the FSDP plugin on CPU, accumulate, the FSDP2
setups, the launchers' refusals)."""

import contextlib
import os

import pytest
import torch

from distlab.accel import fsdp2_plugin, mixed_precision_for
from distlab.chapters import accelerate as demos
from distlab.exercises import check_skips_sync
from distlab.infra.launch import run_ranks
from distlab.model import GPT, preset
from distlab.parallel import no_gradient_sync


def test_fingerprint_tells_equal_weights_from_different_ones():
    a, b = GPT(preset("tiny"), seed=0), GPT(preset("tiny"), seed=0)
    assert demos.fingerprint(a) == demos.fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1e-6  # the tied matrix: one element of one parameter
    assert demos.fingerprint(a) != demos.fingerprint(b)


# ------------------------------------------------------------ FSDP2 mode (items 19, 20)
def test_lab_6_asks_accelerate_for_autocast_only_without_fsdp_and_its_plugin_ignores_fsdp_variables(  # noqa: E501
    monkeypatch,
):
    assert [
        mixed_precision_for(d, f) for d in ("fp32", "bf16") for f in (False, True)
    ] == ["no", "no", "bf16", "no"]
    # a launcher's FSDP_* variables fill every field left unset: lab 6 sets those that
    # would change the model
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    plugin = fsdp2_plugin()
    assert (
        plugin.fsdp_version,
        plugin.activation_checkpointing,
        plugin.auto_wrap_policy,
    ) == (2, False, None)
    # mixed_precision "no": Accelerate builds no policy of its own
    assert plugin.mixed_precision_policy is None


def lab6_sharded_save_and_resume(out: str) -> dict:
    """On a rank: lab 6's --fsdp model (checkpointed, sharded by hand) in Accelerate's
    FSDP2 mode; a step, save_state, two steps, load_state, the same two steps again."""
    from distlab.parallel import apply_activation_checkpointing, apply_fsdp

    accelerator = demos.in_fsdp2_mode(
        fsdp2_plugin(), mixed_precision_for("fp32", fsdp=True)
    )
    model = apply_fsdp(
        apply_activation_checkpointing(GPT(preset("tiny"), seed=0), "full")
    )
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    x = torch.randint(
        0,
        65,
        (2, 32),
        generator=torch.Generator().manual_seed(accelerator.process_index),
    )

    def step() -> float:
        for _ in range(2):  # in_fsdp2_mode counts 2 micro-batches per optimizer step
            with accelerator.accumulate(model):
                _, loss = model(x, x)
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return loss.item()

    step()
    accelerator.save_state(out)
    after_save = [step(), step()]
    accelerator.load_state(out)
    return {
        "after_save": after_save,
        "after_load": [step(), step()],
        "files": sorted(os.listdir(out)),
    }


def test_lab_6s_sharded_model_saves_and_resumes_in_fsdp2_mode(tmp_path):
    ranks = run_ranks(
        lab6_sharded_save_and_resume,
        nprocs=2,
        args=(str(tmp_path),),
        init_group=False,
        quiet=True,
    )
    for r in ranks:
        # model, optimizer and step count all came back
        assert r["after_load"] == r["after_save"]
        assert r["after_save"][1] < r["after_save"][0]  # and they train
        assert r["files"] == [
            "optimizer_0",
            "pytorch_model_fsdp_0",
            "random_states_0.pkl",
            "random_states_1.pkl",
        ]


# --------------------------------------------------------------- Accelerate, exercise 3
def never_sync(accelerator, model):
    return no_gradient_sync(model)


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_skips_sync_checker_catches_wrong_answers():
    # the right answer passes on every build of book/accelerate.md (its exercise 3 cell)
    with pytest.raises(AssertionError, match="no reduce-scatter ran in the step"):
        check_skips_sync(never_sync)
    with pytest.raises(
        AssertionError,
        match="12 reduce-scatters in one step of 4 micro-batches, 4 per unit",
    ):
        # the lab unchanged
        check_skips_sync(lambda accelerator, model: contextlib.nullcontext())


# ------------------------------------------------------------ the prepare-tree figure
def test_prepare_tree_draws_one_panel_per_setup():
    # the page draws the real trees; here only the drawing's shape, from fixed rows
    from distlab.figures.prepare_tree import draw

    rows = [(0, "DistributedDataParallel"), (1, "GPT + autocast"), (0, "Opt(AdamW)")]
    fig = draw({"a": rows, "b": rows[1:]})
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].texts] == [r[1] for r in rows]
