"""The labs benchmark (distlab.bench.labs) on GPUs, tested on a CPU: the rank count
checked against the GPUs before anything starts, the flags passed on to the labs, the
CUDA peaks kept, the result's file name, the GPUs' provenance, and what the Benchmarks
chapter shows of a GPU recording, or says without one. What needs a GPU itself is in
tests/gpu/."""

import json
import os
import shutil

import pytest
import torch

from distlab.bench import lab_scripts, provenance
from distlab.bench import labs as bench
from distlab.bench.report import GPU_COMMAND, RESULTS, gpu_section, recorded_results
from distlab.chapters import benchmarks as chapter
from distlab.errors import UserError

WORKLOAD = {
    "preset": "gpt2",
    "global_batch": 32,
    "micro_batch_size": 8,
    "steps": 20,
    "dtype": "bf16",
    "device": "cuda",
    "eval_batches": 4,
    "repeats": 1,
    "compile": False,
    "log_every": 1,
    "tf32": False,
}


def test_more_ranks_than_gpus_is_refused_in_one_line_before_any_launch(monkeypatch):
    # as on a 2-GPU machine
    monkeypatch.setattr(bench, "pick_device", lambda requested: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench, "run_one", lambda *a: pytest.fail("a lab was launched"))
    with pytest.raises(UserError) as refused:
        bench.main(["--device", "cuda", "--ranks", "1", "2", "4", "--batch-size", "32"])
    assert str(refused.value) == (
        "--ranks 4 needs 4 GPUs (one per rank) and this machine shows 2: "
        "ask for at most 2 ranks, or run on --device cpu"
    )
    # as many as there are GPUs: fine
    bench.check_gpus_for([1, 2], torch.device("cuda", 0))
    # CPU ranks share the cores: no such limit
    bench.check_gpus_for([8], torch.device("cpu"))


def test_compile_log_every_and_tf32_reach_every_lab_only_when_asked(tmp_path):
    plain = lab_scripts.lab_args("lab1_single", WORKLOAD, tmp_path)
    # a plain run's command is unchanged
    assert not {"--compile", "--log-every", "--tf32"} & set(plain)
    # the device resolved by the bench, never "auto"
    assert plain[plain.index("--device") + 1] == "cuda"
    asked = lab_scripts.lab_args(
        "lab4_fsdp2",
        {**WORKLOAD, "compile": True, "log_every": 10, "tf32": True},
        tmp_path,
    )
    assert (
        "--compile" in asked
        and "--tf32" in asked
        and asked[asked.index("--log-every") + 1] == "10"
    )
    assert asked[asked.index("--micro-batch-size") + 1] == "8"  # labs 3-6 only
    # what the Benchmarks chapter looks for
    assert bench.result_name(WORKLOAD) == "cuda_gpt2_bf16"
    assert (
        bench.result_name({**WORKLOAD, "compile": True, "tf32": True})
        == "cuda_gpt2_bf16_tf32_compile"
    )


def test_a_flag_a_lab_does_not_have_is_refused(monkeypatch):
    # an older lab script
    monkeypatch.setattr(lab_scripts, "lab_options", lambda lab: {"preset", "steps"})
    with pytest.raises(
        UserError, match="lab2_ddp has no --compile, --log-every option"
    ):
        lab_scripts.check_options_exist(
            {**WORKLOAD, "compile": True, "log_every": 5}, {"lab2_ddp"}
        )
    lab_scripts.check_options_exist(
        WORKLOAD, {"lab2_ddp"}
    )  # nothing asked: nothing to check


