"""Kernel contracts, layered: numpy reference (here, tested) <- Triton-lang kernels <- TensorRT
plugins. This release ships the reference only: the CPU path runs attention inside the ONNX graph
(backend/build/graph.py) and verification in numpy (backend/verify.py). GPU kernels for the ops
below must match `plugins.reference` exactly on the same inputs.
"""
NAMESPACE = "specdec"
TREE_ATTENTION = "tree_attention"     # q [B,Hq,T,D], k/v [B,Hkv,S,D], bias [B,T,S] -> [B,Hq,T,D]
REJECTION_SAMPLE = "rejection_sample"  # see backend/verify.py (chain and tree, noise as input)
