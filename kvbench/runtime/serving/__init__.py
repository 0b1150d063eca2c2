"""The serving room: the engine's step loop and what feeds it.

    engine            Engine: prefill, chunked prefill, decode, batching (schedule -> run -> postprocess)
    batch             what one step runs: StepBatch (the scheduler's choice), Segment (the runner's input)
    model_runner      ModelRunner: one forward step of the model over the cache, the method's hooks in it
    scheduler         queues, admission, preemption; policies: the two step policies (mixed, prefill_first)
    requests          a request and what one step runs of it; preemption: recompute or swap
    decode_graphs     decode steps replayed from CUDA graphs; host_sync: counting host syncs in a step
    sampling          greedy and sampled next tokens; scoring: log-likelihoods through the engine
    speculative       draft-and-verify decoding over the engine

Serving sits on the model and the cache; nothing below it imports it.
"""
