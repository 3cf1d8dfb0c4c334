"""The asyncio I/O around ``core``: HTTP serving and forwarding, ZMQ event subscribers,
discovery, shared state. The only ring allowed sockets, timers and the environment."""
