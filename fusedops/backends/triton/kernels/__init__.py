"""``@triton.jit`` code only, one file per op family. Launch decisions live in ``configs/``,
launchers in ``runtime/``, the host code that ties them together in ``triton/<op>.py``.
"""
