"""The parts of ``shardwise bench`` (the command line lives in ``shardwise.benchmark``).

Split by concern so that each can be read and tested alone: ``models`` builds
the benchmarked model the same way in every configuration, ``worker`` runs one
(configuration, round) in fresh processes, ``memory`` says where the peak
memory went, ``report`` prints and draws the rows.
"""
