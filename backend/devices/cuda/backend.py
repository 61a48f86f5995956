"""CUDA engines: torch with our Triton-language kernels (runtime/torch_rt.py), fp32/bf16/FP8.

Knows: the torch engine files (export.py), its build option (Fp8Options, chosen by
fp8_choice.py where "auto") and its record of that choice (record.py: Fp8Record), the GPU a
build was made for and the check that this machine is that GPU, loading runtime/torch_rt.py. A
build on a machine without a GPU makes engines for its CPU (tests, FP8 quality), refused on a
GPU. Does not know: the decode algorithm.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.devices.base import BuildOptions, EngineBackend, EngineRef, rebuild_command
from backend.devices.cuda.record import Fp8Record
from backend.errors import UserError
from backend.manifest import Device, WeightFormat
from backend.runtime.fp8 import RECIPES


@dataclass(frozen=True)
class Fp8Options(BuildOptions):
    """FP8 engines' options (cuda and tensorrt: the same recipe)."""

    fp8_recipe: str = field(default="auto", metadata={
        "choices": ["auto"] + [n for r in RECIPES for n in (r.name, r.name + "+gptq")],
        "help": "FP8 engines: how weights and inputs are scaled (+gptq: weights rounded by GPTQ on "
                "the calibration prompts); auto: the fastest recipe that meets the quality bar on "
                "held-out calibration prompts, weights rounded by GPTQ (docs/building.md)"})

    def __post_init__(self):
        if self.fp8_recipe not in self.__dataclass_fields__["fp8_recipe"].metadata["choices"]:
            raise UserError(f"--fp8-recipe: {self.fp8_recipe!r} is not a recipe (choose from "
                            f"{', '.join(self.__dataclass_fields__['fp8_recipe'].metadata['choices'])})")


class CudaBackend(EngineBackend):
    name = "torch"
    device = Device.CUDA
    formats = (WeightFormat.FP32, WeightFormat.BF16, WeightFormat.FP8)
    defaults = (WeightFormat.BF16, WeightFormat.FP8)
    any_feature_layers = True
    options = Fp8Options
    record = Fp8Record

    def environment(self, ctx):
        from backend.devices.cuda import export

        gpu = export.gpu_info()
        ctx.log(f"GPU: {gpu['name']} (sm {gpu['compute_capability']})" if gpu else
                "no CUDA device: the torch engines are built for this CPU (tests, FP8 quality); "
                "a GPU server needs the build run on its GPU")
        return gpu

    def export_targets(self, ctx, formats):
        from backend.devices.cuda import export

        return export.export_all(ctx.ck, formats, ctx.max_seq_len, ctx.engine_dir, ctx.tokenizer_json,
                                       ctx.log, ctx.features, ctx.option(Fp8Options).fp8_recipe)

    def export_layers(self, ctx, n, serving):
        from backend.devices.cuda import export

        return export.export_layers(ctx.ck, n, serving, ctx.log)

    def export_model(self, ctx, path, serving):
        from backend.devices.cuda import export

        return export.export_draft_model(path, ctx.ck, serving, ctx.engine_dir, ctx.log)

    def export_head(self, ctx, head, serving):
        from backend.devices.cuda import export

        return export.export_head(head, ctx.ck, serving, ctx.engine_dir, ctx.log)

    def check_here(self, manifest) -> str:
        """"cuda" on the GPU model the manifest was built for, "cpu" for a build made without a
        GPU (on a machine without one); anything else is refused with the rebuild command."""
        import torch

        here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        built = manifest.gpu
        if built is None:
            if here is not None:
                raise RuntimeError(f"the engines in {manifest.root} were built without a GPU; this "
                                   f"machine has {here}: rebuild here with `{rebuild_command(manifest)}`")
            return "cpu"
        if here is None:
            raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} "
                               f"(sm {built['compute_capability']}); this machine has no CUDA device")
        major, minor = torch.cuda.get_device_capability(0)
        if here != built["name"] or f"{major}.{minor}" != built["compute_capability"]:
            raise RuntimeError(f"the engines in {manifest.root} were built for {built['name']} "
                               f"(sm {built['compute_capability']}); this machine has {here} "
                               f"(sm {major}.{minor}): rebuild with `{rebuild_command(manifest)}`")
        return "cuda"

    def load(self, manifest, ref: EngineRef, options):
        from backend.runtime.torch_rt import TorchRuntime

        return TorchRuntime(ref.path, ref.config, ref.num_layers, manifest.max_seq_len, options,
                            self.check_here(manifest), feature_layers=ref.feature_layers)
