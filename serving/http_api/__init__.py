"""The HTTP API: speech and voice routes, the page at / and /docs, API keys, and the connection limits."""
