"""Decoding: prefill, autoregressive and speculative decode, the verifier, sessions."""
