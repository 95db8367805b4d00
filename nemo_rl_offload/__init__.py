"""RL post-training on a Megatron-core policy with fine-grained activation offloading (FGO).

Data flows one way: config (load, schema, offload rules) -> distributed (Ray, NUMA) ->
models and workers -> algorithms. Nothing later imports anything earlier in reverse.
"""

__version__ = "0.1.0"
