"""Triton model `generator`: the ensemble's decoupled token-level step.

Token ids in (from `preprocessing`), one response per decoding step out (cumulative output ids
plus the character range of new text, for `postprocessing`). Same Service as `specdec`, in
"ids" mode; a request with `stop` = true stops the sequence named by `sequence_key` (the
ensemble's cancellation path, see postprocessing).
"""
import triton_python_backend_utils as pb_utils

from backend.triton_glue import Service


class TritonPythonModel:
    def initialize(self, args):
        self.service = Service(pb_utils, args, mode="ids")

    def execute(self, requests):
        for request in requests:
            self.service.handle(request)
        return None

    def finalize(self):
        self.service.close()
