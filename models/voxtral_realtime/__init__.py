"""Voxtral Realtime: a causal audio encoder whose per-position embeddings are added to the
token embeddings of a Mistral LM at every step, prefill and decode alike."""

from models.voxtral_realtime.family import VoxtralRealtimeFamily

__all__ = ["VoxtralRealtimeFamily"]
