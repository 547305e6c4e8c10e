"""Reproductions of the LaS attention paper (Zimerman & Wolf) on tasks that run on our CPUs."""
