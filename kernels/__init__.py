"""Compute kernels of the worker.

Every kernel has a plain-PyTorch reference (`*_ref`) that defines its meaning: it runs on
the CPU and is the oracle of the tests. On CUDA the public function dispatches to the
Triton implementation; everywhere else it runs the reference.
"""
