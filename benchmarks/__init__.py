"""autopar's benchmarks: `python -m benchmarks` (or `make bench`) writes benchmarks/results/."""
