"""The build as one command, above the devices: `specdec build` from a BuildConfig to a filled
model repository (pipeline.py), the checks and measurements of what it built (check.py: batch
invariance; costs.py: the cost model), the Triton configs it fills (templates.py) and the
embedded default model (embedded.py).

It reaches a device only through the registry (backend.devices) and a drafter kind only through
backend.draft_kinds; what devices share lives one floor below them, in backend/buildlib
(tests/test_layering.py). Not named `build/`: tools and the common Python .gitignore templates read
that name as build output (docs/architecture.md, departure 38).
"""
