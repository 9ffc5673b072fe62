"""An OpenAI-compatible server over the project's generation engines (``python -m nemo_like.serve``),
with per-episode sessions that record the exact tokens sampled, for training agent programs."""
