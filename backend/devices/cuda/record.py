"""What an FP8 build records per engine (the cuda and tensorrt devices share it, as they share
the recipe and its choice): the record's type, written by the exporters and read back at load.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.devices.base import DeviceRecord


@dataclass(frozen=True)
class Fp8Record(DeviceRecord):
    """An FP8 engine's recorded choice (cuda and tensorrt: one recipe for both): the recipe
    (runtime/fp8.py Recipe.to_json); how it was chosen ("chosen_by": "measured" | "--fp8-recipe",
    the quality bar, every candidate measured: top-1 agreement and KL against fp32 on held-out
    calibration prompts, fp8_choice.py); a torch engine's W8A8 width (w8a8.py: from which forward
    width its GPU runs the W8A8 GEMM, as measured there, or null and why). Empty for other formats."""

    recipe: dict | None = None
    choice: dict | None = None
    w8a8: dict | None = None

    @classmethod
    def made(cls, report: dict | None, w8a8: dict | None = None) -> dict | None:
        """The record's JSON from a build's recipe report (export.choose_recipe's) and W8A8
        measurement; None where there is neither."""
        if report is None and w8a8 is None:
            return None
        choice = dict(report or {})
        return cls(choice.pop("recipe", None), choice or None, w8a8).to_json()

    @classmethod
    def from_json(cls, d: dict | None):
        if d and "fp8" in d:        # a version-3 manifest's EngineFile.fp8: the report with "w8a8" in it
            choice = dict(d["fp8"])
            w8a8 = choice.pop("w8a8", None)
            return cls(choice.pop("recipe", None), choice or None, w8a8)
        return super().from_json(d)
