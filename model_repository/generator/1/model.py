"""Triton model `generator`: the decoupled token-level step, and the server's one engine holder.

Token ids in (from the ensemble's `preprocessing`, or from the `specdec` relay), one response per
decoding step out (cumulative output ids plus the character range of new text). A request with
`stop` = true stops the sequence named by `sequence_key` (cancellation through the ensemble or
the relay).
"""
import triton_python_backend_utils as pb_utils

from backend import triton_glue


class TritonPythonModel:
    def initialize(self, args):
        triton_glue.enable_fault_log(args)
        self.service = triton_glue.Service(pb_utils, args)

    def execute(self, requests):
        for request in requests:
            self.service.handle(request)
        return None

    def finalize(self):
        self.service.close()
