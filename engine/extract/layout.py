"""Names of the files an extraction keeps beside its records in a run directory.

Readers that must not pull in the job's code (release, the SpecForge export, the server's spool
sweep, the console) take the names from here; the record format's own files (manifest, run.json)
are named in engine.records.
"""

COMPLETE = "complete.json"  # written once, when every planned sample is recorded or reported bad
PAUSE_FILE = "pause.requested"  # present: the running extraction holds before its next request
SPOOL_SESSIONS = "spool_sessions.txt"  # rid tags of every session of this run, one a line
RUN_LOCK = ".extract.lock"  # flock held by the one extraction writing this run
