"""Model definitions and checkpoint loading (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE, Mixtral)."""
