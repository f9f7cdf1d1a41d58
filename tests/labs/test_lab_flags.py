"""The flags every lab shares for GPUs (--compile, --log-every, --tf32, --preset gpt2),
parsed in this process: the scripts are imported, not run."""

import importlib.util
import sys

import pytest

from distlab.cli import parse_config
from distlab.errors import UserError
from distlab.infra.paths import LABS_DIR

LABS = sorted(p.name for p in LABS_DIR.glob("lab*.py"))


def train_config(lab: str, monkeypatch) -> type:
    name = "lab_script_" + lab.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, LABS_DIR / lab)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up there
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)  # defines the config and main(); runs nothing
    return module.TrainConfig


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_takes_the_gpu_flags(lab, monkeypatch):
    config = train_config(lab, monkeypatch)
    defaults = parse_config(config, [])
    # today's behaviour
    assert (defaults.compile, defaults.log_every, defaults.tf32) == (False, 1, False)
    given = parse_config(
        config, ["--compile", "--log-every", "10", "--tf32", "--preset", "gpt2"]
    )
    assert (given.compile, given.log_every, given.tf32, given.preset) == (
        True,
        10,
        True,
        "gpt2",
    )
    with pytest.raises(UserError, match="--log-every must be positive"):
        parse_config(config, ["--log-every", "0"])


@pytest.mark.parametrize("lab", LABS)
def test_every_flag_has_its_comment_as_help(lab, monkeypatch):
    """A field's comment, trailing or on the lines above it, is its --help text."""
    from distlab.cli import _field_comments

    config = train_config(lab, monkeypatch)
    comments = _field_comments(config)
    missing = [f for f in config.__dataclass_fields__ if not comments.get(f)]
    assert not missing, f"{lab}: fields without a help comment: {missing}"
    assert comments["preset"].startswith("model size")  # a comment above the field
    assert comments["steps"] == "optimizer steps"  # a trailing comment
