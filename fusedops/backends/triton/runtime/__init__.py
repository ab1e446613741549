"""Host-side machinery of the Triton backend, shared by every op: device facts, the lean
:class:`~.launcher.Launcher`, the plan caches and replay runners, the split-row and cluster
launchers. Nothing here decides a launch configuration (that is ``configs/``) or holds a kernel
body (``kernels/``); names here are public within the package.
"""
