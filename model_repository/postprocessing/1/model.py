"""Triton model `postprocessing`: the ensemble's last step.

The generator already sends each step's new text (it decodes for stop strings anyway), so this
step forwards it and holds no tokenizer. On Triton 2.51 a cancelled ensemble stream is not seen
by the running generator, but the ensemble marks the next step (this one) cancelled: we then tell
the generator to stop that sequence (`stop` request), which frees its state.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from backend import triton_glue, triton_io


class TritonPythonModel:
    def initialize(self, args):
        triton_glue.enable_fault_log(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = triton_glue.request_inputs(request)
            if request.is_cancelled():
                triton_glue.stop_generator(pb_utils, np.asarray(inputs[triton_io.SEQUENCE_KEY]).reshape(-1)[0])
            out = {triton_io.TEXT_OUTPUT: np.asarray(inputs[triton_io.TEXT_OUTPUT])}
            responses.append(pb_utils.InferenceResponse(output_tensors=triton_glue.tensors(pb_utils, out)))
        return responses

    def finalize(self):
        triton_glue.release_bls()
