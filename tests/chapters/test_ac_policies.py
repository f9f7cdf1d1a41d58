"""Activation checkpointing past the defaults: what each policy, offload hook and memory budget
keeps and recomputes, counted exactly, with gradients equal to no checkpointing."""

import pytest
import torch
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

import distlab.chapters.ac_policies as ac_policies
from distlab.chapters.ac_policies import (
    POLICIES,
    _work,
    budget_sweep,
    checkpointed,
    offload_traffic,
    policy_costs,
)
from distlab.exercises.ac_policies import check_threshold_offload
from distlab.memory import saved_activation_bytes
from distlab.model import preset
from distlab.tools.offload import HostOffload
from support.exercises import passes

B = 8
CFG = preset("tiny")
BTC = 4 * B * CFG.block_size * CFG.n_embd  # bytes of one (B, T, C) fp32 tensor


@pytest.fixture(autouse=True)
def one_thread():
    # the tiny model's kernels lose time to thread contention on a busy 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch():
    return torch.randint(0, CFG.vocab_size, (2, B, CFG.block_size), generator=torch.Generator().manual_seed(0))


def test_policies_keep_and_recompute_what_the_page_says():
    costs = {row["policy"]: row for row in policy_costs(batch=B)}
    assert set(costs) == set(POLICIES)
    assert all(row["grad_max_abs_diff"] == 0 for row in costs.values())
    none, full = costs["none"], costs["full"]
    save_all, every = costs["save all matmuls"], costs["every other matmul"]
    assert none["kept"] > save_all["kept"] > every["kept"] > full["kept"]
    # every other matmul drops the two output projections' outputs, one (B, T, C) each per block
    assert save_all["kept"] - every["kept"] == 2 * CFG.n_layer * BTC
    # and reruns only the attention projection: one (BT x C) @ (C x C) product per block
    assert every["recomputed_flops"] == 2 * B * CFG.block_size * CFG.n_embd**2 * CFG.n_layer
    assert every["recomputed_ops"]["addmm"] == CFG.n_layer
    assert save_all["recomputed_flops"] == 0
    # full checkpointing: early stop spares the MLP's down projection, 3 of 4 addmm per block
    assert full["recomputed_ops"]["addmm"] == 3 * CFG.n_layer
    # MUST_CPU_OFFLOAD is recomputed in eager torch 2.13: exactly full checkpointing
    offload = costs["offload matmuls (MUST_CPU_OFFLOAD)"]
    assert (offload["kept"], offload["recomputed_flops"]) == (full["kept"], full["recomputed_flops"])


def test_without_early_stop_the_replay_runs_the_down_projection_too():
    idx, targets = _batch()
    with set_checkpoint_early_stop(False):  # read when the checkpointed forward runs
        _, backward, _ = _work(checkpointed("tiny", "every other matmul"), idx, targets)
    assert backward.ops["addmm"] == 2 * CFG.n_layer


def test_the_counter_restarts_in_every_block(monkeypatch):
    """Per block: save the qkv and MLP-up products, recompute the two projections. A policy
    shared by all blocks would only give the same answer here because 4 is even."""
    decisions = []
    real = ac_policies.create_selective_checkpoint_contexts

    def recording(policy):
        def recorded(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if op in ac_policies.MATMULS:
                decisions.append((tuple(args[2].shape), decision))  # addmm(bias, input, weight.t())
            return decision

        return real(recorded)

    monkeypatch.setattr(ac_policies, "create_selective_checkpoint_contexts", recording)
    model = checkpointed("tiny", "every other matmul")
    model(*_batch())
    C = CFG.n_embd
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    one_block = [((C, 3 * C), save), ((C, C), recompute), ((C, 4 * C), save), ((4 * C, C), recompute)]
    assert decisions == one_block * CFG.n_layer


def test_offload_traffic_is_counted_exactly():
    rows, distinct = offload_traffic(batch=B)
    plain, pinned, ours = rows
    idx, targets = _batch()
    assert distinct == saved_activation_bytes(checkpointed("tiny", "none"), idx, targets)
    assert all(r["grad_max_abs_diff"] == 0 for r in rows)
    assert plain["bytes_copied"] == 0  # tensor.cpu() of a CPU tensor is the tensor itself
    assert pinned["bytes_copied"] == pinned["bytes_packed"]  # pin_memory=True copies every pack, even on a CPU
    assert ours["bytes_copied"] == distinct  # each activation storage once, no parameters
    assert 0 < pinned["parameter_bytes"] < pinned["bytes_packed"] - distinct


def test_host_offload_rebuilds_views_after_addresses_are_reused():
    """Many forwards under one HostOffload: freed storages' addresses come back, and each saved
    view (q, k, v of one qkv output) must come back with its own offset and strides."""
    idx, targets = _batch()
    reference = _work(checkpointed("tiny", "none"), idx, targets)[2]
    model = checkpointed("tiny", "none")
    hooks = HostOffload(keep=model.parameters())
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with hooks:
            loss = model(idx, targets)[1]
        loss.backward()
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))
    assert hooks.bytes_moved == 3 * saved_activation_bytes(model, idx, targets)


