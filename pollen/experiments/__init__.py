"""Experiments on runs: grids of runs, their reports, the centralised baseline."""
