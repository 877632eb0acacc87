"""Triton paged-attention kernels and their torch references."""
