"""The GPUs and links the planner knows, each number with the public source it
comes from.

    from distlab.planner.hardware import GPUS, NETWORKS
    # FLOP/s a large bf16 GEMM reaches
    GPUS["a100-80gb"].bf16_peak * GPUS["a100-80gb"].matmul_efficiency

Datasheet numbers (peak, memory, bandwidths, NICs) are what NVIDIA and the clouds
publish. The two efficiencies are measurements someone else published and a reader can
rerun: the matmul one is Stas Bekman's MAMF table (mamf-finder.py), the best one large
GEMM reaches alone; the attention one comes from the FlashAttention papers. Neither is
fitted: what a whole training step achieves is calibrated on published runs apart
(``distlab.planner.calibrate``), and the MAMF figure is used only where no run
calibrates a GPU. The Grand Teton H100's peak is an upper bound (see its entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distlab.costs.collectives import (
    BASE_SIMPLE,
    NCCL_TUNING,
    NET_STEP,
    RING_NVLINK,
    RING_PLATEAU,
    cross_node_busbw,
)

# --- sources (each read for this file; pinned where it is a repository) ---
MAMF_TABLE = (
    "Stas Bekman, ml-engineering, 'Maximum Achievable Matmul FLOPS comparison "
    "table' (BF16, v2, mean of 100 "
    "iterations after 50 warmup), https://github.com/stas00/ml-engineering/blob/"
    "b9e29720eebd4aa946fa9678975385efbc90a777/compute/accelerator/README.md ; "
    "benchmark: "
    "compute/accelerator/benchmarks/mamf-finder.py in the same repository"
)
FA2_PAPER = (
    "Tri Dao, FlashAttention-2 (arXiv 2307.08691), abstract and section 1: "
    "'reaching 50-73% of the theoretical "
    "maximum FLOPs/s on A100'; forward 'up to 73%', backward 'up to 63%' (A100 "
    "80GB SXM4); its FLOP count "
    "halves the attention FLOPs under a causal mask and counts the backward as "
    "2.5x the forward"
)
FA3_PAPER = (
    "Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, FlashAttention-3 (arXiv "
    "2407.08608), abstract: "
    "'FlashAttention-2 achieving only 35% utilization on the H100 GPU' (same "
    "FLOP count as FA2, causal halved)"
)
A100_SPECS = (
    "NVIDIA A100 datasheet "
    "(nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), as reproduced at "
    "https://glennklockwood.com/garden/processors/A100 : BF16 312 TFLOPS dense "
    "(624 sparse); A100 80G SXM4 "
    "80 GB HBM2e at 2.039 TB/s; NVLink '300+300 GB/s'. Same 312 in the MAMF "
    "table's 'Theory' column"
)
H100_SPECS = (
    "NVIDIA H100 SXM datasheet table as reproduced at "
    "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"
    " : BFLOAT16 Tensor Core 1,979 TFLOPS 'shown with sparsity, specifications "
    "1/2 lower without sparsity'; "
    "80 GB HBM3, 3,350 GB/s; 'NVLink: 900GB/s'. The MAMF table's 'Theory' "
    "column says 989"
)
GRAND_TETON = (
    "torchtitan docs/performance.md, "
    "https://github.com/pytorch/torchtitan/blob/eaea6f6a2fa940f03a10906be1df3489cf30af85"
    "/docs/performance.md : 'Each H100 GPU is equipped with 96GB HBM2e with 2.4 "
    "TB/sec peak memory bandwidth', "
    "'fully connected with NVLink', 'We used the default 500W power limit, "
    "although tuning it up to 700W TDP can "
    "potentially provide further speedups'; footnote 2: 'HBM2e-based SXM H100 "
    "with lower TDP, the actual peak TFLOPs "
    "number is between SXM and NVL, and we don't know its exact value'"
)
TT_PEAK_FLOPS = (
    "torchtitan get_peak_flops, "
    "https://github.com/pytorch/torchtitan/blob/9fd2b5172bcb9a5c49d18c75c3ab833abe990819"
    "/torchtitan/utils.py : H100 NVL 835e12, PCIe 756e12, 'for H100 SXM and "
    "other variants' 989e12"
)

# The A100 attention figure: FA2's fig. 4(d) (fwd+bwd, causal, head dim 128, A100) gives
# its values only as bar labels in an image, which no text copy of the paper carries, so
# they are NOT used here. What the text states is the forward's best (73%) and the
# backward's best (63%); a fwd+bwd pass does 1 + 2.5 = 3.5 forward-units of FLOPs, so if
# both ran at their best the pair would reach 3.5 / (1/0.73 + 2.5/0.63) = 0.656 of peak.
# That is a derived UPPER bound (the two bests may come from different settings), in
# FA2's causal-halved FLOP count.
FA2_A100_FWD_BEST, FA2_A100_BWD_BEST = 0.73, 0.63
FA2_A100_FWD_BWD_BOUND = 3.5 / (1 / FA2_A100_FWD_BEST + 2.5 / FA2_A100_BWD_BEST)


@dataclass(frozen=True)
class GPU:
    """One accelerator: datasheet numbers plus the measured fractions of its
    bf16 peak."""

    name: str  # the key in GPUS
    label: str
    # dense bf16 tensor-core FLOP/s (the datasheet's sparse figure halved)
    bf16_peak: float
    # HBM capacity as the datasheet writes it: 80 GB = 80e9 bytes (not GiB)
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    # bytes/s ONE direction per GPU (the datasheet's total is both directions)
    nvlink_bandwidth: float
    # MAMF / bf16 peak: the best a large bf16 GEMM reached (one shape, one torch)
    matmul_efficiency: float
    # FlashAttention-2 fwd+bwd, causal, in FA2's causal-halved FLOP count
    attention_efficiency: float | None
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # where the datasheet peak is only an upper bound: the lowest the peak may be
    bf16_peak_floor: float | None = None
    # GPUs of one kind compute alike (same chip, clocks and power): the calibration
    # fits one GEMM efficiency per kind; None: the GPU's own name
    kind: str | None = None


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU(
        name="a100-80gb",
        label="NVIDIA A100 SXM4 80GB",
        kind="a100-sxm",
        bf16_peak=312e12,
        memory_bytes=80e9,
        hbm_bandwidth=2.039e12,
        nvlink_bandwidth=300e9,  # 600 GB/s total, 300 each way
        # MAMF row: "NVIDIA A100 SXM | 271.2 | 312 | 86.9% | 1024x10240x5120 |
        # 2.6.0+cu126" (the row does not say 40 or 80 GB; the two differ only in memory,
        # so the figure is used for the 80 GB part)
        matmul_efficiency=271.2 / 312,
        attention_efficiency=FA2_A100_FWD_BWD_BOUND,
        sources={
            "bf16_peak": A100_SPECS,
            "memory_bytes": A100_SPECS
            + " (the usable capacity torch reports is smaller; no source read here)",
            "hbm_bandwidth": A100_SPECS,
            "nvlink_bandwidth": A100_SPECS,
            "matmul_efficiency": MAMF_TABLE
            + " : A100 SXM MAMF 271.2 TFLOPS of 312 (86.9%)",
            "attention_efficiency": FA2_PAPER
            + " ; 0.656 = derived upper bound, see FA2_A100_FWD_BWD_BOUND",
        },
    ),
    "a100-40gb": GPU(
        name="a100-40gb",
        label="NVIDIA A100 SXM4 40GB",
        kind="a100-sxm",  # the 80 GB part's compute: 'Its FLOPS were the same'
        bf16_peak=312e12,
        memory_bytes=40e9,  # '40 GB HBM2 (5 stacks)'
        hbm_bandwidth=1.555e12,  # '1.555 TB/s'
        nvlink_bandwidth=300e9,  # '300+300 GB/s NVLink'
        # the MAMF row 'NVIDIA A100 SXM' names no memory size: the same figure as the
        # 80 GB part's (the two compute alike: 'Its FLOPS were the same')
        matmul_efficiency=271.2 / 312,
        attention_efficiency=FA2_A100_FWD_BWD_BOUND,
        sources={
            "bf16_peak": A100_SPECS + " ('A100 40G SXM4'; 'Its FLOPS were the same')",
            "memory_bytes": A100_SPECS + " ('40 GB HBM2 (5 stacks)')",
            "hbm_bandwidth": A100_SPECS + " ('1.555 TB/s')",
            "nvlink_bandwidth": A100_SPECS,
            "matmul_efficiency": MAMF_TABLE
            + " : A100 SXM MAMF 271.2 TFLOPS of 312 (the row names no memory size)",
            "attention_efficiency": FA2_PAPER
            + " ; 0.656 = derived upper bound, see FA2_A100_FWD_BWD_BOUND",
        },
    ),
    "h100-sxm": GPU(
        name="h100-sxm",
        label="NVIDIA H100 SXM5 80GB",
        # 1,979 sparse / 2 = 989.5; the MAMF table and torchtitan's get_peak_flops
        # use 989
        bf16_peak=989e12,
        memory_bytes=80e9,
        hbm_bandwidth=3.35e12,
        nvlink_bandwidth=450e9,  # 900 GB/s total, 450 each way
        # MAMF row: "NVIDIA H100 SXM | 794.5 | 989 | 80.3% | 2048x2048x13312
        # | 2.7.0+cu126"
        matmul_efficiency=794.5 / 989,
        # FA3's abstract: FA2 reaches 35% on H100. The sentence names no setting
        # (causal, head dim, length).
        attention_efficiency=0.35,
        sources={
            "bf16_peak": H100_SPECS,
            "memory_bytes": H100_SPECS,
            "hbm_bandwidth": H100_SPECS,
            "nvlink_bandwidth": H100_SPECS,
            "matmul_efficiency": MAMF_TABLE
            + " : H100 SXM MAMF 794.5 TFLOPS of 989 (80.3%)",
            "attention_efficiency": FA3_PAPER,
        },
    ),
    # Meta's Grand Teton H100 (torchtitan's H100 tables): an SXM-style H100 with 96 GB
    # HBM2e, run at 500 W.
    "h100-96gb-500w": GPU(
        name="h100-96gb-500w",
        label="NVIDIA H100 96GB HBM2e, 500 W (Grand Teton)",
        # No datasheet for this part was read. torchtitan's get_peak_flops returns
        # 989e12 for every H100 that is not NVL or PCIe, and its doc says the true peak
        # lies 'between SXM and NVL' (835e12): an upper bound.
        bf16_peak=989e12,
        bf16_peak_floor=835e12,  # the H100 NVL's (TT_PEAK_FLOPS)
        memory_bytes=96e9,  # '96GB HBM2e' (GRAND_TETON)
        hbm_bandwidth=2.4e12,  # '2.4 TB/sec peak memory bandwidth' (GRAND_TETON)
        # 'fully connected with NVLink', no bandwidth stated: the H100 SXM's assumed
        nvlink_bandwidth=450e9,
        # The H100 SXM's MAMF: the row states no power limit; an H100 SXM's TDP is 700 W
        # (GRAND_TETON: 'tuning it up to 700W TDP'), this part runs at 500 W, so
        # tokens/s predicted for it are an UPPER bound.
        matmul_efficiency=794.5 / 989,
        attention_efficiency=0.35,  # the H100's (FA3_PAPER); none measured at 500 W
        sources={
            "bf16_peak": TT_PEAK_FLOPS + " ; " + GRAND_TETON + " footnote 2",
            "memory_bytes": GRAND_TETON,
            "hbm_bandwidth": GRAND_TETON,
            "nvlink_bandwidth": H100_SPECS
            + " (assumed: the doc states NVLink but not its bandwidth)",
            "matmul_efficiency": MAMF_TABLE
            + " : H100 SXM MAMF 794.5 TFLOPS of 989, at the SXM's power, not 500 W",
            "attention_efficiency": FA3_PAPER + " (H100 SXM, not this part)",
        },
    ),
}
# Not included: H200 and A100 40GB. The MAMF table (commit above) has no H200 row (its
# GH200 row, 828.6 of 989, is a 900 W Grace-Hopper part) and no row that says A100 40GB,
# so their matmul efficiency has no source yet.


@dataclass(frozen=True)
class Network:
    """What a node's GPUs reach other nodes through: its NICs, each one way."""

    name: str
    label: str
    nic_bandwidth: float  # bytes/s of one NIC, one direction (its line rate / 8)
    nics_per_node: int  # of an 8-GPU node
    source: str

    def busbw(self, intra_busbw: float) -> float:
        """The bus bandwidth of a ring across nodes: a channel per NIC
        (``costs.collectives.cross_node_busbw``)."""
        return cross_node_busbw(self.nics_per_node, self.nic_bandwidth, intra_busbw)


