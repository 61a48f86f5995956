"""specdec nodes behind NVIDIA Dynamo: the worker that registers a node (worker.py), the request
translation (protocol.py), the model card (card.py), the launcher (launch.py) and Dynamo's Python
side beside its Rust core (install.py). docs/scale-out.md."""
