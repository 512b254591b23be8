"""The ``shardwise`` command line: its entry, its workers and its commands (see main.py)."""
