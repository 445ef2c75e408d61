"""Triton kernels beside the attention backends, each with a torch reference: fused elementwise work for the blocks
(`elementwise`) and the packed-batch geometry in one launch (`geometry`)."""
