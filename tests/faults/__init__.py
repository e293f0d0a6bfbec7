"""Fault-injection suite: kill -9, full disks, corrupted data, two consoles (see conftest.py)."""
