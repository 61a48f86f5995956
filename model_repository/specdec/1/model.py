"""Triton model `specdec`: text in, streamed text out, speculative decoding inside.

A thin adapter: backend.triton_relay.TextRelay tokenizes each request, streams it through the
`generator` model (the one process that holds the engines) and streams the text back through
the request's response sender. execute() returns at once (decoupled model).
"""
import triton_python_backend_utils as pb_utils

from backend import triton_glue
from backend.triton_relay import TextRelay


class TritonPythonModel:
    def initialize(self, args):
        triton_glue.enable_fault_log(args)
        self.relay = TextRelay(pb_utils, args)

    def execute(self, requests):
        for request in requests:
            self.relay.handle(request)
        return None

    def finalize(self):
        self.relay.close()
