"""The encoder role (E/P/D): a node that runs only a vision model's tower for prefill nodes."""
