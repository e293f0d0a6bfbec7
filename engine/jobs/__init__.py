"""The job subsystem: detached supervised processes, their context and events, the stage/job registry."""
