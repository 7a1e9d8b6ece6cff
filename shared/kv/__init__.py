"""The KV cache's shape and memory, shared by the model, the engine and the transfer plane."""
