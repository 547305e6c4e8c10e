"""Reproductions of the vision experiments of the implicit-attention papers (Vision Mamba on small images)."""