# Latencies are NCCL's tuning model (``distlab.costs.collectives``): per ring step over
# NVLink, per step over the network with the multi-node plateau, and once per call.
NVLINK_LAT = RING_NVLINK
NET_LAT = RING_PLATEAU * NET_STEP
CALL_LAT = BASE_SIMPLE
NETWORKS: dict[str, Network] = {
    # HGX nodes: a NIC per GPU (the usual 8-NIC node; a cluster with fewer NICs differs)
    "ib-200g": Network(
        "ib-200g",
        "HDR InfiniBand, 8 x 200 Gb/s per node",
        200e9 / 8,
        8,
        "ConnectX-6 HDR: '200 Gb/s Ethernet and InfiniBand', "
        "https://lenovopress.lenovo.com/lp1195 ; " + NCCL_TUNING,
    ),
    "ib-400g": Network(
        "ib-400g",
        "NDR InfiniBand, 8 x 400 Gb/s per node",
        400e9 / 8,
        8,
        "'400 Gbps (NDR) InfiniBand doubles network performance compared to HDR', "
        "https://docs.nvidia.com/dgx-superpod/design-guide-cabling-data-centers/latest/ndr-overview.html"  # noqa: E501
        " ; " + NCCL_TUNING,
    ),
    # AWS p4d: '8 x 40 GB NVIDIA Tesla A100 GPUs with NVSwitch and 400 Gbps Elastic
    # Fabric Adapter (EFA)' per instance: 4 x 100 Gb/s. (p4d carries 40 GB A100s; the
    # 80 GB ones are p4de, not read here.)
    "efa-p4d": Network(
        "efa-p4d",
        "AWS p4d EFA, 400 Gb/s per 8-GPU instance",
        100e9 / 8,
        4,
        "AWS Compute Blog 'Amazon EC2 P4d instances deep dive' "
        "(aws.amazon.com/blogs/compute/amazon-ec2-p4d-"
        "instances-deep-dive/, read via its syndicated copy "
        "https://noise.getoto.net/2020/11/03/amazon-ec2-p4d-"
        "instances-deep-dive/) ; " + NCCL_TUNING,
    ),
    # AWS p5: 'P5 and P5e support up to 32 network cards and can provide up to 3,200
    # Gbps': 32 x 100 Gb/s
    "efa-p5": Network(
        "efa-p5",
        "AWS p5 EFA, 3200 Gb/s per 8-GPU instance",
        100e9 / 8,
        32,
        "AWS EC2 User Guide, 'Maximize network bandwidth on accelerated "
        "computing instances with EFA' "
        "(docs.aws.amazon.com/AWSEC2/latest/UserGuide/p5-efa.html; read in its "
        "Portuguese edition) ; " + NCCL_TUNING,
    ),
}
