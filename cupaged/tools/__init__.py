"""Developer tools: ``python -m cupaged.tools.compile_check`` (the NVRTC gate)."""
