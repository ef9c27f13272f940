"""Compute kernels: pure functions over tensors. No Ray, no HTTP, nothing of ours imported."""
