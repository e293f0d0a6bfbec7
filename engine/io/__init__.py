"""Files: atomic writes, JSON and JSONL helpers, safe names."""
