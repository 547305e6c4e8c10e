"""The induction-head study (Yamamoto & Matsuzaki, Table 2): models, training, analysis."""
