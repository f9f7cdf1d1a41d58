"""The exercise checkers: a correct solution passes, and a typical wrong one fails with a
message that names the problem. Each launch of ranks is a few seconds, under a timeout."""

import contextlib
import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from distlab.exercises import (
    check_all_reduce,
    check_attention_only_policy,
    check_bf16_unit,
    check_kill_during_shard_writes,
    check_loads_ddp_state,
    check_lockstep_broadcast,
    check_sgd_exposes_missing_division,
    check_skips_sync,
)
from distlab.parallel import no_gradient_sync, save_ops_policy
from distlab.scratch.fsdp import FlatShardUnit

pytestmark = pytest.mark.timeout(180)  # a checker that hangs fails here, not in CI's overall limit
aten = torch.ops.aten


def passes(check, *args, capsys) -> str:
    check(*args)
    line = capsys.readouterr().out.strip()
    assert line.startswith("passed: ") and "\n" not in line, line
    return line


# ---------------------------------------------------------------- Collectives, exercise 3
def all_reduce_in_two_halves(t):
    n = dist.get_world_size()
    shard = t.new_empty(t.numel() // n)  # same dtype and device as t
    dist.reduce_scatter_single(shard, t.view(-1))
    dist.all_gather_single(t.view(-1), shard)
    return t


def reduce_scatter_only(t):  # forgets the all-gather: each rank has one block of the sum
    shard = t.new_empty(t.numel() // dist.get_world_size())
    dist.reduce_scatter_single(shard, t.view(-1))
    return t


def sum_in_a_new_tensor(t):
    out = t.clone()
    dist.all_reduce(out)
    return out


def test_all_reduce_checker(capsys):
    assert "on 2 and 3 ranks" in passes(check_all_reduce, all_reduce_in_two_halves, capsys=capsys)
    with pytest.raises(AssertionError, match=r"on 2 ranks, rank 0 holds .* expected the sum over ranks .* max abs"):
        check_all_reduce(reduce_scatter_only)
    with pytest.raises(AssertionError, match="left its input unchanged"):
        check_all_reduce(sum_in_a_new_tensor, (2,))


# ---------------------------------------------------------------- Activation checkpointing, exercise 2
def test_attention_only_policy_checker(capsys):
    policy = save_ops_policy([aten._scaled_dot_product_flash_attention_for_cpu.default])
    assert "recomputes every matrix product" in passes(check_attention_only_policy, policy, capsys=capsys)
    with pytest.raises(AssertionError, match=r"also saves aten.addmm.default \(8x\)"):
        check_attention_only_policy(save_ops_policy())  # the default keeps the matrix products too
    with pytest.raises(ValueError, match="saved no operator's output"):
        check_attention_only_policy(save_ops_policy([aten.mm.default]))  # the Linears run addmm
    with pytest.raises(ValueError, match="must be a function"):
        check_attention_only_policy([aten._scaled_dot_product_flash_attention_for_cpu.default])


# ---------------------------------------------------------------- FSDP from scratch, exercises 3 and 4
class SummingUnit(FlatShardUnit):
    def _post_backward(self, full):
        shard_grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(shard_grad, full.grad, group=self.group)  # SUM, not divided by N
        self.shard.grad = shard_grad if self.shard.grad is None else self.shard.grad + shard_grad
        full.grad = None
        self.free()


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def test_sgd_missing_division_checker(capsys):
    assert "catches the bug" in passes(check_sgd_exposes_missing_division, sgd, SummingUnit, capsys=capsys)
    with pytest.raises(AssertionError, match="cannot see the bug"):
        check_sgd_exposes_missing_division(adamw, SummingUnit)
    with pytest.raises(AssertionError, match="1.000 times the averaged one: it still divides by N"):
        check_sgd_exposes_missing_division(sgd, FlatShardUnit)
    with pytest.raises(ValueError, match="subclass of distlab.scratch.fsdp.FlatShardUnit"):
        check_sgd_exposes_missing_division(sgd, "SummingUnit")


class Bf16Unit(FlatShardUnit):
    def __init__(self, *args):
        super().__init__(*args)
        # a bf16 leaf in place of the fp32 one: all-gathered and computed in bf16
        self.full = torch.empty(self.full.numel(), dtype=torch.bfloat16, device=self.shard.device, requires_grad=True)
        self.full.untyped_storage().resize_(0)
        self.full.register_post_accumulate_grad_hook(self._post_backward)

    def gather(self):
        storage = self.full.untyped_storage()
        if storage.nbytes() > 0:
            return
        storage.resize_(self.full.numel() * self.full.element_size())
        dist.all_gather_single(self.full.data, self.shard.data.to(torch.bfloat16), group=self.group)

    def _post_backward(self, full):
        shard_grad = torch.empty_like(self.shard)  # fp32
        dist.reduce_scatter_single(shard_grad, full.grad.float(), group=self.group)
        shard_grad.div_(dist.get_world_size(self.group))
        self.shard.grad = shard_grad if self.shard.grad is None else self.shard.grad + shard_grad
        full.grad = None
        self.free()


class Bf16UnitWithoutDivision(Bf16Unit):
    def _post_backward(self, full):
        shard_grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(shard_grad, full.grad.float(), group=self.group)
        self.shard.grad = shard_grad
        full.grad = None
        self.free()


def test_bf16_unit_checker(capsys):
    assert "MixedPrecisionPolicy" in passes(check_bf16_unit, Bf16Unit, capsys=capsys)
    with pytest.raises(AssertionError, match="computed with .*float32.* weights; expected bfloat16"):
        check_bf16_unit(FlatShardUnit, (2,))  # the chapter's unit: all fp32
    with pytest.raises(AssertionError, match="differs from FSDP2's mixed precision by .* missing division"):
        check_bf16_unit(Bf16UnitWithoutDivision, (2,))


# ---------------------------------------------------------------- Accelerate, exercise 3
def skip_sync_until_last(accelerator, model):
    return contextlib.nullcontext() if accelerator.sync_gradients else no_gradient_sync(model)


def never_sync(accelerator, model):
    return no_gradient_sync(model)


def test_skips_sync_checker(capsys):
    assert "3 reduce-scatters (1 per unit) instead of 12" in passes(
        check_skips_sync, skip_sync_until_last, capsys=capsys
    )
    with pytest.raises(AssertionError, match="no reduce-scatter ran in the step"):
        check_skips_sync(never_sync)
    with pytest.raises(AssertionError, match="12 reduce-scatters in one step of 4 micro-batches, 4 per unit"):
        check_skips_sync(lambda accelerator, model: contextlib.nullcontext())  # the lab unchanged


# ---------------------------------------------------------------- Resume and fault tolerance, exercise 4
def _stall_in_write_data(save_number, marker, items_written):
    from torch.distributed.checkpoint import FileSystemWriter

    original, calls = FileSystemWriter.write_data, [0]

    def patched(self, plan, planner):
        calls[0] += 1
        if calls[0] == save_number:
            kept = dataclasses.replace(plan, items=items_written(plan.items))
            original(self, kept, planner)  # writes these items, then closes the file
            marker.write_text(f"{os.getpid()}\n")
            while True:  # until killed
                time.sleep(1)
        return original(self, plan, planner)

    FileSystemWriter.write_data = patched


def stall_mid_shard_write(save_number, marker):
    _stall_in_write_data(save_number, marker, lambda items: items[: len(items) // 2])


def stall_before_shard_write(save_number, marker):
    _stall_in_write_data(save_number, marker, lambda items: [])  # an empty file: nothing written yet


def stall_in_finish(save_number, marker):
    from torch.distributed.checkpoint import FileSystemWriter

    def patched(self, *args, **kwargs):
        marker.write_text(f"{os.getpid()}\n")
        while True:
            time.sleep(1)

    # finish writes .metadata on the coordinator, rank 0: in rank 1 this patch never runs
    FileSystemWriter.finish = patched


def test_kill_during_shard_writes_checker(capsys):
    assert "a partial __1_0.distcp" in passes(check_kill_during_shard_writes, stall_mid_shard_write, capsys=capsys)
    with pytest.raises(AssertionError, match="rank 1's __1_0.distcp is empty: the kill landed before its writes"):
        check_kill_during_shard_writes(stall_before_shard_write)
    with pytest.raises(AssertionError, match="lab 2 finished: your stall never made rank 1 wait"):
        check_kill_during_shard_writes(stall_in_finish)


# ---------------------------------------------------------------- Debugging, exercise 3
def share_weights_from_one_line(broadcast):
    t = torch.arange(4.0) if dist.get_rank() == 0 else torch.empty(4)
    broadcast(t, src=0)
    return t


def share_weights_in_two_branches(broadcast):  # the program of the exercise
    if dist.get_rank() == 0:
        weights = torch.arange(4.0)
        broadcast(weights, src=0)
        return weights
    buffer = torch.empty(4)
    broadcast(buffer, src=0)
    return buffer


def test_lockstep_broadcast_checker(capsys):
    assert "on all 3 ranks" in passes(check_lockstep_broadcast, share_weights_from_one_line, capsys=capsys)
    with pytest.raises(AssertionError, match=r"Lockstep stopped your program on 3 ranks(.|\n)*rank 1: #0 broadcast"):
        check_lockstep_broadcast(share_weights_in_two_branches)


# ---------------------------------------------------------------- Lab 2, exercise 3
def load_stripping_the_prefix(model, state):
    consume_prefix_in_state_dict_if_present(state, "module.")
    model.load_state_dict(state)


def load_as_saved(model, state):
    model.load_state_dict(state)


def load_leniently(model, state):
    model.load_state_dict(state, strict=False)  # matches no key: loads nothing, says nothing


def test_loads_ddp_state_checker(capsys):
    assert "exactly" in passes(check_loads_ddp_state, load_stripping_the_prefix, capsys=capsys)
    with pytest.raises(AssertionError, match=r"your load raised RuntimeError: .*Missing key.*'module\."):
        check_loads_ddp_state(load_as_saved)
    with pytest.raises(AssertionError, match=r"wte.weight differs from the saved model's .*strict=False"):
        check_loads_ddp_state(load_leniently)
