"""Triton model `preprocessing`: text_input (+ apply_chat_template) -> input_ids.

It also validates the request (sequence.validate_request, with what it knows here: the engine's
length), so the ensemble refuses a bad request (INVALID_ARG naming the field) before the
generator starts; the generator checks the drafter against what it runs."""
import numpy as np
import triton_python_backend_utils as pb_utils

from backend import triton_glue, triton_io
from backend.manifest import EngineManifest
from backend.sequence import RequestLimits, validate_request
from backend.tokenizer import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        triton_glue.enable_fault_log(args)
        cfg = triton_glue.serve_config(args)
        manifest = EngineManifest.load(cfg.engine_dir)
        self.tok = Tokenizer.from_manifest(manifest)
        self.limits = RequestLimits(manifest.max_seq_len)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = triton_glue.request_inputs(request)
                text = triton_io.prompt_text(inputs, self.tok.apply_chat_template)
                ids = np.asarray(self.tok.encode(text, add_special_tokens=True), np.int32)
                parsed = triton_io.parse(inputs, ids, context=self.limits.max_seq_len)
                validate_request(parsed.request, self.limits)
                arrays = {triton_io.INPUT_IDS: ids[None] if parsed.batched else ids}
                responses.append(pb_utils.InferenceResponse(output_tensors=triton_glue.tensors(
                    pb_utils, arrays, triton_glue.requested_outputs(request))))
            except Exception as exc:
                responses.append(triton_glue.error_response(
                    pb_utils, exc, internal=not isinstance(exc, triton_io.RequestError)))
        return responses
