"""LoRA adapters over the served model: reading PEFT folders, the wrapped projections, the registry."""
