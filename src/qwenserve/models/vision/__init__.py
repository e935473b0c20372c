"""Vision towers of the Qwen vision-language models (Qwen3-VL, Qwen3.5): ``tower.py``."""
