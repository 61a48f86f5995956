"""The `specdec` subcommands' flags and help texts: one function per subcommand that declares its
arguments on an argparse parser. Knows: names, defaults, choices, help. Does not know: what a
command does (backend/cli.py, whose SUBCOMMANDS table pairs each function with its command)."""
from __future__ import annotations

import argparse

from backend import request_schema
from backend.bench.prompt_sets import default_prompts
from backend.devices import DEVICES, FORMATS, OPTIONS

DEFAULT_REPO = "model_repository"


def add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="HF checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", choices=[d.value for d in DEVICES],
                   help="cpu: our C kernel over GGUF blocks and ONNX Runtime graphs; cuda: torch + Triton kernels (built on the GPU "
                        "that serves; without a GPU, for this CPU); tensorrt: TensorRT engines with "
                        "our plugins (built on the GPU that serves; without TensorRT and a GPU, the "
                        "engine-ready ONNX only)")
    p.add_argument("--weights", default=None,
                   help="weight formats to build, comma separated (first = serving default): "
                        "gguf, fp32, q4 for cpu (default gguf,fp32,q4; gguf: the GGUF's own blocks on our C "
                        "kernel, left out where the install could not compile it); fp32, bf16, fp8 for cuda (default bf16,fp8); "
                        "fp32, fp8 for tensorrt (default fp8)")
    p.add_argument("--default-format", default=None, choices=[f.value for f in FORMATS],
                   help="format serving uses (default: the first of --weights)")
    p.add_argument("--draft", action="append", default=[],
                   help="draft to build: a checkpoint PATH (any vocabulary: another tokenizer is mapped "
                        "by bytes, docs/hetero-vocab.md), self:N (first N target layers + head), eagle:DIR "
                        "(trained head: ours, or EAGLE-1/2/3's published layout) or medusa:DIR (Medusa-1 "
                        "heads); repeatable (default for the embedded target: self:4 and the committed EAGLE head)")
    p.add_argument("--output", default=DEFAULT_REPO, help="model repository to fill")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--no-invariance-check", action="store_true")
    p.add_argument("--no-cost-model", action="store_true",
                   help="skip measuring forward costs (the adaptive speculation controller needs them)")
    p.add_argument("--remote-draft", default="",
                   help="draft on a draft node: its tritonserver's gRPC host:port, or `local` for "
                        "this server's own (serve a node with `specdec build-draft-node`)")
    p.add_argument("--remote-draft-kind", default="draft-model", choices=["draft-model", "eagle"])
    for options in OPTIONS:                  # each backend's own flags (devices/<name>/backend.py)
        options.add_args(p)
    p.add_argument("--quiet", action="store_true")

def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=8080,
                   help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)")
    p.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI-compatible API")
    p.add_argument("--draft", action="append", default=[],
                   help="drafts to build on first run (default: self:4 and the committed EAGLE head)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--log-file", default=None)
    scale = p.add_argument_group("scale-out behind NVIDIA Dynamo (docs/scale-out.md)")
    scale.add_argument("--nodes", type=int, default=0,
                       help="N nodes on this machine behind Dynamo's frontend (KV-aware router, request "
                            "migration); the frontend serves the OpenAI API on --openai-port")
    scale.add_argument("--router", default="kv", choices=["kv", "round-robin"],
                       help="how the frontend picks a node: kv (where the prompt's prefix is cached, "
                            "and the load), round-robin")
    scale.add_argument("--dynamo-node", action="store_true",
                       help="serve this machine as one node of a Dynamo deployment (found through --discovery)")
    scale.add_argument("--dynamo-frontend", action="store_true",
                       help="serve Dynamo's frontend only, for the nodes it discovers")
    scale.add_argument("--discovery", default="file", choices=["file", "etcd", "kubernetes"],
                       help="how frontend and nodes find each other: file (one machine; $DYN_FILE_KV, "
                            "else a new directory), etcd ($ETCD_ENDPOINTS), kubernetes")
    scale.add_argument("--namespace", default="specdec", help="Dynamo namespace of the deployment")
    scale.add_argument("--migration-limit", type=int, default=3,
                       help="times the frontend may move a request to another node when its node dies")
    scale.add_argument("--openai-host", default="127.0.0.1",
                       help="address Dynamo's frontend listens on (0.0.0.0 to serve other machines)")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 gRPC / :8000 HTTP)")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    p.add_argument("--model", default="specdec", help="specdec or ensemble")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    for f in request_schema.FIELDS:                  # the request schema's fields as they are
        if f.flag:
            p.add_argument(f.flag, type=f.py_type, default=None, help=f"{f.meaning} (default: {f.default_text})")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as is (no chat template): plain text to continue; needed for a base model, which has no chat template")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts(),
                   help="JSON lines of chat messages, comma separated files (default: the public set; "
                        "benchmarks/prompts/agent.jsonl: repeated-structure agent traffic); a model without a "
                        "chat template (a base model) gets each prompt's text as a plain continuation")
    p.add_argument("--drafter", default="prompt-lookup",
                   help="none | prompt-lookup | suffix | draft-model[:NAME] | eagle | auto; a comma "
                        "list compares several in one run (each its own decoder, same prompts, turns "
                        "alternating per prompt) and reports their ratios per prompt kind")
    p.add_argument("--warmup-passes", type=int, default=0,
                   help="run the whole prompt set this many times through each drafter before "
                        "measuring (feeds drafters with history, suffix decoding; greedy or seeded, "
                        "the measured answers are then repeats of ones seen)")
    p.add_argument("--prefix-cache", type=float, default=0, metavar="MB",
                   help="give plain decoding and every drafter a decoder with its own prefix cache of "
                        "MB MiB (as separate servers with the default prefix_cache_mb would have; "
                        "default 0: none, every prompt prefilled in full); with --warmup-passes every "
                        "mode's cache then holds the same prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-draft-tokens", type=int, default=None, help="fixed K (default: adaptive)")
    p.add_argument("--draft-width", type=int, default=1)
    p.add_argument("--lookup-width", type=int, default=1)
    p.add_argument("--no-eagle-gate", action="store_true",
                   help="EAGLE-2's fixed tree depth and size (no confidence gating)")
    p.add_argument("--format", default=None, help="weight format (default: the manifest's)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--concurrency", default=None,
                   help="comma list of concurrent streams: benchmark against a real Triton server")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --concurrency: minimum rounds per level; modes alternate ABC CBA so drift cancels")
    p.add_argument("--control", action="store_true",
                   help="with --concurrency: also run plain decoding a second time in every round "
                        "(A/A control): its ratio to plain shows the noise of the run")
    p.add_argument("--paired", action="store_true",
                   help="with --concurrency: run the modes time-sliced in this process (one scheduler "
                        "iteration each in turn) instead of one after another on Triton, so the "
                        "machine's drift cancels out of their ratios; the control always runs")
    p.add_argument("--seed", type=int, default=0,
                   help="with --paired: request i of a level samples with seed (SEED << 32) | i in every "
                        "mode, so at a temperature > 0 the modes decode the same tokens (default 0)")
    p.add_argument("--sweep-k", default=None,
                   help="with --concurrency: other fixed K measured at n=1 (default 1,2,3,4,6,8; "
                        "tree sizes 2,4,8,12,16 for eagle)")
    p.add_argument("--plot", default=None)


