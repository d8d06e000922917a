"""The proxy: gRPC Inference + the OpenAI HTTP API, cache-aware scheduling and routing.

server.py starts it (`epd proxy`) and serves gRPC, http.py the HTTP API and dashboard.py the
dashboard, all three over core.py's `Proxy`; prepare.py turns requests into token ids and hashed
items; frontend.py runs one request through encoders and LM workers; workers.py knows the
workers.
"""
