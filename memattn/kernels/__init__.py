"""Triton kernels. Imported lazily by memattn.ops: Triton decides at decoration time
whether a kernel runs compiled or in its interpreter (TRITON_INTERPRET=1)."""
