"""Triton model `specdec`: text in, streamed text out, speculative decoding inside.

A thin adapter: backend.triton_glue.Service parses tensors, submits each request to the
continuous-batching scheduler (backend/scheduler.py) and streams the scheduler's outputs back
through the request's response sender. execute() returns at once (decoupled model).
"""
import triton_python_backend_utils as pb_utils

from backend.triton_glue import Service


class TritonPythonModel:
    def initialize(self, args):
        self.service = Service(pb_utils, args, mode="text")

    def execute(self, requests):
        for request in requests:
            self.service.handle(request)
        return None

    def finalize(self):
        self.service.close()
