"""Files: atomic writes, weight files (safetensors) and training checkpoints."""
