"""The LM role ("PD" of EPD): continuous-batched prefill and decode over gathered embeddings.

The step loop is in engine.py (LMEngine.step); server.py is the gRPC edge (`epd lm`).
"""
