"""Speed and memory benchmarks. Run the suite with ``python -m benchmarks.run``."""
