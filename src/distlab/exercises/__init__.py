"""Checkers for the exercises that ask for code: call one with your code, read one
line back.

Each checker runs your code against a reference (PyTorch's own op, or the chapter's own
implementation), on gloo or NCCL ranks through ``distlab.infra.launch.run_ranks`` where
a collective is involved, with timeouts, so a hang becomes an error. It prints one line
starting with ``passed:`` that says what was compared, or raises an ``AssertionError``
(``ValueError`` for an argument of the wrong kind) that says what is wrong.

    chapter / lab                exercise  checker
    Collectives                  3         check_all_reduce(all_reduce)
    DDP overlap and compression  5         check_fp16_hook(hook)
    DDP in practice              5         check_exact_evaluation(evaluate)
    DDP's flags, batch and LR    4         check_scaled_lr(scaled_lr)
    FSDP from scratch            3         check_sgd_exposes_missing_division(
                                               make_optimizer, SummingUnit)
    FSDP from scratch            4         check_bf16_unit(Bf16Unit)
    FSDP2 prefetch and offload   3         check_set_prefetch_all(set_prefetch_all)
    A model bigger than one rank 3         check_fill_blocks(fill_blocks_)
    Activation checkpointing     2         check_attention_only_policy(policy)
    AC past the defaults         2         check_threshold_offload(make_hooks)
    FSDP2 with torch.compile     1         check_parallelize(parallelize)
    Accelerate                   3         check_skips_sync(sync_context)
    Accelerate's FSDP2 config    3         check_optimizer_problems(find_problems)
    Resume and fault tolerance   4         check_kill_during_shard_writes(stall)
    Debugging                    3         check_lockstep_broadcast(program)
    Plan a run (capstone)        1         check_70b_plan(make_plan)
    Lab 2                        3         check_loads_ddp_state(load)
    Lab 3                        4         check_accumulates_by_tokens(accumulate)
"""

from distlab.exercises.ac_policies import check_threshold_offload
from distlab.exercises.accelerate import check_skips_sync
from distlab.exercises.accelerate_fsdp2 import check_optimizer_problems
from distlab.exercises.activation_checkpointing import check_attention_only_policy
from distlab.exercises.collectives import check_all_reduce
from distlab.exercises.ddp_in_practice import check_exact_evaluation
from distlab.exercises.ddp_overlap import check_fp16_hook
from distlab.exercises.ddp_tuning import check_scaled_lr
from distlab.exercises.debugging import check_lockstep_broadcast
from distlab.exercises.fault_tolerance import check_kill_during_shard_writes
from distlab.exercises.fsdp_big_models import check_fill_blocks
from distlab.exercises.fsdp_compile import check_parallelize
from distlab.exercises.fsdp_prefetch_offload import check_set_prefetch_all
from distlab.exercises.fsdp_scratch import (
    check_bf16_unit,
    check_sgd_exposes_missing_division,
)
from distlab.exercises.lab2_ddp import check_loads_ddp_state
from distlab.exercises.lab3_grad_accum import check_accumulates_by_tokens
from distlab.exercises.planner import check_70b_plan

__all__ = [
    "check_70b_plan",
    "check_all_reduce",
    "check_exact_evaluation",
    "check_fp16_hook",
    "check_scaled_lr",
    "check_sgd_exposes_missing_division",
    "check_bf16_unit",
    "check_set_prefetch_all",
    "check_fill_blocks",
    "check_attention_only_policy",
    "check_threshold_offload",
    "check_parallelize",
    "check_skips_sync",
    "check_optimizer_problems",
    "check_kill_during_shard_writes",
    "check_lockstep_broadcast",
    "check_loads_ddp_state",
    "check_accumulates_by_tokens",
]
