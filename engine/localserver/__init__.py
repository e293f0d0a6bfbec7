"""The local target server: a transformers causal LM behind SGLang's HTTP subset
(/health, /health_generate, /server_info, /model_info, /generate, /metrics), writing the
same capture spool segments as the SGLang capture patch. Run: `python -m engine.localserver`.

Nothing here imports torch at import time; the model runner does so when it loads.
"""
