import math

import pytest
import torch

from distlab.model import (
    GPT,
    PRESETS,
    GPTConfig,
    count_parameters,
    parameter_formula,
    preset,
)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_formula_matches_the_instantiated_model(name):
    cfg = preset(name)
    assert parameter_formula(cfg) == count_parameters(GPT(cfg))


def test_shakespeare_preset_has_10_77m_parameters():
    cfg = preset("shakespeare")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size) == (
        6,
        384,
        6,
        256,
        65,
    )
    assert count_parameters(GPT(cfg)) == 10_770_816
    # the figure nanoGPT prints for its bias-free config, without position embeddings
    assert parameter_formula(cfg, bias=False, include_wpe=False) == 10_646_784


def test_gpt2_preset_is_gpt2_small_shaped_with_85_89m_parameters():
    cfg = preset("gpt2")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size) == (
        12,
        768,
        12,
        1024,
        65,
    )
    # GPT(cfg) has as many: the parametrized test above builds it
    assert parameter_formula(cfg) == 85_892_352
    # GPT-2 small's own count
    assert parameter_formula(preset("gpt2", vocab_size=50_257)) == 124_439_808


def test_head_is_tied_to_the_token_embedding():
    model = GPT(preset("tiny"))
    assert model.lm_head.weight is model.wte.weight


def test_initialisation_is_deterministic_and_seeded():
    a, b, c = (
        GPT(preset("tiny"), seed=1),
        GPT(preset("tiny"), seed=1),
        GPT(preset("tiny"), seed=2),
    )
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_initialisation_ignores_the_global_rng():
    torch.manual_seed(0)
    a = GPT(preset("tiny"), seed=3)
    torch.manual_seed(1)
    b = GPT(preset("tiny"), seed=3)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_forward_shapes_and_initial_loss_is_near_uniform():
    cfg = preset("tiny")
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=gen)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    assert model(idx)[1] is None


def test_attention_is_causal():
    """Changing a later token must not change the logits at earlier positions."""
    cfg = preset("tiny")
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % cfg.vocab_size
    a, b = model(idx)[0], model(changed)[0]
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_too_long_a_sequence_is_refused():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="block_size"):
        GPT(cfg)(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny, shakespeare"):
        preset("huge")


def test_generate_extends_the_prompt():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    out = model.generate(
        torch.zeros(2, 3, dtype=torch.long),
        10,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape == (2, 13) and int(out.max()) < 11
