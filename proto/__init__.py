"""The epd.v1 gRPC API: `epd.proto` and its generated stubs (see `codegen.py`)."""