def test_memory_budget_spans_eager_to_full_checkpointing(monkeypatch):
    import torch._functorch.partitioners as partitioners

    knapsack_budgets = []
    knapsack = partitioners._optimize_runtime_with_given_memory

    def recorded(graph, memories, runtimes, budget, *args, **kwargs):
        knapsack_budgets.append(budget)
        return knapsack(graph, memories, runtimes, budget, *args, **kwargs)

    monkeypatch.setattr(partitioners, "_optimize_runtime_with_given_memory", recorded)
    rows = {r["budget"]: r for r in budget_sweep((1.0, 0.5, 0.1, 0.0), batch=B)}
    # the page: at 0.5 a cheaper min-cut fits (no knapsack), at 0.1 the knapsack decides
    assert set(knapsack_budgets) == {0.1}
    assert rows[0.5]["recomputed_ops"].get("addmm", 0) == 0 and rows[0.1]["recomputed_ops"]["addmm"] == 2
    eager = rows["eager, no checkpointing"]
    assert all(r["grad_max_abs_diff"] == 0 for r in rows.values())
    assert rows[1.0]["saved"] == eager["saved"] and rows[1.0]["recomputed_flops"] == 0
    assert rows[0.0]["saved"] == BTC  # the block's input only
    assert eager["saved"] > rows[0.5]["saved"] > rows[0.0]["saved"]
    # budget 0.0 recomputes per block what eager full checkpointing does: qkv, attention, projection, MLP up
    C, T = CFG.n_embd, CFG.block_size
    attention = 4 * B * CFG.n_head * T * T * (C // CFG.n_head)
    assert rows[0.0]["recomputed_flops"] == 2 * B * T * C * (3 * C + C + 4 * C) + attention


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        checkpointed("tiny", "every third matmul")


def _threshold_hooks(model, min_bytes):
    offload = HostOffload(keep=model.parameters())

    def pack(t):
        return t if t.untyped_storage().nbytes() < min_bytes else offload.pack_hook(t)

    return pack, offload.unpack_hook


def test_threshold_offload_checker(capsys):
    assert "gradients equal no hooks exactly" in passes(check_threshold_offload, _threshold_hooks, capsys=capsys)
    everything = lambda model, min_bytes: (lambda h: (h.pack_hook, h.unpack_hook))(HostOffload(keep=model.parameters()))  # noqa: E731
    with pytest.raises(AssertionError, match="was moved"):
        check_threshold_offload(everything)
    pinned = lambda model, min_bytes: (lambda h: (h.pack_hook, h.unpack_hook))(save_on_cpu(pin_memory=True))  # noqa: E731
    with pytest.raises(AssertionError, match="a parameter was moved"):
        check_threshold_offload(pinned)
    with pytest.raises(AssertionError, match="was left in place"):
        check_threshold_offload(lambda model, min_bytes: (lambda t: t, lambda t: t))

    def lossy(model, min_bytes):  # moves the right storages, but brings them back rounded to bf16
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            big = t.untyped_storage().nbytes() >= min_bytes and t.untyped_storage().data_ptr() not in params
            return t.bfloat16() if big and t.is_floating_point() else t

        return pack, lambda p: p.float() if p.dtype == torch.bfloat16 else p

    with pytest.raises(AssertionError, match="gradients differ"):
        check_threshold_offload(lossy)
    with pytest.raises(ValueError, match="pair of functions"):
        check_threshold_offload(lambda model, min_bytes: None)


def test_bench_smoke_path(tmp_path):
    from distlab.bench.ac_policies import EAGER, main

    result = main(["--smoke", "--out", str(tmp_path / "bench.json")])
    runs = {r["config"]: r for r in result["runs"]}
    assert list(runs) == list(EAGER)
    assert all(r["grad_max_abs_diff"] == 0 and len(r["step_s"]) == 2 for r in runs.values())
    assert (tmp_path / "bench.json").exists() and result["provenance"]["command"].endswith(
        "--smoke --out " + str(tmp_path / "bench.json")
    )
