"""Triton model `draft`: a draft node (backend/draft_node.py). One JSON request in (the rows of
a target's step), one JSON response out (a proposal or `resync` per row)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import triton_glue


class TritonPythonModel:
    def initialize(self, args):
        triton_glue.enable_fault_log(args)
        self.node = triton_glue.draft_node(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                body = json.loads(pb_utils.get_input_tensor_by_name(request, "request").as_numpy().reshape(-1)[0])
                f = pb_utils.get_input_tensor_by_name(request, "features")
                out = self.node.handle(body, None if f is None else f.as_numpy())
                arr = np.array([json.dumps(out).encode()], np.object_)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("response", arr)]))
            except Exception as exc:
                responses.append(triton_glue.error_response(pb_utils, exc, internal=True))
        return responses
