"""Where models come from (registry packages, GGUF, local folders) and loading them."""
