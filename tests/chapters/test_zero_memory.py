"""The memory calculator and the ZeRO memory chapter: the ZeRO paper's numbers, the
static page's arithmetic, bad inputs. The bytes measured on real DDP and FSDP2 ranks
(``measure_one_step``, ``fsdp2_gathered``), the saved activations and the peaks against
MemTracker are asserted by the page itself (book/zero_memory.md) on every build."""

import itertools
import json
import re
import subprocess

import pytest
import torch

from distlab.chapters.zero_memory import (
    allocated_state_bytes,
    paper_table_1,
    reduction,
)
from distlab.memory import activation_bytes_formula, state_bytes
from distlab.model import GPT, count_parameters, preset
from distlab.tools.calculator_page import (
    calculator_html,
    calculator_widget,
    format_bytes,
    format_estimate,
)
from distlab.tools.memory_calculator import (
    DTYPES,
    GB,
    MODELS,
    OPTIMIZERS,
    PARTS,
    STRATEGIES,
    activation_bytes,
    calculator_data,
    estimate,
    gathered_params,
    model_params,
    per_rank_bytes,
)
from distlab.tools.memory_checks import (
    PAPER_FIGURE_1,
    agrees_with_print,
    zero_paper_bytes,
)

STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp2"}


def test_every_cell_of_the_papers_table_1_to_its_printed_digits():
    cells = paper_table_1()
    assert len(cells) == 3 * 3 * 6  # 3 models x stages 1-3 x 6 data-parallel degrees
    ways = {}
    # the calculator's cell against the paper's own formula, and its printed digits
    for c in cells:
        assert c["ours_gb"] * GB == pytest.approx(
            zero_paper_bytes(c["psi"], c["ranks"], c["stage"]), rel=1e-15
        )
        assert c["agrees"] is not None and c["agrees"] == agrees_with_print(
            c["ours_gb"], c["printed"]
        ), c
        # and never off by a printed unit
        assert abs(c["ours_gb"] - float(c["printed"])) < 1.0
        ways.setdefault(c["psi"], set()).add(c["agrees"])
    # the 7.5B columns are rounded; in the 128B and 1T columns fractions were dropped
    assert ways == {
        7.5e9: {"rounded"},
        128e9: {"rounded", "truncated"},
        1e12: {"rounded", "truncated"},
    }


def test_figure_1_example_and_the_papers_gb_is_1e9_bytes():
    figure_1 = [
        per_rank_bytes(7.5e9, 64, "bf16_mixed", "adamw", STAGES[s])["total"]
        for s in range(4)
    ]
    assert [agrees_with_print(b / GB, p) for b, p in zip(figure_1, PAPER_FIGURE_1)] == [
        "rounded"
    ] * 4
    # Table 1's digits
    assert (
        PAPER_FIGURE_1[3] == "1.9"
        and agrees_with_print(figure_1[3] / GB, "1.88") == "rounded"
    )
    # GiB would print 111.8
    assert agrees_with_print(figure_1[0] / 2**30, "120") is None


def test_stage_1_and_2_saturate_at_4x_and_8x_stage_3_is_n_times():
    assert (
        reduction("zero1", 2**40, "bf16_mixed")
        == pytest.approx(4)
        == 16 / (4 + 12 / 2**40)
    )
    assert reduction("zero2", 2**40, "bf16_mixed") == pytest.approx(8)
    assert (
        reduction("zero1", 8, "bf16_mixed") == 16 / (4 + 12 / 8)
        and reduction("fsdp2", 64, "fp32") == 64
    )
    # fp32 AdamW (4 + 4 + 8): at most 2x, 4x
    assert reduction("zero1", 2**40, "fp32") == pytest.approx(2)
    assert reduction("zero2", 2**40, "fp32") == pytest.approx(4)
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        reduction("zero4", 8, "fp32")


def test_bytes_per_param_match_the_paper_and_fp32_adamw():
    assert per_rank_bytes(1, 1, "bf16_mixed", "adamw") == {
        "params": 2,
        "grads": 2,
        "optimizer": 12,
        "total": 16,
    }
    assert per_rank_bytes(1, 1, "fp32", "adamw") == {
        "params": 4,
        "grads": 4,
        "optimizer": 8,
        "total": 16,
    }
    assert per_rank_bytes(1, 1, "fp32", "sgd")["total"] == 8


