"""``--additional-config``: vLLM Ascend's plugin options (its additional_config.md), by name.

Every documented key tunes an Ascend-specific mechanism of vLLM Ascend (graph modes, fused
operators, weight layouts, HCCL communication, scheduler extensions). qwenserve implements none of
those mechanisms, on Ascend or elsewhere, so each given key is logged once at start-up with what it
does in vLLM Ascend and that it has no effect here. Unknown keys get a warning, as vLLM Ascend
gives; a value that is not a JSON object is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qwenserve.json_option import json_object_option

# vLLM Ascend's documented keys (docs/source/user_guide/configuration/additional_config.md)
KNOWN_KEYS: dict[str, str] = {
    "xlite_graph_config": "Xlite graph mode",
    "finegrained_tp_config": "per-module tensor-parallel sizes (lm_head, o_proj, mlp)",
    "ascend_compilation_config": "npugraph_ex backend and Ascend fusion passes",
    "eplb_config": "expert-parallel load balancing",
    "scheduler_config": "Ascend scheduler extensions (balance, recompute, chunked PP)",
    "refresh": "refresh of the global Ascend config (tests, RLHF)",
    "dump_config": "msprobe dumps",
    "dump_config_path": "msprobe dump config file",
    "enable_shared_expert_dp": "shared experts replicated and run data-parallel",
    "multistream_overlap_shared_expert": "shared expert on a second NPU stream",
    "enable_cpu_binding": "binding of host threads to NUMA-local ARM cores",
    "pa_shape_list": "paged-attention operator shapes",
    "enable_kv_nz": "NZ layout of the KV cache (MLA models)",
    "enable_sparse_sfa_c8": "C8 KV cache of sparse flash attention (DSA models)",
    "enable_sparse_li_c8": "C8 caches of LightningIndexer (DSA models)",
    "c8_enable_reshape_optim": "StoreKVBlock for LightningIndexer C8 writes",
    "enable_mc2_hierarchy_comm": "MC2 dispatch/combine over RoCE between nodes",
    "enable_prefill_mc2": "MC2 token capacity for prefill batches",
    "mega_moe_max_tokens": "per-rank token capacity of the fused mega-MoE operator",
    "msmonitor_use_daemon": "msmonitor daemon mode",
    "enable_mlapo": "MLAPO fused MLA preprocessing",
    "weight_nz_mode": "NZ (fractal) layout of weights for the Ascend matmul units",
    "enable_fused_mc2": "fused MC2 MoE dispatch/combine operator",
    "enable_transpose_kv_cache_by_block": "block-wise KV cache transpose operator",
    "enable_dsa_cp": "DSA context parallelism (DeepSeek V3.2/V4)",
    "rejection_sampler_config": "block/entropy verification in speculative decoding",
    "dynamic_spec_config": "dynamic speculative decoding",
    "multistream_dsv4_dsa_overlap": "DSA multi-stream overlap (DeepSeek V4)",
    "rl_config": "RL-mode defaults",
    "enable_reduce_sample": "top-k sampling over TP-partitioned logits",
    "weight_prefetch_config": "weight prefetching into on-chip memory",
}


@dataclass(frozen=True)
class AdditionalConfig:
    given: dict[str, Any] = field(default_factory=dict)

    def startup_notes(self, platform_name: str) -> tuple[list[str], list[str]]:
        """(info lines for known keys, warnings for unknown ones)."""
        infos, warnings = [], []
        for key, value in self.given.items():
            shown = f"--additional-config {key}={json.dumps(value)}"
            if key in KNOWN_KEYS:
                infos.append(f"{shown} (vLLM Ascend: {KNOWN_KEYS[key]}): no effect on "
                             f"{platform_name}: qwenserve does not implement this vLLM Ascend "
                             "mechanism")
            else:
                warnings.append(f"{shown}: unknown key (not one of vLLM Ascend's documented "
                                "options); it has no effect")
        return infos, warnings


def parse_additional_config(value: Any) -> AdditionalConfig:
    if value is None:
        return AdditionalConfig()
    return AdditionalConfig(json_object_option("--additional-config", value))
