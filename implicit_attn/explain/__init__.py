"""Explanations built on the operators: per-layer maps, raw attention, rollout,
Mamba-Attribution (Eq. 23), gradient-weighted contributions, faithfulness metrics,
figures, an HTML report, viewer adapters and the ``explain`` command.

    from implicit_attn.explain import explain, faithfulness
    ex = explain(model, ids, method="rollout", variant="full")   # ex.relevance (B, L)
    ex = explain(griffin_lm, ids, segment_pos=pos)               # packed documents (Griffin)
    m = operator_map(op, "abs_mean", heads=[0, 2])                # Mamba-2 / attention heads
    curves = faithfulness(model, ids, ex.relevance)               # {"auac": Curve, ...}
    M = oversmoothing(model, ids)              # (B, layers): Eq. 24 cosine similarity per layer
    r = vision.cls_relevance(params, images, cfg, "attribution")   # ViM: (B, patches) for CLS
"""
from . import vision
from .adapters import circuitsvis_kwargs, to_bertviz, to_circuitsvis
from .maps import (channel_maps, head_channels, head_maps, iter_operators, minmax_normalize, model_maps,
                   operator_map, position_mean)
from .methods import (METHODS, Explanation, attribution_maps, contribution_map, explain,
                      output_gradients, raw_attention, resolve_target, rollout)
from .metrics import (Curve, activation, comprehensiveness, faithfulness, negative_perturbation,
                      perturbation_curve, positive_perturbation, pruning, random_relevance, sufficiency)
from .report import render_html, write_html
from .smoothing import feature_smoothing, oversmoothing, smoothing_summary
from .viz import curves_plot, heatmap_grid, operator_grid, relevance_strip, smoothing_plot

__all__ = ["explain", "Explanation", "METHODS", "raw_attention", "rollout", "attribution_maps",
           "contribution_map", "output_gradients", "resolve_target", "operator_map", "channel_maps",
           "head_maps", "head_channels",
           "model_maps", "iter_operators", "minmax_normalize", "position_mean", "Curve", "activation",
           "pruning", "positive_perturbation", "negative_perturbation", "comprehensiveness",
           "sufficiency", "faithfulness", "perturbation_curve", "random_relevance", "heatmap_grid",
           "relevance_strip", "operator_grid", "curves_plot", "render_html", "write_html",
           "to_circuitsvis", "circuitsvis_kwargs", "to_bertviz", "oversmoothing", "feature_smoothing",
           "smoothing_summary", "smoothing_plot", "vision"]