def test_hybrid_with_g_equal_n_is_zero3_and_with_g_1_is_ddp():
    assert per_rank_bytes(1e9, 8, strategy="hsdp", group_size=8) == per_rank_bytes(
        1e9, 8, strategy="fsdp2"
    )
    assert per_rank_bytes(1e9, 8, strategy="hsdp", group_size=1) == per_rank_bytes(
        1e9, 8, strategy="ddp"
    )
    assert per_rank_bytes(1e9, 64, strategy="hsdp", group_size=8) == per_rank_bytes(
        1e9, 8, strategy="fsdp2"
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"ranks": 0}, "ranks must be a whole number >= 1"),
        ({"ranks": 2.5}, "ranks must be a whole number >= 1"),
        (
            {"ranks": 8, "strategy": "hsdp", "group_size": 3},
            "group size g that divides",
        ),
        ({"ranks": 8, "strategy": "hsdp"}, "group size g that divides"),
        (
            {"ranks": 8, "strategy": "zero4"},
            "unknown strategy 'zero4'; choose one of ddp, zero1",
        ),
        ({"ranks": 8, "dtype": "fp8"}, "unknown dtype"),
        ({"ranks": 8, "optimizer": "lion"}, "unknown optimizer"),
    ],
)
def test_bad_input_says_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        per_rank_bytes(1e9, **kwargs)


def test_bad_activation_input_and_unknown_model():
    with pytest.raises(ValueError, match="seq_len <= block_size 64"):
        estimate("tiny", 2, seq_len=65)
    with pytest.raises(ValueError, match="unknown model"):
        estimate("gpt5", 2)


def grid():
    for model, ranks, dtype, opt, strategy in itertools.product(
        [*MODELS, "custom"], [1, 2, 3, 8, 64, 1024], DTYPES, OPTIMIZERS, STRATEGIES
    ):
        for group in (
            [g for g in (1, 2, 4) if ranks % g == 0] if strategy == "hsdp" else [None]
        ):
            cfg = MODELS.get(model, {}).get("config")
            block_size = cfg.block_size if cfg else 1
            for ac, batch, seq in [
                (False, 1, 1),
                (False, 4, min(17, block_size)),
                (True, 3, block_size),
                (True, 8, 17),
            ]:
                yield {
                    "model": model,
                    "customParams": 3.3e9,
                    "ranks": ranks,
                    "group": group,
                    "dtype": dtype,
                } | {
                    "optimizer": opt,
                    "strategy": strategy,
                    "ac": ac,
                    "batch": batch,
                    "seq": seq,
                }


def python_estimate(i):
    model = i["model"] if i["model"] != "custom" else i["customParams"]
    return estimate(
        model,
        i["ranks"],
        i["dtype"],
        i["optimizer"],
        i["strategy"],
        i["group"],
        i["batch"],
        i["seq"],
        i["ac"],
    )


def test_the_pages_own_script_under_node_gives_the_python_numbers():
    """The page's perRankBytes, run by Node.js on the exported table, equals estimate()
    exactly on every input of the grid: both precisions, checkpointing on and off,
    every strategy."""
    html = calculator_html()
    script = html.split("// --- begin formula ---")[1].split("// --- end formula ---")[
        0
    ]
    payload = re.search(
        r'<script type="application/json" id="distlab-memcalc-data">(.*?)</script>',
        html,
    ).group(1)
    assert json.loads(payload) == calculator_data()
    inputs = list(grid())
    assert len(inputs) > 2000
    program = (
        script + f"\nconst data = {payload};\nconst inputs = {json.dumps(inputs)};\n"
        "console.log(JSON.stringify(inputs.map((i) => perRankBytes(data, i))));"
    )
    # stdin: long
    node = subprocess.run(
        ["node", "-"], input=program, capture_output=True, text=True, timeout=60
    )
    assert node.returncode == 0, node.stderr
    for inp, js in zip(inputs, json.loads(node.stdout), strict=True):
        assert js == python_estimate(inp), inp


# the whole inline script, run against a stand-in for the page's form: what a reader
# would see
FAKE_PAGE = """
const values = %s;
const elements = {};
for (const [k, v] of Object.entries(values)) elements[k] = k === "ac" ? {checked: v} : {value: String(v)};
const out = {innerHTML: "", textContent: ""};
const root = {querySelector: (sel) => (sel === "form" ? {elements, addEventListener() {}} : out)};
global.document = {getElementById: (id) => (id.endsWith("-data") ? {textContent: %s} : root)};
%s
console.log(out.textContent || out.innerHTML);
"""  # noqa: E501 (a data string: HTML or JavaScript)


