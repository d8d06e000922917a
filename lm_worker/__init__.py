"""The LM role ("PD" of EPD): continuous-batched prefill and decode over gathered embeddings.

The step loop is in engine.py (`LMEngine.step`); a request's inputs besides its token ids live
in inputs.py (`RequestInputs`); frontend.py runs a request's flow around the engine; loader.py
builds the engine from the served family; server.py is the gRPC edge (`epd lm`).
"""
