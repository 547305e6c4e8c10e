"""The demo and study built on the library: the induction-head task, its shipped Mamba
model (``assets/induction``) and the mechanism check (``implicit-attn demo``)."""
