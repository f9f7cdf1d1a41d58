"""Published training runs the planner is calibrated and checked on, one module per
source: what each states, quoted, and what it leaves out.

    from distlab.planner.runs import RUNS, RUNS_BY_NAME

Every run is data parallel only (FSDP, FSDP2 or ZeRO, no tensor or pipeline parallel).
A number is quoted from the source named beside it, or derived from quoted numbers with
the arithmetic shown in ``notes``; None means the source does not state it. GPU and
network keys refer to ``distlab.planner.hardware``.
"""

from __future__ import annotations

from distlab.planner.runs import (
    fms_fsdp,
    llm_foundry,
    llmc,
    torchtitan_a100,
    torchtitan_h100,
)

SOURCES = {
    "torchtitan (A100)": torchtitan_a100.RUNS,
    "torchtitan (H100)": torchtitan_h100.RUNS,
    "llm.c": llmc.RUNS,
    "llm-foundry": llm_foundry.RUNS,
    "fms-fsdp": fms_fsdp.RUNS,
}
RUNS = [run for runs in SOURCES.values() for run in runs]
RUNS_BY_NAME = {run["name"]: run for run in RUNS}