def add_train_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="checkpoint (default: the embedded default)")
    p.add_argument("--model-repository", default=DEFAULT_REPO,
                   help="use the target already built here when it matches --target")
    p.add_argument("--out", required=True, help="head directory to write")
    p.add_argument("--work", default=None, help="data + checkpoints (default: ~/.cache/specdec/train/NAME)")
    p.add_argument("--corpus-tokens", type=int, default=3_000_000,
                   help="fixed text (docstrings of the stdlib and installed packages), labelled by the target")
    p.add_argument("--prompts", type=int, default=600,
                   help="also train on the target's own answers to N generated chat questions")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary size (FR-Spec)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    p.add_argument("--val-prompts", type=int, default=48, help="held-out chat questions for selection")
    p.add_argument("--val-every", type=int, default=100, help="steps between validations")
    p.add_argument("--init", default=None, help="start from this head directory's weights")
    p.add_argument("--own-repeat", type=int, default=1, help="times each own answer is seen per epoch")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--ttt-steps", type=int, default=2, help="training-time-test passes on own features")
    p.add_argument("--vocab-from", default=None,
                   help="keep this head directory's draft vocabulary instead of choosing one")
    p.add_argument("--eagle3", action="store_true",
                   help="an EAGLE-3 head on the target's low, middle and high layer features (needs the gguf or "
                        "torch engine), written in the EAGLE-3 reference's layout")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)


def add_bench_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--question-tokens", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", default="4", help="comma list of client streams for the mixed workload ('' = skip)")
    p.add_argument("--system-tokens", type=int, default=1000, help="the mixed workload's shared system prompt")
    p.add_argument("--requests", type=int, default=12, help="requests of the mixed workload, per mode")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--drafter", default="auto")
    p.add_argument("--json", default=None)


def add_bench_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO)
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--formats", default=None)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    p.add_argument("--wide", default=None,
                   help="instead: the cost of wide activations on the gguf engine, settings by ';' (none, all, "
                        "built: the build's choice, or families by comma), alternated --reps times in one process")
    p.add_argument("--isa", default=None,
                   help="instead: the matmul paths to A/B, by ';' (amx: AMX tiles; avx512: the vector path), "
                        "crossed with --wide's settings (default built), alternated --reps times in one process")
    p.add_argument("--builds", default=None,
                   help="instead: builds of the native kernel to A/B, name=library.so by ';' (the same library "
                        "under two names: an A/A control), crossed with --isa's paths (default: default), B=1 "
                        "forwards of T=1..16 after 256 tokens alternated --reps times in one process; CPU time "
                        "with SPECDEC_THREADS=1")


def add_build_draft_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO, help="where the draft was built")
    p.add_argument("--kind", default="draft-model", choices=["draft-model", "eagle"])
    p.add_argument("--output", required=True)


def add_health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP host:port")
    p.add_argument("--model", default="specdec")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds")


def add_check_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="the smallest cases only (a dry run)")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", default=DEFAULT_REPO,
                   help="a repository built with both formats (--device cuda; or tensorrt, run with "
                        "SPECDEC_EXECUTOR=onnxruntime where TensorRT is absent)")
    p.add_argument("--format", default="fp8")
    p.add_argument("--reference", default="fp32")
    p.add_argument("--prompts", default=default_prompts())
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--json", default=None)
