"""Image inputs: placement in the prompt, preprocessing, content hashes and M-RoPE positions."""