@pytest.mark.parametrize(
    "values,expected",
    [
        ({"model": "paper_7.5b", "ranks": 64, "strategy": "zero1"}, "<b>31.4 GB</b>"),
        (
            {"model": "gpt2", "ranks": 8, "strategy": "fsdp2", "ac": True, "seq": 1024},
            None,
        ),
        (
            {"model": "tiny", "ranks": 8, "strategy": "hsdp", "group": 3},
            "hybrid sharding needs a group size g",
        ),
        ({"model": "tiny", "seq": 65}, "sequence length from 1 to 64"),
    ],
)
def test_the_page_script_renders_the_python_total_or_says_what_is_wrong(
    values, expected
):
    form = {
        "model": "tiny",
        "custom": 7.5,
        "ranks": 8,
        "group": 4,
        "dtype": "bf16_mixed",
        "optimizer": "adamw",
    }
    form |= {"strategy": "ddp", "ac": False, "batch": 8, "seq": 64} | values
    html = calculator_html()
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    payload = json.dumps(json.dumps(calculator_data()))
    node = subprocess.run(
        ["node", "-e", FAKE_PAGE % (json.dumps(form), payload, script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert node.returncode == 0, node.stderr
    if expected is None:  # the total the Python calculator gives for the same inputs
        args = [form[k] for k in ("model", "ranks", "dtype", "optimizer", "strategy")]
        est = estimate(
            *args,
            micro_batch=form["batch"],
            seq_len=form["seq"],
            activation_checkpointing=form["ac"],
        )
        expected = f"<b>{format_bytes(est['total'])}</b>"
    assert expected in node.stdout


def test_the_page_fetches_nothing_and_the_widget_builds():
    html = calculator_html()
    assert "http" not in html and " src=" not in html and "<link" not in html
    assert len(calculator_widget().children) == 2
    text = format_estimate(estimate("paper_7.5b", 64, "bf16_mixed", strategy="zero1"))
    assert "31.4 GB" in text and "n/a" in text


def test_allocated_bytes_of_a_plain_model_are_its_tensor_bytes_and_a_tied_matrix_counts_once():  # noqa: E501
    model = GPT(preset("tiny"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(*torch.randint(0, 65, (2, 2, 8)))[1].backward()
    optimizer.step()
    # no padding, no sharing
    assert allocated_state_bytes(model, optimizer) == state_bytes(model, optimizer)
    # wte = lm_head
    assert allocated_state_bytes(model, optimizer)["params"] == 4 * count_parameters(
        model
    )


# the formula itself: tests/unit/test_memory_and_flops.py
def test_bf16_activations_are_counted_in_bf16_bytes():
    cfg, fp32, bf16 = (
        preset("tiny"),
        *(
            activation_bytes(preset("tiny"), 4, 64, dtype=d)
            for d in ("fp32", "bf16_mixed")
        ),
    )
    assert (
        bf16["saved"]
        == activation_bytes_formula(cfg, 4, 64, value_bytes=2)["total"]
        < 0.6 * fp32["saved"]
    )
    assert (
        estimate("tiny", 2, "bf16_mixed", micro_batch=4, seq_len=64)["activations"]
        == bf16["peak"]
    )


def test_without_resharding_the_calculator_gathers_every_parameter_whole():
    """The calculator's gathered part on gpt2 (the page measures it on the tiny GPT,
    2 ranks)."""
    # without resharding the parameters are whole at the peak, not 1/N
    n = model_params("gpt2")
    no_reshard, zero3 = (
        estimate("gpt2", 8, "bf16_mixed", strategy=s)
        for s in ("fsdp2-no-reshard", "fsdp2")
    )
    assert no_reshard["gathered"] == 2 * n  # every parameter, whole, in bf16
    assert [no_reshard[p] for p in PARTS] == [zero3[p] for p in PARTS] and sum(
        zero3[p] for p in PARTS
    ) == 16 * n / 8
    assert (
        zero3["gathered"]
        == 2 * gathered_params("fsdp2", n, MODELS["gpt2"]["config"])
        < no_reshard["gathered"]
    )
