"""Owning the target server process (local or SGLang): launch, readiness, polling, stop, restart."""
