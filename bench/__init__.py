"""The benchmarks: `adloco-bench` (suite.py) runs the sections of issue 11; the other scripts run alone
(`python bench/NAME.py`, from the repository root)."""
