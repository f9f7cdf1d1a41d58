"""Activation checkpointing past the defaults: what the page (book/ac_policies.md) does
not run. The page asserts on every build what each policy, offload hook and memory
budget keeps and recomputes, counted exactly, with gradients equal to no checkpointing.
Here: the replay without early stop, the per-block counter, HostOffload over many
forwards, bad input, the exercise's checker and the benchmark's smoke path."""

import pytest
import torch
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

import distlab.chapters.ac_policies as ac_policies
from distlab.chapters.ac_policies import _work, checkpointed
from distlab.exercises.ac_policies import check_threshold_offload
from distlab.memory import saved_activation_bytes
from distlab.model import preset
from distlab.tools.offload import HostOffload
from support.exercises import passes

B = 8
CFG = preset("tiny")


def _batch():
    return torch.randint(
        0,
        CFG.vocab_size,
        (2, B, CFG.block_size),
        generator=torch.Generator().manual_seed(0),
    )


def test_without_early_stop_the_replay_runs_the_down_projection_too():
    idx, targets = _batch()
    with set_checkpoint_early_stop(False):  # read when the checkpointed forward runs
        _, backward, _ = _work(checkpointed("tiny", "every other matmul"), idx, targets)
    assert backward.ops["addmm"] == 2 * CFG.n_layer


def test_the_counter_restarts_in_every_block(monkeypatch):
    """Per block: save the qkv and MLP-up products, recompute the two projections. A
    policy shared by all blocks would only give the same answer here because 4 is even.
    """
    decisions = []
    real = ac_policies.create_selective_checkpoint_contexts

    def recording(policy):
        def recorded(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if op in ac_policies.MATMULS:
                # addmm(bias, input, weight.t())
                decisions.append((tuple(args[2].shape), decision))
            return decision

        return real(recorded)

    monkeypatch.setattr(ac_policies, "create_selective_checkpoint_contexts", recording)
    model = checkpointed("tiny", "every other matmul")
    model(*_batch())
    C = CFG.n_embd
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    one_block = [
        ((C, 3 * C), save),
        ((C, C), recompute),
        ((C, 4 * C), save),
        ((4 * C, C), recompute),
    ]
    assert decisions == one_block * CFG.n_layer


def test_host_offload_rebuilds_views_after_addresses_are_reused():
    """Many forwards under one HostOffload: freed storages' addresses come back, and
    each saved view (q, k, v of one qkv output) must come back with its own offset
    and strides."""
    idx, targets = _batch()
    reference = _work(checkpointed("tiny", "none"), idx, targets)[2]
    model = checkpointed("tiny", "none")
    hooks = HostOffload(keep=model.parameters())
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with hooks:
            loss = model(idx, targets)[1]
        loss.backward()
        assert all(
            torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference)
        )
    assert hooks.bytes_moved == 3 * saved_activation_bytes(model, idx, targets)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        checkpointed("tiny", "every third matmul")


def _threshold_hooks(model, min_bytes):
    offload = HostOffload(keep=model.parameters())

    def pack(t):
        return t if t.untyped_storage().nbytes() < min_bytes else offload.pack_hook(t)

    return pack, offload.unpack_hook


def test_threshold_offload_checker(capsys):
    assert "gradients equal no hooks exactly" in passes(
        check_threshold_offload, _threshold_hooks, capsys=capsys
    )

    def everything(model, min_bytes):
        h = HostOffload(keep=model.parameters())
        return h.pack_hook, h.unpack_hook

    with pytest.raises(AssertionError, match="was moved"):
        check_threshold_offload(everything)

    def pinned(model, min_bytes):
        h = save_on_cpu(pin_memory=True)
        return h.pack_hook, h.unpack_hook

    with pytest.raises(AssertionError, match="a parameter was moved"):
        check_threshold_offload(pinned)
    with pytest.raises(AssertionError, match="was left in place"):
        check_threshold_offload(lambda model, min_bytes: (lambda t: t, lambda t: t))

    # moves the right storages, but brings them back rounded to bf16
    def lossy(model, min_bytes):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            big = (
                t.untyped_storage().nbytes() >= min_bytes
                and t.untyped_storage().data_ptr() not in params
            )
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
    assert all(
        r["grad_max_abs_diff"] == 0 and len(r["step_s"]) == 2 for r in runs.values()
    )
    assert (tmp_path / "bench.json").exists() and result["provenance"][
        "command"
    ].endswith("--smoke --out " + str(tmp_path / "bench.json"))


def test_recompute_counts_sorts_forward_operators_by_kind():
    from distlab.figures.ac_policy_figures import recompute_counts

    ops = {
        "addmm": 6,
        "mm": 2,
        "_scaled_dot_product_flash_attention_for_cpu": 2,
        "_scaled_dot_product_flash_attention_for_cpu_backward": 2,
        "native_layer_norm": 4,
        "native_layer_norm_backward": 4,
        "gelu": 2,
        "view": 10,
    }
    assert recompute_counts(ops, blocks=2) == {
        "matmul": 4,
        "attention": 1,
        "LayerNorm": 2,
        "GELU": 1,
    }
