"""Benchmarks: figures printed side by side with the floors measured in the same run."""
