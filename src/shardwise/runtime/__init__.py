"""The runtime: what happens to a sharded module in a training step.

One step's path, top to bottom: ``fsdp_module`` (the methods ``fully_shard``
mixes into a module's class) -> ``module`` (one module's hooks) -> ``root``
(the root's boundaries: a forward's start and end, a backward's end) ->
``context`` (the root's shared state; each module's ``Stage``) -> ``param_group``
(one group's gather, reshard and reduction, its ``GroupState``) -> ``mesh_part``
(its parameters on one mesh) -> the gather and reduce strategies (comm/).
``lifecycle`` names every state and the only transitions there are; ``check``
verifies them as they happen; ``settings`` holds what ``fully_shard`` and the
setters decided; ``trace`` records the timeline; ``step_in_backward`` steps an
optimizer inside backward; ``pipeline_stage`` checks a root inside a pipeline stage.

Files here import comm/ and layout/, never the public face above them.
"""
