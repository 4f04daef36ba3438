"""The decoder in plain PyTorch, its checkpoint files, rotary embeddings and tokenizer."""
