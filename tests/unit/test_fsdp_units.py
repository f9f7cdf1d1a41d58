"""The from-scratch FSDP's unit policy (distlab.scratch.fsdp_units): which unit owns
which parameter, for any model. Training with it is tested in
tests/chapters/test_fsdp_scratch.py."""

import pytest
import torch
import torch.nn as nn

from distlab.chapters.fsdp_scratch import ConvBlock, ConvNet
from distlab.model import GPT, Block, preset
from distlab.scratch.fsdp import shard_model
from distlab.scratch.fsdp_units import unit_parameters


def owners(slots) -> list[list[str]]:
    return [[attr for _, attr in where] for where in slots.values()]


def test_gpt_blocks_are_units_and_the_tied_head_is_one_root_parameter():
    model = GPT(preset("tiny"))
    units = unit_parameters(model, {Block})
    assert [name for name, _, _ in units] == ["blocks.0", "blocks.1", "root"]
    assert [module for _, module, _ in units] == [*model.blocks, model]
    root = units[-1][2]
    # stored once
    assert root[model.wte.weight] == [(model.wte, "weight"), (model.lm_head, "weight")]
    assert sum(len(slots) for _, _, slots in units) == len(list(model.parameters()))


def test_a_conv_net_with_its_own_block_class():
    model = ConvNet(n_blocks=3)
    units = unit_parameters(model, {ConvBlock})
    assert [name for name, _, _ in units] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "root",
    ]
    assert set(units[-1][2]) == {
        model.stem.weight,
        model.stem.bias,
        model.head.weight,
        model.head.bias,
    }
    assert unit_parameters(model, ConvBlock) == units  # one class alone is a policy too
    # no policy: one unit
    assert [name for name, _, _ in unit_parameters(model, set())] == ["root"]


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))
        self.inner = Inner()


def test_nested_units_the_innermost_owns_a_parameter_and_empty_units_are_left_out():
    model = nn.Sequential(Outer(), nn.Sequential(Inner()), nn.ReLU())
    units = unit_parameters(model, {Outer, Inner})
    # no root: it has no parameter of its own
    assert [name for name, _, _ in units] == ["0", "0.inner", "1.0"]
    assert owners(units[0][2]) == [["scale"]] and owners(units[1][2]) == [
        ["weight"],
        ["bias"],
    ]


def test_a_module_used_twice_belongs_to_its_first_unit():
    shared = Inner()
    model = nn.ModuleDict(
        {"a": Outer(), "b": nn.Sequential(shared), "c": nn.Sequential(shared)}
    )
    assert [name for name, _, _ in unit_parameters(model, {Outer, Inner})] == [
        "a",
        "a.inner",
        "b.0",
    ]


def test_what_it_refuses_says_what_to_do():
    model = nn.Sequential(Inner(), Inner())
    model[1].linear.weight = model[0].linear.weight  # tied across two units
    with pytest.raises(
        ValueError,
        match="shared by units '0' and '1': put the modules that share it in one unit",
    ):
        unit_parameters(model, {Inner})
    frozen = nn.Sequential(Inner())
    frozen[0].linear.bias.requires_grad_(False)
    # accepted: the shard wrapper gives frozen parameters a unit of their own
    # (tests/unit/test_fsdp_scratch_models.py trains them)
    ((_, _, slots),) = unit_parameters(frozen, {Inner})
    assert list(slots) == [frozen[0].linear.weight, frozen[0].linear.bias]
    with pytest.raises(ValueError, match="a set of nn.Module classes"):
        unit_parameters(frozen, {"Inner"})
    with pytest.raises(
        ValueError, match="compute_dtype must be a floating-point dtype"
    ):
        shard_model(frozen, {Inner}, compute_dtype=torch.int8)
