"""The speech server as a Ray Serve fleet: one engine per replica (`replica.py`), a front that routes each stream to
the replica with the most headroom and ends a dead replica's streams with a proper error (`front.py`, `router.py`),
autoscaling on live streams with drained scale-downs (`app.py`), and `qtts-jax cluster` (`cli.py`).

Above `serving/` (each replica runs the server's own app, so validation, admission and encoding are its code) and
below `qtts_cli/`; it needs the `fleet` extra (`ray[serve]`)."""
