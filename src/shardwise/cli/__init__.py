"""The ``shardwise`` command line: ``train``, ``sample`` and ``bench`` (see cli/main.py)."""
