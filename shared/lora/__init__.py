"""LoRA adapters in the engine (docs/lora.md), one concept a file:

    request.py   LoRARequest: an adapter to load, by name and PEFT directory
    targets.py   the model's linears an adapter can adapt (fused qkv_proj / gate_up_proj and their parts)
    peft.py      reading and checking a PEFT adapter directory -> LoRAAdapter (fused, scaled weights)
    layers.py    LoRALinear (a linear plus its adapters' stacked slots) and the step's LoRAMetadata
    manager.py   LoRAManager: loaded adapters, the ones held in memory (LRU), the step's slots
"""
