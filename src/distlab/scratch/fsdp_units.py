"""The unit policy of the from-scratch FSDP: which parameters each unit owns.

    # [("blocks.0", block, slots), ..., ("root", model, slots)]
    unit_parameters(model, {Block})

FSDP2's users write ``for block in model.blocks: fully_shard(block)`` then
``fully_shard(model)``: each call takes the parameters of its module that no nested call
took. A policy of module classes says the same for any model: every submodule of one of
those classes is a unit (the innermost one owns a parameter), and the root unit, the
model itself, owns the rest.
"""

from __future__ import annotations

import torch.nn as nn

# {parameter: [(module, attribute), ...]}: a tied parameter is one key with
# several owners
Slots = dict[nn.Parameter, list[tuple[nn.Module, str]]]


def _check_policy(units) -> tuple[type, ...]:
    classes = (
        tuple(units) if isinstance(units, (set, frozenset, list, tuple)) else (units,)
    )
    wrong = [
        c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))
    ]
    if wrong:
        raise ValueError(
            "the unit policy is a set of nn.Module classes, such as {Block}; "
            f"got {wrong}"
        )
    return classes


def unit_parameters(
    model: nn.Module, units, ignored: set[nn.Parameter] = frozenset()
) -> list[tuple[str, nn.Module, Slots]]:
    """``[(name, module, {parameter: [(owner, attribute), ...]})]``: the units in the
    order ``model.named_modules()`` meets them, then the root (named ``"root"``).

    A tied parameter (``lm_head.weight is wte.weight``) is one key with two owners, so
    it is stored, gathered and reduced once; it must not be shared by two units. A unit
    without parameters of its own is left out, and so are the ``ignored`` parameters.
    The same traversal on an unwrapped copy of the model gives the same order.
    """
    classes = _check_policy(units)
    # module -> the unit that owns its parameters
    owner_unit: dict[nn.Module, nn.Module] = {}
    names = {model: "root"}

    def walk(module: nn.Module, prefix: str, unit: nn.Module) -> None:
        if module in owner_unit:
            return  # a module reached twice (shared) keeps its first unit
        owner_unit[module] = unit
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if isinstance(child, classes):
                names.setdefault(child, qualified)
            walk(child, qualified + ".", child if isinstance(child, classes) else unit)

    walk(model, "", model)
    found: dict[nn.Module, Slots] = {}
    unit_of: dict[nn.Parameter, nn.Module] = {}
    for module, unit in owner_unit.items():
        for attr, p in module._parameters.items():
            if p is None or p in ignored:
                continue
            if unit_of.setdefault(p, unit) is not unit:
                raise ValueError(
                    f"a parameter ({attr} of {type(module).__name__}) is shared "
                    f"by units {names[unit_of[p]]!r} "
                    f"and {names[unit]!r}: put the modules that share it in one unit"
                )
            found.setdefault(unit, {}).setdefault(p, []).append((module, attr))
    order = [
        m for m in dict.fromkeys(owner_unit.values()) if m is not model and m in found
    ]
    return [(names[m], m, found[m]) for m in order] + (
        [("root", model, found[model])] if model in found else []
    )
