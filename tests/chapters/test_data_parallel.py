"""DataParallel from scratch gives the plain module's outputs, gradients and training
losses on what the page does not run (3 and 4 replicas, the other strategies, the
edge-case models, the step record on 3 devices); the experiment harness's timing rule
and strategy names. The page checks its own runs on every build (the step it draws,
2 replicas even and uneven, two wrappers trained against the plain module, the
DataParallel pitfalls)."""

import pytest
import torch
import torch.nn as nn

from distlab.chapters import data_parallel as chapter
from distlab.chapters.data_parallel import STRATEGIES, backward_threads, train_steps
from distlab.data import token_data
from distlab.infra import experiment
from distlab.model import GPT, preset
from distlab.scratch.data_parallel import (
    ScratchDataParallel,
    SequentialDataParallel,
    gather,
    replicate,
    scatter,
)
from support.edge_models import (
    EDGE_MODELS,
    assert_same_grads,
    build,
    grads,
    loss_of,
    reference,
    sgd_step,
    shard,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def data():
    return token_data()


def batch(data, rows):
    return data.batch("train", 0, rows, preset("tiny").block_size, 0, 0, 1, CPU)


def pair(data):
    cfg = preset("tiny", vocab_size=data.tokenizer.vocab_size)
    return GPT(cfg, seed=0), GPT(cfg, seed=0)


# the page checks 16 rows on 2 on every build
@pytest.mark.parametrize("rows,replicas", [(12, 3), (16, 4)])
def test_outputs_and_gradients_equal_the_plain_module(data, rows, replicas):
    plain, model = pair(data)
    x, y = batch(data, rows)
    ref_logits, ref_loss = plain(x, y)
    ref_loss.backward()
    logits, losses = ScratchDataParallel(model, [CPU] * replicas)(x, y)
    assert losses.shape == (replicas,)
    losses.mean().backward()
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(losses.mean(), ref_loss, rtol=0, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def single():
    return train_steps("single", "tiny", steps=5, global_batch=16)


# the page trains dp-scratch and dp-scratch-no-threads against the plain module on
# every build
@pytest.mark.parametrize("strategy", ["dp", "dp-scratch-1-intra-op"])
def test_training_matches_the_plain_module(strategy, single):
    got = train_steps(strategy, "tiny", steps=5, global_batch=16)
    assert got["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert single["losses"][-1] < single["losses"][0]  # it trained
    phases = {s.phase for s in got["spans"]}
    assert {"backward", "optimizer"} <= phases
    # the wrapper's own phases, from the last step only
    if strategy.startswith("dp-scratch"):
        assert {"scatter", "replicate", "threads", "gather"} <= phases
        assert sum(s.phase == "scatter" for s in got["spans"]) == 1
    assert got["threads"] == (
        1 if strategy == "dp-scratch-1-intra-op" else single["threads"]
    )


def test_the_first_steps_are_not_timed(single):
    """tokens/s counts the steps after WARMUP_STEPS only; a run of no more steps
    has none."""
    T, timed = preset("tiny").block_size, single["step_s"][experiment.WARMUP_STEPS :]
    assert (
        experiment.WARMUP_STEPS == 2 and len(single["step_s"]) == 5 and len(timed) == 3
    )
    assert single["tokens_per_s"] == pytest.approx(16 * T * len(timed) / sum(timed))
    assert (
        experiment.train("single", steps=experiment.WARMUP_STEPS)["tokens_per_s"]
        is None
    )


def test_strategy_names_are_one_vocabulary():
    for name in experiment.STRATEGIES:
        assert name == name.lower() and " " not in name and "_" not in name, name
    assert set(STRATEGIES) <= set(experiment.STRATEGIES)
    with pytest.raises(
        ValueError, match="unknown strategy 'plain'; choose one of single, ddp, "
    ):
        experiment.train("plain", steps=1)
    with pytest.raises(
        RuntimeError, match="'ddp' runs on every rank of a process group"
    ):
        experiment.build("ddp")  # no process group in this process


def test_replicas_are_differentiable_copies_with_ties_kept(data):
    model = GPT(preset("tiny", vocab_size=data.tokenizer.vocab_size), seed=0)
    replica = replicate(model, [CPU])[0]
    originals = {id(p) for p in model.parameters()}
    copies = list(replica.parameters())
    assert len(copies) == len(list(model.parameters()))
    assert not any(id(p) in originals for p in copies)
    # connected to the originals by autograd
    assert all(p.grad_fn is not None for p in copies)
    assert replica.lm_head.weight is replica.wte.weight  # the tied head stays tied
    assert replica.blocks[0] is not model.blocks[0]


def test_thread_local_grad_mode_and_autocast_reach_the_replicas(data):
    _, model = pair(data)
    dp = ScratchDataParallel(model, [CPU, CPU])
    x, y = batch(data, 4)
    with torch.no_grad():
        logits, _ = dp(x, y)
    assert not logits.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = dp(x, y)
    assert logits.dtype == torch.bfloat16


def test_a_failing_replica_raises_in_the_caller(data):
    _, model = pair(data)
    x, y = batch(data, 4)
    x[3, 0] = 10_000  # a token id past the vocabulary, in the second replica's rows
    with pytest.raises(RuntimeError, match="replica 1 failed"):
        ScratchDataParallel(model, [CPU, CPU])(x, y)


def test_short_batches_and_bad_devices(data):
    x, y = batch(data, 1)
    # one row: one chunk, as torch.chunk gives
    assert len(scatter((x, y), [CPU] * 4)) == 1
    _, model = pair(data)
    logits, loss = ScratchDataParallel(model, [CPU] * 4)(x, y)
    assert logits.shape[0] == 1 and loss.dim() == 0
    with pytest.raises(ValueError, match="at least one device"):
        ScratchDataParallel(model, [])


def test_the_step_record_on_three_devices(data):
    from distlab.scratch.data_parallel_steps import CALLS, record_step, what_moved

    model = GPT(preset("tiny", vocab_size=data.tokenizer.vocab_size), seed=0)
    x, y = batch(data, 7)
    record = record_step(model, (x, y), [CPU] * 3)
    params = sum(p.numel() for p in model.parameters())
    assert record["rows"] == [3, 3, 1] and record["copied"] == [params] * 3
    assert record["gathered"][0] == 7 and record["losses"] == 3
    assert record["with_grad"] == len(list(model.parameters()))
    assert all(len(record["cells"][call]) == 3 for call in CALLS)
    assert set(what_moved(record)) == set(CALLS)


def test_gather_stacks_scalars_and_concatenates_the_rest():
    out = gather(
        [(torch.ones(2, 3), torch.tensor(1.0)), (torch.zeros(1, 3), torch.tensor(2.0))],
        CPU,
    )
    assert out[0].shape == (3, 3)
    assert out[1].tolist() == [1.0, 2.0]


def test_dataparallel_traffic_sends_each_byte_once_per_link():
    from distlab.scratch.collectives import ring_bytes_sent_per_rank

    P, B, T, V = 1_000_000, 8, 16, 100
    in_module = chapter.dataparallel_traffic(P, B, T, V, 4, logits_to_gpu0=False)
    # any N
    assert (
        in_module["DataParallel GPU 0 sends"]
        == in_module["DataParallel GPU 0 receives"]
        == 4 * P
    )
    assert in_module["DDP each GPU sends"] == pytest.approx(
        ring_bytes_sent_per_rank(P, 4, 4)
    )
    on_gpu0 = chapter.dataparallel_traffic(P, B, T, V, 4, logits_to_gpu0=True)
    assert on_gpu0["DataParallel GPU 0 receives"] == pytest.approx(
        4 * P + 3 / 4 * 4 * B * T * V
    )
    # the mechanisms the model rests on, in the installed torch: one autograd node
    # broadcasts every parameter (its backward is one reduce), the reduce is NCCL's, and
    # autocast's dtype is not passed on
    import importlib
    import inspect

    # torch.nn.parallel's functions shadow the modules of the same name
    def source(module):
        return inspect.getsource(importlib.import_module(f"torch.nn.parallel.{module}"))

    assert "Broadcast.apply(devices, *tensors)" in source("replicate")
    assert "nccl.reduce(inputs, output=result, root=root_index)" in source("comm")
    assert "torch.amp.autocast(device_type, enabled=autocast_enabled)" in source(
        "parallel_apply"
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU behaviour of nn.DataParallel"
)
def test_torch_dataparallel_without_gpus_calls_the_module_once(data):
    model = GPT(preset("tiny", vocab_size=data.tokenizer.vocab_size), seed=0)
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    dp = nn.DataParallel(model, device_ids=[0, 1])
    x, y = batch(data, 16)
    dp(x, y)
    assert dp.device_ids == [] and seen == [(16, 64)]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on GPUs each device has its own autograd thread"
)
def test_cpu_backward_of_every_replica_runs_on_the_calling_thread():
    assert backward_threads() == {0: {"MainThread"}, 1: {"MainThread"}}


def test_the_recorded_comparison_is_complete_and_its_variants_trained_alike():
    """The chapter reads results/dp_bench.json (python -m distlab.bench.dp): five
    variants, the same steps, the same losses, and the phases of one dp-scratch step."""
    from distlab.bench.dp import WARMUP_STEPS, load

    measured, workload, runs = load()
    assert {"machine", "torch", "commit", "date", "command"} <= set(measured)
    assert measured["command"].startswith("python -m distlab.bench.dp")
    assert workload["steps"] > WARMUP_STEPS == workload["warmup_steps"]
    assert list(runs) == [
        "single",
        "dp-scratch",
        "dp-scratch-1-intra-op",
        "dp-scratch-no-threads",
        "ddp",
    ]
    assert set(runs) <= set(experiment.STRATEGIES)
    for name, r in runs.items():
        assert len(r["losses"]) == len(r["step_s"]) == workload["steps"], name
        assert (
            max(abs(a - b) for a, b in zip(r["losses"], runs["single"]["losses"]))
            < 1e-4
        ), name
    phases = {s.phase for s in runs["dp-scratch"]["spans"]}
    assert {
        "scatter",
        "replicate",
        "threads",
        "gather",
        "backward",
        "optimizer",
    } <= phases


def test_the_comparison_recorder_refuses_bad_workloads(capsys):
    from distlab.bench.dp import main

    for argv in (["--steps", "2"], ["--global-batch", "7"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert "--global-batch must be even" in capsys.readouterr().err


# ---- models that break wrappers written for one model (tests/support/edge_models.py)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("wrapper", [ScratchDataParallel, SequentialDataParallel])
@pytest.mark.parametrize("name", list(EDGE_MODELS))
def test_edge_case_models_train_as_one_process_on_the_same_chunks(
    name, wrapper, replicas
):
    """Frozen, unused, data-dependent, tied, BatchNorm: 3 steps give one process's
    gradients (None where no chunk reached a parameter) and parameters. Buffers follow
    torch's DataParallel: only replica 0's in-place updates reach the original, from
    its chunk."""
    model, buffers_from_chunk_0 = build(name), build(name)
    dp = wrapper(model, [CPU] * replicas)
    per_step = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        chunks = [shard(r, replicas, step) for r in range(replicas)]
        # what torch's replica 0 does to the original's buffers, and nothing else
        with torch.no_grad():
            buffers_from_chunk_0.load_state_dict(model.state_dict())
            buffers_from_chunk_0(chunks[0])
        # equal chunks: the mean of the chunks' means
        loss_of(dp(torch.cat(chunks))).backward()
        per_step.append(grads(model))
        for mine, theirs in zip(
            model.buffers(), buffers_from_chunk_0.buffers(), strict=True
        ):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        sgd_step(model)
    one_process = reference(name, replicas)
    assert_same_grads(per_step, one_process["grads"], what=f"{wrapper.__name__} {name}")
    for mine, theirs in zip(model.parameters(), one_process["params"], strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-5, atol=1e-6)
