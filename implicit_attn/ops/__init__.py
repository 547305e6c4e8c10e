"""Pure functions shared by all blocks: arrays in, arrays out. Imports nothing else of
the library."""
from .attention import attention_mask, attention_output, attention_probs, query_blocks, softmax_decay_rows
from .conv import causal_conv, conv_matrix, conv_right
from .delta import (DeltaChunks, chunk_factors, delta_rule, delta_rule_matrix, grouped_transfer_matrix, segment_sums,
                    transfer_matrix, unit_lower_inverse)
from .dplr import DplrChunks, blocked_pairs, dplr_factors, dplr_matrix, dplr_parts, dplr_rule, dplr_step, factorizable
from .embed import embed
from .grouped import (expert_columns, expert_order, expert_packs, grouped_matmul_from_tokens, grouped_matmul_packs,
                      grouped_matmul_to_tokens, pack_layout, packs_from_tokens)
from .las import (POOL_ALIGNS, alibi_slopes, block_start, causal_distance, check_chunk, check_pool, las_alphas, las_probs,
                  las_scores, las_softmax, pool_rows, pool_values, pool_window, pooled_apply)
from .linear import linear
from .batching import any_in_batch, batched_as_tokens, most_in_batch, zero_mapped_with
from .precision import full_precision, rounded
from .materialize import scalar_decay_kernel, state_decay_kernel
from .mlstm import mlstm_matrix, mlstm_rule, mlstm_stabiliser
from .scan import linear_scan, selective_scan_sequential
from .ssd import ssd_chunked
from .wkv import EMPTY_LOG_MAX, past_decay, wkv_chunked
from .nan import from_first, mark_nan, nan_rows, zero_nan
from .segsum import causal_mask, chunk_sums, decay_matrix, decayed_scores, keep_causal, rate_times_time, segment_sum

__all__ = [
    "attention_mask", "attention_probs", "query_blocks", "attention_output", "softmax_decay_rows", "DeltaChunks", "chunk_factors", "delta_rule", "delta_rule_matrix", "segment_sums", "transfer_matrix", "grouped_transfer_matrix", "unit_lower_inverse", "DplrChunks", "blocked_pairs", "dplr_parts", "dplr_step", "dplr_rule", "dplr_factors", "dplr_matrix", "factorizable", "full_precision", "rounded", "any_in_batch", "most_in_batch", "zero_mapped_with", "batched_as_tokens", "EMPTY_LOG_MAX", "past_decay", "wkv_chunked", "linear", "causal_conv", "conv_matrix", "conv_right", "embed", "expert_order", "pack_layout", "expert_packs", "expert_columns", "grouped_matmul_packs", "packs_from_tokens", "grouped_matmul_from_tokens", "grouped_matmul_to_tokens",
    "scalar_decay_kernel", "state_decay_kernel", "mlstm_matrix", "mlstm_rule", "mlstm_stabiliser", "linear_scan", "selective_scan_sequential", "ssd_chunked", "causal_mask", "chunk_sums", "decay_matrix", "decayed_scores",
    "segment_sum", "keep_causal", "rate_times_time", "zero_nan", "from_first", "mark_nan", "nan_rows",
    "POOL_ALIGNS", "las_alphas", "alibi_slopes", "check_pool", "check_chunk", "causal_distance", "block_start", "las_scores",
    "las_softmax", "las_probs", "pool_rows", "pool_values", "pool_window", "pooled_apply",
]