def test_a_run_keeps_rank_0s_cuda_peaks_when_its_lab_recorded_them(
    monkeypatch, tmp_path
):
    summary = {
        "lab": "lab1_single",
        "world_size": 1,
        "tokens_per_step": 32768,
        "tokens_per_s": 65536.0,
        "mfu": 0.3,
        "mfu_of_datasheet_peak": 0.2,
        "state_bytes_per_rank": {"total": 10**9},
        "peak_bytes_by_kind": {"total": 2 * 10**9},
        "final_train_loss": 3.0,
        "cuda_max_memory_allocated": 5 * 10**9,
        "cuda_max_memory_reserved": 6 * 10**9,
    }
    launched = {}

    # what the lab would have written
    def fake_run_script(script, args, nprocs, timeout, device, quiet):
        launched["device"] = device
        out = args[args.index("--out") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write('{"step": 0, "loss": 3.0}\n')

    monkeypatch.setattr(bench, "run_script", fake_run_script)
    run = bench.run_one("lab1_single", 1, WORKLOAD, tmp_path, timeout=10)
    # launched for the GPUs: no CUDA_VISIBLE_DEVICES="" pinning
    assert launched["device"] == "cuda"
    assert (run["cuda_max_memory_allocated"], run["cuda_max_memory_reserved"]) == (
        5 * 10**9,
        6 * 10**9,
    )
    assert run["step_s"] == 0.5 and run["losses"] == [3.0]
    assert "CUDA peak 5,000 MB" in bench.describe(
        run
    ) and "(0.20 of the datasheet's)" in bench.describe(run)


def test_gpu_provenance_names_the_gpus_driver_cuda_and_nccl(monkeypatch, tmp_path):
    # prints what `nvidia-smi --query-gpu=driver_version` prints, per GPU
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text("#!/bin/sh\necho 550.54.15\necho 550.54.15\n")
    fake_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3"
    )
    gpus = provenance.gpu_provenance()
    assert gpus["gpu_count"] == 2 and gpus["gpu_names"] == ["NVIDIA H100 80GB HBM3"] * 2
    assert gpus["nvidia_driver"] == "550.54.15"
    assert gpus["cuda"] == torch.version.cuda  # None on this CPU wheel
    # a CPU wheel carries no NCCL
    assert gpus["nccl"] is None or gpus["nccl"].count(".") >= 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert provenance.nvidia_driver() is None  # no nvidia-smi: unknown, not an error
    # a CPU recording has no GPU fields
    assert "gpu_count" not in provenance.provenance("distlab.bench", [], "cpu")


# --- the chapter's GPU section (distlab.bench.report.gpu_section): a GPU recording
# beside the CPU one, or the plain fact that there is none ---


def test_without_a_gpu_recording_the_page_says_so_and_gives_a_valid_command(
    tmp_path, monkeypatch
):
    shutil.copy(RESULTS / "cpu_shakespeare_fp32.json", tmp_path)
    [said] = gpu_section(recorded_results(tmp_path))
    assert said.startswith("No GPU recording has been made yet")
    assert GPU_COMMAND not in said  # the page prints it once, after the section

    class Parsed(Exception):
        pass

    # the command's options were all accepted: nothing is run
    def stop_after_parsing(requested: str):
        raise Parsed(requested)

    monkeypatch.setattr(bench, "pick_device", stop_after_parsing)
    with pytest.raises(Parsed, match="cuda"):
        bench.main(GPU_COMMAND.split()[3:])  # after "python -m distlab.bench"


def test_a_gpu_recording_is_shown_beside_the_cpu_one(tmp_path):
    cpu = recorded_results()["cpu_shakespeare_fp32"]
    gpus = {
        "gpu_count": 2,
        "gpu_names": ["NVIDIA H100 80GB HBM3"] * 2,
        "nvidia_driver": "550.54.15",
    }
    prov = {
        **cpu["provenance"],
        **gpus,
        "machine": "NVIDIA H100 80GB HBM3",
        "cuda": "12.8",
        "nccl": "2.27.3",
    }
    extra = {
        "mfu_of_datasheet_peak": 0.25,
        "cuda_max_memory_allocated": 5e9,
        "cuda_max_memory_reserved": 6e9,
    }
    gpu = {
        **cpu,  # a synthetic recording: the CPU one's runs, said to be from 2 H100s
        "provenance": prov,
        "workload": {
            **cpu["workload"],
            "device": "cuda",
            "preset": "gpt2",
            "dtype": "bf16",
            "compile": True,
        },
        "runs": [{**r, **extra} for r in cpu["runs"] if "error" not in r],
    }
    for name, result in (
        ("cpu_shakespeare_fp32", cpu),
        ("cuda_gpt2_bf16_compile", gpu),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    side_by_side, about, runs_rows = gpu_section(recorded_results(tmp_path))
    assert [row["recording"] for row in side_by_side] == [
        "cpu_shakespeare_fp32",
        "cuda_gpt2_bf16_compile",
    ]
    assert (
        side_by_side[1]["measured on"] == "2 x NVIDIA H100 80GB HBM3"
        and "compiled" in side_by_side[1]["workload"]
    )
    assert (
        side_by_side[0]["lab 1 MFU, datasheet peak"],
        side_by_side[1]["lab 1 MFU, datasheet peak"],
    ) == ("-", "0.25")
    assert (
        "NVIDIA driver 550.54.15, CUDA 12.8, NCCL 2.27.3" in about
        and cpu["provenance"]["command"] in about
    )
    assert (
        len(runs_rows) == len(gpu["runs"])
        and runs_rows[0]["lab"] == chapter.LAB_NAMES["lab1_single"]
    )
    assert {row["CUDA peak MB, allocated / reserved"] for row in runs_rows} == {
        "5,000 / 6,000"
    }
    assert runs_rows[0]["loss, largest rel. difference from lab 1"] == "0.0e+00"
