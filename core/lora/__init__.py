"""LoRA adapters: PEFT directories read and checked (adapter_spec), their weights loaded
in the form the runner multiplies (weights)."""
