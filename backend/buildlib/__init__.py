"""What every device's build shares, one floor below the devices: checkpoint readers
(checkpoint.py, gguf_file.py), the ONNX graph writer (graph.py, engine_graph.py, fp8_graph.py,
quant.py), the FP8 weight math (fp8.py, fp8_gptq.py), calibration and its prompt source
(calibration.py, prompts.py), the drafts' shared parts (drafts.py, heads/) and the timing the
drafter kinds price with (timing.py).

It never imports a device, the registry, a drafter kind or the build's orchestration
(backend/builder, above the devices; tests/test_layering.py).
"""
