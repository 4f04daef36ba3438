"""Measurements: `qspec bench`, `qspec quality` and their real-text prompts."""
