"""The proxy: gRPC Inference + the OpenAI HTTP API, cache-aware scheduling and routing.

server.py starts it (`epd proxy`); prepare.py turns requests into token ids and hashed items;
frontend.py runs one request through encoders and LM workers; workers.py knows the workers.
"""
