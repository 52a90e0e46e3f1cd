"""Triton kernels, for the CUDA path.

Every module here but small_m_configs (plain launch tables) imports Triton when it is imported, and defines its
kernels then. So code outside this package imports a kernel module only inside the branch that launches it (a
CUDA tensor, or use_triton=True in tests under TRITON_INTERPRET=1): the CPU path never loads Triton, and runs
where it is not installed. A kernel module named after a module elsewhere (staged_inputs.py, tree_verify.py,
...) holds that module's kernel; the module keeps the torch path and the choice between the two.
"""
