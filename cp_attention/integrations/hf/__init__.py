"""The transformers wing: the attention function and mask registered as "cp_flash", the model check, the
guard of a multi-rank block, verification at first use, and the adapters (:mod:`.adapters`) of what a
modeling module computes along the sequence outside the attention interface."""
