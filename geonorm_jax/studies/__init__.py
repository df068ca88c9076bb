"""Studies: sweeps of runs, the claim experiments' protocol and statistics, run reports."""
