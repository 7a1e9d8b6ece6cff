"""The vision towers of the Qwen2-VL family: pixels in, merged image embeddings out."""
