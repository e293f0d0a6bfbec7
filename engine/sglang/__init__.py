"""SGLang backend: launch spec, capture hook, version profiles, NCCL all-reduce check."""
