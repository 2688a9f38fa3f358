"""The targets the GPU results are held to, and what bounds each one that is missed.

A suite's results file gets a `targets` table: each headline ratio present with its target, whether
it is met, how far it is from it, and, for a miss, what limits it (docs/performance.md has the
measurements behind each bound).
"""

from __future__ import annotations

from typing import Any

HOST_BOUND = "Host work a step that the overlapped schedule does not hide."
REAL_MOE_BOUND = ("See real_moe's rows: the experts touched per layer against the step, and the slice's "
                  "engine_decode_vs_floor at the same batch for the fixed costs.")

SPEC_BOUND = ("See spec_decode's per-batch rows: the accept length its drafts reached, and `parts_ms` "
              "(the verify forward, the rejection rule, the drafter) against the plain step; a speculating "
              "step does not overlap the host with the device as plain decode steps do.")

# key -> (target: the ratio must be at least this, or at most this for keys in AT_MOST; the bound when missed)

TARGETS: dict[str, tuple[float, str]] = {
    "decode_attention_roofline_B32": (
        0.6,
        "Per-block key gathers through row indices do not overlap the P.V product, plus a fixed cost of "
        "two launches, the query tile load, split-K partials and their combine. Tried: split heuristics, "
        "block widths, narrow partials, lazy rescaling.",
    ),
    "decode_attention_vs_torch_B32": (5.0, "Same bound as decode_attention_roofline_B32."),
    "topk_only_vs_torch_topk_B1_N65536": (
        5.0,
        "Two launches (histogram filter, then one finishing program that walks the radix buckets "
        "serially); the fused scores + top-k, which the engine runs, is well above its torch chain.",
    ),
    "compressor_vs_torch": (10.0, ""),
    "mhc_vs_torch": (5.0, ""),
    "moe_mxfp4_weight_bw_B1": (
        0.7,
        "Four launches a call (operand packing, gate / up, down, the slot sum), none near the copy "
        "bandwidth alone. Tried: tile widths, packed f16x2 math, inline-asm e2m1 decode, 16-byte weight "
        "copies, pre-packed operands.",
    ),
    "moe_mxfp4_weight_bw_B8": (0.7, "At 8 tokens the 48 (token, slot) pairs meet few of the experts."),
    "engine_decode_vs_floor_B1_ctx4096": (
        0.6,
        "The captured decode graph is hundreds of launches a step (norms, routing, index building, "
        "compressor state writes) at 1-3 us each, FP8 GEMVs at about half the bandwidth and the MoE "
        "near 0.55 of it.",
    ),
    "engine_host_fraction_B32_ctx4096": (0.10, HOST_BOUND),
    "engine_host_fraction_B64_ctx4096": (0.10, HOST_BOUND),
    "decode_throughput_B8_64k_vs_4k": (0.8, ""),
    "engine_prefill_flop_frac_ctx16384": (
        0.4, "The GEMMs run at the cuBLAS rate; the rest is attention, the indexer scores and glue."),
    "engine_prefill_flop_frac_ctx65536": (
        0.4, "The indexer scores run one query row a program (row groups sharing the key gather were "
        "slower)."),
    "engine_release_vs_exact_step_B1_ctx4096": (
        1.1, "The FP8-row attention and the release-only round trips."),
    # 3514 / 6880 = 0.5108: the arithmetic of the pools' row formats (docs/performance.md).
    "engine_release_vs_exact_bytes_per_token": (0.511, ""),
    "engine_decode_vs_transformers_B1_ctx4096": (
        30.0, "transformers' own eager step varies by 2x between runs on one machine: compare within a run."),
    "engine_hisparse_vs_off_step_B1_ctx65536": (1.3, "HiSparse copies every top-k row it misses."),
    # HiSparse against off, each pair of engines timed alone (`hisparse_prefill`).
    "hisparse_prefill_vs_off_ctx16384": (
        1.3, "Each long chunk gathers its sequence's earlier C4 rows from the host tier once per CSA layer."),
    "hisparse_prefill_vs_off_ctx65536": (1.3, "Same bound as hisparse_prefill_vs_off_ctx16384."),
    "hisparse_decode_vs_off_ctx65536": (1.1, "HiSparse copies every top-k row it misses."),
    "topk_alone_vs_torch_B1_N65536": (
        5.0, "A chain of dependent L2 round trips (load, histogram atomics, grid barriers or a second "
        "launch, tie list, ordered store): the two launches and the one-launch select both sit there."),
    # "within 1.5x" read as within 1.5x of the 5x asked at 64K: at least 5 / 1.5.
    "topk_alone_vs_torch_B1_N4096": (5.0 / 1.5, "A fixed latency of either design."),
    # V4-Flash's 256 experts: the floor counts only the experts the timed steps' routing touched.
    # What bounds a miss is read from the section (its step against the slice's at the same batch).
    "decode_vs_floor_real_moe_B1": (0.6, REAL_MOE_BOUND),
    "decode_vs_floor_real_moe_B32": (0.6, REAL_MOE_BOUND),
    "decode_vs_floor_real_moe_B64": (0.5, REAL_MOE_BOUND),
    # Batch-invariant mode's decode throughput over the default plan's at the same batch.
    "batch_invariant_vs_default_B8": (
        0.5, "Every step replays the graph of the largest size (deterministic_slice's `plan`): at B8 "
        "a B32 replay, the padded rows' MoE pairs and attention included."),
    "batch_invariant_vs_default_B32": (0.5, "The same graph as the default plan at B32: a step that "
                                             "leaves it runs its chunks as one-token forwards."),
    # Speculation with the slice's distilled MTP block (`spec_decode`, k = 3): the B1 aim holds where
    # the accept length (`spec_accept_length_k3`) is at least 2.5; B32 is held to not losing speed
    # where the engine's batch threshold keeps speculation on (spec_decode sets it at the largest batch).
    "spec_speedup_B1": (1.8, SPEC_BOUND),
    "spec_speedup_B8": (1.2, SPEC_BOUND),
    "spec_speedup_B32": (0.95, SPEC_BOUND),
    # Seconds from `Engine.from_pretrained` to an engine that serves, the kernel cache on disk.
    "second_start_s": (15.0, "See cold_start's `phases`: checkpoint load, graph captures, warm-up steps."),
}
AT_MOST = {"engine_host_fraction_B32_ctx4096", "engine_host_fraction_B64_ctx4096",
           "engine_release_vs_exact_step_B1_ctx4096", "engine_release_vs_exact_bytes_per_token",
           "engine_hisparse_vs_off_step_B1_ctx65536", "hisparse_prefill_vs_off_ctx16384",
           "hisparse_prefill_vs_off_ctx65536", "hisparse_decode_vs_off_ctx65536", "second_start_s"}


def summarize(ratios: dict[str, Any]) -> dict[str, Any]:
    """-> {key: {value, target, at_most, met, of_target[, bound]}} for every target whose ratio is present."""
    table = {}
    for key, (target, bound) in TARGETS.items():
        if ratios.get(key) is None:
            continue
        value = float(ratios[key])
        at_most = key in AT_MOST
        met = value <= target if at_most else value >= target
        of_target = (target / value if value else float("inf")) if at_most else value / target
        table[key] = {"value": value, "target": target, "at_most": at_most, "met": met,
                      "of_target": of_target, **({} if met else {"bound": bound})}
    return table
