"""The DDP benchmark (distlab.bench.ddp): torch DDP at its defaults, interleaved
repeats, and no verdict inside the spread; and the recording the DDP chapter reads."""

import json
import statistics

import matplotlib.pyplot as plt
import pytest
import torch.distributed as dist

from distlab.bench import ddp as bench
from distlab.infra import claims
from distlab.infra.experiment import WrapOptions, build
from distlab.infra.launch import run_ranks
from distlab.infra.paths import REPO_ROOT

RECORDED = REPO_ROOT / "results" / "ddp_bench.json"


def _first_bucket(options: WrapOptions) -> tuple[bool, int]:
    wrapped = build("ddp", "tiny", options=options).wrapped
    return (
        wrapped.bucket_bytes_cap_default,
        wrapped._bucket_config.first_bucket_bytes_cap,
    )


def test_torch_ddp_keeps_its_small_first_bucket_only_when_bucket_cap_mb_is_not_passed():
    default, passed = run_ranks(
        lambda: (
            _first_bucket(WrapOptions()),
            _first_bucket(WrapOptions(bucket_cap_mb=25)),
        ),
        nprocs=2,
    )[0]
    # 1 MiB first, then 25
    assert default == (True, dist._DEFAULT_FIRST_BUCKET_BYTES) == (True, 2**20)
    # the default value, passed: every bucket 25 MiB
    assert passed == (False, 25 * 2**20)


def test_the_plan_runs_torch_ddp_at_its_defaults_and_passes_a_cap_only_in_the_sweep():
    rows = bench.plan(nprocs=2, caps=[1.0, 25.0])
    assert rows["ddp"]["cap"] is None and all(
        rows[s]["cap"] is None for s in ("ddp-naive", "ddp-bucketed")
    )
    assert [r["cap"] for name, r in rows.items() if name.startswith("ddp cap=")] == [
        1.0,
        25.0,
    ]
    assert (rows["lab1_single"]["ranks"], rows["lab2_ddp"]["ranks"]) == (1, 2)


def _result(rows: dict[str, list[float]]) -> dict:
    work = {"preset": "tiny", "global_batch": 16, "nprocs": 2, "repeats": 3}
    return {
        "workload": work,
        "rows": {
            name: {"about": name, "tokens_per_s": claims.spread(t)}
            for name, t in rows.items()
        },
    }


def test_two_rows_differ_only_when_their_spreads_do_not_overlap():
    result = _result(
        {
            "lab1_single": [100, 110, 105],
            "lab2_ddp": [111, 120, 115],
            "ddp": [100, 104, 102],
            # overlaps DDP's 100-104: a draw, though its median is lower
            "ddp-naive": [95, 103, 99],
            "ddp-bucketed": [106, 108, 107],
            "ddp cap=1": [90, 92, 91],
        }
    )
    assert [
        bench.compare(result, n, "ddp")
        for n in ("ddp-naive", "ddp-bucketed", "ddp cap=1")
    ] == [
        "within noise",
        "faster",
        "slower",
    ]
    # lab 2 is compared with lab 1
    assert bench.verdict(result, "lab2_ddp") == "faster (vs lab1_single)"
    assert bench.verdict(result, "ddp") == bench.verdict(result, "lab1_single") == ""
    table = {row["row"]: row for row in bench.table(result)}
    assert (
        table["ddp-naive"]["min - max"] == "95 - 103"
        and table["ddp-naive"]["median / torch DDP's"] == "0.97"
    )
    fig = bench.figure(result)
    # default DDP stands beside the sweep
    assert [len(ax.patches) for ax in fig.axes] == [5, 2]
    plt.close(fig)


def test_the_benchmark_refuses_fewer_than_three_repeats(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "2"])
    assert "--repeats must be at least 3" in capsys.readouterr().err


def test_the_recording_the_chapter_reads_has_repeats_spreads_and_defaults():
    result = json.loads(RECORDED.read_text())
    assert result["schema"] == bench.SCHEMA and result["workload"]["repeats"] >= 3
    prov = result["provenance"]
    assert {"cpu_flags", "load_average", "load_average_at_end", "finished"} <= set(prov)
    assert result["rows"]["ddp"]["bucket_cap_mb"] is None  # torch DDP as users get it
    for name, row in result["rows"].items():
        t = row["tokens_per_s"]
        assert len(t["repeats"]) == result["workload"]["repeats"], name
        assert (t["median"], t["min"], t["max"]) == (
            statistics.median(t["repeats"]),
            min(t["repeats"]),
            max(t["repeats"]),
        )
    for lab in ("lab1_single", "lab2_ddp"):
        assert all(m is None or 0 < m <= 1 for m in result["rows"][lab]["mfu"]), lab
