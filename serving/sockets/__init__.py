"""The WebSocket protocols (the server's own and vLLM-Omni's) and the live text a socket appends to an utterance."""
