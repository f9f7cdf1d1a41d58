"""What FSDP2 sends: the page (book/fsdp_communication.md) runs every variant and every
switch on 4 gloo ranks in one launch and asserts on every build what they count (the
bytes per collective kind, gloo's doubled reduce-scatter, the switches' skipped
collectives and their gradients). Here: Psi."""

from distlab.chapters.fsdp_communication import parameter_bytes
from distlab.infra.experiment import gpt
from distlab.model import count_parameters


def test_psi_counts_every_parameter_once_the_tied_matrix_included():
    model = gpt("tiny")
    assert model.lm_head.weight is model.wte.weight  # one matrix, two uses
    assert parameter_bytes(model) == 4 * count_parameters(model)  # fp32
