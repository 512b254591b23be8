"""``shardwise bench``: its command line (``command``) and its parts.

Split by concern so that each can be read and tested alone: ``models`` builds
the benchmarked model the same way in every configuration, ``jobs`` runs one
(configuration, round) in fresh processes, ``memory`` says where the peak
memory went, ``tables`` prints and draws the rows.
"""
