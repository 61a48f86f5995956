"""GPU ops, layered: numpy reference (reference.py: the contracts and the spec) <- Triton-language
kernels (kernels.py, interpreted on a CPU) <- TensorRT plugins (next). Names shared by all layers.
"""
NAMESPACE = "specdec"
TREE_ATTENTION = "tree_attention"     # q [B,T,Hq,D], slot KV caches, ctx_len [B], paths [B,T,P] -> o
REJECTION_SAMPLE = "rejection_sample"  # logits [B,T,V], tree, params, noise keys -> accepted path
