"""Communication: how a group's parameters are gathered and its gradients reduced.

``gather`` and ``reduce`` are the strategies (each chosen once per layout and
settings, an object that issues and then finishes); ``collectives`` is the only
file that calls torch.distributed; ``node_collectives`` composes its calls into
the collectives that know the node boundary; ``comm_policy`` says which of them
a module uses (ZeRO++'s qwZ, hpZ, qgZ); ``quantize`` (and ``quantize_gpu``, its
fused CUDA kernels) packs blocks of int8 or fp8 for them.

Files here import layout/, never runtime/ or the public face.
"""
