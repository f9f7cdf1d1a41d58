"""apply_compile keeps the plain model's names; apply_fsdp builds its mesh on the device
in use."""

import pytest
import torch
import torch.distributed as dist

from distlab.model import GPT, preset
from distlab.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp


def test_apply_compile_compiles_each_block_in_place_and_keeps_the_state_dict_keys():
    model = GPT(preset("tiny"))
    keys, blocks = list(model.state_dict()), list(model.blocks)
    apply_compile(model)  # compiling happens at the first call: nothing runs here
    assert list(model.state_dict()) == keys and not any(
        "_orig_mod" in k for k in model.state_dict()
    )
    # the same modules, not wrappers
    assert all(a is b for a, b in zip(model.blocks, blocks))
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None  # the embeddings, head and loss stay eager


def test_after_checkpointing_the_wrapper_is_compiled_and_the_keys_stay_plain():
    model = apply_compile(apply_activation_checkpointing(GPT(preset("tiny")), "full"))
    # the wrapper's hooks strip its part
    assert list(model.state_dict()) == list(GPT(preset("tiny")).state_dict())
    assert all(
        type(b).__name__ == "CheckpointWrapper" and b._compiled_call_impl
        for b in model.blocks
    )


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mesh_type(model) -> str:
    return next(model.parameters()).device_mesh.device_type


def test_apply_fsdp_meshes_on_the_models_device_even_when_an_accelerator_is_reported(
    one_rank_group, monkeypatch
):
    """FSDP2's default mesh follows torch._C._get_accelerator(): a CUDA mesh whenever a
    GPU is visible, whatever device the model is on. apply_fsdp builds the mesh itself,
    on the CPU here."""
    # as on a GPU machine
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    assert mesh_type(apply_fsdp(GPT(preset("tiny")))) == "cpu"


def test_a_model_on_the_meta_device_needs_the_device_named(one_rank_group):
    with torch.device("meta"):
        model = GPT(preset("tiny"))
    with pytest.raises(ValueError, match="found meta: pass device="):
        apply_fsdp(model, check_weights=False)
    assert mesh_type(apply_fsdp(model, device=torch.device("cpu"))) == "cpu"
