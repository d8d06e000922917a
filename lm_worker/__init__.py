"""The LM role ("PD" of EPD): continuous-batched prefill and decode over gathered embeddings.

The step loop is in engine.py (LMEngine.step); loader.py builds it from the served family;
server.py is the gRPC edge (`epd lm`).
"""
