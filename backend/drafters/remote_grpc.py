"""The gRPC transport of drafters/remote.py: one call to a draft node's Triton model
(backend/serve/draft_node) with a deadline, through tritonclient. Kept apart so remote.py knows
only the node protocol and the serving core imports nothing from serve/.
Knows: tritonclient, the node model's tensors. Does not know: drafting.
"""
from __future__ import annotations

import json

import numpy as np


def draft_node_transport(url: str, timeout_s: float, model: str = "draft"):
    """A drafters/remote.py Transport over gRPC to a draft node's Triton model, with a deadline.
    Raises on an error, a timeout or an unreachable node."""
    import tritonclient.grpc as grpcclient

    state = {"client": None}

    def call(request: dict, features) -> dict:
        if state["client"] is None:
            state["client"] = grpcclient.InferenceServerClient(url)
        req = grpcclient.InferInput("request", [1], "BYTES")
        req.set_data_from_numpy(np.array([json.dumps(request).encode()], np.object_))
        inputs = [req]
        if features is not None and len(features):
            f = grpcclient.InferInput("features", list(features.shape), "FP32")
            f.set_data_from_numpy(np.ascontiguousarray(features, np.float32))
            inputs.append(f)
        try:
            result = state["client"].infer(model, inputs, client_timeout=timeout_s)
        except Exception:
            state["client"] = None                 # a fresh channel after a failure
            raise
        return json.loads(result.as_numpy("response")[0])
    return call
