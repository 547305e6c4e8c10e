"""Batch analysis at scale: ``analyze(model_or_ckpt, data, out, analyses=...)`` runs maps,
relevance, faithfulness and operator statistics over a corpus into a resumable Zarr v3
store (TensorStore), data parallel over local devices and ``jax.distributed`` processes.

    from implicit_attn.analyze import analyze, read_array, read_manifest
    summary = analyze("ckpt_dir", "corpus.jsonl", "store", analyses=("maps", "relevance"))
    rel = read_array("store", "relevance")          # (N, Lmax) float32, 0 after each length
"""
from .corpus import BadLine, Corpus
from .run import ANALYSES, Settings, analyze, attention_stats, batch_results, model_sharding, plan
from .store import Store, StoreMismatch, read_array, read_manifest

__all__ = ["analyze", "ANALYSES", "Settings", "Corpus", "BadLine", "Store", "StoreMismatch", "read_array",
           "read_manifest", "attention_stats", "batch_results", "model_sharding", "plan"]
