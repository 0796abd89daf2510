"""The sections of tools/bench.py, one module each; timing.py holds what they share (CUDA-event
timing, the rows of the report, the checks, the per-kernel profile)."""
