"""The Accelerate chapter's claims, reproduced with distlab.chapters.accelerate on 2 gloo ranks:
without cpu=True each process trains alone; the FSDP plugin on CPU gives DDP; accumulate syncs,
all-reduces and steps on every k-th micro-batch only. Lab 6's checks catch the first two.
In Accelerate's FSDP2 mode (set on CPU ranks as on GPUs): what the plugin builds, and lab 6's
own sharding, prepared, accumulated, saved and resumed. The launchers' refusals."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlab.accel import fsdp2_plugin, mixed_precision_for
from distlab.chapters import accelerate as demos
from distlab.exercises import check_skips_sync
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT
from distlab.infra.ports import free_port
from distlab.model import GPT, count_parameters, preset
from distlab.parallel import no_gradient_sync
from support.exercises import passes


def test_fingerprint_tells_equal_weights_from_different_ones():
    a, b = GPT(preset("tiny"), seed=0), GPT(preset("tiny"), seed=0)
    assert demos.fingerprint(a) == demos.fingerprint(b)
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1e-6  # the tied matrix: one element of one parameter
    assert demos.fingerprint(a) != demos.fingerprint(b)


def test_without_cpu_true_each_process_trains_its_own_model_and_lab_6_says_so():
    ranks = run_ranks(demos.without_cpu_true, nprocs=2, init_group=False, quiet=True, timeout=180)
    assert [r["WORLD_SIZE"] for r in ranks] == ["2", "2"]  # the launcher started 2 processes ...
    assert [r["num_processes"] for r in ranks] == [1, 1]  # ... and Accelerate made 2 groups of one
    assert all(r["distributed_type"].endswith("NO") and r["strategy"] == "single" for r in ranks)
    assert ranks[0]["weights"] != ranks[1]["weights"]  # no all-reduce: the models drifted apart
    assert all("Accelerate sees 1" in r["caught"] for r in ranks)


def test_the_fsdp_plugin_on_cpu_gives_ddp_with_every_parameter_on_every_rank():
    ranks = run_ranks(demos.fsdp_plugin_on_cpu, nprocs=2, init_group=False, quiet=True, timeout=180)
    full = count_parameters(GPT(preset("tiny")))
    for r in ranks:
        assert r["num_processes"] == 2 and r["wrapper"] == "DistributedDataParallel" and r["strategy"] == "ddp"
        assert r["parameters_on_this_rank"] == full  # FSDP2 on 2 ranks would hold about half
        assert "asked for fsdp2 but the prepared model is ddp" in r["caught"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # a correct DDP run, just not the one asked for


def test_accumulate_syncs_all_reduces_and_steps_on_every_kth_micro_batch(tmp_path):
    # under our launcher (as under torchrun) instead of notebook_launcher: the same environment;
    # 3 micro-batches per step where the page shows 4, so nothing here depends on that number
    accum_steps = 3
    run_ranks(demos.accumulate_trace, nprocs=2, args=(str(tmp_path), accum_steps), init_group=False, quiet=True)
    traces = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    rows = traces[0]["rows"]
    assert rows == traces[1]["rows"] and len(rows) == 2 * accum_steps
    every_kth = [(i + 1) % accum_steps == 0 for i in range(2 * accum_steps)]
    assert [r["sync_gradients"] for r in rows] == every_kth
    assert [r["weights changed"] for r in rows] == every_kth  # optimizer.step() is skipped in between
    assert [r["all-reduces"] for r in rows] == [int(k) for k in every_kth]  # the tiny model: one bucket
    gradient_bytes = 4 * count_parameters(GPT(preset("tiny")))  # every fp32 gradient, in that one bucket
    assert [r["bytes all-reduced"] for r in rows] == [gradient_bytes * k for k in every_kth]
    assert gradient_bytes < torch.distributed._DEFAULT_FIRST_BUCKET_BYTES  # 1 MiB: the rebuilt first bucket
    # gather_for_metrics concatenates in rank order; reduce(mean) averages
    mine = [t["mine"] for t in traces]
    assert all(t["gathered"] == mine[0] + mine[1] for t in traces)
    assert all(t["reduced_mean"] == pytest.approx([(a + b) / 2 for a, b in zip(*mine)]) for t in traces)


# ---------------------------------------------------------------- FSDP2 mode (items 19, 20)
def test_the_fsdp2_plugin_left_to_itself_and_lab_6s_own_sharding():
    ranks = run_ranks(demos.fsdp2_setups, nprocs=2, init_group=False, quiet=True, timeout=240)
    assert ranks[0] == ranks[1]
    before, plugin_ac, by_name, lab6 = ranks[0]
    # the plugin shards the Block inside each checkpoint wrapper (and the wrapper, with nothing in it)
    for row in (before, plugin_ac):
        assert row["block 0 after prepare"] == "FSDP[0](CheckpointWrapper(FSDP[12](Block)))"
        assert row["units"] == ["root", "blocks.0", "blocks.0._checkpoint_wrapped_module"] + [
            "blocks.1",
            "blocks.1._checkpoint_wrapped_module",
            "ln_f",
        ]
    assert by_name["units"] == ["root", "ln_f"]  # naming the wrapper class gives the blocks no unit at all
    # mixed_precision="bf16" alone: bf16 reduction and a bf16 loss; an explicit policy is kept as given
    bf16_everywhere = "param_dtype bfloat16, reduce_dtype bfloat16, output_dtype bfloat16"
    assert (before["policy"], before["loss dtype"], before["reduce-scatter dtypes"]) == (
        bf16_everywhere,
        "bfloat16",
        ["bfloat16"],
    )
    # lab 6: one unit per checkpointed block, kept by prepare, with lab 5's policy
    assert lab6["block 0 after prepare"] == "FSDP[12](CheckpointWrapper(Block))"
    assert lab6["units"] == ["root", "blocks.0", "blocks.1"]
    for row in (plugin_ac, lab6):
        assert row["policy"] == "param_dtype bfloat16, reduce_dtype float32, output_dtype None"
        assert (row["loss dtype"], row["reduce-scatter dtypes"]) == ("float32", ["float32"])
    assert lab6["reduce-scatters per micro-batch"] == [0, 3]  # accumulate skips the first: 3 units, then
    assert lab6["grad_norm"] == plugin_ac["grad_norm"] != before["grad_norm"]


def test_lab_6_asks_accelerate_for_autocast_only_without_fsdp_and_its_plugin_ignores_fsdp_variables(monkeypatch):
    assert [mixed_precision_for(d, f) for d in ("fp32", "bf16") for f in (False, True)] == ["no", "no", "bf16", "no"]
    # a launcher's FSDP_* variables fill every field left unset: lab 6 sets those that would change the model
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    plugin = fsdp2_plugin()
    assert (plugin.fsdp_version, plugin.activation_checkpointing, plugin.auto_wrap_policy) == (2, False, None)
    assert plugin.mixed_precision_policy is None  # mixed_precision "no": Accelerate builds no policy of its own


def lab6_sharded_save_and_resume(out: str) -> dict:
    """On a rank: lab 6's --fsdp model (checkpointed, sharded by hand) in Accelerate's FSDP2 mode;
    a step, save_state, two steps, load_state, the same two steps again."""
    from distlab.parallel import apply_activation_checkpointing, apply_fsdp

    accelerator = demos.in_fsdp2_mode(fsdp2_plugin(), mixed_precision_for("fp32", fsdp=True))
    model = apply_fsdp(apply_activation_checkpointing(GPT(preset("tiny"), seed=0), "full"))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(accelerator.process_index))

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
    return {"after_save": after_save, "after_load": [step(), step()], "files": sorted(os.listdir(out))}


def test_lab_6s_sharded_model_saves_and_resumes_in_fsdp2_mode(tmp_path):
    ranks = run_ranks(lab6_sharded_save_and_resume, nprocs=2, args=(str(tmp_path),), init_group=False, quiet=True)
    for r in ranks:
        assert r["after_load"] == r["after_save"]  # model, optimizer and step count all came back
        assert r["after_save"][1] < r["after_save"][0]  # and they train
        assert r["files"] == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl"]


# ---------------------------------------------------------------- the launchers' constraints (item 21)
def test_cpu_overrides_a_config_files_multi_process_launch_and_refuses_multi_gpu(tmp_path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = tmp_path / "two_gpus.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    accelerate = str(Path(sys.executable).parent / "accelerate")
    command = [accelerate, "launch", "--config_file", str(config), "--cpu", "--main_process_port", str(free_port())]
    proc = subprocess.run(
        [*command, "-m", "distlab.chapters.accelerate"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("process ") == 1 and "process 0 of 1" in proc.stdout
    with pytest.raises(ValueError, match="You can only use one of `--cpu`, `--multi_gpu`"):
        _validate_launch_command(launch_command_parser().parse_args(["--cpu", "--multi_gpu", "train.py"]))


def test_notebook_launcher_refuses_while_an_accelerator_exists():
    from accelerate import Accelerator, notebook_launcher
    from accelerate.state import AcceleratorState

    try:
        Accelerator(cpu=True)
        with pytest.raises(ValueError, match="should only be initialized inside your training function"):
            notebook_launcher(print, num_processes=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # no Accelerator left for other tests


# ---------------------------------------------------------------- Accelerate, exercise 3
def skip_sync_until_last(accelerator, model):
    return contextlib.nullcontext() if accelerator.sync_gradients else no_gradient_sync(model)


def never_sync(accelerator, model):
    return no_gradient_sync(model)


@pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
def test_skips_sync_checker(capsys):
    assert "3 reduce-scatters (1 per unit) instead of 12" in passes(
        check_skips_sync, skip_sync_until_last, capsys=capsys
    )
    with pytest.raises(AssertionError, match="no reduce-scatter ran in the step"):
        check_skips_sync(never_sync)
    with pytest.raises(AssertionError, match="12 reduce-scatters in one step of 4 micro-batches, 4 per unit"):
        check_skips_sync(lambda accelerator, model: contextlib.nullcontext())  # the lab unchanged
