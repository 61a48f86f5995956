"""Triton model `postprocessing`: cumulative output ids -> the new text of this response.

Runs once per streamed generator response. Stateless incremental detokenization: the generator
sends all ids so far and the character range that became final, so each response decodes to
exactly its chunk. On Triton 2.51 a cancelled ensemble stream is not seen by the running
generator, but the ensemble marks the next step (this one) cancelled: we then tell the
generator to stop that sequence (`stop` request), which frees its state.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from backend import triton_glue, triton_io
from backend.manifest import EngineManifest
from backend.tokenizer import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        cfg = triton_glue.serve_config(args)
        self.tok = Tokenizer.from_manifest(EngineManifest.load(cfg.engine_dir))

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = triton_glue.request_inputs(request)
            key = np.asarray(inputs[triton_io.SEQUENCE_KEY]).reshape(-1)[0]
            if request.is_cancelled():
                stop = pb_utils.InferenceRequest(model_name="generator", requested_output_names=[], inputs=[
                    pb_utils.Tensor(triton_io.STOP, np.array([[True]])),
                    pb_utils.Tensor(triton_io.SEQUENCE_KEY, np.array([[key]], np.object_)),
                    pb_utils.Tensor(triton_io.INPUT_IDS, np.zeros((1, 1), np.int32))])
                for _ in stop.exec(decoupled=True):
                    pass
            ids = np.asarray(inputs[triton_io.OUTPUT_IDS]).reshape(-1).tolist()
            start = int(np.asarray(inputs[triton_io.TEXT_START]).reshape(-1)[0])
            end = int(np.asarray(inputs[triton_io.TEXT_END]).reshape(-1)[0])
            text = self.tok.decode(ids)[start:end]
            batched = np.asarray(inputs[triton_io.OUTPUT_IDS]).ndim >= 2
            arr = np.array([text.encode("utf-8")], np.object_)
            out = {triton_io.TEXT_OUTPUT: arr[None] if batched else arr}
            responses.append(pb_utils.InferenceResponse(output_tensors=triton_glue.tensors(pb_utils, out)))
        return responses
