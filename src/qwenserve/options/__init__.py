"""vLLM's JSON-valued engine options (``--hf-overrides``, ``--compilation-config``,
``--additional-config``): parsed and checked here without torch, so a bad value fails at start-up
with a message naming the key, and each accepted key either acts or is logged by name."""
