"""The model room: the Llama-family forward over the paged cache, and how its weights get there.

    forward           LlamaFamilyModel: the forward over the paged cache (one ragged step)
    rope              rotary tables and their application
    loading           a checkpoint into a LlamaFamilyModel; model_files: checking a model folder's files
    tensor_parallel   Megatron-style sharding of the weights over ranks; distributed: the torchrun launch

The model imports the cache and the hook protocol (kvbench.runtime.hooks), never the serving loop.
"""
