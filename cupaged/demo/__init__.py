"""The demo's tiny Llama-style decoder (``tiny``), run by ``python -m cupaged demo``."""
