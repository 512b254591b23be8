"""The vocabulary: where a parameter lives, placement -> layout.

``placement`` (which dim, which mesh), ``tensor_parallel`` (how a DTensor's own
split composes with ours), ``sharded_param`` (one parameter: its sharded and
unsharded forms), ``extensions`` (parameters that gather themselves),
``flat_shard`` (one group's flat shard, unsharded storage and views),
``precision`` and ``offload`` (which dtype, which memory), ``containers``
(tensors inside what a module takes and returns), ``labels`` (names for
profilers and memory records).

Files here import only each other and torch.
"""
