"""LoRA adapters served on the base model, chosen per request by model name (docs/lora.md).

- `batched`: the adapters' term inside the step (every token's slot, all slots stacked; pure JAX);
- `peft`: reading a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) into host arrays
  checked against the model's projections;
- `layout`: the device-side slot stacks of one engine (shapes, logical axes, shardings, bytes per chip) and
  writing an adapter into a slot;
- `slots`: rank 0's table of which adapter is in which slot, with LRU eviction of adapters no request uses.

This package imports nothing of the model at import time, so the model's projections may import `batched`.
"""
