"""What every role shares. The lower half (config.py, process.py, log.py) imports nothing of
ours, so connector/ may use it; the upper half (server.py, served_model.py, media.py, device.py,
health.py) builds on models/ and proto/. Nothing here imports a role or the CLI."""
